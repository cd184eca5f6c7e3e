"""The actor's per-token log-probabilities and entropy straight from the head's logits, forward and backward.

    lp, ent = head_logprob(h, weight, targets, temperature, chunk)
        h (n, D), weight (V, D) the head, targets (n,) -> lp (n,) fp32 = log_softmax(h @ weight^T / t)[target],
        ent (n,) fp32 = the entropy of softmax(h @ weight^T / t) (no gradient, a statistic)

The logits are made `chunk` rows at a time. The kernel runs one program per row and makes one pass over the
vocabulary (online max, sum, and sum of z * e^z for the entropy). Its backward writes (onehot - p) * g / t in the
logits' dtype in one more pass. The torch twin (Transformer.token_logprobs on CPU) goes through (n, V) fp32 copies:
the division, log_softmax, its saved output, exp and the product. Autograd also sums a full-size weight gradient
per chunk there.
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


class _HeadLogprob(torch.autograd.Function):
    """Rows in chunks: a chunk's logits are one GEMM, then one pass of the kernel; they are kept for the backward
    (as the chunked autograd graph kept them). The backward writes each chunk's gradient rows of h directly and
    accumulates the weight's gradient inside its GEMMs (addmm), instead of a full-size weight gradient per chunk
    summed by autograd."""

    @staticmethod
    def forward(ctx, h, weight, targets, temperature, chunk):
        n = h.shape[0]
        tgt = targets.contiguous()
        lp, ent, lse = (torch.empty(n, dtype=torch.float32, device=h.device) for _ in range(3))
        inv_t = 1.0 / temperature
        logits = []
        for s in range(0, n, chunk):
            x = torch.mm(h[s:s + chunk], weight.t())
            _logprob_fwd[(x.shape[0],)](x, tgt[s:], lp[s:], ent[s:], lse[s:], inv_t, V=x.shape[1], BLOCK=_BLOCK,
                                        num_warps=8)
            logits.append(x)
        ctx.save_for_backward(h, weight, tgt, lse, *logits)
        ctx.inv_t, ctx.chunk = inv_t, chunk
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, glp, gent):
        h, weight, tgt, lse, *logits = ctx.saved_tensors
        glp = glp.float().contiguous()
        gh = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        gw = torch.zeros_like(weight) if ctx.needs_input_grad[1] and not logits else None
        buf = torch.empty_like(logits[0]) if logits else None  # one chunk's logit gradient, reused
        for i, x in enumerate(logits):
            s, c = i * ctx.chunk, x.shape[0]
            gx = buf[:c]
            _logprob_bwd[(c,)](x, tgt[s:], lse[s:], glp[s:], gx, ctx.inv_t, V=x.shape[1], BLOCK=_BLOCK, num_warps=8)
            if gh is not None:
                torch.mm(gx, weight, out=gh[s:s + c])
            if ctx.needs_input_grad[1]:
                gw = torch.mm(gx.t(), h[s:s + c]) if gw is None else gw.addmm_(gx.t(), h[s:s + c])
        return gh, gw, None, None, None


def head_logprob(h, weight, targets, temperature: float = 1.0, chunk: int = 1024):
    """h (n, D) final hidden states, weight (V, D) the head, targets (n,) int64 -> (log-prob of each target under
    softmax(h @ weight^T / temperature) (n,) fp32, the entropy of that distribution (n,) fp32, not
    differentiable). The logits exist `chunk` rows at a time, in h's dtype."""
    return _HeadLogprob.apply(h, weight, targets, float(temperature), int(chunk))
