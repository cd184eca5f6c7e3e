"""Routed experts on the decode path: a grouped GEMM over the experts a batch actually routes to.

    y = fused_moe(x, ids, weights, w1, w2, w3, s1, s2, s3, limit)

Token slots (token, k) are sorted by expert and padded to whole row blocks (`moe_align`, 16-64 rows: static shapes,
so the whole thing can live inside a CUDA graph); one program per (row block, column tile) reads the weights of
its block's expert only, so experts nobody routed to are never read. Weights are FP8 with 128x128 block scales
(activations quantized per 1x128 tile) or plain BF16 (s* = None). The torch reference loops over experts.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .fp8_gemm import (F32_DOT, act_quant, act_quant_ref, divisor_at_most, dot32, gdc_launch_dependents,
                       launch_fitting, pdl, pdl_wait, pow2, quant_rows, slab_dot, slab_rows, tickets, triton,
                       use_triton)
from .quant import BLOCK, fp8_max

if triton is not None:
    import triton.language as tl

BLOCK_M = 16


def slot_ids(ids: torch.Tensor, n_experts: int, n_shared: int = 0) -> torch.Tensor:
    """ids (T, k) routed experts -> (T, k + n_shared): each token's slots, its shared experts (the last n_shared of
    the n_experts) after its routed ones."""
    if not n_shared:
        return ids
    shared = torch.arange(n_experts - n_shared, n_experts, dtype=ids.dtype, device=ids.device)
    return torch.cat([ids, shared.expand(ids.shape[0], n_shared)], 1)


def moe_align(ids: torch.Tensor, n_experts: int, block_m: int = BLOCK_M, fused: bool = True, n_shared: int = 0):
    """ids (T, k) -> sorted_slots (nb * block_m,) slot ids grouped by expert, padded with S = T * (k + n_shared);
    block_expert (nb,) expert of each row block or -1; nb = ceil(S / block_m) + n_experts (a static bound).
    Slots are token-major, k + n_shared a token (`slot_ids`): the last n_shared experts are shared, every token's.
    An id equal to n_experts means "not here" (another rank's expert): its blocks are marked -1 and skipped.
    On GPU one Triton program (`_moe_align_kernel`) instead of ~20 torch kernels; fused=False forces the torch
    twin (`_align`)."""
    if fused and use_triton(ids):
        return _align_triton(ids, n_experts + 1, block_m, n_shared)
    sorted_slots, block_expert = _align(slot_ids(ids, n_experts, n_shared), n_experts + 1, block_m)
    return sorted_slots, torch.where(block_expert == n_experts, torch.full_like(block_expert, -1), block_expert)


def _align(ids: torch.Tensor, n_experts: int, block_m: int):
    flat = ids.reshape(-1)
    S = flat.numel()
    nb = -(-S // block_m) + n_experts
    counts = torch.zeros(n_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    first = torch.cumsum(counts, 0) - counts
    dest = (ends - padded)[e_sorted] + torch.arange(S, device=ids.device) - first[e_sorted]
    sorted_slots = torch.full((nb * block_m,), S, dtype=torch.int64, device=ids.device).scatter_(0, dest, order)
    starts = torch.arange(nb, device=ids.device) * block_m
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(starts < ends[-1], block_expert, torch.full_like(block_expert, -1))
    return sorted_slots, block_expert


if triton is not None:
    @triton.jit
    def _slot_expert(IDS, s, m, E1, KR: tl.constexpr, KT: tl.constexpr):
        """The expert of slots s (token s // KT, its j-th: routed ids[token, j] for j < KR, else shared expert
        E1 - 1 - (KT - j))."""
        j = s % KT
        e = tl.load(IDS + (s // KT) * KR + j, mask=m & (j < KR), other=0).to(tl.int32)
        return tl.where(j < KR, e, E1 - 1 - KT + j)

    @triton.jit
    def _moe_align_kernel(IDS, SLOTS, BEXP, S_rt, nb_rt, E1: tl.constexpr, BM: tl.constexpr, NE: tl.constexpr,
                          C: tl.constexpr, CB: tl.constexpr, KR: tl.constexpr, KT: tl.constexpr, S_C: tl.constexpr,
                          NB_C: tl.constexpr, DYNAMIC: tl.constexpr, PDL: tl.constexpr = False):
        """Program e of E1 (one an expert): every program counts all experts' slots (a histogram of each chunk of C
        slots) for the padded offsets; program e then places its expert's slots in slot order (a running cumsum
        of "mine" over the chunks) and pads its own rows; the row blocks' experts (how many experts end at or
        before a block's first row) and the rows past the last block are shared out in chunks, program e taking
        chunks e, e + E1, ... DYNAMIC: sizes as runtime values (GPU); else the constexpr copies (the interpreter
        loops over Python ints only)."""
        pdl_wait(PDL)
        if DYNAMIC:
            S = S_rt
            nb = nb_rt
        else:
            S: tl.constexpr = S_C
            nb: tl.constexpr = NB_C
        me = tl.program_id(0)
        e_ar = tl.arange(0, NE)
        ii = tl.arange(0, C)
        counts = tl.zeros((NE,), tl.int32)
        for c0 in range(0, S, C):
            m = c0 + ii < S
            e = _slot_expert(IDS, c0 + ii, m, E1, KR, KT)
            counts += tl.histogram(e, NE, mask=m & (e >= 0) & (e < NE))
        padded = (counts + BM - 1) // BM * BM
        ends = tl.cumsum(padded, 0)
        total = tl.sum(padded, 0)
        mine = e_ar == me
        start = tl.sum(tl.where(mine, ends - padded, 0), 0)
        count = tl.sum(tl.where(mine, counts, 0), 0)
        pad = tl.arange(0, BM)  # this expert's padding rows, after its slots
        tl.store(SLOTS + start + count + pad, tl.full((BM,), 0, tl.int64) + S,
                 mask=pad < tl.sum(tl.where(mine, padded, 0), 0) - count)
        run = start
        for c0 in range(0, S, C):
            m = c0 + ii < S
            hit = ((_slot_expert(IDS, c0 + ii, m, E1, KR, KT) == me) & m).to(tl.int32)
            tl.store(SLOTS + run + tl.cumsum(hit, 0) - 1, (c0 + ii).to(tl.int64), mask=hit != 0)
            run += tl.sum(hit, 0)
        for o in range(0, nb * BM, C * E1):  # rows past the last block: padding
            r = o + me * C + ii
            tl.store(SLOTS + r, tl.full((C,), 0, tl.int64) + S, mask=(r >= total) & (r < nb * BM))
        ib = tl.arange(0, CB)
        for b0 in range(0, nb, CB * E1):
            b = b0 + me * CB + ib
            st = b * BM
            be = tl.sum(((ends[None, :] <= st[:, None]) & (e_ar[None, :] < E1)).to(tl.int32), 1)
            be = tl.where((st < total) & (be != E1 - 1), be, -1)  # past the last block, or "not here"
            tl.store(BEXP + b, be.to(tl.int64), mask=b < nb)


# Slots a program takes at once: pow2(S) up to ALIGN_CHUNK (the counts a histogram); row blocks at once for their
# experts: ALIGN_BLOCKS. On an H200 (k 6 + 1 shared, 33 experts), us a call at 1 / 16 / 64 / 256 / 1,024 tokens:
# 3.3 / 3.5 / 3.8 / 5.4 / 12.8, against 4.0 / 4.0 / 6.5 / 14.9 / 50.4 for 128-slot chunks counted with one-hot
# sums and 4 warps (the same slots and blocks; chunks of 128-2,048 x 4 / 8 warps measured, 8 warps and the
# largest chunk the fastest from 64 tokens on)
ALIGN_CHUNK, ALIGN_BLOCKS, ALIGN_WARPS = 2048, 128, 8


def _align_triton(ids: torch.Tensor, n_experts: int, block_m: int, n_shared: int):
    flat = ids.reshape(-1).contiguous()
    k = ids.shape[1]
    S = ids.shape[0] * (k + n_shared)
    nb = -(-S // block_m) + n_experts
    slots = torch.empty(nb * block_m, dtype=torch.int64, device=ids.device)
    bexp = torch.empty(nb, dtype=torch.int64, device=ids.device)
    ne = pow2(n_experts)
    dyn = ids.is_cuda
    _moe_align_kernel[(n_experts,)](flat, slots, bexp, S, nb, E1=n_experts, BM=block_m, NE=ne,
                                    C=min(ALIGN_CHUNK, max(32, pow2(S))), CB=ALIGN_BLOCKS,
                                    KR=k, KT=k + n_shared, S_C=0 if dyn else S, NB_C=0 if dyn else nb, DYNAMIC=dyn,
                                    num_warps=ALIGN_WARPS, **pdl(flat))
    return slots, bexp


def swiglu(g, u, limit: float):
    return F.silu(g.clamp(max=limit)) * u.clamp(min=-limit, max=limit)


def _linear(x, w, s):
    """One expert's linear in the kernel's numerics: W8A8 with block scales, or plain matmul."""
    if s is None:
        return x @ w.T
    from .fp8_gemm import fp8_gemm_ref
    if x.shape[1] % BLOCK:
        from .quant import dequant_fp8_block
        return x.float() @ dequant_fp8_block(w, s).T
    xq, sx = act_quant_ref(x, w.dtype)
    return fp8_gemm_ref(xq, sx, w, s)


def _expert(x, e, w1, w2, w3, s1, s2, s3, limit):
    """Expert e on rows x -> fp32, in the kernels' numerics (SwiGLU of the fp32 products, h in x's dtype)."""
    def scale(s):
        return None if s is None else s[e]
    h = swiglu(_linear(x, w1[e], scale(s1)).float(), _linear(x, w3[e], scale(s3)).float(), limit).to(x.dtype)
    return _linear(h, w2[e], scale(s2)).float()


def fused_moe_ref(x, ids, weights, w1, w2, w3, s1=None, s2=None, s3=None, limit: float = 10.0, n_shared: int = 0):
    """x (T, D); ids, weights (T, k); w1/w3 (E, I, D), w2 (E, D, I) [+ scales (E, ., .)] -> (T, D) in x's dtype:
    the weighted sum of each token's routed experts, plus its shared experts (the last n_shared of the E) in fp32."""
    T, k = ids.shape
    out = torch.zeros(T * k, x.shape[1], dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    ws = (w1, w2, w3, s1, s2, s3, limit)
    for e in flat.unique().tolist():
        if e >= w1.shape[0] - n_shared:  # "not here": another rank's expert
            continue
        slots = (flat == e).nonzero()[:, 0]
        out[slots] = _expert(x[slots // k], e, *ws) * weights.reshape(-1)[slots, None]
    y = out.view(T, k, -1).sum(1)
    for e in range(w1.shape[0] - n_shared, w1.shape[0]):
        y = y + _expert(x, e, *ws)
    return y.to(x.dtype)


if triton is not None:
    @triton.jit
    def _moe_up_kernel(X, SX, W1, W3, S1, S3, H, SH, HDT, SLOTS, BEXP, PART, CNT, n_slots, stride_x, limit, fmax,
                       K: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr, SCALED: tl.constexpr,
                       QUANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       KSPLIT: tl.constexpr, PREC: tl.constexpr, SWAP: tl.constexpr = False, PDL: tl.constexpr = False,
                       READY=None, OVERLAP: tl.constexpr = False):
        """Row block pb (one expert's slots), columns [pn * BLOCK_N, ...) of h = SwiGLU(x W1^T, x W3^T), rounded
        to HDT's dtype. QUANT (BLOCK_N == BLOCK_K: a tile is one 1x128 group a row): h leaves as the down
        kernel's FP8 input, H (fp8) and SH (scales), in act_quant's arithmetic. SWAP: the products weights-first,
        (BLOCK_N, BLOCK_M) tiles transposed after the K loop (Hopper's wgmma at 16-row blocks). KSPLIT > 1: program
        ks takes the ks-th K range and stores its two fp32 partials in PART[ks]; the tile's last program to finish
        (a ticket counter in CNT, put back to 0) adds the KSPLIT partials in range order and finishes the tile.
        OVERLAP (KSPLIT == 1): the grid is (column tile, row block), a block's tiles launched together, and each
        program counts its finished tile in READY[pb] (release), which the down kernel's programs of that block
        wait for instead of the whole launch (see _moe_down_kernel)."""
        pdl_wait(PDL)
        if OVERLAP:
            pn, pb, ks = tl.program_id(0), tl.program_id(1), 0
        else:
            pb, pn, ks = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        e = tl.load(BEXP + pb)
        if e < 0:
            if OVERLAP:
                tl.atomic_add(READY + pb, 1, sem="release")
            return
        rows = pb * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(SLOTS + rows)
        valid = slot < n_slots
        tok = tl.where(valid, slot // TOPK, 0)
        rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = rn < I
        rk = tl.arange(0, BLOCK_K)
        nkb: tl.constexpr = K // BLOCK_K
        if SWAP:  # the products weights-first: (BLOCK_N, BLOCK_M) tiles, transposed after the loop
            acc1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc3 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        wbase = e.to(tl.int64) * I * K
        NKR: tl.constexpr = K // KSPLIT // BLOCK_K  # K blocks a range
        for j in range(NKR):
            k0 = (ks * NKR + j) * BLOCK_K
            x = tl.load(X + tok[:, None] * stride_x + (k0 + rk)[None, :], mask=valid[:, None], other=0.0)
            woff = wbase + rn[:, None] * K + (k0 + rk)[None, :]
            w1 = tl.load(W1 + woff, mask=mn[:, None], other=0.0)
            w3 = tl.load(W3 + woff, mask=mn[:, None], other=0.0)
            if SWAP:
                d1 = dot32(w1, tl.trans(x), PREC)
                d3 = dot32(w3, tl.trans(x), PREC)
            else:
                d1 = dot32(x, tl.trans(w1), PREC)
                d3 = dot32(x, tl.trans(w3), PREC)
            if SCALED:
                kb = k0 // BLOCK_K
                sx = tl.load(SX + tok * nkb + kb, mask=valid, other=0.0)
                soff = e.to(tl.int64) * tl.cdiv(I, BLOCK_K) * nkb + (rn // BLOCK_K) * nkb + kb
                s1 = tl.load(S1 + soff, mask=mn, other=0.0)
                s3 = tl.load(S3 + soff, mask=mn, other=0.0)
                if SWAP:
                    d1 = d1 * s1[:, None] * sx[None, :]
                    d3 = d3 * s3[:, None] * sx[None, :]
                else:
                    d1 = d1 * sx[:, None] * s1[None, :]
                    d3 = d3 * sx[:, None] * s3[None, :]
            acc1 += d1
            acc3 += d3
        if SWAP:
            acc1 = tl.trans(acc1)
            acc3 = tl.trans(acc3)
        if KSPLIT > 1:
            mask = valid[:, None] & mn[None, :]
            part = PART + rows[:, None] * (2 * I) + rn[None, :]
            step = tl.num_programs(0) * BLOCK_M * 2 * I  # one range's partials
            tl.store(part + ks * step, acc1, mask=mask)
            tl.store(part + ks * step + I, acc3, mask=mask)
            tl.debug_barrier()  # the whole partial is written before the ticket is taken
            tile = pb * tl.num_programs(1) + pn
            if tl.atomic_add(CNT + tile, 1) != KSPLIT - 1:  # acq_rel: the other ranges' partials are visible
                return
            acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(KSPLIT):
                acc1 += tl.load(part + s * step, mask=mask, other=0.0, cache_modifier=".cg")
                acc3 += tl.load(part + s * step + I, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(CNT + tile, 0)
        g = tl.minimum(acc1, limit)
        u = tl.minimum(tl.maximum(acc3, -limit), limit)
        h = (g / (1.0 + tl.exp(-g)) * u).to(HDT.dtype.element_ty)
        if QUANT:
            h, sh = quant_rows(h.to(tl.float32), fmax)
            tl.store(SH + rows * (I // BLOCK_K) + pn, sh, mask=valid)
        tl.store(H + rows[:, None] * I + rn[None, :], h.to(H.dtype.element_ty), mask=valid[:, None] & mn[None, :])
        if OVERLAP:
            tl.debug_barrier()  # every thread's part of the tile is stored before the count
            tl.atomic_add(READY + pb, 1, sem="release")

    @triton.jit
    def _down_dot(H, SH, S2, w, e, rows, valid, rn, mn, rk, k0, K: tl.constexpr, D: tl.constexpr,
                  SCALED: tl.constexpr, SWAP: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
        """One K step of the down kernel: h's (rows, [k0, k0 + BLOCK_K)) times the weight tile w, scaled."""
        h = tl.load(H + rows[:, None] * K + (k0 + rk)[None, :], mask=valid[:, None], other=0.0)
        if SWAP:
            d = dot32(w, tl.trans(h), PREC)
        else:
            d = dot32(h, tl.trans(w), PREC)
        if SCALED:
            nkb: tl.constexpr = K // BLOCK_K
            kb = k0 // BLOCK_K
            sh = tl.load(SH + rows * nkb + kb, mask=valid, other=0.0)
            s2 = tl.load(S2 + e.to(tl.int64) * tl.cdiv(D, BLOCK_K) * nkb + (rn // BLOCK_K) * nkb + kb, mask=mn,
                         other=0.0)
            if SWAP:
                d = d * s2[:, None] * sh[None, :]
            else:
                d = d * sh[:, None] * s2[None, :]
        return d

    @triton.jit
    def _moe_down_kernel(H, SH, W2, S2, Y, WTS, SLOTS, BEXP, n_slots,
                         K: tl.constexpr, D: tl.constexpr, KR: tl.constexpr, KT: tl.constexpr, SCALED: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
                         SWAP: tl.constexpr = False, PDL: tl.constexpr = False, READY=None, DONE=None, NT=1,
                         OVERLAP: tl.constexpr = False, EARLY: tl.constexpr = False):
        """Row block pb (one expert's slots), columns [pn * BLOCK_N, ...): Y[slot] = (h W2^T) times the slot's
        routing weight (1 for a shared expert), fp32. SWAP as in the up kernel.
        OVERLAP: the grid is (column tile, row block), and a program waits for its block's NT up tiles
        (READY[pb], acquire), not for the whole up launch: under PDL this launch's programs take the SMs the up
        launch's last wave leaves free; EARLY: each loads its first weight tile before that wait. It reads
        nothing before that wait that the up launch or the kernels before it write (the up programs count only
        after their own PDL wait, so those kernels have finished). The block's last program to finish (DONE[pb])
        puts both counts back to 0."""
        tl.static_assert(OVERLAP or not EARLY, "EARLY: the first weight tile before the OVERLAP wait")
        if OVERLAP:
            pn, pb = tl.program_id(0), tl.program_id(1)
            if PDL:
                gdc_launch_dependents()
        else:
            pdl_wait(PDL)
            pb, pn = tl.program_id(0), tl.program_id(1)
        e = tl.load(BEXP + pb)
        rows = pb * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = rn < D
        rk = tl.arange(0, BLOCK_K)
        wrow = W2 + tl.maximum(e, 0).to(tl.int64) * D * K + rn[:, None] * K + rk[None, :]
        if EARLY:  # (written before the up launch)
            w0 = tl.load(wrow, mask=mn[:, None] & (e >= 0), other=0.0)
        if OVERLAP:
            n = tl.atomic_add(READY + pb, 0, sem="acquire")
            while n < NT:
                n = tl.atomic_add(READY + pb, 0, sem="acquire")
        if e < 0:
            if OVERLAP:
                _block_done(READY, DONE, pb, tl.num_programs(0))
            return
        slot = tl.load(SLOTS + rows)
        valid = slot < n_slots
        if SWAP:  # as in the up kernel
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if EARLY:
            acc += _down_dot(H, SH, S2, w0, e, rows, valid, rn, mn, rk, 0, K, D, SCALED, SWAP, BLOCK_K, PREC)
        for k0 in range(BLOCK_K if EARLY else 0, K, BLOCK_K):
            w = tl.load(wrow + k0, mask=mn[:, None], other=0.0)
            acc += _down_dot(H, SH, S2, w, e, rows, valid, rn, mn, rk, k0, K, D, SCALED, SWAP, BLOCK_K, PREC)
        if SWAP:
            acc = tl.trans(acc)
        j = slot % KT  # a token's j-th slot: routed (weight WTS[token, j]) or shared (weight 1)
        wt = tl.load(WTS + (slot // KT) * KR + j, mask=valid & (j < KR), other=1.0)
        acc = acc * wt[:, None]
        tl.store(Y + slot[:, None] * D + rn[None, :], acc, mask=valid[:, None] & mn[None, :])
        if OVERLAP:
            _block_done(READY, DONE, pb, tl.num_programs(0))

    @triton.jit
    def _block_done(READY, DONE, pb, n):
        """A down program of row block pb is done with READY[pb]; the block's n-th puts READY and DONE back to 0."""
        if tl.atomic_add(DONE + pb, 1) == n - 1:
            tl.store(READY + pb, 0)
            tl.store(DONE + pb, 0)


if triton is not None:
    @triton.jit
    def slot_total(Y, IDS, E, t, rd, md, D: tl.constexpr, KR: tl.constexpr, KT: tl.constexpr, mt=None):
        """Token t's KT slot rows of Y (fp32) at columns rd (md: those < D), summed in slot order in fp32,
        skipping routed slots (j < KR) whose expert is not here (IDS[t, j] >= E: never written). The slot sum of
        every kernel that does it (_moe_sum_kernel, fused.hc_post's), so they give the same bits. Or a tile of
        tokens: t (BT,) with mt (BT,) those that exist, rd (BK,), md (BT, BK) -> (BT, BK)."""
        acc = tl.zeros(md.shape, tl.float32)
        rows = t if mt is None else t[:, None]
        cols = rd if mt is None else rd[None, :]
        for j in tl.static_range(KT):
            here = md
            if j < KR:
                if mt is None:
                    here = md & (tl.load(IDS + t * KR + j) < E)
                else:
                    here = md & (tl.load(IDS + t * KR + j, mask=mt, other=E) < E)[:, None]
            acc += tl.load(Y + (rows * KT + j) * D + cols, mask=here, other=0.0)
        return acc

    @triton.jit
    def _moe_sum_kernel(Y, IDS, OUT, E, D: tl.constexpr, KR: tl.constexpr, KT: tl.constexpr, BD: tl.constexpr,
                        PDL: tl.constexpr = False):
        """Token t, BD columns: OUT[t] = slot_total, rounded to OUT's dtype."""
        pdl_wait(PDL)
        t = tl.program_id(0).to(tl.int64)
        rd = tl.program_id(1) * BD + tl.arange(0, BD)
        md = rd < D
        tl.store(OUT + t * D + rd, slot_total(Y, IDS, E, t, rd, md, D, KR, KT).to(OUT.dtype.element_ty), mask=md)


if triton is not None:
    @triton.jit
    def _expert_slab(W, SW, e, rn, N: tl.constexpr, K: tl.constexpr, NKBP: tl.constexpr, BLOCK_K: tl.constexpr,
                     SCALED: tl.constexpr):
        """Rows rn of expert e's (N, K) weight in the (E, N, K) stack W, the whole K in one load -> (w (BN, NKBP,
        128), its 128 x 128 block scales from SW (BN, NKBP), or w again where not SCALED)."""
        NKB: tl.constexpr = K // BLOCK_K
        kb = tl.arange(0, NKBP)
        mk = kb < NKB
        rk = tl.arange(0, BLOCK_K)
        w = tl.load(W + (e * N + rn)[:, None, None] * K + kb[None, :, None] * BLOCK_K + rk[None, None, :],
                    mask=mk[None, :, None], other=0.0)
        sw = w
        if SCALED:
            sw = tl.load(SW + (e * (N // BLOCK_K) + rn // BLOCK_K)[:, None] * NKB + kb[None, :], mask=mk[None, :],
                         other=0.0)
        return w, sw

    @triton.jit
    def _moe_gemv_kernel(X, IDS, W, SW, W3, SW3, Y, WTS, E, stride_x, limit, fmax, N: tl.constexpr,
                         K: tl.constexpr, BN: tl.constexpr, NKBP: tl.constexpr, KR: tl.constexpr, KT: tl.constexpr,
                         GATED: tl.constexpr, SCALED: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr = False, EARLY: tl.constexpr = False, n_tok=0,
                         SHARED_FIRST: tl.constexpr = False, R: tl.constexpr = 1):
        """Program (slot s, pn): rows [pn * R * BN, (pn + 1) * R * BN) of the slot's expert (token t = s // KT, its
        j-th slot: routed IDS[t, j] for j < KR, else the shared expert E - KT + j of the E), R whole (BN, K) weight
        slabs, each in one load, and slab_dot, the GEMV kernel's product. GATED (up): Y[s, rows] = SwiGLU(x W1^T,
        x W3^T) for x token t's row of X, in Y's dtype (the tiled up kernel's arithmetic), the next slab's loads
        issued before this one's products (R > 1); else (down, R 1): Y[s, rows] = (X[s] W^T) times the slot's
        routing weight (1 for a shared expert), fp32. An id of E or more (another rank's expert) stores nothing:
        the sum skips that slot.
        SHARED_FIRST (the up launch, a 1-D grid over n_tok tokens): the shared slots' programs come first and do
        not wait under PDL, so they run beside the kernel before (the router's last): what they read (X, the
        weights) was written before that kernel, and what they write (Y) is no memory it uses (moe_gemv_early).
        EARLY (the down launch, not GATED): under PDL it reads its slots' expert ids, weight slabs and routing
        weights before its wait, beside the up launch's last programs: only X is the up launch's; the rest was
        written before it (the up programs that read ids release this launch after their own wait, as
        _moe_down_kernel's OVERLAP relies on)."""
        tl.static_assert(not (EARLY and GATED), "EARLY: the down launch only (the up launch's ids are its own wait's)")
        tl.static_assert(not SHARED_FIRST or (GATED and KT > KR), "SHARED_FIRST: an up launch with shared slots")
        tl.static_assert(R == 1 or GATED, "R: the up launch's")
        NPR: tl.constexpr = N // BN // R  # programs a slot
        if SHARED_FIRST:  # a 1-D grid: the n_tok tokens' shared slots first, without the wait
            L = tl.program_id(0)
            NS: tl.constexpr = KT - KR
            nsh = n_tok * NS * NPR
            if L < nsh:
                q = L // NPR
                s, pn = q // NS * KT + KR + q % NS, L % NPR
            else:
                q = (L - nsh) // NPR
                s, pn = q // KR * KT + q % KR, (L - nsh) % NPR
                pdl_wait(PDL)
        else:
            if not EARLY:
                pdl_wait(PDL)
            s, pn = tl.program_id(0), tl.program_id(1)
        t, j = s // KT, s % KT
        e = tl.where(j < KR, tl.load(IDS + t * KR + j, mask=j < KR, other=0), E - KT + j).to(tl.int64)
        if e >= E:
            return
        rn = pn * R * BN + tl.arange(0, BN)
        kb = tl.arange(0, NKBP)
        mk = kb < K // BLOCK_K
        rk = tl.arange(0, BLOCK_K)
        w, sw = _expert_slab(W, SW, e, rn, N, K, NKBP, BLOCK_K, SCALED)
        if not GATED:
            wt = tl.load(WTS + t * KR + j, mask=j < KR, other=1.0)
            if EARLY:
                pdl_wait(PDL)  # X: the up launch's h
            x = tl.load(X + s * stride_x + kb[:, None] * BLOCK_K + rk[None, :], mask=mk[:, None],
                        other=0.0).to(tl.float32)
            tl.store(Y + s * N + rn, slab_dot(w, sw, x, fmax, SCALED) * wt)
        else:
            w3, sw3 = _expert_slab(W3, SW3, e, rn, N, K, NKBP, BLOCK_K, SCALED)
            x = tl.load(X + t * stride_x + kb[:, None] * BLOCK_K + rk[None, :], mask=mk[:, None],
                        other=0.0).to(tl.float32)
            for r in tl.static_range(R):  # R slabs, the next one's loads issued before this one's products
                if r + 1 < R:
                    w_n, sw_n = _expert_slab(W, SW, e, rn + (r + 1) * BN, N, K, NKBP, BLOCK_K, SCALED)
                    w3_n, sw3_n = _expert_slab(W3, SW3, e, rn + (r + 1) * BN, N, K, NKBP, BLOCK_K, SCALED)
                g = tl.minimum(slab_dot(w, sw, x, fmax, SCALED), limit)
                u = tl.minimum(tl.maximum(slab_dot(w3, sw3, x, fmax, SCALED), -limit), limit)
                tl.store(Y + s * N + rn + r * BN, (g / (1.0 + tl.exp(-g)) * u).to(Y.dtype.element_ty))
                if r + 1 < R:
                    w, w3, sw, sw3 = w_n, w3_n, sw_n, sw3_n


# fused_moe takes the GEMV kernels up to this many tokens: a few slots, each reading its expert's whole weights.
# On an H200 (bench/fp8_linear.py --moe: mini's experts from HBM, k 6 + 1 shared), us a call against the tiled
# kernels: FP8 1 token 22.9 against 29.5, 2 tokens 38.8 against 43.3, 4 tokens 64.1 against 52.5; BF16 27.9
# against 36.0, 46.0 against 52.8, 72.8 against 66.4. In the engine's batch-1 step: FP8 1.19 -> 1.12 ms.
MOE_GEMV_TOKENS = 2
# their programs' most weight bytes and warps: fused_moe a call on an H200 (bench/fp8_linear.py --moe --sweep, every
# 8-64 KB x 4 / 8 warps) within 0.4 us of the fastest at 1 and 2 tokens, FP8 and BF16 (FP8 1 token 20.4 us against
# 22.9 for the dense GEMV's 32 KB on 8 warps, 2 tokens 35.4 against 38.7); the engine's FP8 step at batch 1 1.06 ->
# 1.03 ms, batch 2 1.30 -> 1.28, BF16 batch 1 1.22 -> 1.20
MOE_GEMV_SLAB, MOE_GEMV_WARPS = 16384, 4
# the up programs' slabs (by FP8 weights or not), the next one's loads in flight during this one's products: at one
# token (FP8, mini) 896 programs of 159 registers (3 an SM) against 1,792 of 91 (5 an SM). The engine's steps on an
# H200 (mini, two runs each, tok/s; see also moe_gemv_early): FP8 batch 1 1,152 / 1,155 (1 slab) -> 1,185 / 1,185,
# batch 2 1,823 / 1,826 -> 1,838 / 1,838; BF16 batch 1 946 / 947 -> 937 / 936, batch 2 1,502 / 1,503 -> 1,494 /
# 1,494, so BF16 keeps one. FP8 with the shared slots launched apart: 1,111 / 1,112 at batch 1 with 2 slabs
# (slower); 4 slabs (167 registers) 1,147 / 1,145; 8 KB slabs 1,161, 8 warps 1,181 (one run each); 2 slabs held
# to 128 registers (maxnreg: 4 an SM, 44 bytes of spills) 1,166 / 1,166
MOE_GEMV_REPS = {True: 2, False: 1}


def _moe_gemv(x, ids, weights, w1, w2, w3, s1, s2, s3, limit: float, n_shared: int, slab: int | None = None,
              warps: int | None = None, rows: SlotRows | None = None, reps: int | None = None) -> SlotRows:
    """The routed + shared experts of a few tokens: up (+ SwiGLU) and down through _moe_gemv_kernel, programs of
    (slot, reps slabs of weight rows) up, (slot, slab) down, -> the slot rows (SlotRows). fused_moe's numerics
    with the products' sums in another order.
    slab, warps: a program's most weight bytes (a slab) and its warps (default MOE_GEMV_SLAB, MOE_GEMV_WARPS);
    reps: the up programs' slabs (default MOE_GEMV_REPS, by FP8 weights or not; the same bits). rows:
    moe_gemv_early's for x, whose buffers take the slots: the up launch's shared slots then go first, without
    waiting for the kernel before."""
    T, D = x.shape
    E, I, _ = w1.shape
    first = rows is not None and rows.kt > rows.k
    rows = moe_gemv_rows(x, ids, w1, n_shared) if rows is None else rows._replace(ids=ids.contiguous())
    k, kt = rows.k, rows.kt
    scaled = s1 is not None
    wts = weights.float().contiguous()
    h, y = rows.h, rows.y
    x = x.contiguous()
    launches = ((x, w1, s1, w3, s3, h, I, D, True), (h, w2, s2, w2, s2, y, D, I, False))  # up, then down
    for X, W, S, W3, S3, Y, N, K, gated in launches if T * kt else ():
        bn = slab_rows(N, K * W.element_size() * (2 if gated else 1), slab=slab or MOE_GEMV_SLAB)
        r = divisor_at_most(N // bn, reps or MOE_GEMV_REPS[scaled]) if gated else 1
        npr = N // bn // r
        _moe_gemv_kernel[(T * kt * npr,) if first and gated else (T * kt, npr)](
            X, rows.ids, W, S if scaled else W, W3, S3 if scaled else W3, Y, wts, E, X.stride(0), limit,
            fp8_max(W.dtype) if scaled else 1.0, N=N, K=K, BN=bn, NKBP=pow2(K // BLOCK), KR=k, KT=kt, GATED=gated,
            SCALED=scaled, BLOCK_K=BLOCK, num_warps=warps or MOE_GEMV_WARPS, EARLY=not gated and T == 1, n_tok=T,
            SHARED_FIRST=first and gated, R=r, **pdl(x))
    return rows


def moe_gemv_rows(x, ids, w1, n_shared: int, k: int | None = None) -> SlotRows:
    """The GEMV kernels' buffers for x's tokens, k routed (ids' width) + n_shared slots each: SlotRows with its
    up output h (T * kt, I) in x's dtype. ids may come later (moe_gemv_early: None, k given)."""
    T, D = x.shape
    k = ids.shape[1] if ids is not None else k
    kt = k + n_shared
    y = torch.empty(T * kt, D, dtype=torch.float32, device=x.device)
    h = torch.empty(T * kt, w1.shape[1], dtype=x.dtype, device=x.device)
    return SlotRows(y, None if ids is None else ids.contiguous(), w1.shape[0], k, kt, x.dtype, h)


def moe_gemv_early(x, k: int, w1, n_shared: int) -> SlotRows | None:
    """fused_moe's GEMV-path buffers for x's tokens (up to MOE_GEMV_TOKENS), k routed + n_shared slots each, made
    before the routing: -> SlotRows for fused_moe(..., rows=), whose up launch then runs the shared slots' programs
    first and without waiting for the kernel launched before it (under PDL, the router's last), beside it; None
    where fused_moe would not take the GEMV kernels (or there is no shared expert). The caller makes them before
    it launches the router, so no memory those launches read becomes theirs, and x must be written before the
    router's last launch (under PDL, the kernels before the one before a launch have finished when it starts).
    On an H200 (the engine's FP8 decode, mini.yaml, two runs each, tok/s): batch 1 1,131 / 1,132 with the shared
    slots launched apart on a second stream beside the router (whose programs then waited for SMs behind the
    routed ones' launched early under PDL) -> 1,150 / 1,150 first in the one launch, 1,184 / 1,183 with 2 slabs
    an up program (MOE_GEMV_REPS); batch 2 1,806 / 1,807 -> 1,818 / 1,819 -> 1,842 / 1,841. BF16 batch 1 949 /
    949 -> 946 / 947 (one slab an up program)."""
    T, D = x.shape
    if not n_shared or T > MOE_GEMV_TOKENS or not moe_kernels_take(x, D, w1.shape[1]):
        return None
    return moe_gemv_rows(x, None, w1, n_shared, k)


def _moe_tiles(T: int, scaled: bool = False):
    """((BLOCK_N, warps, stages[, K ranges]) of the up kernel, (BLOCK_N, warps, stages) of the down kernel) for T
    tokens.
    BF16: the fastest of 32 / 64 / 128-wide tiles in the engine's decode steps on an H200 (mini.yaml; up and
    down kernels a step): at 64 tokens 1,345 us against 1,385 for 32-wide; at 1 token up 32, down 64.
    FP8 (scaled): the up kernel 128 wide, one 1x128 group of h a row, which it quantizes itself (no act_quant
    launch between the two). From `bench/fp8_linear.py --moe --sweep` on an H200 (fused_moe a call, mini's
    experts from HBM): up to 4 tokens the up kernel's K in 4 ranges, 8 warps (1 token: 31.8 us against 34.5
    unsplit; from 16 tokens on every split was slower; in the engine's batch-1 step the up kernels took 166 us
    against 196). Past 4 tokens the down kernel 128 wide: at 256 tokens 146 us against 152 in the sweep, and
    535 us a step against 600 in the engine; at 16 / 64 tokens 66.1 / 75.3 us against 67.7 / 77.0 for 64 wide,
    and the engine's step (two runs each) 1.80 -> 1.76 ms at batch 16, 2.17 -> 2.15-2.16 at 64 (an older tree had
    measured the opposite at 64: 291 us against 280 for 64 wide). 32- and 64-row blocks: the up kernel on 8 warps
    (128 tokens, 32-row blocks weights-first: 86.3 us a call against 89.4 on 4). At 17-64 tokens (16-row blocks
    weights-first, moe_swap) both kernels on 2 stages: two smem buffers a program, three programs an SM."""
    if not scaled:
        return ((32 if T <= 4 else 64), 4, 3), (64, 4, 3)
    if 16 < T <= 64:  # weights-first 16-row blocks (moe_swap), 2 stages both (see moe_swap)
        return (128, 4, 2), (128, 4, 2)
    up = (128, 8, 3, 4) if T <= 4 else (128, 8, 3) if moe_block_m(T, True) > 16 else (128, 4, 3)
    return up, ((128 if T > 4 else 64), 4, 3)


def moe_block_m(T: int, scaled: bool = False) -> int:
    """Rows of a row block for T tokens: each block reads its expert's whole weights, so past ~12 slots an expert
    (64 tokens, k 6 + 1 shared of 33) larger blocks read them fewer times. fused_moe a call on an H200 (mini's
    experts from HBM, scratch sweep of 16 / 32 / 64 rows x up / down tiles):
    BF16: 16 rows up to 64 tokens (64: 121 us against 129 for 32 or 64 rows), 32 at 128 (132 against 146), 64
    from 256 (256: 149 against 206; 512: 226 against 347).
    FP8: 16 rows up to 64 tokens, 32 (weights-first, moe_swap) up to 128, 64 past. Against every (16 / 32 / 64
    rows) x (x-first / weights-first) x (4 / 8 up warps), us a call: 64 tokens 76.7 (16 rows x-first) against
    78.1 weights-first and 82.6 for 32 rows; 128 tokens 86.3 (32 rows weights-first, 8 warps) against 95.1 for 16
    rows x-first; 256 tokens 104.4 (64 rows x-first) against 112.8 for 32 weights-first (earlier: 512 tokens 157
    against 227 for 16 rows). In the engine's step (32 rows weights-first for 17-128 tokens, on 4 up warps): batch
    32 2.13 -> 2.11 ms, 128 2.88 -> 2.77, but 64 2.28 -> 2.39, hence 16 rows up to 64 tokens. The 64-row tiles
    and the weights-first products run on Hopper's wgmma, whose FP8 products sum inside each 128-wide K block at
    reduced precision before the block's scales promote them to the fp32 accumulator -- DeepSeek's own recipe
    (DeepGEMM promotes every 128), and the dense FP8 GEMM's past 32 rows: relative error against the torch twin
    about 5e-3, against 2-4e-4 with x-first 16 or 32 rows."""
    if scaled:
        return 64 if T > 128 else 32 if T > 64 else 16
    return 16 if T <= 64 else 32 if T <= 128 else 64


def moe_swap(T: int, scaled: bool) -> bool:
    """Whether the tiled kernels take their products weights-first (SWAP: (BLOCK_N, rows) tiles) for T tokens: FP8
    up to 128 tokens (moe_block_m's 16- and 32-row blocks), where a block's x-first product is not Hopper's wgmma
    (which needs 64 rows) but mma.sync on FP8 weights converted to FP16 in registers (164 of them at 16 rows) and
    the weights-first one is wgmma on the tiles in shared memory (128). fused_moe a call on an H200 (mini's experts
    from HBM): 4 tokens 45.3 us against 48.5, 16 tokens 70.5 against 74.4; at 17-64 tokens with 2 pipeline stages
    in both kernels (_moe_tiles; at 3 they were slower than x-first there): 64 tokens 73.5-73.9 against 75.5-76.1
    for x-first 3-stage kernels (six timings each in one machine call), 32 tokens 72.2 against 74.4. The engine's
    steps: batch 16 1.95 ms against 2.00; FP8 batch 32 / 64 1.73-1.74 / 1.88 ms against 1.78 / 1.91 (two runs
    each, alternated with the x-first tree). Numerics: wgmma's, as at 64-row blocks (see moe_block_m)."""
    return scaled and T <= 128


def moe_overlap(T: int, scaled: bool) -> bool:
    """Whether the down kernel's programs of a row block start when that block's up tiles are done (under PDL,
    in the SMs the up launch's last wave leaves free) rather than after the whole up launch, for T tokens: BF16,
    and FP8 past 16 tokens. fused_moe a call on an H200 (mini's experts from HBM), us, overlapped against not:
    BF16 16 tokens 104.7 against 108.6, 64 115.3-116.0 against 119.6-119.8, 128 129.1 against 132.2, 256 149.2
    against 148.1 (noise); FP8 16 tokens 64.0-64.2 against 63.3-64.7 (no gain: not there), 32 67.9-68.4 against
    70.2-70.5, 64 70.2-71.0 against 71.7-71.9, 128 85.4-85.6 against 86.6-87.5, 256 98.7 against 105.1 (FP8 32-128
    with 5e0acb2's weights-first 2-stage kernels; before them, 16-row x-first 3-stage blocks, overlapping was
    slower at 64: the engine's FP8 batch 64 2.15-2.16 ms against 2.12-2.13). The engine's FP8 steps, overlapped
    from 17 tokens (with moe_down_early) against from 129, two runs each alternated in one machine session: batch
    32 1.72 ms against 1.75, 64 1.90 against 1.92, 128 2.43-2.44 against 2.46; batch 16 1.60 both."""
    return not scaled or T > 16


def moe_down_early(T: int, scaled: bool) -> bool:
    """Whether the overlapped down programs (moe_overlap) load their first weight tile before they wait for their
    row block's up tiles, for T tokens: FP8 up to 64 tokens. fused_moe a call on an H200 (mini's experts from
    HBM, three timings each), us, early against not: FP8 32 tokens 67.9 against 68.3-68.4, 64 70.3-70.6 against
    70.7-71.0; but 128 89.5-89.7 against 85.4-85.6, and BF16 64 116.5-116.7 against 115.5-115.7 (two tiles early:
    no better at 32-64 tokens, worse at 128)."""
    return scaled and T <= 64


def moe_up_regs(x: torch.Tensor, block_m: int, warps: int, swap: bool, scaled: bool) -> dict:
    """The up kernel's launch option capping its registers a thread, where ptxas's own count costs a program an SM:
    the FP8 32-row weights-first blocks on 8 warps (moe_block_m's 65-128 tokens) take 144, one 256-thread program
    an SM by registers; held to 128 (8 bytes spilled), two (shared memory allows two at 3 stages). fused_moe a call
    on an H200 (mini's experts from HBM, the same bits, three timings), us: 96 tokens 83.4-84.7 -> 80.0-80.3,
    128 85.1-85.9 -> 81.5-82.1. Not elsewhere: held to 128, the 64-row x-first blocks past 128 tokens (226 registers)
    spill 176 bytes (256 tokens 98.6 -> 174.8), and the down kernel is slower (128 tokens 85.3 -> 86.9); the 32-row
    blocks on 4 warps (236) held to 168 spill 104 bytes (64 tokens 86.8 -> 94.5). ptxas's counts: each variant
    compiled on the CPU for sm90 (`triton.compile` with the pointers' 16-byte divisibility; `cuobjdump
    --dump-resource-usage`). CUDA only: ROCm's Triton takes no maxnreg."""
    if scaled and swap and block_m == 32 and warps == 8 and x.is_cuda and torch.version.hip is None:
        return {"maxnreg": 128}
    return {}


def moe_kernels_take(x: torch.Tensor, D: int, I: int) -> bool:
    """Whether fused_moe runs its kernels on x's device for hidden size D and expert width I (128-multiples: the
    FP8 block tiles), not fused_moe_ref, whose loop over the experts hit reads them on the host (no CUDA graph
    can capture that)."""
    return use_triton(x) and D % BLOCK == 0 and I % BLOCK == 0


def fused_moe(x, ids, weights, w1, w2, w3, s1=None, s2=None, s3=None, limit: float = 10.0, n_shared: int = 0,
              tiles=None, block_m: int | None = None, gemv: bool | None = None, swap: bool | None = None, xq=None,
              overlap: bool | None = None, summed: bool = True, rows: SlotRows | None = None,
              early: bool | None = None):
    """fused_moe_ref on GPUs: align, [act_quant], up (+ SwiGLU), [act_quant], down (x routing weight), and the sum
    of each token's slots; the shared experts (n_shared) ride along as one more slot per token each. block_m: the
    rows of a row block (default moe_block_m). gemv: the GEMV kernels instead (_moe_gemv; default up to
    MOE_GEMV_TOKENS tokens, unless tiles or block_m are given). swap: the tiled kernels' products weights-first
    (default moe_swap). xq: FP8 weights' input x already quantized, (q, scales) as act_quant gives them (the
    tiled kernels take them instead of an act_quant launch; the GEMV kernels quantize x themselves). overlap: the
    down kernel's programs wait each for its row block's up tiles, not for the whole up launch (default
    moe_overlap, under PDL; only where the up kernel's K is unsplit; the same bits either way); early: the
    overlapped down programs' first weight tile loaded before their wait (default moe_down_early). summed=False: on
    the kernels' path the slot rows unsummed (SlotRows, whose summed() gives the same bits), for a consumer that
    sums them itself; fused_moe_ref's result is summed either way. rows: moe_gemv_early's for this x: the GEMV
    kernels into its buffers, the shared slots beside the kernel before (the same bits; tiles, block_m, gemv and
    xq do not apply)."""
    T, D = x.shape
    E, I, _ = w1.shape
    scaled = s1 is not None
    if not moe_kernels_take(x, D, I):
        return fused_moe_ref(x, ids, weights, w1, w2, w3, s1, s2, s3, limit, n_shared)
    if rows is not None:  # moe_gemv_early's: the GEMV kernels into its buffers, the shared slots first
        if ids.shape != (T, rows.k) or rows.y.shape[0] != T * rows.kt:
            raise ValueError(f"fused_moe(rows=): ids of shape ({T}, {rows.k}) for rows of {T} tokens, got ids "
                             f"{tuple(ids.shape)}, rows of {rows.y.shape[0] // rows.kt} tokens")
        rows = _moe_gemv(x, ids, weights, w1, w2, w3, s1, s2, s3, limit, n_shared, rows=rows)
        return rows.summed() if summed else rows
    if gemv or (gemv is None and tiles is None and block_m is None and T <= MOE_GEMV_TOKENS):
        rows = _moe_gemv(x, ids, weights, w1, w2, w3, s1, s2, s3, limit, n_shared)
        return rows.summed() if summed else rows
    k = ids.shape[1]
    kt = k + n_shared
    bm = block_m or moe_block_m(T, scaled)
    slots, bexp = moe_align(ids, E, bm, n_shared=n_shared)
    nb = bexp.shape[0]
    x = x.contiguous()
    if scaled:
        xq, sx = act_quant(x, w1.dtype) if xq is None else xq
    else:
        xq, sx = x, x  # unused scale operand
    up, down = tiles or _moe_tiles(T, scaled)
    (bn, nw, ns), (bn2, nw2, ns2) = up[:3], down
    swap = moe_swap(T, scaled) if swap is None else swap
    ks = divisor_at_most(D // BLOCK, up[3] if len(up) > 3 else 1)  # the up kernel's K ranges
    quant = scaled and bn == BLOCK  # the up kernel writes h quantized
    h = torch.empty(nb * bm, I, dtype=w2.dtype if quant else x.dtype, device=x.device)
    sh = torch.empty(nb * bm, I // BLOCK, dtype=torch.float32, device=x.device) if quant else h
    nt, nd = triton.cdiv(I, bn), triton.cdiv(D, bn2)
    # by default only under PDL: in stream order the down launch starts after the whole up launch anyway
    overlap = moe_overlap(T, scaled) and pdl(x)["PDL"] if overlap is None else overlap
    overlap = overlap and ks == 1 and not (scaled and not quant)  # (an act_quant launch between: no overlap)
    part = torch.empty(ks, nb * bm, 2 * I, dtype=torch.float32, device=x.device) if ks > 1 else h
    cnt = tickets(x.device, nb * nt if ks > 1 else 2 * nb) if ks > 1 or overlap else h  # (overlap: ks == 1)
    wts = weights.float().contiguous()
    early = overlap and (moe_down_early(T, scaled) if early is None else early)
    # (fewer stages where the tiles of ns do not fit shared memory: FP32 weights)
    tile = (bm, bn, bn2, xq.dtype, w1.dtype)
    launch_fitting(_moe_up_kernel, (nt, nb) if overlap else (nb, nt, ks), (
        xq, sx, w1, w3, s1 if scaled else w1, s3 if scaled else w3, h, sh, x, slots, bexp, part, cnt, T * kt,
        xq.stride(0), limit, fp8_max(w2.dtype) if quant else 1.0), dict(
        K=D, I=I, TOPK=kt, SCALED=scaled, QUANT=quant, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK, KSPLIT=ks, SWAP=swap,
        PREC=F32_DOT, num_warps=nw, READY=cnt, OVERLAP=overlap, **pdl(x), **moe_up_regs(x, bm, nw, swap, scaled)),
        ns, tile)
    if scaled and not quant:
        hq, sh = act_quant(h, w2.dtype)
    else:
        hq = h
    y = torch.empty(T * kt, D, dtype=torch.float32, device=x.device)
    launch_fitting(_moe_down_kernel, (nd, nb) if overlap else (nb, nd), (
        hq, sh, w2, s2 if scaled else w2, y, wts, slots, bexp, T * kt), dict(
        K=I, D=D, KR=k, KT=kt, SCALED=scaled, BLOCK_M=bm, BLOCK_N=bn2, BLOCK_K=BLOCK, SWAP=swap, PREC=F32_DOT,
        num_warps=nw2, READY=cnt, DONE=cnt[nb:] if overlap else cnt, NT=nt, OVERLAP=overlap, EARLY=early, **pdl(x)),
        ns2, tile)
    rows = SlotRows(y, ids.contiguous(), E, k, kt, x.dtype)
    return rows.summed() if summed else rows


class SlotRows(NamedTuple):
    """fused_moe's output before each token's slots are summed (summed=False), for a consumer that sums them
    itself (kernels.fused.hc_post): y (T * kt, D) fp32, token t's j-th slot at row t * kt + j; ids (T, k) the
    routed experts (an id of E or more: another rank's, its row never written); dtype: the sum's (x's); h: the
    GEMV kernels' up output (T * kt, I), where they made the rows."""
    y: torch.Tensor
    ids: torch.Tensor
    E: int
    k: int
    kt: int
    dtype: torch.dtype
    h: torch.Tensor | None = None

    def summed(self) -> torch.Tensor:
        """(T, D) in dtype: each token's kt slots summed in slot order in fp32 (_moe_sum_kernel)."""
        T, D = self.y.shape[0] // self.kt, self.y.shape[1]
        out = torch.empty(T, D, dtype=self.dtype, device=self.y.device)
        if T:
            bd = min(1024, pow2(D))
            _moe_sum_kernel[(T, triton.cdiv(D, bd))](self.y, self.ids, out, self.E, D=D, KR=self.k, KT=self.kt,
                                                     BD=bd, num_warps=4, **pdl(self.y))
        return out


# ---------------------------------------------------------------------------------------------------------
# training: the weighted combine of the experts' outputs back to their tokens


if triton is not None:
    @triton.jit
    def _combine_fwd(YS, INV, W, OUT, K: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
        """Token n, BD columns: OUT[n] = sum_j W[n, j] * YS[INV[n * K + j]] (fp32 sum)."""
        n = tl.program_id(0).to(tl.int64)
        rd = tl.program_id(1) * BD + tl.arange(0, BD)
        md = rd < D
        acc = tl.zeros((BD,), tl.float32)
        for j in range(K):
            i = tl.load(INV + n * K + j)
            w = tl.load(W + n * K + j).to(tl.float32)
            acc += w * tl.load(YS + i * D + rd, mask=md, other=0.0).to(tl.float32)
        tl.store(OUT + n * D + rd, acc.to(OUT.dtype.element_ty), mask=md)

    @triton.jit
    def _combine_bwd(YS, INV, W, GOUT, GYS, GW, K: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
        """Slot s = (n, j) at sorted row INV[s]: GYS[row] = W[s] * GOUT[n]; GW[s] = YS[row] . GOUT[n]."""
        s = tl.program_id(0).to(tl.int64)
        n = s // K
        i = tl.load(INV + s)
        w = tl.load(W + s).to(tl.float32)
        dot = tl.zeros((BD,), tl.float32)
        for d0 in range(0, D, BD):
            rd = d0 + tl.arange(0, BD)
            md = rd < D
            g = tl.load(GOUT + n * D + rd, mask=md, other=0.0).to(tl.float32)
            y = tl.load(YS + i * D + rd, mask=md, other=0.0).to(tl.float32)
            tl.store(GYS + i * D + rd, (w * g).to(GYS.dtype.element_ty), mask=md)
            dot += y * g
        tl.store(GW + s, tl.sum(dot, 0))


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ys, inv, w):
        ys, inv, w = ys.contiguous(), inv.contiguous(), w.contiguous()
        N, k = w.shape
        D = ys.shape[1]
        out = torch.empty(N, D, dtype=ys.dtype, device=ys.device)
        if N:
            bd = min(1024, pow2(D))
            _combine_fwd[(N, triton.cdiv(D, bd))](ys, inv, w, out, K=k, D=D, BD=bd, num_warps=4)
        ctx.save_for_backward(ys, inv, w)
        return out

    @staticmethod
    def backward(ctx, gout):
        ys, inv, w = ctx.saved_tensors
        N, k = w.shape
        D = ys.shape[1]
        gys = torch.empty_like(ys)
        gw = torch.empty(N, k, dtype=torch.float32, device=ys.device)
        if N:
            _combine_bwd[(N * k,)](ys, inv, w, gout.contiguous(), gys, gw, K=k, D=D, BD=min(1024, pow2(D)),
                                   num_warps=4)
        return gys, None, gw.to(w.dtype)


def combine_rows(ys, inv, w):
    """ys (N * k, D) the experts' outputs in sorted order, inv (N * k,) the sorted row of each token slot, w (N, k)
    -> (N, D) = sum_j w[n, j] * ys[inv[n * k + j]], in one pass (backward: one more); model.combine's fused form."""
    return _Combine.apply(ys, inv, w)
