"""Fused small ops for the decode path, where kernel count (not FLOPs or bytes) is the cost:

    hc_pre(x, fn, base, scale, iters, eps, norm_eps) -> collapsed, post, comb   (a GEMV + one kernel, not ~130)
    hc_post(out, x, post, comb) -> new streams
    rms_norm(x, weight, eps)                                                     (weight None = unweighted)

Each computes the same function as its twin in model/model.py (`hc_pre`, `hc_post`, `RMSNorm`, `rms_unweighted`),
which the model calls instead whenever `fused_ok(x)` is false: on CPU, with autograd, or outside inference mode.
"""
from __future__ import annotations

import torch

from .fp8_gemm import pow2, triton, use_triton

if triton is not None:
    import triton.language as tl


def fused_ok(x: torch.Tensor) -> bool:
    """Inference engines (torch.inference_mode) on a GPU: training and the actor's scoring keep the torch ops."""
    return use_triton(x) and torch.is_inference_mode_enabled()


if triton is not None:
    @triton.jit
    def _hc_pre_kernel(X, RAW, BASE, SCALE, COLL, POST, COMB, eps, norm_eps, ITERS: tl.constexpr,
                       N_HC: tl.constexpr, D: tl.constexpr, NP: tl.constexpr, MIXP: tl.constexpr,
                       BLOCK: tl.constexpr):
        """One token: RAW = x @ fn^T (from cuBLAS) scaled by the streams' rsqrt-mean-square, then pre / post /
        Sinkhorn-projected comb, and the pre-weighted collapse of the streams."""
        t = tl.program_id(0)
        MIX: tl.constexpr = (2 + N_HC) * N_HC
        F: tl.constexpr = N_HC * D
        rm = tl.arange(0, MIXP)
        ss = tl.zeros((BLOCK,), tl.float32)
        for f0 in range(0, F, BLOCK):
            rf = f0 + tl.arange(0, BLOCK)
            x = tl.load(X + t * F + rf, mask=rf < F, other=0.0).to(tl.float32)
            ss += x * x
        raw = tl.load(RAW + t * MIX + rm, mask=rm < MIX, other=0.0)
        mix = raw * tl.rsqrt(tl.sum(ss, 0) / F + norm_eps)
        b = tl.load(BASE + rm, mask=rm < MIX, other=0.0)
        s0, s1, s2 = tl.load(SCALE), tl.load(SCALE + 1), tl.load(SCALE + 2)
        ri = tl.arange(0, NP)
        mi = ri < N_HC
        # pre / post: entries [0, n) and [n, 2n) of the mix vector, picked with one-hot sums
        sel_pre = (rm[None, :] == ri[:, None]) & mi[:, None]
        sel_post = (rm[None, :] == (ri[:, None] + N_HC)) & mi[:, None]
        pre_raw = tl.sum(tl.where(sel_pre, mix[None, :] * s0 + b[None, :], 0.0), 1)
        post_raw = tl.sum(tl.where(sel_post, mix[None, :] * s1 + b[None, :], 0.0), 1)
        pre = 1.0 / (1.0 + tl.exp(-pre_raw)) + eps
        post = 2.0 / (1.0 + tl.exp(-post_raw))
        # comb: entries [2n, 2n + n*n) as an (n, n) matrix, row softmax, then Sinkhorn (column first)
        rj = tl.arange(0, NP)
        cidx = 2 * N_HC + ri[:, None] * N_HC + rj[None, :]
        valid = mi[:, None] & (rj[None, :] < N_HC)
        cm = tl.zeros((NP, NP), tl.float32)
        for m in range(2 * N_HC, MIX):
            v = tl.sum(tl.where(rm == m, mix * s2 + b, 0.0), 0)
            cm = tl.where(cidx == m, v, cm)
        cm = tl.where(valid, cm, float("-inf"))
        cm = tl.exp(cm - tl.max(cm, 1)[:, None])
        cm = tl.where(valid, cm / tl.sum(cm, 1)[:, None] + eps, 0.0)
        cm = cm / (tl.sum(cm, 0)[None, :] + eps)
        for _ in range(ITERS - 1):
            cm = cm / (tl.sum(cm, 1)[:, None] + eps)
            cm = cm / (tl.sum(cm, 0)[None, :] + eps)
        tl.store(POST + t * N_HC + ri, post, mask=mi)
        tl.store(COMB + t * N_HC * N_HC + ri[:, None] * N_HC + rj[None, :], cm, mask=valid)
        for d0 in range(0, D, BLOCK):
            rd = d0 + tl.arange(0, BLOCK)
            md = rd < D
            xs = tl.load(X + t * F + ri[:, None] * D + rd[None, :], mask=mi[:, None] & md[None, :], other=0.0)
            c = tl.sum(xs.to(tl.float32) * pre[:, None], 0)
            tl.store(COLL + t * D + rd, c.to(COLL.dtype.element_ty), mask=md)

    @triton.jit
    def _hc_post_kernel(OUT, X, POST, COMB, Y, N_HC: tl.constexpr, D: tl.constexpr, NP: tl.constexpr,
                        BLOCK: tl.constexpr):
        t, db = tl.program_id(0), tl.program_id(1)
        ri = tl.arange(0, NP)
        mi = ri < N_HC
        rd = db * BLOCK + tl.arange(0, BLOCK)
        md = rd < D
        x = tl.load(X + t * N_HC * D + ri[:, None] * D + rd[None, :], mask=mi[:, None] & md[None, :], other=0.0)
        x = x.to(tl.float32)
        out = tl.load(OUT + t * D + rd, mask=md, other=0.0).to(tl.float32)
        post = tl.load(POST + t * N_HC + ri, mask=mi, other=0.0)
        # comb[j, i]: y_i = post_i * out + sum_j comb[j, i] * x_j
        comb = tl.load(COMB + t * N_HC * N_HC + ri[:, None] * N_HC + ri[None, :], mask=mi[:, None] & mi[None, :],
                       other=0.0)
        mixed = tl.sum(comb[:, :, None] * x[:, None, :], 0)
        y = post[:, None] * out[None, :] + mixed
        tl.store(Y + t * N_HC * D + ri[:, None] * D + rd[None, :], y.to(Y.dtype.element_ty),
                 mask=mi[:, None] & md[None, :])

    @triton.jit
    def _rms_kernel(X, W, Y, eps, D: tl.constexpr, BLOCK: tl.constexpr, WEIGHTED: tl.constexpr):
        r = tl.program_id(0)
        rd = tl.arange(0, BLOCK)
        md = rd < D
        x = tl.load(X + r * D + rd, mask=md, other=0.0)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)
        if WEIGHTED:
            w = tl.load(W + rd, mask=md, other=0.0).to(tl.float32)
            y = w * (xf * inv)
        else:  # the torch twin multiplies in x's dtype: round the factor first
            y = xf * inv.to(x.dtype).to(tl.float32)
        tl.store(Y + r * D + rd, y.to(Y.dtype.element_ty), mask=md)


def hc_pre(x, fn, base, scale, iters: int, eps: float, norm_eps: float):
    """x (..., n, D) -> collapsed (..., D) x.dtype, post (..., n) fp32, comb (..., n, n) fp32."""
    *lead, n, D = x.shape
    xf = x.reshape(-1, n * D).contiguous()
    N = xf.shape[0]
    raw = torch.nn.functional.linear(xf.float(), fn.float())  # the (n * D) x ((2 + n) n) GEMV goes to the BLAS
    coll = torch.empty(N, D, dtype=x.dtype, device=x.device)
    post = torch.empty(N, n, dtype=torch.float32, device=x.device)
    comb = torch.empty(N, n, n, dtype=torch.float32, device=x.device)
    if N:
        _hc_pre_kernel[(N,)](xf, raw.contiguous(), base.float().contiguous(), scale.float().contiguous(),
                             coll, post, comb, eps, norm_eps, ITERS=iters, N_HC=n, D=D, NP=pow2(n),
                             MIXP=pow2((2 + n) * n), BLOCK=1024, num_warps=4)
    return coll.view(*lead, D), post.view(*lead, n), comb.view(*lead, n, n)


def hc_post(out, x, post, comb):
    """out (..., D), x (..., n, D), post (..., n), comb (..., n, n) -> (..., n, D) in x.dtype."""
    *lead, n, D = x.shape
    y = torch.empty_like(x)
    N = x.numel() // (n * D)
    if N:
        bd = min(256, pow2(D))
        _hc_post_kernel[(N, triton.cdiv(D, bd))](out.contiguous(), x.contiguous(), post.contiguous(),
                                                 comb.contiguous(), y, N_HC=n, D=D, NP=pow2(n), BLOCK=bd, num_warps=4)
    return y


if triton is not None:
    @triton.jit
    def _swiglu_kernel(G, U, Y, n, limit, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        g = tl.minimum(tl.load(G + i, mask=m, other=0.0).to(tl.float32), limit)
        u = tl.load(U + i, mask=m, other=0.0).to(tl.float32)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        s = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)  # silu in x's dtype, as torch rounds it
        tl.store(Y + i, (s * u).to(Y.dtype.element_ty), mask=m)


def swiglu(g, u, limit: float):
    """The fused twin of model._swiglu: silu(g.clamp(max=limit)) * u.clamp(-limit, limit), one pass."""
    gc, uc = g.contiguous(), u.contiguous()
    y = torch.empty_like(gc)
    n = gc.numel()
    if n:
        _swiglu_kernel[(triton.cdiv(n, 1024),)](gc, uc, y, n, float(limit), BLOCK=1024, num_warps=4)
    return y


def rms_norm(x, weight, eps: float):
    D = x.shape[-1]
    xc = x.contiguous()
    y = torch.empty_like(xc)
    rows = xc.numel() // D
    if rows:
        _rms_kernel[(rows,)](xc, weight if weight is not None else xc, y, eps, D=D, BLOCK=pow2(D),
                             WEIGHTED=weight is not None, num_warps=4 if D <= 2048 else 8)
    return y


if triton is not None:
    @triton.jit
    def _rope_kernel(X, COS, SIN, Y, per, sign, DIM: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
                     HB: tl.constexpr):
        r = tl.program_id(0)
        c = r // per
        rd = tl.arange(0, BLOCK)
        nope: tl.constexpr = DIM - 2 * HALF
        md = rd < nope
        tl.store(Y + r * DIM + rd, tl.load(X + r * DIM + rd, mask=md), mask=md)
        j = tl.arange(0, HB)
        mj = j < HALF
        x0 = tl.load(X + r * DIM + nope + 2 * j, mask=mj, other=0.0)
        x1 = tl.load(X + r * DIM + nope + 2 * j + 1, mask=mj, other=0.0)
        co = tl.load(COS + c * HALF + j, mask=mj, other=0.0)
        si = tl.load(SIN + c * HALF + j, mask=mj, other=0.0) * sign
        a, b = x0.to(tl.float32), x1.to(tl.float32)
        tl.store(Y + r * DIM + nope + 2 * j, (a * co - b * si).to(Y.dtype.element_ty), mask=mj)
        tl.store(Y + r * DIM + nope + 2 * j + 1, (b * co + a * si).to(Y.dtype.element_ty), mask=mj)


def rope(x, cos, sin, inverse: bool = False):
    """The fused twin of model.apply_rope for the layouts the engines use (cos/sin rows shared by the trailing
    head dims of x); returns None for any other broadcast, and the caller falls back to torch."""
    half, dim = cos.shape[-1], x.shape[-1]
    xl, cl = [s for s in x.shape[:-1]], [s for s in cos.shape[:-1]]
    while xl and xl[0] == 1:
        xl.pop(0)
    while cl and cl[0] == 1:
        cl.pop(0)
    while cl and cl[-1] == 1:
        cl.pop()
    if xl[:len(cl)] != cl or cos.shape != sin.shape:
        return None
    rows = 1
    for s in xl:
        rows *= s
    per = 1
    for s in xl[len(cl):]:
        per *= s
    xc = x.contiguous()
    y = torch.empty_like(xc)
    if rows:
        _rope_kernel[(rows,)](xc, cos.contiguous().float(), sin.contiguous().float(), y, per, -1.0 if inverse else 1.0,
                              DIM=dim, HALF=half, BLOCK=pow2(max(dim - 2 * half, 1)), HB=pow2(half), num_warps=1)
    return y
