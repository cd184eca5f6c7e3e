"""One decode step of a KV compressor over paged state, in one kernel per layer (all sequences of the batch).

    count = compress_decode(kv, gate, pos, slots, table, buf_kv, buf_gate, prev_kv, prev_gate, pool,
                            ape, norm_w, eps, cos, sin)

Each sequence b writes its projections kv[b], gate[b] (width,) (any float dtype, as the linears give them) into
row pos % r of its partial window buf_kv/buf_gate[slot] (n_slots, r, width) fp32, the gate plus its position
bias ape[pos % r] (r, width). When the token completes a window ((pos + 1) % r == 0) the window is pooled: per
channel, softmax over the window's rows of the gate, weighted sum of kv; with overlap (CSA: prev_kv/prev_gate
(n_slots, r, hd) given, width = 2 hd) the rows are the previous window's first series (only when a previous
window exists) and this window's second series, and this window's first series becomes the new prev. The pooled
vector is RMS-normed (norm_w, eps), its last 2 * cos.shape[1] channels rotated in interleaved pairs by cos/sin
(B, rd/2) (the window's first position), and stored as entry count - 1 = (pos + 1) // r - 1 of the sequence's
paged pool (n_blocks, BE, hd) through table (B, max_blocks).
Returns count (B,) int64, the entries each sequence has.

The torch twin is rollout_server.compress_step_ref (the model's own Compressor.pool); CPU runs it.
"""
from __future__ import annotations

import torch

from .fp8_gemm import pdl, pdl_wait, pow2, triton, use_triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _compress_decode_kernel(KV, GATE, POS, SLOTS, TABLE, BK, BG, PK, PG, POOL, APE, NW, COS, SIN, COUNT, eps,
                                max_blocks, stride_kv, stride_gate, R: tl.constexpr, WIDTH: tl.constexpr,
                                HD: tl.constexpr, RD: tl.constexpr, BE: tl.constexpr, OVERLAP: tl.constexpr,
                                BW: tl.constexpr, BR: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr = False):
        pdl_wait(PDL)
        b = tl.program_id(0)
        slot = tl.load(SLOTS + b).to(tl.int64)
        p = tl.load(POS + b)
        count = (p + 1) // R
        tl.store(COUNT + b, count)
        row = slot * R + p % R
        for w0 in range(0, WIDTH, BW):  # this token's row of the partial window
            rw = w0 + tl.arange(0, BW)
            mw = rw < WIDTH
            tl.store(BK + row * WIDTH + rw, tl.load(KV + b * stride_kv + rw, mask=mw).to(tl.float32), mask=mw)
            g = tl.load(GATE + b * stride_gate + rw, mask=mw).to(tl.float32) + \
                tl.load(APE + (p % R) * WIDTH + rw, mask=mw)
            tl.store(BG + row * WIDTH + rw, g, mask=mw)
        if (p + 1) % R == 0:
            tl.debug_barrier()  # the row just stored is read back by other threads of this program
            j = tl.arange(0, HALF)  # channel pairs (2j, 2j + 1): even and odd channels kept apart for RoPE
            mj = j < HD // 2
            m_e = tl.full((HALF,), float("-inf"), tl.float32)
            m_o = tl.full((HALF,), float("-inf"), tl.float32)
            l_e = tl.zeros((HALF,), tl.float32)
            l_o = tl.zeros((HALF,), tl.float32)
            a_e = tl.zeros((HALF,), tl.float32)
            a_o = tl.zeros((HALF,), tl.float32)
            NROWS: tl.constexpr = 2 * R if OVERLAP else R
            for r0 in range(0, NROWS, BR):
                rows = r0 + tl.arange(0, BR)
                if OVERLAP:  # rows [0, r): the previous window's first series; [r, 2r): this window's second
                    pm = (rows < R)[:, None] & mj[None, :] & (count >= 2)
                    bm = ((rows >= R) & (rows < NROWS))[:, None] & mj[None, :]
                    po = (slot * R + rows[:, None]) * HD + 2 * j[None, :]
                    bo = (slot * R + rows[:, None] - R) * WIDTH + HD + 2 * j[None, :]
                    k_e = tl.load(PK + po, mask=pm, other=0.0) + tl.load(BK + bo, mask=bm, other=0.0)
                    k_o = tl.load(PK + po + 1, mask=pm, other=0.0) + tl.load(BK + bo + 1, mask=bm, other=0.0)
                    g_e = tl.where(pm, tl.load(PG + po, mask=pm, other=0.0),
                                   tl.load(BG + bo, mask=bm, other=float("-inf")))
                    g_o = tl.where(pm, tl.load(PG + po + 1, mask=pm, other=0.0),
                                   tl.load(BG + bo + 1, mask=bm, other=float("-inf")))
                else:
                    bm = (rows < R)[:, None] & mj[None, :]
                    bo = (slot * R + rows[:, None]) * WIDTH + 2 * j[None, :]
                    k_e = tl.load(BK + bo, mask=bm, other=0.0)
                    k_o = tl.load(BK + bo + 1, mask=bm, other=0.0)
                    g_e = tl.load(BG + bo, mask=bm, other=float("-inf"))
                    g_o = tl.load(BG + bo + 1, mask=bm, other=float("-inf"))
                n_e = tl.maximum(m_e, tl.max(g_e, 0))
                n_o = tl.maximum(m_o, tl.max(g_o, 0))
                n_e = tl.where(n_e == float("-inf"), 0.0, n_e)  # a tile of masked rows only
                n_o = tl.where(n_o == float("-inf"), 0.0, n_o)
                p_e = tl.exp(g_e - n_e[None, :])
                p_o = tl.exp(g_o - n_o[None, :])
                c_e, c_o = tl.exp(m_e - n_e), tl.exp(m_o - n_o)
                l_e = l_e * c_e + tl.sum(p_e, 0)
                l_o = l_o * c_o + tl.sum(p_o, 0)
                a_e = a_e * c_e + tl.sum(p_e * k_e, 0)
                a_o = a_o * c_o + tl.sum(p_o * k_o, 0)
                m_e, m_o = n_e, n_o
            x_e = tl.where(mj, a_e / l_e, 0.0)
            x_o = tl.where(mj, a_o / l_o, 0.0)
            inv = tl.rsqrt((tl.sum(x_e * x_e, 0) + tl.sum(x_o * x_o, 0)) / HD + eps)
            y_e = tl.load(NW + 2 * j, mask=mj, other=0.0) * (x_e * inv)
            y_o = tl.load(NW + 2 * j + 1, mask=mj, other=0.0) * (x_o * inv)
            OFF: tl.constexpr = (HD - RD) // 2  # pairs before the rotated ones
            rj = j - OFF
            mr = (j >= OFF) & mj
            cs = tl.load(COS + b * (RD // 2) + rj, mask=mr, other=1.0)
            sn = tl.load(SIN + b * (RD // 2) + rj, mask=mr, other=0.0)
            o_e = y_e * cs - y_o * sn
            o_o = y_o * cs + y_e * sn
            e = count - 1
            blk = tl.load(TABLE + b * max_blocks + e // BE).to(tl.int64)
            dst = POOL + (blk * BE + e % BE) * HD + 2 * j
            tl.store(dst, o_e.to(POOL.dtype.element_ty), mask=mj)
            tl.store(dst + 1, o_o.to(POOL.dtype.element_ty), mask=mj)
            if OVERLAP:  # this window's first series becomes prev (after every thread has read the old prev)
                tl.debug_barrier()
                for o in range(0, R * HD, BW):
                    idx = o + tl.arange(0, BW)
                    mi = idx < R * HD
                    src = (slot * R + idx // HD) * WIDTH + idx % HD
                    tl.store(PK + slot * R * HD + idx, tl.load(BK + src, mask=mi), mask=mi)
                    tl.store(PG + slot * R * HD + idx, tl.load(BG + src, mask=mi), mask=mi)


def compress_decode(kv, gate, pos, slots, table, buf_kv, buf_gate, prev_kv, prev_gate, pool, ape, norm_w,
                    eps: float, cos, sin):
    """See the module docstring. Needs Triton (GPU, or TRITON_INTERPRET=1); every tensor contiguous but the rows
    of kv and gate (column slices of the engine's fused input GEMM)."""
    assert use_triton(kv), "compress_decode runs on Triton; the torch twin is rollout_server.compress_step_ref"
    B, width = kv.shape
    R, hd = buf_kv.shape[1], pool.shape[2]
    overlap = prev_kv is not None
    assert width == (2 * hd if overlap else hd) and buf_kv.shape[2] == width and hd % 2 == 0
    count = torch.empty(B, dtype=torch.int64, device=kv.device)
    kv, gate = (t if t.stride(-1) == 1 else t.contiguous() for t in (kv, gate))
    if B:
        pk = prev_kv if overlap else buf_kv
        pg = prev_gate if overlap else buf_gate
        _compress_decode_kernel[(B,)](
            kv, gate, pos, slots, table.contiguous(), buf_kv, buf_gate, pk, pg, pool,
            ape.contiguous(), norm_w, cos.contiguous(), sin.contiguous(), count, eps, table.shape[1], kv.stride(0),
            gate.stride(0), R=R,
            WIDTH=width, HD=hd, RD=2 * cos.shape[-1], BE=pool.shape[1], OVERLAP=overlap, BW=min(1024, pow2(width)),
            BR=min(pow2(2 * R if overlap else R), 16), HALF=pow2(hd // 2), num_warps=4, **pdl(kv))
    return count
