"""Fused small ops: one pass each instead of a chain of torch kernels over fp32 copies.

    hc_pre(x, fn, base, scale, iters, eps, norm_eps, norm[, fp8]) -> collapsed [normed], post, comb[, quantized]
    hc_head(x, fn, base, scale, eps, norm_eps, norm) -> collapsed [normed]
    hc_post(out, x, post, comb[, fn]) -> new streams [, the next hc_pre's mix partials over them]
    rms_norm(x, weight, eps)                                                     (weight None = unweighted)
    rms_norm_quant(x, weight, eps, fp8) -> normed, quantized                     (inference, for FP8 linears)
    rope(x, cos, sin, inverse)                                                   (interleaved, last dims)
    norm_rope(x, weight, eps, cos, sin[, store, first])                          (RMSNorm then rope, inference)
    swiglu(gate, up, limit)

Each computes the same function as its twin in model/model.py (`hc_pre`, `Transformer.hc_head`, `hc_post`,
`RMSNorm`, `rms_unweighted`, `apply_rope`'s `_rope`, `_swiglu`). rms_norm, rope and swiglu have backward kernels
(autograd Functions), so the model uses them wherever Triton runs (`use_triton`: GPUs, or the interpreter in
tests), training included. The hyper-connection kernels are forward-only: the model calls them when `fused_ok(x)`,
in inference mode; there hc_pre and hc_head also apply the RMSNorm that follows them.
"""
from __future__ import annotations

import torch

from . import fp8_gemm
from .fp8_gemm import pdl, pdl_wait, pow2, quant_rows, triton, use_triton
from .moe import SlotRows
from .quant import BLOCK as TILE, fp8_max

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    from .moe import slot_total


def needs_grad(*ts) -> bool:
    """Whether autograd will want a backward through these inputs (None entries ignored)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def fused_ok(x: torch.Tensor) -> bool:
    """For the forward-only kernels: inference engines (torch.inference_mode) on a GPU."""
    return use_triton(x) and torch.is_inference_mode_enabled()


if triton is not None:
    @triton.jit
    def _hc_mix_kernel(X, FN, PART, M, F: tl.constexpr, MIX: tl.constexpr, MIXP: tl.constexpr,
                       SPLIT: tl.constexpr, CHUNK: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                       SSQ: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr = False):
        """x @ fn^T for rows [BM * rb, BM * (rb + 1)) over the s-th CHUNK of columns: PART[t, s] (MIXP,) fp32
        partials, fp32 products at about fp32 accuracy (tensor-core passes of PREC, fp8_gemm.F32_DOT) in an order
        fixed by the constexprs alone, so a row's partials do not depend on M (the batch) or on its neighbours.
        SSQ: column MIXP - 1 (past the MIX products) holds the chunk's sum of squares of x."""
        pdl_wait(PDL)
        rb, s = tl.program_id(0), tl.program_id(1)
        rows = rb * BM + tl.arange(0, BM)
        mr = rows < M
        rm = tl.arange(0, MIXP)
        acc = tl.zeros((BM, MIXP), tl.float32)
        ss = tl.zeros((BM,), tl.float32)
        for f0 in range(0, CHUNK, BK):
            rf = s * CHUNK + f0 + tl.arange(0, BK)
            mf = rf < F
            x = tl.load(X + rows[:, None] * F + rf[None, :], mask=mr[:, None] & mf[None, :], other=0.0)
            x = x.to(tl.float32)
            w = tl.load(FN + rm[None, :] * F + rf[:, None], mask=(rm[None, :] < MIX) & mf[:, None], other=0.0)
            acc = tl.dot(x, w.to(tl.float32), acc, input_precision=PREC)
            if SSQ:
                ss += tl.sum(x * x, 1)
        if SSQ:
            acc = tl.where(rm[None, :] == MIXP - 1, ss[:, None], acc)
        tl.store(PART + (rows[:, None] * SPLIT + s) * MIXP + rm[None, :], acc, mask=mr[:, None])

    @triton.jit
    def _sum_partials(PART, t, SPLIT: tl.constexpr, W: tl.constexpr, SB: tl.constexpr):
        """Row t's SPLIT partials (W,) of _hc_mix_kernel summed, SB at a time (one tile load each, not SPLIT
        dependent loads), in an order fixed by the constexprs."""
        rw = tl.arange(0, W)
        rs = tl.arange(0, SB)
        tot = tl.zeros((W,), tl.float32)
        for s0 in range(0, SPLIT, SB):
            ms = s0 + rs < SPLIT
            tot += tl.sum(tl.load(PART + (t * SPLIT + s0 + rs[:, None]) * W + rw[None, :], mask=ms[:, None],
                                  other=0.0), 0)
        return tot

    @triton.jit
    def _collapse(X, t, pre, d0, N_HC: tl.constexpr, D: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr,
                  dtype: tl.constexpr):
        """Columns [d0, d0 + BLOCK) of token t's pre-weighted sum of its N_HC streams, rounded to dtype (as fp32)."""
        ri = tl.arange(0, NP)
        rd = d0 + tl.arange(0, BLOCK)
        xs = tl.load(X + t * (N_HC * D) + ri[:, None] * D + rd[None, :], mask=(ri < N_HC)[:, None] & (rd < D)[None, :],
                     other=0.0)
        return tl.sum(xs.to(tl.float32) * pre[:, None], 0).to(dtype).to(tl.float32)

    @triton.jit
    def _hc_pre_kernel(X, PART, BASE, SCALE, NW, COLL, POST, COMB, Q, S, eps, norm_eps, rms_eps, fmax,
                       ITERS: tl.constexpr, N_HC: tl.constexpr, D: tl.constexpr, NP: tl.constexpr,
                       MIXP: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr, HEAD: tl.constexpr,
                       NORM: tl.constexpr, SB: tl.constexpr, QUANT: tl.constexpr = False, ROLE: tl.constexpr = 0,
                       PDL: tl.constexpr = False):
        """Program (token t, role). Both roles sum the SPLIT partials of _hc_mix_kernel (x @ fn^T, and the sum of
        squares of x in column MIXP - 1) and scale them by the streams' rsqrt-mean-square. Role 0: pre and the
        pre-weighted collapse of the streams, RMS-normed with weight NW (eps rms_eps) when NORM. Role 1: post and
        the Sinkhorn-projected comb, so the Sinkhorn chain runs beside the collapse. HEAD: the head's collapse
        (N_HC pre weights, one scale, no role 1). ROLE: the first program's role (1: a launch of role 1 alone).
        QUANT (NORM, D <= BLOCK, D % 128 == 0): role 0 also stores the normed row quantized per 1x128 tile in Q
        (fp8) and S (scales), act_quant's arithmetic on the stored (rounded) row, so the FP8 linears and experts
        that read it skip their act_quant."""
        pdl_wait(PDL)
        t, role = tl.program_id(0), tl.program_id(1) + ROLE
        MIX: tl.constexpr = N_HC if HEAD else (2 + N_HC) * N_HC
        rm = tl.arange(0, MIXP)
        raw = _sum_partials(PART, t, SPLIT, MIXP, SB)
        mix = raw * tl.rsqrt(tl.sum(tl.where(rm == MIXP - 1, raw, 0.0), 0) / (N_HC * D) + norm_eps)
        b = tl.load(BASE + rm, mask=rm < MIX, other=0.0)
        ri = tl.arange(0, NP)
        mi = ri < N_HC
        dt: tl.constexpr = COLL.dtype.element_ty
        if role == 0:
            # pre: entries [0, n) of the mix vector, picked with one-hot sums
            sel = (rm[None, :] == ri[:, None]) & mi[:, None]
            pre = 1.0 / (1.0 + tl.exp(-tl.sum(tl.where(sel, mix[None, :] * tl.load(SCALE) + b[None, :], 0.0), 1)))
            pre += eps
            if NORM and D <= BLOCK:  # the row in registers
                c = _collapse(X, t, pre, 0, N_HC, D, NP, BLOCK, dt)
                rd = tl.arange(0, BLOCK)
                inv = tl.rsqrt(tl.sum(c * c, 0) / D + rms_eps)
                w = tl.load(NW + rd, mask=rd < D, other=0.0).to(tl.float32)
                y = (w * (c * inv)).to(dt)
                tl.store(COLL + t * D + rd, y, mask=rd < D)
                if QUANT:
                    store_quant_row(Q, S, t, y, fmax, D, BLOCK)
            else:  # the collapse in chunks, then (NORM) a second pass over what this program stored
                ss = tl.zeros((BLOCK,), tl.float32)
                for d0 in range(0, D, BLOCK):
                    c = _collapse(X, t, pre, d0, N_HC, D, NP, BLOCK, dt)
                    rd = d0 + tl.arange(0, BLOCK)
                    tl.store(COLL + t * D + rd, c.to(dt), mask=rd < D)
                    ss += c * c
                if NORM:
                    inv = tl.rsqrt(tl.sum(ss, 0) / D + rms_eps)
                    tl.debug_barrier()
                    for d0 in range(0, D, BLOCK):
                        rd = d0 + tl.arange(0, BLOCK)
                        c = tl.load(COLL + t * D + rd, mask=rd < D, other=0.0).to(tl.float32)
                        w = tl.load(NW + rd, mask=rd < D, other=0.0).to(tl.float32)
                        tl.store(COLL + t * D + rd, (w * (c * inv)).to(dt), mask=rd < D)
        else:
            s1, s2 = tl.load(SCALE + 1), tl.load(SCALE + 2)
            sel_post = (rm[None, :] == (ri[:, None] + N_HC)) & mi[:, None]
            post = 2.0 / (1.0 + tl.exp(-tl.sum(tl.where(sel_post, mix[None, :] * s1 + b[None, :], 0.0), 1)))
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

    @triton.jit
    def _load_out(OUT, SY, IDS, E, t, rd, md, D: tl.constexpr, KR: tl.constexpr, KT: tl.constexpr):
        """The sublayer's output for token t at columns rd (md: those < D), fp32: OUT's, or with KT > 0 the sum of
        the token's KT slot rows of SY (an MoE's SlotRows) rounded to OUT's dtype, as moe._moe_sum_kernel stores
        it (the same slot_total), whose launch this saves: the same bits as summing first."""
        if KT == 0:
            out = tl.load(OUT + t * D + rd, mask=md, other=0.0).to(tl.float32)
        else:
            out = slot_total(SY, IDS, E, t, rd, md, D, KR, KT).to(OUT.dtype.element_ty).to(tl.float32)
        return out

    @triton.jit
    def _post_tile(OUT, X, POST, COMB, t, rd, N_HC: tl.constexpr, D: tl.constexpr, NP: tl.constexpr,
                   SY=None, IDS=None, E=0, KR: tl.constexpr = 0, KT: tl.constexpr = 0):
        """Token t's new streams at columns rd, fp32 (NP, len(rd)): y_i = post_i * out + sum_j comb[j, i] * x_j
        (out: _load_out's)."""
        ri = tl.arange(0, NP)
        mi = ri < N_HC
        md = rd < D
        x = tl.load(X + t * N_HC * D + ri[:, None] * D + rd[None, :], mask=mi[:, None] & md[None, :], other=0.0)
        x = x.to(tl.float32)
        out = _load_out(OUT, SY, IDS, E, t, rd, md, D, KR, KT)
        post = tl.load(POST + t * N_HC + ri, mask=mi, other=0.0)
        comb = tl.load(COMB + t * N_HC * N_HC + ri[:, None] * N_HC + ri[None, :], mask=mi[:, None] & mi[None, :],
                       other=0.0)  # comb[j, i]
        return post[:, None] * out[None, :] + tl.sum(comb[:, :, None] * x[:, None, :], 0)

    @triton.jit
    def _hc_post_kernel(OUT, X, POST, COMB, Y, N_HC: tl.constexpr, D: tl.constexpr, NP: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        pdl_wait(PDL)
        t, db = tl.program_id(0), tl.program_id(1)
        ri = tl.arange(0, NP)
        rd = db * BLOCK + tl.arange(0, BLOCK)
        y = _post_tile(OUT, X, POST, COMB, t, rd, N_HC, D, NP)
        tl.store(Y + t * N_HC * D + ri[:, None] * D + rd[None, :], y.to(Y.dtype.element_ty),
                 mask=(ri < N_HC)[:, None] & (rd < D)[None, :])

    @triton.jit
    def _hc_post_mix_kernel(OUT, X, POST, COMB, Y, FN, PART, SY, IDS, E, N_HC: tl.constexpr, D: tl.constexpr,
                            NP: tl.constexpr, MIX: tl.constexpr, MIXP: tl.constexpr, CHUNK: tl.constexpr,
                            KR: tl.constexpr, KT: tl.constexpr, PDL: tl.constexpr = False):
        """Program (s, token t): hc_post (_hc_post_kernel's arithmetic) for stream i's columns [d0, d0 + CHUNK),
        s = i * D / CHUNK + d0 / CHUNK being that chunk of the flattened (n * D) row, then the chunk's mix
        partials over the stored (rounded) result: _hc_mix_kernel's PART[t, s] (the next hc_pre sums them), fp32
        products and sums. KT > 0: out is the sum of slot rows (_load_out)."""
        pdl_wait(PDL)
        s, t = tl.program_id(0), tl.program_id(1).to(tl.int64)
        SPLIT: tl.constexpr = N_HC * D // CHUNK
        i = s // (D // CHUNK)
        rd = (s % (D // CHUNK)) * CHUNK + tl.arange(0, CHUNK)
        ri = tl.arange(0, NP)
        rm = tl.arange(0, MIXP)
        y = _post_tile(OUT, X, POST, COMB, t, rd, N_HC, D, NP, SY, IDS, E, KR, KT)
        y = tl.sum(tl.where(ri[:, None] == i, y, 0.0), 0).to(Y.dtype.element_ty)  # stream i's row
        tl.store(Y + t * N_HC * D + i * D + rd, y)
        y = y.to(tl.float32)
        w = tl.load(FN + rm[None, :] * (N_HC * D) + i * D + rd[:, None], mask=(rm < MIX)[None, :], other=0.0)
        acc = tl.sum(y[:, None] * w, 0)
        tl.store(PART + (t * SPLIT + s) * MIXP + rm, tl.where(rm == MIXP - 1, tl.sum(y * y, 0), acc))

    @triton.jit
    def _hc_post_mix_rows_kernel(OUT, X, POST, COMB, Y, FN, PART, N, SY, IDS, E, N_HC: tl.constexpr,
                                 D: tl.constexpr, NP: tl.constexpr, MIX: tl.constexpr, MIXP: tl.constexpr,
                                 CHUNK: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                                 KR: tl.constexpr = 0, KT: tl.constexpr = 0, PDL: tl.constexpr = False):
        """Program (s, token block b): _hc_post_mix_kernel's work for BT tokens at once, the chunk's weights loaded
        once for all of them. The mix partials take _hc_mix_kernel's steps (tensor-core products of PREC over BK
        columns of BT rows, accumulated; the sum of squares beside them), so they equal what that kernel gives
        over the stored streams with the same tiles. KT > 0: out is the sum of the tokens' KT slot rows of SY
        (slot_total's order, rounded to OUT's dtype), and the partials read the new streams back as stored (a
        load, as _hc_mix_kernel's): computed from the sums, the streams took a register layout whose sums of
        squares ran in another order."""
        pdl_wait(PDL)
        s, b = tl.program_id(0), tl.program_id(1)
        SPLIT: tl.constexpr = N_HC * D // CHUNK
        i = s // (D // CHUNK)
        t = (b * BT + tl.arange(0, BT)).to(tl.int64)
        mt = t < N
        rj = tl.arange(0, NP)
        mj = rj < N_HC
        rm = tl.arange(0, MIXP)
        post = tl.load(POST + t * N_HC + i, mask=mt, other=0.0)
        comb = tl.load(COMB + t[:, None] * (N_HC * N_HC) + rj[None, :] * N_HC + i, mask=mt[:, None] & mj[None, :],
                       other=0.0)  # comb[t, j, i]
        acc = tl.zeros((BT, MIXP), tl.float32)
        ss = tl.zeros((BT,), tl.float32)
        for f0 in range(0, CHUNK, BK):
            rd = (s % (D // CHUNK)) * CHUNK + f0 + tl.arange(0, BK)
            x = tl.load(X + t[:, None, None] * (N_HC * D) + rj[None, :, None] * D + rd[None, None, :],
                        mask=mt[:, None, None] & mj[None, :, None], other=0.0).to(tl.float32)  # (BT, NP, BK)
            if KT == 0:
                out = tl.load(OUT + t[:, None] * D + rd[None, :], mask=mt[:, None], other=0.0).to(tl.float32)
            else:
                out = slot_total(SY, IDS, E, t, rd, mt[:, None] & (rd < D)[None, :], D, KR, KT, mt)
                out = out.to(OUT.dtype.element_ty).to(tl.float32)
            y = (post[:, None] * out + tl.sum(comb[:, :, None] * x, 1)).to(Y.dtype.element_ty)
            yp = Y + t[:, None] * (N_HC * D) + i * D + rd[None, :]
            tl.store(yp, y, mask=mt[:, None])
            if KT == 0:
                y = y.to(tl.float32)
            else:
                tl.debug_barrier()  # every thread's part of the tile is stored before any reads it back
                y = tl.load(yp, mask=mt[:, None], other=0.0).to(tl.float32)
            w = tl.load(FN + rm[None, :] * (N_HC * D) + i * D + rd[:, None], mask=(rm < MIX)[None, :], other=0.0)
            acc = tl.dot(y, w.to(tl.float32), acc, input_precision=PREC)
            ss += tl.sum(y * y, 1)
        acc = tl.where(rm[None, :] == MIXP - 1, ss[:, None], acc)
        tl.store(PART + (t[:, None] * SPLIT + s) * MIXP + rm[None, :], acc, mask=mt[:, None])

    @triton.jit
    def store_quant_row(Q, S, r, y, fmax, D: tl.constexpr, BLOCK: tl.constexpr):
        """Row r of (Q (rows, D) fp8, S (rows, D/128) fp32) = y (BLOCK,) (a row as it was stored, D of it valid,
        D % 128 == 0) quantized per 1x128 tile in act_quant's arithmetic (quant_rows): the bytes act_quant would
        give the FP8 linears and experts that read the row, so they skip its launch."""
        NT: tl.constexpr = BLOCK // 128
        q, s = quant_rows(tl.reshape(y.to(tl.float32), (NT, 128)), fmax)
        tb = tl.arange(0, NT)
        offs = tb[:, None] * 128 + tl.arange(0, 128)[None, :]
        tl.store(Q + r * D + offs, q.to(Q.dtype.element_ty), mask=offs < D)
        tl.store(S + r * (D // 128) + tb, s, mask=tb < D // 128)

    @triton.jit
    def _rms_row(X, W, r, stride_x, eps, D: tl.constexpr, BLOCK: tl.constexpr, WEIGHTED: tl.constexpr):
        """Row r of x RMS-normed, fp32 (BLOCK,) before the cast to x's dtype."""
        rd = tl.arange(0, BLOCK)
        md = rd < D
        x = tl.load(X + r * stride_x + rd, mask=md, other=0.0)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)
        if WEIGHTED:
            y = tl.load(W + rd, mask=md, other=0.0).to(tl.float32) * (xf * inv)
        else:  # the torch twin multiplies in x's dtype: round the factor first
            y = xf * inv.to(x.dtype).to(tl.float32)
        return y

    @triton.jit
    def _rms_kernel(X, W, Y, Q, S, eps, stride_x, fmax, D: tl.constexpr, BLOCK: tl.constexpr,
                    WEIGHTED: tl.constexpr, QUANT: tl.constexpr = False, PDL: tl.constexpr = False):
        """Row r of Y = RMSNorm(x). QUANT (D % 128 == 0): the stored row also quantized per 1x128 tile into Q and
        S, act_quant's bytes (store_quant_row)."""
        pdl_wait(PDL)
        r = tl.program_id(0)
        rd = tl.arange(0, BLOCK)
        y = _rms_row(X, W, r, stride_x, eps, D, BLOCK, WEIGHTED).to(Y.dtype.element_ty)
        tl.store(Y + r * D + rd, y, mask=rd < D)
        if QUANT:
            store_quant_row(Q, S, r, y, fmax, D, BLOCK)


MIX_CHUNK = 64  # columns a mix partial sums (_mix_partials and hc_post's: one layout)
MIX_ROWS = 16   # rows a mix program takes (_mix_partials at every M; hc_post's past POST_MIX_TOKENS)


def _mix_warps(M: int) -> int:
    return 4 if M <= 16 else 2


def _mix_step(mixp: int) -> int:
    """Columns of a mix product step: the chunk, or fewer where the (step x mixp) fp32 weight tile would pass 16 KB."""
    return max(16, min(MIX_CHUNK, 4096 // mixp))


def _mix_width(n: int, ssq: bool) -> int:
    """A row of mix partials: n products [and the sum of squares in the last column], >= 16 wide."""
    return max(16, pow2(n + ssq))


def _mix_partials(x, w, ssq: bool = False):
    """x (M, K) any float dtype, w (N, K) small N -> (M, ceil(K / MIX_CHUNK), _mix_width) fp32 partial sums of
    x @ w^T over column chunks: enough programs to fill the GPU at M = 1, and batch-invariant (see _hc_mix_kernel).
    ssq: the last column holds each chunk's sum of squares of x (the width leaves one past the N products).
    (cuBLAS took two casts, an fp32 GEMM and a split-K reduction for these skinny products.)
    Tiles: 16 rows at every M (one order of sums for a row whatever the batch), a 64-column step where the
    weight tile stays within 16 KB, 4 warps up to 16 rows, 2 past. On an H200, mini.yaml's mHC (K 8,192, 24
    outputs) / router (K 2,048, 32), us a call against 4-row tiles of fp32 sums (no tensor cores): 1 row 2.1 / 2.0
    against 1.7 / 1.8; 16 rows 2.2 against 2.6; 64 rows 3.0 / 2.2 against 5.9 / 2.6; 256 rows 6.5 / 2.9
    against 18.7 / 5.8. Relative error against float64 2e-7 (1e-7 before)."""
    M, K = x.shape
    n, bm, chunk = w.shape[0], MIX_ROWS, MIX_CHUNK
    mixp = _mix_width(n, ssq)
    split = triton.cdiv(K, chunk)
    part = torch.empty(M, split, mixp, dtype=torch.float32, device=x.device)
    _hc_mix_kernel[(triton.cdiv(M, bm), split)](x, w.contiguous(), part, M, F=K, MIX=n, MIXP=mixp, SPLIT=split,
                                               CHUNK=chunk, BM=bm, BK=_mix_step(mixp), SSQ=ssq,
                                               PREC=fp8_gemm.F32_DOT, num_warps=_mix_warps(M), **pdl(x))
    return part


if triton is not None:
    @triton.jit
    def _route_kernel(PART, BIAS, HASH, TOKS, WOUT, IOUT, scale, E: tl.constexpr, EP: tl.constexpr,
                      SPLIT: tl.constexpr, SB: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, FUNC: tl.constexpr,
                      HASHED: tl.constexpr, NORM: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr = False,
                      ROUT=None, stride_r=0):
        """One token: logits (the SPLIT partials of _hc_mix_kernel, summed) -> scores (FUNC 0 softmax,
        1 sigmoid, 2 sqrt(softplus)), the top K of scores + bias (or the hash layer's K ids: row TOKS[t] of its
        table HASH), their scores normalized (NORM) and scaled. ROUT: the ids also as uint8, row t at t *
        stride_r."""
        pdl_wait(PDL)
        t = tl.program_id(0)
        re = tl.arange(0, EP)
        me = re < E
        lg = _sum_partials(PART, t, SPLIT, EP, SB)
        if FUNC == 0:
            z = tl.where(me, lg, float("-inf"))
            ex = tl.exp(z - tl.max(z, 0))
            s = ex / tl.sum(ex, 0)
        elif FUNC == 1:
            s = 1.0 / (1.0 + tl.exp(-lg))
        else:  # torch's softplus: x itself past its threshold 20
            if LIBDEVICE:
                sp_ = libdevice.log1p(tl.exp(lg))
            else:
                sp_ = tl.log(1.0 + tl.exp(lg))
            s = tl.sqrt(tl.where(lg > 20.0, lg, sp_))
        rk = tl.arange(0, KP)
        if HASHED:
            ids = tl.load(HASH + tl.load(TOKS + t) * K + rk, mask=rk < K, other=0)
            w = tl.sum(tl.where(ids[:, None] == re[None, :], s[None, :], 0.0), 1)
        else:
            sel = tl.where(me, s + tl.load(BIAS + re, mask=me, other=0.0), float("-inf"))
            ids = tl.zeros((KP,), tl.int64)
            w = tl.zeros((KP,), tl.float32)
            for j in range(K):
                _, i = tl.max(sel, 0, return_indices=True, return_indices_tie_break_left=True)
                ids = tl.where(rk == j, i.to(tl.int64), ids)
                w = tl.where(rk == j, tl.sum(tl.where(re == i, s, 0.0), 0), w)
                sel = tl.where(re == i, float("-inf"), sel)
        w = tl.where(rk < K, w, 0.0)
        if NORM:
            w = w / (tl.sum(w, 0) + 1e-20)
        tl.store(WOUT + t * K + rk, w * scale, mask=rk < K)
        tl.store(IOUT + t * K + rk, ids.to(tl.int64), mask=rk < K)
        if ROUT is not None:
            tl.store(ROUT + t * stride_r + rk, ids.to(tl.uint8), mask=rk < K)


_SCORE_FUNC = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


def route(x, weight, bias, k: int, score_func: str, norm: bool, scale: float, hash_table=None, tokens=None,
          rows=None):
    """The router at inference (model.Gate's twin without replay): x (M, D), weight (E, D), bias (E,) fp32 ->
    weights (M, k) fp32, expert ids (M, k) int64, the ids in descending order of score + bias (hash layers: the
    rows of hash_table (V, k) at the M token ids tokens, in their order, read by the kernel). Two launches: the
    fp32 product as split partials, then one program per token for the scores and the top-k (torch took two
    casts, an fp32 GEMM, its split-K reduction and ~8 elementwise, top-k and gather kernels). rows: an (M, k)
    uint8 tensor (any row stride) the kernel also writes the ids into (the engine's routing rows)."""
    M, E = x.shape[0], weight.shape[0]
    w = torch.empty(M, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(M, k, dtype=torch.int64, device=x.device)
    if M:
        part = _mix_partials(x.contiguous(), weight)
        hashed = hash_table is not None
        _route_kernel[(M,)](part, bias if not hashed else part, hash_table.contiguous() if hashed else ids,
                            tokens.reshape(-1).contiguous() if hashed else ids, w, ids,
                            float(scale), E=E, EP=part.shape[2], SPLIT=part.shape[1],
                            SB=max(1, min(32, 1024 // part.shape[2])), K=k, KP=max(2, pow2(k)),
                            FUNC=_SCORE_FUNC[score_func], HASHED=hashed, NORM=norm, LIBDEVICE=x.is_cuda,
                            num_warps=1, ROUT=rows, stride_r=0 if rows is None else rows.stride(0), **pdl(part))
    return w, ids


def _hc_launch(x, fn, base, scale, iters: int, eps: float, norm_eps: float, norm, head: bool, part, fp8=None,
               side=None):
    *lead, n, D = x.shape
    xf = x.reshape(-1, n * D).contiguous()
    N = xf.shape[0]
    coll = torch.empty(N, D, dtype=x.dtype, device=x.device)
    post = torch.empty(N, n, dtype=torch.float32, device=x.device)
    comb = torch.empty(N, n, n, dtype=torch.float32, device=x.device)
    block = pow2(D) if D <= 4096 else 1024
    quant = fp8 is not None and norm is not None and D <= block and D % TILE == 0
    q = torch.empty(N, D, dtype=fp8, device=x.device) if quant else coll
    s = torch.empty(N, D // TILE, dtype=torch.float32, device=x.device) if quant else coll
    if N:
        # role 1 reads part, base and scale: on a side stream only where they are the caller's (kept alive to the
        # join), not copies made here that the current stream could reuse before the side stream has read them
        base32, scale32 = base.float().contiguous(), scale.float().contiguous()
        apart = side is not None and not head and part is not None and base32 is base and scale32 is scale
        if part is None:  # the hc_pre kernel sums them
            part = _mix_partials(xf, fn, ssq=True)
        assert part.shape[0] == N and part.is_contiguous(), "part: one row of partials a token (hc_post's)"
        nw, neps = norm if norm is not None else (coll, 0.0)
        # partials summed 128 a load (mini's 128 in one): on an H200 a call took 4.3 us at 1 token and 4.6 at 64,
        # against 5.4 and 5.5 at 32 a load; loading x beside them (before the sum) made it slower (5.2 / 6.4).
        # Warps: 4 up to 64 tokens, 2 past (us a call at 1 / 16 / 64 / 256 tokens: 4 warps 3.53 / 3.81 / 4.30 /
        # 7.31, 2 warps 3.55 / 3.83 / 4.33 / 5.46, 1 and 8 slower)
        args = (xf, part, base32, scale32, nw, coll, post, comb, q, s, eps, norm_eps, neps,
                fp8_max(fp8) if quant else 1.0)
        meta = dict(ITERS=iters, N_HC=n, D=D, NP=pow2(n), MIXP=part.shape[2], SPLIT=part.shape[1], BLOCK=block,
                    HEAD=head, NORM=norm is not None, SB=min(128, pow2(part.shape[1])), QUANT=quant,
                    num_warps=4 if N <= 64 else 2, **pdl(xf))
        if not apart:
            _hc_pre_kernel[(N, 1 if head else 2)](*args, **meta)
        else:  # role 1 (post, comb: the Sinkhorn chain, the longer) on the side stream, off the collapse's path
            side.wait_stream(torch.cuda.current_stream(x.device))
            _hc_pre_kernel[(N, 1)](*args, **meta)
            with torch.cuda.stream(side):
                _hc_pre_kernel[(N, 1)](*args, ROLE=1, **meta)
    xq = (q, s) if quant else None
    return coll.view(*lead, D), post.view(*lead, n), comb.view(*lead, n, n), xq


def hc_pre(x, fn, base, scale, iters: int, eps: float, norm_eps: float, norm=None, part=None, fp8=None, side=None):
    """x (..., n, D) -> collapsed (..., D) x.dtype, post (..., n) fp32, comb (..., n, n) fp32. norm: (weight, eps)
    of an RMSNorm applied to the collapsed row in the same kernel (model.RMSNorm's numerics). part: x's mix
    partials as hc_post(..., fn) gave them (else a launch computes them). fp8 (an FP8 dtype): one more output,
    the normed rows (N, D) quantized per 1x128 tile as act_quant would give them, (q, scales), or None where the
    kernel does not make them (no norm, D not a multiple of 128 or past 4096). side (a CUDA stream): where part is
    given and base and scale are fp32 and contiguous, post and comb are made there from them, after it waits for
    the current stream; the caller keeps part alive and joins the stream before reading post and comb."""
    out = _hc_launch(x, fn, base, scale, iters, eps, norm_eps, norm, False, part, fp8, side)
    return out if fp8 is not None else out[:3]


def hc_head(x, fn, base, scale, eps: float, norm_eps: float, norm=None, part=None):
    """model.Transformer.hc_head: x (..., n, D) -> (..., D) x.dtype, the pre-weighted collapse with the head's n
    weights (sigmoid(mix * scale + base) + eps); norm and part as in hc_pre."""
    return _hc_launch(x, fn, base, scale, 0, eps, norm_eps, norm, True, part)[0]


# hc_post with the next mix's partials in one launch: one program a (chunk, token) up to this many tokens, past
# them one a (chunk, 16 tokens) (_hc_post_mix_rows_kernel, the chunk's weights loaded once for the 16). Measured on
# an H200 (mini's mHC: 4 streams x 2048, 24 mix outputs; CUDA graph, 64 stream copies), us a call, a program a
# token / 16-token blocks / hc_post + the mix kernel: 1 token 1.75 / 2.01 / 2.89, 4 tokens 2.14 / 2.27 / 3.03,
# 8 tokens 2.55 / 2.37 / 3.08, 16 tokens 4.93 / 2.49 / 3.17, 64 tokens - / 3.97 / 4.52, 256 - / 9.86 / 9.81.
POST_MIX_TOKENS = 4


def hc_post(out, x, post, comb, fn=None):
    """out (..., D), x (..., n, D), post (..., n), comb (..., n, n) -> (..., n, D) in x.dtype.
    fn: the next mHC's mix weights (m, n * D) -> (new streams, their mix partials for that hc_pre / hc_head's
    part, from the same kernel; None where D is not a multiple of MIX_CHUNK). Past POST_MIX_TOKENS tokens the
    partials are the mix kernel's own (_mix_partials over the new streams gives the same bits).
    out may be an MoE's unsummed slot rows (kernels.moe.SlotRows, out.summed() of shape (N, D)): with fn and in
    x's dtype the kernel sums them (the same bits, one launch fewer), else they are summed first."""
    *lead, n, D = x.shape
    y = torch.empty_like(x)
    N = x.numel() // (n * D)
    slots = out if isinstance(out, SlotRows) else None
    if slots is not None and (fn is None or D % MIX_CHUNK or slots.dtype != x.dtype):
        out, slots = slots.summed(), None
    if fn is not None:
        if D % MIX_CHUNK:
            return hc_post(out, x, post, comb), None
        chunk, mixp = MIX_CHUNK, _mix_width(fn.shape[0], True)
        part = torch.empty(N, n * D // chunk, mixp, dtype=torch.float32, device=x.device)
        x = x.contiguous()
        # with slot rows x stands in for out: the kernel reads only its dtype, the one the sums are rounded to
        args = (x if slots is not None else out.contiguous(), x, post.contiguous(), comb.contiguous(), y,
                fn.contiguous(), part)
        sy, ids, E, kr, kt = (x, x, 0, 0, 0) if slots is None else (slots.y, slots.ids, slots.E, slots.k, slots.kt)
        if 0 < N <= POST_MIX_TOKENS:
            _hc_post_mix_kernel[(n * D // chunk, N)](*args, sy, ids, E, N_HC=n, D=D, NP=pow2(n), MIX=fn.shape[0],
                                                    MIXP=mixp, CHUNK=chunk, KR=kr, KT=kt, num_warps=2, **pdl(x))
        elif N:  # _mix_partials' tiles and warps, so the partials are its own
            _hc_post_mix_rows_kernel[(n * D // chunk, triton.cdiv(N, MIX_ROWS))](
                *args, N, sy, ids, E, N_HC=n, D=D, NP=pow2(n), MIX=fn.shape[0], MIXP=mixp, CHUNK=chunk, BT=MIX_ROWS,
                BK=_mix_step(mixp), PREC=fp8_gemm.F32_DOT, KR=kr, KT=kt, num_warps=_mix_warps(N), **pdl(x))
        return y, part
    if N:
        big = N >= 1024  # training-sized: wider tiles, fewer warps (measured on an H200); decode keeps more programs
        bd = min(512 if big else 256, pow2(D))
        _hc_post_kernel[(N, triton.cdiv(D, bd))](out.contiguous(), x.contiguous(), post.contiguous(),
                                                 comb.contiguous(), y, N_HC=n, D=D, NP=pow2(n), BLOCK=bd,
                                                 num_warps=2 if big else 4, **pdl(out))
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

    @triton.jit
    def _swiglu_bwd_kernel(G, U, GY, GG, GU, n, limit, BLOCK: tl.constexpr):
        """d/dg and d/du of silu(min(g, limit)) * clamp(u, -limit, limit); clamped inputs get no gradient."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        g = tl.load(G + i, mask=m, other=0.0).to(tl.float32)
        u = tl.load(U + i, mask=m, other=0.0).to(tl.float32)
        gy = tl.load(GY + i, mask=m, other=0.0).to(tl.float32)
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        sig = 1.0 / (1.0 + tl.exp(-gc))
        dg = gy * uc * sig * (1.0 + gc * (1.0 - sig))
        du = gy * gc * sig
        tl.store(GG + i, tl.where(g <= limit, dg, 0.0).to(GG.dtype.element_ty), mask=m)
        tl.store(GU + i, tl.where((u >= -limit) & (u <= limit), du, 0.0).to(GU.dtype.element_ty), mask=m)


def _swiglu_fwd(g, u, limit: float):
    gc, uc = g.contiguous(), u.contiguous()
    y = torch.empty_like(gc)
    n = gc.numel()
    if n:
        _swiglu_kernel[(triton.cdiv(n, 1024),)](gc, uc, y, n, float(limit), BLOCK=1024, num_warps=4)
    return y


class _Swiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u, limit):
        ctx.limit = limit
        ctx.save_for_backward(g, u)
        return _swiglu_fwd(g, u, limit)

    @staticmethod
    def backward(ctx, gy):
        g, u = (t.contiguous() for t in ctx.saved_tensors)
        gg, gu = torch.empty_like(g), torch.empty_like(u)
        n = g.numel()
        if n:
            _swiglu_bwd_kernel[(triton.cdiv(n, 1024),)](g, u, gy.contiguous(), gg, gu, n, float(ctx.limit),
                                                        BLOCK=1024, num_warps=4)
        return gg, gu, None


def swiglu(g, u, limit: float):
    """The fused twin of model._swiglu: silu(g.clamp(max=limit)) * u.clamp(-limit, limit), one pass (and one
    backward pass when autograd needs it)."""
    if needs_grad(g, u):
        return _Swiglu.apply(g, u, limit)
    return _swiglu_fwd(g, u, limit)


if triton is not None:
    @triton.jit
    def _rms_bwd_kernel(X, W, GY, GX, GW, rows, eps, D: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                        WEIGHTED: tl.constexpr):
        """ROWS rows per program: gx = inv * (g - xhat * mean(g * xhat)) with g = gy * w; the program's share of
        the weight's gradient, sum of gy * xhat over its rows, goes to GW[program]."""
        pid = tl.program_id(0)
        rd = tl.arange(0, BLOCK)
        md = rd < D
        if WEIGHTED:
            w = tl.load(W + rd, mask=md, other=0.0).to(tl.float32)
            gw = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(ROWS):
            r = (pid * ROWS + i).to(tl.int64)
            m = md & (r < rows)
            x = tl.load(X + r * D + rd, mask=m, other=0.0).to(tl.float32)
            gy = tl.load(GY + r * D + rd, mask=m, other=0.0).to(tl.float32)
            inv = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
            xh = x * inv
            if WEIGHTED:
                gw += gy * xh
                gy = gy * w
            gx = inv * (gy - xh * (tl.sum(gy * xh, 0) / D))
            tl.store(GX + r * D + rd, gx.to(GX.dtype.element_ty), mask=m)
        if WEIGHTED:
            tl.store(GW + pid * D + rd, gw, mask=md)


def _rms_fwd(x, weight, eps: float, fp8=None):
    """Rows of x may be strided (a column slice of a wider output: the engine's fused input GEMMs). fp8 (an FP8
    dtype, D % 128 == 0): -> (y, (q, scales)), y's rows also quantized per 1x128 tile as act_quant gives them."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty(rows, D, dtype=x.dtype, device=x.device)
    q = torch.empty(rows, D, dtype=fp8, device=x.device) if fp8 is not None else y
    s = torch.empty(rows, D // TILE, dtype=torch.float32, device=x.device) if fp8 is not None else y
    if rows:
        _rms_kernel[(rows,)](x2, weight if weight is not None else x2, y, q, s, eps, x2.stride(0),
                             fp8_max(fp8) if fp8 is not None else 1.0, D=D, BLOCK=pow2(D),
                             WEIGHTED=weight is not None, QUANT=fp8 is not None, num_warps=4 if D <= 2048 else 8,
                             **pdl(x2))
    return y.view(x.shape) if fp8 is None else (y.view(x.shape), (q, s))


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.eps = eps
        ctx.save_for_backward(x, weight)
        return _rms_fwd(x, weight, eps)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        D = x.shape[-1]
        xc, gyc = x.contiguous(), gy.contiguous()
        rows = xc.numel() // D
        per = 1 if weight is None else min(64, pow2(triton.cdiv(rows, 1024)))
        progs = triton.cdiv(rows, per)
        gx = torch.empty_like(xc)
        gw = None if weight is None else torch.empty(progs, D, dtype=torch.float32, device=x.device)
        if rows:
            _rms_bwd_kernel[(progs,)](xc, weight if weight is not None else xc, gyc, gx, gw if gw is not None else gx,
                                      rows, ctx.eps, D=D, BLOCK=pow2(D), ROWS=per, WEIGHTED=weight is not None,
                                      num_warps=4 if D <= 2048 else 8)
        if gw is not None:
            gw = gw.sum(0).to(weight.dtype)
        return gx, gw, None


def rms_norm(x, weight, eps: float):
    """weight None: the unweighted norm. Differentiable (a backward kernel) when autograd needs it."""
    if needs_grad(x, weight):
        return _RmsNorm.apply(x, weight, eps)
    return _rms_fwd(x, weight, eps)


def rms_norm_quant(x, weight, eps: float, fp8):
    """Inference's rms_norm whose kernel also quantizes the normed rows for an FP8 linear: x (..., D) -> (y,
    xq) with xq = (q (rows, D) fp8, scales (rows, D/128)) as act_quant(y) gives them, or None where the kernel
    does not make them (D not a multiple of 128, or autograd on)."""
    if x.shape[-1] % TILE or needs_grad(x, weight):
        return rms_norm(x, weight, eps), None
    return _rms_fwd(x, weight, eps, fp8)


if triton is not None:
    @triton.jit
    def _rope_kernel(X, COS, SIN, Y, per, ncos, sign, DIM: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
                     HB: tl.constexpr, PDL: tl.constexpr = False):
        """Row r of x (per rows share a cos/sin row; the row index wraps over the ncos table rows)."""
        pdl_wait(PDL)
        r = tl.program_id(0).to(tl.int64)
        c = (r // per) % ncos
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


def _rope_launch(x, cos, sin, sign: float, per: int):
    xc = x.contiguous()
    y = torch.empty_like(xc)
    half, dim = cos.shape[-1], x.shape[-1]
    rows = xc.numel() // dim
    if rows:
        _rope_kernel[(rows,)](xc, cos, sin, y, per, cos.numel() // half, sign, DIM=dim, HALF=half,
                              BLOCK=pow2(max(dim - 2 * half, 1)), HB=pow2(half), num_warps=1, **pdl(xc))
    return y


class _Rope(torch.autograd.Function):
    """A rotation: its backward is the inverse rotation of the gradient."""

    @staticmethod
    def forward(ctx, x, cos, sin, sign, per):
        ctx.save_for_backward(cos, sin)
        ctx.sign, ctx.per = sign, per
        return _rope_launch(x, cos, sin, sign, per)

    @staticmethod
    def backward(ctx, gy):
        cos, sin = ctx.saved_tensors
        return _rope_launch(gy, cos, sin, -ctx.sign, ctx.per), None, None, None, None


def _rope_per(x, cos, sin):
    """How many consecutive rows of x (..., dim) share a row of cos/sin (..., rd/2), when they broadcast against
    x's leading dims as one contiguous run of dims (torch's right-aligned broadcasting: size-1 or missing dims
    before the run, size-1 dims after it); None for any other broadcast."""
    xs, cs = list(x.shape[:-1]), list(cos.shape[:-1])
    if cos.shape != sin.shape or len(cs) > len(xs):
        return None
    lo, hi = 0, len(cs)
    while lo < hi and cs[lo] == 1:
        lo += 1
    while hi > lo and cs[hi - 1] == 1:
        hi -= 1
    at = len(xs) - len(cs) + lo  # where the run sits in x's dims
    if xs[at:at + hi - lo] != cs[lo:hi]:
        return None
    per = 1
    for s in xs[at + hi - lo:]:
        per *= s
    return per


def rope(x, cos, sin, inverse: bool = False):
    """The fused twin of model.apply_rope when cos/sin broadcast against x's leading dims as `_rope_per` allows;
    returns None for any other broadcast, and the caller falls back to torch. Differentiable in x."""
    per = _rope_per(x, cos, sin)
    if per is None:
        return None
    cos, sin = cos.contiguous().float(), sin.contiguous().float()
    sign = -1.0 if inverse else 1.0
    if needs_grad(x):
        return _Rope.apply(x, cos, sin, sign, per)
    return _rope_launch(x, cos, sin, sign, per)


if triton is not None:
    @triton.jit
    def _norm_rope_row(X, W, COS, SIN, Y, OUT2, ROWS2, r, eps, stride_x, per, ncos, DIM: tl.constexpr,
                       HALF: tl.constexpr, BLOCK: tl.constexpr, WEIGHTED: tl.constexpr, STORE2: tl.constexpr):
        """Row r: RMSNorm (weight W, or unweighted: the factor rounded to x's dtype first, as the twin does), then
        the last HALF channel pairs rotated by row (r // per) % ncos of cos/sin; to Y, and (STORE2) to row
        ROWS2[r] of OUT2 too."""
        rd = tl.arange(0, BLOCK)
        md = rd < DIM
        y = _rms_row(X, W, r, stride_x, eps, DIM, BLOCK, WEIGHTED).to(X.dtype.element_ty)
        ye, yo = tl.split(tl.reshape(y.to(tl.float32), (BLOCK // 2, 2)))
        j = tl.arange(0, BLOCK // 2) - (DIM // 2 - HALF)  # the pair's row in the tables (< 0: not rotated)
        mj = (j >= 0) & (j < HALF)
        c = (r // per) % ncos
        co = tl.load(COS + c * HALF + j, mask=mj, other=1.0)
        si = tl.load(SIN + c * HALF + j, mask=mj, other=0.0)
        out = tl.reshape(tl.join(ye * co - yo * si, yo * co + ye * si), (BLOCK,)).to(Y.dtype.element_ty)
        tl.store(Y + r * DIM + rd, out, mask=md)
        if STORE2:
            tl.store(OUT2 + tl.load(ROWS2 + r) * DIM + rd, out.to(OUT2.dtype.element_ty), mask=md)

    @triton.jit
    def _norm_rope_kernel(X, W, COS, SIN, Y, OUT2, ROWS2, eps, stride_x, per, ncos,
                          XA, WA, YA, eps_a, stride_xa, per_a, rows_a, DIM: tl.constexpr, HALF: tl.constexpr,
                          BLOCK: tl.constexpr, WEIGHTED: tl.constexpr, STORE2: tl.constexpr,
                          WEIGHTED_A: tl.constexpr, PDL: tl.constexpr = False):
        """Programs [0, rows_a): _norm_rope_row over XA (weight WA) into YA; the programs after them: over X (weight
        W) into Y (and OUT2). Both with the same cos / sin."""
        pdl_wait(PDL)
        r = tl.program_id(0).to(tl.int64)
        if r < rows_a:
            _norm_rope_row(XA, WA, COS, SIN, YA, YA, YA, r, eps_a, stride_xa, per_a, ncos, DIM, HALF, BLOCK,
                           WEIGHTED_A, False)
        else:
            _norm_rope_row(X, W, COS, SIN, Y, OUT2, ROWS2, r - rows_a, eps, stride_x, per, ncos, DIM, HALF, BLOCK,
                           WEIGHTED, STORE2)


def _rows2(x):
    """x (..., dim) as rows (n, dim) with unit column stride (a column slice of a wider GEMM output stays a view)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def norm_rope(x, weight, eps: float, cos, sin, store=None, first=None):
    """Inference's RMSNorm (weight None: unweighted) + apply_rope in one pass: x (..., dim) with rows possibly
    strided (a column slice of the engine's fused input GEMM), cos/sin as `rope` takes them. store: (buf (R,
    dim), rows (x's rows,) int64) also writes row i of the result to buf[rows[i]] (the engine's window cache).
    first: (xa, weight_a, eps_a, cos_a, sin_a), another tensor of the same last dim whose rows the same launch
    normalizes and rotates the same way (cos_a / sin_a: the same tables, shaped for xa; no store).
    -> (..., dim) in x's dtype (with first: (its result, x's)), or None where `rope` would decline a broadcast
    (the caller composes the two)."""
    per = _rope_per(x, cos, sin)
    dim = x.shape[-1]
    if per is None or dim % 2:
        return None
    x2 = _rows2(x)
    rows, half = x2.shape[0], cos.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    xa2, wa, eps_a, per_a, ya = x2, None, eps, per, y
    if first is not None:
        xa, wa, eps_a, cos_a, sin_a = first
        per_a = _rope_per(xa, cos_a, sin_a)
        if per_a is None or xa.shape[-1] != dim or cos_a.numel() != cos.numel():
            return None
        xa2 = _rows2(xa)
        ya = torch.empty(xa.shape, dtype=xa.dtype, device=xa.device)
    rows_a = xa2.shape[0] if first is not None else 0
    if rows + rows_a:
        cos, sin = cos.contiguous().float(), sin.contiguous().float()
        buf, idx = store if store is not None else (y, y)
        _norm_rope_kernel[(rows_a + rows,)](
            x2, weight if weight is not None else x2, cos, sin, y, buf, idx, eps, x2.stride(0), per,
            cos.numel() // half, xa2, wa if wa is not None else xa2, ya, eps_a, xa2.stride(0), per_a, rows_a, DIM=dim,
            HALF=half, BLOCK=pow2(dim), WEIGHTED=weight is not None, STORE2=store is not None,
            WEIGHTED_A=wa is not None, num_warps=4 if dim >= 1024 else 2, **pdl(x2))
    return (ya, y) if first is not None else y
