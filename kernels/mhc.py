"""The manifold-constrained hyper-connections for training: hc_pre and hc_post as autograd Functions whose
forward and backward are Triton kernels (the torch twins, model._hc_pre / model._hc_post, take ~130 kernels and
fp32 copies of the streams per call, and as many again in backward).

    hc_pre(x, fn, base, scale, iters, eps, norm_eps) -> collapsed, post, comb
        mix:      raw = x @ fn^T (fp32 in tensor-core passes, fp8_gemm.F32_DOT) and each token's sum of squares,
                  one read of x
        sinkhorn: per token, pre / post / the Sinkhorn-projected comb from raw * rsqrt(mean square)
        collapse: sum_i pre_i * x_i
      backward: the sinkhorn step's VJP recomputes the iterations it needs (a few hundred 4x4 normalizations a
      token, no saved intermediates); x's gradient is one pass, fn's one more.
    hc_post(out, x, post, comb) -> post * out + comb^T @ x; backward in one pass per token.

The inference engines use kernels/fused.py's forward-only versions (one token per program, tuned for decode).
"""
from __future__ import annotations

import torch

from . import fp8_gemm
from .fp8_gemm import pow2, triton
from .fused import hc_post as _hc_post_fwd

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _sigmoid(a):
        return 1.0 / (1.0 + tl.exp(-a))

    @triton.jit
    def _row_norm(c, eps):  # c (BT, NP, NP): each row i over j
        return c / (tl.sum(c, 2)[:, :, None] + eps)

    @triton.jit
    def _col_norm(c, eps):  # each column j over i
        return c / (tl.sum(c, 1)[:, None, :] + eps)

    @triton.jit
    def _row_norm_vjp(c, g, valid, eps):
        s = tl.sum(c, 2)[:, :, None] + eps
        return tl.where(valid, (g - tl.sum(g * (c / s), 2)[:, :, None]) / s, 0.0)

    @triton.jit
    def _col_norm_vjp(c, g, valid, eps):
        s = tl.sum(c, 1)[:, None, :] + eps
        return tl.where(valid, (g - tl.sum(g * (c / s), 1)[:, None, :]) / s, 0.0)

    @triton.jit
    def _mix_fwd_kernel(X, FN, RAW, SSQ, N, K: tl.constexpr, MIX: tl.constexpr, MIXP: tl.constexpr,
                        BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
        """RAW = X @ FN^T in fp32 and SSQ = each row's sum of squares: X (N, K), FN (MIX, K) fp32."""
        t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
        mt = t < N
        rm = tl.arange(0, MIXP)
        mm = rm < MIX
        acc = tl.zeros((BT, MIXP), tl.float32)
        ss = tl.zeros((BT,), tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            mk = rk < K
            x = tl.load(X + t[:, None] * K + rk[None, :], mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)
            f = tl.load(FN + rm[None, :] * K + rk[:, None], mask=mm[None, :] & mk[:, None], other=0.0)
            acc = tl.dot(x, f, acc, input_precision=PREC)
            ss += tl.sum(x * x, 1)
        tl.store(RAW + t[:, None] * MIX + rm[None, :], acc, mask=mt[:, None] & mm[None, :])
        tl.store(SSQ + t, ss, mask=mt)

    @triton.jit
    def _load_mix(RAW, SSQ, BASE, SCALE, t, mt, inv_k, norm_eps, NH: tl.constexpr, NP: tl.constexpr):
        """The pre / post / comb arguments of one block of tokens: (mix, a = mix * scale + base) for each."""
        MIX: tl.constexpr = (2 + NH) * NH
        r = tl.rsqrt(tl.load(SSQ + t, mask=mt, other=0.0) * inv_k + norm_eps)
        ri = tl.arange(0, NP)
        mi = ri < NH
        m2 = mt[:, None] & mi[None, :]
        s0, s1, s2 = tl.load(SCALE), tl.load(SCALE + 1), tl.load(SCALE + 2)
        pw = tl.load(RAW + t[:, None] * MIX + ri[None, :], mask=m2, other=0.0) * r[:, None]
        qw = tl.load(RAW + t[:, None] * MIX + NH + ri[None, :], mask=m2, other=0.0) * r[:, None]
        a0 = pw * s0 + tl.load(BASE + ri, mask=mi, other=0.0)[None, :]
        a1 = qw * s1 + tl.load(BASE + NH + ri, mask=mi, other=0.0)[None, :]
        ij = 2 * NH + ri[:, None] * NH + ri[None, :]
        valid = (mi[:, None] & mi[None, :])[None, :, :]
        cw = tl.load(RAW + t[:, None, None] * MIX + ij[None, :, :], mask=valid & mt[:, None, None], other=0.0)
        cw = cw * r[:, None, None]
        z = cw * s2 + tl.load(BASE + ij, mask=mi[:, None] & mi[None, :], other=0.0)[None, :, :]
        # softmax over j; rows beyond NH are padding (uniform here, zeroed by the callers through `valid`)
        z = tl.where(valid, z, -1e30)
        p = tl.exp(z - tl.max(z, 2)[:, :, None])
        p = p / tl.sum(p, 2)[:, :, None]
        return r, pw, qw, cw, a0, a1, p, valid

    @triton.jit
    def _sinkhorn_fwd_kernel(RAW, SSQ, BASE, SCALE, PRE, POST, COMB, N, eps, norm_eps, inv_k,
                             ITERS: tl.constexpr, NH: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr):
        t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
        mt = t < N
        r, pw, qw, cw, a0, a1, p, valid = _load_mix(RAW, SSQ, BASE, SCALE, t, mt, inv_k, norm_eps, NH, NP)
        ri = tl.arange(0, NP)
        m2 = mt[:, None] & (ri < NH)[None, :]
        tl.store(PRE + t[:, None] * NH + ri[None, :], _sigmoid(a0) + eps, mask=m2)
        tl.store(POST + t[:, None] * NH + ri[None, :], 2.0 * _sigmoid(a1), mask=m2)
        c = _col_norm(tl.where(valid, p + eps, 0.0), eps)
        for _ in range(ITERS - 1):
            c = _col_norm(_row_norm(c, eps), eps)
        ij = ri[:, None] * NH + ri[None, :]
        tl.store(COMB + t[:, None, None] * (NH * NH) + ij[None, :, :], c, mask=valid & mt[:, None, None])

    @triton.jit
    def _sinkhorn_bwd_kernel(RAW, SSQ, BASE, SCALE, GPRE, GPOST, GCOMB, GRAW, GSSQ, GPART, N, eps, norm_eps, inv_k,
                             ITERS: tl.constexpr, NH: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr):
        """-> GRAW (N, MIX) and GSSQ (N,): the gradients of raw and of the sum of squares; GPART[program] =
        this program's sums of the base (MIX) and scale (3) gradients."""
        MIX: tl.constexpr = (2 + NH) * NH
        pid = tl.program_id(0)
        t = (pid * BT + tl.arange(0, BT)).to(tl.int64)
        mt = t < N
        r, pw, qw, cw, a0, a1, p, valid = _load_mix(RAW, SSQ, BASE, SCALE, t, mt, inv_k, norm_eps, NH, NP)
        s0, s1, s2 = tl.load(SCALE), tl.load(SCALE + 1), tl.load(SCALE + 2)
        ri = tl.arange(0, NP)
        mi = ri < NH
        m2 = mt[:, None] & mi[None, :]
        sg0, sg1 = _sigmoid(a0), _sigmoid(a1)
        ga0 = tl.where(m2, tl.load(GPRE + t[:, None] * NH + ri[None, :], mask=m2, other=0.0) * sg0 * (1 - sg0), 0.0)
        ga1 = tl.where(m2, tl.load(GPOST + t[:, None] * NH + ri[None, :], mask=m2, other=0.0) * 2.0 * sg1 * (1 - sg1),
                       0.0)
        # comb: back through the Sinkhorn iterations, recomputing each one's input from the first column norm
        vt = valid & mt[:, None, None]
        ij = ri[:, None] * NH + ri[None, :]
        g = tl.load(GCOMB + t[:, None, None] * (NH * NH) + ij[None, :, :], mask=vt, other=0.0)
        c0 = tl.where(valid, p + eps, 0.0)
        c1 = _col_norm(c0, eps)
        for it in range(ITERS - 1):
            c = c1
            for _ in range(ITERS - 2 - it):
                c = _col_norm(_row_norm(c, eps), eps)
            g = _row_norm_vjp(c, _col_norm_vjp(_row_norm(c, eps), g, valid, eps), valid, eps)
        g = _col_norm_vjp(c0, g, valid, eps)
        gz = tl.where(vt, p * (g - tl.sum(g * p, 2)[:, :, None]), 0.0)
        # back to the normalized mix, then to raw and to the sum of squares
        gpw, gqw, gcw = ga0 * s0, ga1 * s1, gz * s2
        gr = tl.sum(gpw * pw, 1) + tl.sum(gqw * qw, 1) + tl.sum(tl.sum(gcw * cw, 2), 1)  # (d/dr) * r
        tl.store(GSSQ + t, -0.5 * gr * r * r * inv_k, mask=mt)
        tl.store(GRAW + t[:, None] * MIX + ri[None, :], gpw * r[:, None], mask=m2)
        tl.store(GRAW + t[:, None] * MIX + NH + ri[None, :], gqw * r[:, None], mask=m2)
        tl.store(GRAW + t[:, None, None] * MIX + 2 * NH + ij[None, :, :], gcw * r[:, None, None], mask=vt)
        out = GPART + pid * (MIX + 3)
        tl.store(out + ri, tl.sum(ga0, 0), mask=mi)
        tl.store(out + NH + ri, tl.sum(ga1, 0), mask=mi)
        tl.store(out + 2 * NH + ij, tl.sum(gz, 0), mask=mi[:, None] & mi[None, :])
        tl.store(out + MIX, tl.sum(tl.sum(ga0 * pw, 1), 0))
        tl.store(out + MIX + 1, tl.sum(tl.sum(ga1 * qw, 1), 0))
        tl.store(out + MIX + 2, tl.sum(tl.sum(tl.sum(gz * cw, 2), 1), 0))

    @triton.jit
    def _collapse_kernel(X, PRE, GC, OUT, NH: tl.constexpr, NP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                         BACKWARD: tl.constexpr):
        """One token. Forward: OUT (N, D) = sum_i PRE_i * X_i. Backward: OUT (N, NH) = X_i . GC (d/dPRE)."""
        t = tl.program_id(0).to(tl.int64)
        ri = tl.arange(0, NP)
        mi = ri < NH
        if BACKWARD:
            acc = tl.zeros((NP,), tl.float32)
        else:
            pre = tl.load(PRE + t * NH + ri, mask=mi, other=0.0)
        for d0 in range(0, D, BD):
            rd = d0 + tl.arange(0, BD)
            md = rd < D
            x = tl.load(X + t * NH * D + ri[:, None] * D + rd[None, :], mask=mi[:, None] & md[None, :], other=0.0)
            if BACKWARD:
                gc = tl.load(GC + t * D + rd, mask=md, other=0.0).to(tl.float32)
                acc += tl.sum(x.to(tl.float32) * gc[None, :], 1)
            else:
                tl.store(OUT + t * D + rd, tl.sum(x.to(tl.float32) * pre[:, None], 0).to(OUT.dtype.element_ty),
                         mask=md)
        if BACKWARD:
            tl.store(OUT + t * NH + ri, acc, mask=mi)

    @triton.jit
    def _mix_bwd_x_kernel(GRAW, GSSQ, FN, X, PRE, GC, GX, N, K: tl.constexpr, D: tl.constexpr, MIX: tl.constexpr,
                          MIXP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
        """GX = GRAW @ FN + 2 X GSSQ + PRE_i GC (the collapse's share), tiles of (BT tokens, BK of the NH * D)."""
        t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
        rk = tl.program_id(1) * BK + tl.arange(0, BK)
        mt, mk = t < N, rk < K
        rm = tl.arange(0, MIXP)
        mm = rm < MIX
        gr = tl.load(GRAW + t[:, None] * MIX + rm[None, :], mask=mt[:, None] & mm[None, :], other=0.0)
        f = tl.load(FN + rm[:, None] * K + rk[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
        acc = tl.dot(gr, f, input_precision=PREC)
        m2 = mt[:, None] & mk[None, :]
        x = tl.load(X + t[:, None] * K + rk[None, :], mask=m2, other=0.0).to(tl.float32)
        acc += 2.0 * x * tl.load(GSSQ + t, mask=mt, other=0.0)[:, None]
        pre = tl.load(PRE + t[:, None] * (K // D) + rk[None, :] // D, mask=m2, other=0.0)
        gc = tl.load(GC + t[:, None] * D + rk[None, :] % D, mask=m2, other=0.0).to(tl.float32)
        tl.store(GX + t[:, None] * K + rk[None, :], (acc + pre * gc).to(GX.dtype.element_ty), mask=m2)

    @triton.jit
    def _mix_bwd_fn_kernel(GRAW, X, GFN, N, NCAP: tl.constexpr, DYNAMIC: tl.constexpr, K: tl.constexpr,
                           MIX: tl.constexpr, MIXP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                           PREC: tl.constexpr):
        """GFN (MIX, K) = GRAW^T @ X, one program per BK columns, over all tokens."""
        rk = tl.program_id(0) * BK + tl.arange(0, BK)
        mk = rk < K
        rm = tl.arange(0, MIXP)
        mm = rm < MIX
        acc = tl.zeros((MIXP, BK), tl.float32)
        for t0 in range(0, N if DYNAMIC else NCAP, BT):  # the interpreter needs a static bound
            t = (t0 + tl.arange(0, BT)).to(tl.int64)
            mt = t < N
            gr = tl.load(GRAW + t[None, :] * MIX + rm[:, None], mask=mm[:, None] & mt[None, :], other=0.0)
            x = tl.load(X + t[:, None] * K + rk[None, :], mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)
            acc = tl.dot(gr, x, acc, input_precision=PREC)
        tl.store(GFN + rm[:, None] * K + rk[None, :], acc, mask=mm[:, None] & mk[None, :])

    @triton.jit
    def _hc_post_bwd_kernel(GY, OUT, X, POST, COMB, GOUT, GX, GPOST, GCOMB, NH: tl.constexpr, NP: tl.constexpr,
                            D: tl.constexpr, BD: tl.constexpr):
        """One token of y_j = post_j * out + sum_i comb[i, j] * x_i: the gradients of out, x, post and comb."""
        t = tl.program_id(0).to(tl.int64)
        ri = tl.arange(0, NP)
        mi = ri < NH
        mij = mi[:, None] & mi[None, :]
        post = tl.load(POST + t * NH + ri, mask=mi, other=0.0)
        comb = tl.load(COMB + t * NH * NH + ri[:, None] * NH + ri[None, :], mask=mij, other=0.0)
        gpost = tl.zeros((NP,), tl.float32)
        gcomb = tl.zeros((NP, NP), tl.float32)
        for d0 in range(0, D, BD):
            rd = d0 + tl.arange(0, BD)
            md = rd < D
            m2 = mi[:, None] & md[None, :]
            gy = tl.load(GY + t * NH * D + ri[:, None] * D + rd[None, :], mask=m2, other=0.0).to(tl.float32)
            x = tl.load(X + t * NH * D + ri[:, None] * D + rd[None, :], mask=m2, other=0.0).to(tl.float32)
            o = tl.load(OUT + t * D + rd, mask=md, other=0.0).to(tl.float32)
            tl.store(GOUT + t * D + rd, tl.sum(post[:, None] * gy, 0).to(GOUT.dtype.element_ty), mask=md)
            gx = tl.sum(comb[:, :, None] * gy[None, :, :], 1)  # gx_i = sum_j comb[i, j] gy_j
            tl.store(GX + t * NH * D + ri[:, None] * D + rd[None, :], gx.to(GX.dtype.element_ty), mask=m2)
            gpost += tl.sum(gy * o[None, :], 1)
            gcomb += tl.sum(x[:, None, :] * gy[None, :, :], 2)
        tl.store(GPOST + t * NH + ri, gpost, mask=mi)
        tl.store(GCOMB + t * NH * NH + ri[:, None] * NH + ri[None, :], gcomb, mask=mij)


# tiles measured on an H200 at mini's width (16k tokens, 4 streams of 2048): the fastest of 9-18 variants each
_BT, _BK = 64, 64          # the forward mix and fn's gradient (tokens, features)
_BT_GX, _BK_GX = 32, 128   # x's gradient
_BT_SINK = 64              # tokens per program of the Sinkhorn kernels (2 warps)


class _HcPre(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, base, scale, iters, eps, norm_eps):
        *lead, n, D = x.shape
        xf = x.reshape(-1, n * D).contiguous()
        N, K, MIX = xf.shape[0], n * D, (2 + n) * n
        dev = x.device
        f32 = dict(dtype=torch.float32, device=dev)
        fn32, base32, scale32 = (t.float().contiguous() for t in (fn, base, scale))
        raw, ssq = torch.empty(N, MIX, **f32), torch.empty(N, **f32)
        pre, post, comb = torch.empty(N, n, **f32), torch.empty(N, n, **f32), torch.empty(N, n, n, **f32)
        coll = torch.empty(N, D, dtype=x.dtype, device=dev)
        mixp, npow = max(16, pow2(MIX)), pow2(n)
        if N:
            _mix_fwd_kernel[(triton.cdiv(N, _BT),)](xf, fn32, raw, ssq, N, K=K, MIX=MIX, MIXP=mixp, BT=_BT, BK=_BK,
                                                    PREC=fp8_gemm.F32_DOT, num_warps=4)
            _sinkhorn_fwd_kernel[(triton.cdiv(N, _BT_SINK),)](raw, ssq, base32, scale32, pre, post, comb, N, eps,
                                                              norm_eps, 1.0 / K, ITERS=iters, NH=n, NP=npow,
                                                              BT=_BT_SINK, num_warps=2)
            _collapse_kernel[(N,)](xf, pre, xf, coll, NH=n, NP=npow, D=D, BD=min(1024, pow2(D)), BACKWARD=False,
                                   num_warps=4)
        ctx.save_for_backward(x, fn32, base32, scale32, raw, ssq, pre)
        ctx.cfg = (iters, eps, norm_eps, fn.dtype, base.dtype, scale.dtype)
        return coll.view(*lead, D), post.view(*lead, n), comb.view(*lead, n, n)

    @staticmethod
    def backward(ctx, g_coll, g_post, g_comb):
        x, fn32, base32, scale32, raw, ssq, pre = ctx.saved_tensors
        iters, eps, norm_eps, fn_dt, base_dt, scale_dt = ctx.cfg
        *lead, n, D = x.shape
        xf = x.reshape(-1, n * D).contiguous()
        N, K, MIX = xf.shape[0], n * D, (2 + n) * n
        dev = x.device
        g_coll = (torch.zeros(N, D, dtype=x.dtype, device=dev) if g_coll is None
                  else g_coll.reshape(N, D).contiguous())
        g_post = (torch.zeros(N, n, device=dev) if g_post is None else g_post.reshape(N, n).float().contiguous())
        g_comb = (torch.zeros(N, n, n, device=dev) if g_comb is None
                  else g_comb.reshape(N, n, n).float().contiguous())
        mixp, npow = max(16, pow2(MIX)), pow2(n)
        g_pre = torch.empty(N, n, dtype=torch.float32, device=dev)
        graw, gssq = torch.empty(N, MIX, dtype=torch.float32, device=dev), torch.empty(N, dtype=torch.float32, device=dev)
        progs = triton.cdiv(N, _BT_SINK)
        part = torch.empty(progs, MIX + 3, dtype=torch.float32, device=dev)
        gx = torch.empty_like(xf)
        gfn = torch.empty(MIX, K, dtype=torch.float32, device=dev)
        if N:
            _collapse_kernel[(N,)](xf, pre, g_coll, g_pre, NH=n, NP=npow, D=D, BD=min(1024, pow2(D)), BACKWARD=True,
                                   num_warps=4)
            _sinkhorn_bwd_kernel[(progs,)](raw, ssq, base32, scale32, g_pre, g_post, g_comb, graw, gssq, part, N, eps,
                                           norm_eps, 1.0 / K, ITERS=iters, NH=n, NP=npow, BT=_BT_SINK, num_warps=2)
            _mix_bwd_x_kernel[(triton.cdiv(N, _BT_GX), triton.cdiv(K, _BK_GX))](graw, gssq, fn32, xf, pre, g_coll, gx,
                                                                                N, K=K, D=D, MIX=MIX, MIXP=mixp,
                                                                                BT=_BT_GX, BK=_BK_GX,
                                                                                PREC=fp8_gemm.F32_DOT, num_warps=4)
            _mix_bwd_fn_kernel[(triton.cdiv(K, _BK),)](graw, xf, gfn, N, NCAP=N if not xf.is_cuda else 0,
                                                       DYNAMIC=xf.is_cuda, K=K, MIX=MIX, MIXP=mixp, BT=_BT, BK=_BK,
                                                       PREC=fp8_gemm.F32_DOT, num_warps=4)
        else:
            gfn.zero_()
            part.zero_()
        gpart = part.sum(0)
        return (gx.view(x.shape), gfn.to(fn_dt), gpart[:MIX].to(base_dt), gpart[MIX:].to(scale_dt),
                None, None, None)


def hc_pre(x, fn, base, scale, iters: int, eps: float, norm_eps: float):
    """The differentiable twin of model._hc_pre: x (..., n, D) -> collapsed (..., D) in x's dtype, post (..., n)
    and comb (..., n, n) fp32."""
    return _HcPre.apply(x, fn, base, scale, iters, eps, norm_eps)


class _HcPost(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, x, post, comb):
        ctx.save_for_backward(out, x, post, comb)
        return _hc_post_fwd(out, x, post, comb)

    @staticmethod
    def backward(ctx, gy):
        out, x, post, comb = (t.contiguous() for t in ctx.saved_tensors)
        n, D = x.shape[-2:]
        N = x.numel() // (n * D)
        gout, gx = torch.empty_like(out), torch.empty_like(x)
        gpost = torch.empty(post.shape, dtype=torch.float32, device=x.device)
        gcomb = torch.empty(comb.shape, dtype=torch.float32, device=x.device)
        if N:
            _hc_post_bwd_kernel[(N,)](gy.contiguous(), out, x, post, comb, gout, gx, gpost, gcomb, NH=n, NP=pow2(n),
                                      D=D, BD=min(1024, pow2(D)), num_warps=2)
        return gout, gx, gpost.to(post.dtype), gcomb.to(comb.dtype)


def hc_post(out, x, post, comb):
    """The differentiable twin of model._hc_post: out (..., D), x (..., n, D), post (..., n), comb (..., n, n)."""
    return _HcPost.apply(out, x, post, comb)
