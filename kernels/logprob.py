"""The actor's per-token log-probabilities and entropy straight from the head's logits, forward and backward.

    lp, ent = token_logprob(logits, targets, temperature)
        logits (n, V) in the head's dtype, targets (n,) -> lp (n,) fp32 = log_softmax(logits / t)[target],
        ent (n,) fp32 = the entropy of softmax(logits / t) (no gradient, a statistic)

One program per row, one pass over the vocabulary (online max, sum and sum of z * e^z for the entropy); the backward
writes (onehot - p) * g / t in the logits' dtype in one more pass. The torch twin (Transformer.token_logprobs on
CPU) goes through (n, V) fp32 copies: the division, log_softmax, its saved output, exp and the product.
"""
from __future__ import annotations

import torch

from .fp8_gemm import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _logprob_fwd(X, TGT, LP, ENT, LSE, inv_t, V: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        m = tl.full((BLOCK,), -1e30, tl.float32)
        l = tl.zeros((BLOCK,), tl.float32)
        s = tl.zeros((BLOCK,), tl.float32)
        for v0 in range(0, V, BLOCK):
            v = v0 + tl.arange(0, BLOCK)
            mv = v < V
            z = tl.load(X + row * V + v, mask=mv, other=0.0).to(tl.float32) * inv_t
            m2 = tl.where(mv, tl.maximum(m, z), m)
            a = tl.exp(m - m2)
            e = tl.exp(tl.where(mv, z - m2, float("-inf")))  # 0 past the end (z is 0 there)
            l = l * a + e
            s = s * a + z * e
            m = m2
        mx = tl.max(m, 0)
        w = tl.exp(m - mx)
        lsum = tl.sum(l * w, 0)
        lse = mx + tl.log(lsum)
        zt = tl.load(X + row * V + tl.load(TGT + row)).to(tl.float32) * inv_t
        tl.store(LP + row, zt - lse)
        tl.store(ENT + row, lse - tl.sum(s * w, 0) / lsum)
        tl.store(LSE + row, lse)

    @triton.jit
    def _logprob_bwd(X, TGT, LSE, G, GX, inv_t, V: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        lse = tl.load(LSE + row)
        g = tl.load(G + row)
        tgt = tl.load(TGT + row)
        for v0 in range(0, V, BLOCK):
            v = v0 + tl.arange(0, BLOCK)
            mv = v < V
            z = tl.load(X + row * V + v, mask=mv, other=0.0).to(tl.float32) * inv_t
            gz = g * (tl.where(v == tgt, 1.0, 0.0) - tl.exp(z - lse))
            tl.store(GX + row * V + v, (gz * inv_t).to(GX.dtype.element_ty), mask=mv)


_BLOCK = 2048


class _TokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature):
        x = logits.contiguous()
        n, V = x.shape
        tgt = targets.contiguous()
        lp, ent, lse = (torch.empty(n, dtype=torch.float32, device=x.device) for _ in range(3))
        if n:
            _logprob_fwd[(n,)](x, tgt, lp, ent, lse, 1.0 / temperature, V=V, BLOCK=_BLOCK, num_warps=8)
        ctx.save_for_backward(x, tgt, lse)
        ctx.inv_t = 1.0 / temperature
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, glp, gent):
        x, tgt, lse = ctx.saved_tensors
        n, V = x.shape
        gx = torch.empty_like(x)
        if n:
            _logprob_bwd[(n,)](x, tgt, lse, glp.float().contiguous(), gx, ctx.inv_t, V=V, BLOCK=_BLOCK, num_warps=8)
        return gx, None, None


def token_logprob(logits, targets, temperature: float = 1.0):
    """logits (n, V), targets (n,) int64 -> (log-prob of each target under softmax(logits / temperature) (n,) fp32,
    entropy of that distribution (n,) fp32, not differentiable)."""
    return _TokenLogprob.apply(logits, targets, float(temperature))
