"""Decode-path attention for DeepSeek-V4 over paged state: one query token per sequence (and prefill's rows).

    out = decode_attention(q, win, slots, pos, sink, scale, pool, table, sel=..., count=...)
        q (B, H, d); win (n_slots, W, d) ring buffers of the sliding window (position p at p % W);
        compressed entries in `pool` (n_blocks, BE, d), located through `table` (B, max_blocks):
        sel (B, K) entry ids picked by the indexer (-1 = none; CSA) or count (B,) = attend to entries [0, count)
        (HCA); with both, sel's positions from count[b] on are ignored (index_topk lists a row's valid ids first,
        at most count of them: the kernel reads only those); sink (H,) per-head logit added to the softmax
        denominator. MQA: one K == V head for all H. unrope (cos, sin) (B, r) fp32: the output (rounded to q's
        dtype) then takes the inverse rotation of its last 2r dims at each row's angles (model.apply_rope(...,
        inverse=True), which project_out would otherwise run as one more kernel).
    out = prefill_attention(q, keys, base, pos, sink, scale, W, entries, first, sel=..., count=...)
        prefill's rows, the same kernel over linear buffers: q (N, H, d) at positions pos (N,); row n's window
        keys[base[n] + kp] for kp in (pos[n] - W, pos[n]], its entry i entries[first[n] + i] (sel / count as above,
        without the cache's block tables).
    scores = index_scores(qi, wi, pool, table, count, S)
        the Lightning Indexer: sum_h wi[b, h] * relu(qi[b, h] . k[b, s]) * d^-0.5 for s < count[b], -inf after.
    picks = prefill_index(qi, wi, rows, keys, count, k)
        prefill's indexer: those scores for many query rows against linear entries, then their top k (-1 past count).

Triton on GPU (online softmax over key tiles, all heads of a sequence in one program), torch references
(gathers) on CPU; the two compute the same function.
"""
from __future__ import annotations

import torch

from . import fp8_gemm
from .fp8_gemm import dot32, pdl, pdl_wait, pow2, quant_rows, sm_count, tickets, triton, use_triton
from .quant import fp8_max

if triton is not None:
    import triton.language as tl


def _entry_rows(pool, table, idx):
    """idx (B, K) entry ids (clamped >= 0) -> rows (B, K, d) from the paged pool."""
    BE = pool.shape[1]
    blk = table.gather(1, idx // BE)
    return pool[blk, idx % BE]


def window_positions(pos, W: int):
    """(B,) query positions -> (B, W) position held in each ring slot (negative = not yet written)."""
    j = torch.arange(W, device=pos.device)
    return pos[:, None] - torch.remainder(pos[:, None] - j, W)


def unrope_ref(o, cos, sin):
    """o (B, H, d) -> its last 2r dims rotated back by the angles of cos / sin (B, r), interleaved pairs in fp32
    (model._rope with -sin)."""
    r = cos.shape[-1]
    x0, x1 = o[..., -2 * r::2].float(), o[..., -2 * r + 1::2].float()
    c, s = cos[:, None, :], sin[:, None, :]
    y = torch.stack((x0 * c + x1 * s, x1 * c - x0 * s), dim=-1).flatten(-2)
    return torch.cat([o[..., :-2 * r], y.to(o.dtype)], -1)


def decode_attention_ref(q, win, slots, pos, sink, scale, pool=None, table=None, sel=None, count=None, unrope=None):
    B, H, d = q.shape
    keys = win[slots]
    valid = window_positions(pos, win.shape[1]) >= 0
    if pool is not None:
        if sel is not None:
            idx, ok = sel.clamp(min=0), sel >= 0
            if count is not None:
                ok &= torch.arange(sel.shape[1], device=q.device) < count[:, None]
        else:
            cap = table.shape[1] * pool.shape[1]
            idx = torch.arange(cap, device=q.device).expand(B, cap)
            ok = idx < count[:, None]
        keys = torch.cat([keys, _entry_rows(pool, table, idx).to(keys.dtype)], 1)
        valid = torch.cat([valid, ok], 1)
    out = _attend_rows(q, keys, valid, sink, scale)
    return out if unrope is None else unrope_ref(out, *unrope)


def _attend_rows(q, keys, valid, sink, scale):
    """q (B, H, d), each row over its own keys (B, K, d) where valid (B, K), and the sinks -> (B, H, d)."""
    B, H, d = q.shape
    logits = torch.einsum("bhd,bkd->bhk", q.float(), keys.float()) * scale
    logits = logits.masked_fill(~valid[:, None], float("-inf"))
    logits = torch.cat([logits, sink.float().view(1, H, 1).expand(B, H, 1)], -1)
    p = logits.softmax(-1)[..., :-1]
    return torch.einsum("bhk,bkd->bhd", p, keys.float()).to(q.dtype)


def prefill_attention_ref(q, keys, base, pos, sink, scale, W: int, entries=None, first=None, sel=None, count=None):
    """prefill_attention's function by gathers: each row's window keys and entries, then _attend_rows."""
    kp = pos[:, None] - torch.arange(W, device=q.device)
    valid = kp >= 0
    rows = keys[(base[:, None] + kp).clamp(0, keys.shape[0] - 1)]
    if entries is not None:
        if sel is not None:
            idx, ok = sel.clamp(min=0), sel >= 0
        else:
            idx = torch.arange(int(count.max()) if count.numel() else 0, device=q.device).expand(q.shape[0], -1)
            ok = idx < count[:, None]
        rows = torch.cat([rows, entries[(first[:, None] + idx).clamp(0, max(0, entries.shape[0] - 1))].to(rows.dtype)],
                         1)
        valid = torch.cat([valid, ok], 1)
    return _attend_rows(q, rows, valid, sink, scale)


if triton is not None:
    @triton.jit
    def _online(q, k, valid, m, l, acc, scale, PREC: tl.constexpr):
        s = dot32(q, tl.trans(k), PREC) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet (a split's first blocks)
        alpha = tl.exp(m - m_use)
        p = tl.exp(s - m_use[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot32(p.to(k.dtype), k, PREC)
        return m_new, l, acc

    @triton.jit
    def _store_out(OUT, offs, o, rmask, COS, SIN, b, d0, Q, S, srow, fmax, R: tl.constexpr, BD: tl.constexpr,
                   D: tl.constexpr, HALF: tl.constexpr, QUANT: tl.constexpr):
        """Store o (R, BD) fp32 at OUT + offs (R heads' columns [d0, d0 + BD), token b; rows where rmask),
        rounded to the output's dtype; HALF > 0: then rotated back (unrope_ref's arithmetic on the rounded
        values) where the columns fall in a head's last HALF pairs. QUANT (BD % 128 == 0): the stored values also
        quantized per 1x128 tile, act_quant's bytes at Q + offs and the R * BD / 128 tiles' scales (row-major) at
        S + srow + tile: the output projection's FP8 GEMM input."""
        mask = rmask[:, None]
        ptr = OUT + offs
        y = o.to(ptr.dtype.element_ty)
        if HALF > 0:
            ye, yo = tl.split(tl.reshape(y.to(tl.float32), (R, BD // 2, 2)))
            j = d0 // 2 + tl.arange(0, BD // 2) - (D // 2 - HALF)  # the pair's column in the tables (< 0: none)
            mj = (j >= 0) & (j < HALF)
            c = tl.load(COS + b * HALF + j, mask=mj, other=1.0)[None, :]
            s = tl.load(SIN + b * HALF + j, mask=mj, other=0.0)[None, :]
            y = tl.reshape(tl.join(ye * c + yo * s, yo * c - ye * s), (R, BD)).to(ptr.dtype.element_ty)
        tl.store(ptr, y, mask=mask)
        if QUANT:
            NT: tl.constexpr = R * BD // 128
            q, sc = quant_rows(tl.reshape(y.to(tl.float32), (NT, 128)), fmax)
            tl.store(Q + offs, tl.reshape(q, (R, BD)).to(Q.dtype.element_ty), mask=mask)
            tmask = tl.reshape(tl.broadcast_to(mask, (R, BD // 128)), (NT,))
            tl.store(S + srow + tl.arange(0, NT), sc, mask=tmask)

    @triton.jit
    def _entry_row(TABLE, b, idx, valid, eb, max_blocks, BE: tl.constexpr, LINEAR: tl.constexpr):
        """Row b's entries idx: their rows of the pool, through its block table (or, LINEAR, from its first, eb)."""
        if LINEAR:
            return tl.where(valid, eb + idx, 0)
        blk = tl.load(TABLE + b * max_blocks + idx // BE, mask=valid, other=0).to(tl.int64)
        return blk * BE + idx % BE

    @triton.jit
    def _decode_attn_kernel(Q, WIN, SLOTS, POS, SINK, PM, PL, PACC, OUT, CNT, POOL, TABLE, SEL, COUNT, COS, SIN,
                            OQ, OS, scale, H, max_blocks, fmax, W: tl.constexpr, D: tl.constexpr, BE: tl.constexpr,
                            KSEL: tl.constexpr, CAP: tl.constexpr, MODE: tl.constexpr, BOUNDED: tl.constexpr,
                            DYNAMIC: tl.constexpr, NS: tl.constexpr, MERGE: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_K: tl.constexpr, HALF: tl.constexpr, PREC: tl.constexpr, QUANT: tl.constexpr = False,
                            PDL: tl.constexpr = False, LINEAR: tl.constexpr = False):
        """Split sp of NS (flash-decoding): key blocks sp, sp + NS, ... of the window, then of the entries (MODE 1:
        sel's first count[b] positions when BOUNDED, else all KSEL; MODE 2: entries [0, count[b])). NS == 1: adds
        the sinks, normalizes and stores OUT. Else it stores its running max, sum and unnormalized output (PM, PL,
        PACC) for _decode_combine_kernel, or (MERGE) the last of the NS programs of (token, head block) to finish
        (a ticket counter in CNT, reset to 0 after) merges them in split order with the sinks: the same sum
        whichever finishes last. HALF > 0: the stored output is rotated back; QUANT: also stored quantized in OQ /
        OS (_store_out). LINEAR (prefill_attention): WIN and POOL are (rows, D) buffers, row b's window keys at
        rows SLOTS[b] + kp for positions kp in (p - W, p], kp >= 0, and its entry i at row TABLE[b] + i."""
        pdl_wait(PDL)
        b, hb, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rh = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        mh = rh < H
        rd = tl.arange(0, D)
        q = tl.load(Q + (b * H + rh[:, None]) * D + rd[None, :], mask=mh[:, None], other=0.0)
        slot = tl.load(SLOTS + b).to(tl.int64)
        p = tl.load(POS + b)
        m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, D), tl.float32)
        for j0 in range(0, W, NS * BLOCK_K):  # (the interpreter takes no program id in a range)
            j = j0 + sp * BLOCK_K + tl.arange(0, BLOCK_K)
            if LINEAR:  # the key j positions back
                kp = p - j
            else:  # ring place j of the slot's window
                kp = p - ((p - j) % W + W) % W
            valid = (j < W) & (kp >= 0)
            # (a masked lane's address kept at row 0, inside the buffer: a prefill row's lanes before position 0)
            krow = tl.where(valid, slot + kp, 0) if LINEAR else slot * W + j
            k = tl.load(WIN + krow[:, None] * D + rd[None, :], mask=valid[:, None], other=0.0)
            m, l, acc = _online(q, k, valid, m, l, acc, scale, PREC)
        eb = 0
        if LINEAR:  # row b's first entry
            eb = tl.load(TABLE + b).to(tl.int64)
        if MODE == 1:  # indexer-selected entries
            nsel = tl.minimum(tl.load(COUNT + b), KSEL) if BOUNDED else KSEL
            # the loop bound is data-dependent on GPU; the CPU interpreter needs a static one
            for t0 in range(0, nsel if DYNAMIC else KSEL, NS * BLOCK_K):
                t = t0 + sp * BLOCK_K + tl.arange(0, BLOCK_K)
                idx = tl.load(SEL + b * KSEL + t, mask=t < nsel, other=-1)
                valid = idx >= 0
                idx = tl.maximum(idx, 0)
                k = tl.load(POOL + _entry_row(TABLE, b, idx, valid, eb, max_blocks, BE, LINEAR)[:, None] * D +
                            rd[None, :], mask=valid[:, None], other=0.0)
                m, l, acc = _online(q, k.to(q.dtype), valid, m, l, acc, scale, PREC)
        if MODE == 2:  # every entry written so far
            n = tl.load(COUNT + b)
            for t0 in range(0, n if DYNAMIC else CAP, NS * BLOCK_K):
                idx = t0 + sp * BLOCK_K + tl.arange(0, BLOCK_K)
                valid = idx < n
                k = tl.load(POOL + _entry_row(TABLE, b, idx, valid, eb, max_blocks, BE, LINEAR)[:, None] * D +
                            rd[None, :], mask=valid[:, None], other=0.0)
                m, l, acc = _online(q, k.to(q.dtype), valid, m, l, acc, scale, PREC)
        sink = tl.load(SINK + rh, mask=mh, other=0.0).to(tl.float32)
        offs = (b * H + rh[:, None]) * D + rd[None, :]
        srow = (b * H + hb * BLOCK_H) * (D // 128)  # the block's first 1x128 tile (QUANT)
        if NS == 1:  # one split: add the sinks and normalize here
            m_new = tl.maximum(m, sink)
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.exp(sink - m_new)
            _store_out(OUT, offs, acc * alpha[:, None] / l[:, None], mh, COS, SIN, b, 0, OQ, OS, srow, fmax,
                       BLOCK_H, D, D, HALF, QUANT)
        else:
            row = (b * H + rh) * NS
            tl.store(PM + row + sp, m, mask=mh)
            tl.store(PL + row + sp, l, mask=mh)
            tl.store(PACC + (row + sp)[:, None] * D + rd[None, :], acc, mask=mh[:, None])
        if NS > 1 and MERGE:
            tl.debug_barrier()  # the whole partial is written before the ticket is taken
            tile = b * tl.num_programs(1) + hb
            if tl.atomic_add(CNT + tile, 1) == NS - 1:  # acq_rel: the other splits' partials are visible
                mx = sink
                for s in range(NS):
                    mx = tl.maximum(mx, tl.load(PM + row + s, mask=mh, other=0.0, cache_modifier=".cg"))
                tot = tl.exp(sink - mx)
                acc = tl.zeros((BLOCK_H, D), tl.float32)
                for s in range(NS):
                    w = tl.exp(tl.load(PM + row + s, mask=mh, other=0.0, cache_modifier=".cg") - mx)
                    tot += tl.load(PL + row + s, mask=mh, other=0.0, cache_modifier=".cg") * w
                    acc += tl.load(PACC + (row + s)[:, None] * D + rd[None, :], mask=mh[:, None], other=0.0,
                                   cache_modifier=".cg") * w[:, None]
                _store_out(OUT, offs, acc / tot[:, None], mh, COS, SIN, b, 0, OQ, OS, srow, fmax, BLOCK_H, D, D,
                           HALF, QUANT)
                tl.store(CNT + tile, 0)

    @triton.jit
    def _decode_combine_kernel(PM, PL, PACC, SINK, OUT, COS, SIN, OQ, OS, H, fmax, D: tl.constexpr,
                               NS: tl.constexpr, NSP: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr,
                               QUANT: tl.constexpr = False, PDL: tl.constexpr = False):
        """One (token, head), BLOCK_D columns: the NS splits' partial softmaxes merged with the sink's logit,
        normalized (QUANT: BLOCK_D 128, one tile, also stored quantized)."""
        pdl_wait(PDL)
        r, db = tl.program_id(0), tl.program_id(1)
        rs = tl.arange(0, NSP)
        ms = rs < NS
        m = tl.load(PM + r * NS + rs, mask=ms, other=float("-inf"))
        l = tl.load(PL + r * NS + rs, mask=ms, other=0.0)
        sink = tl.load(SINK + r % H).to(tl.float32)
        mx = tl.maximum(tl.max(m, 0), sink)
        w = tl.exp(m - mx)
        tot = tl.sum(l * w, 0) + tl.exp(sink - mx)
        rd = db * BLOCK_D + tl.arange(0, BLOCK_D)
        acc = tl.load(PACC + (r * NS + rs[:, None]) * D + rd[None, :], mask=ms[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tot
        _store_out(OUT, r * D + rd[None, :], out[None, :], tl.full((1,), 1, tl.int1), COS, SIN, r // H,
                   db * BLOCK_D, OQ, OS, r * (D // BLOCK_D) + db, fmax, 1, BLOCK_D, D, HALF, QUANT)


def _attn_plan(B: int, hb: int, mode: int, W: int, entries: int, sms: int, d: int = 512, hip: bool = False
               ) -> tuple[int, int, int, bool, int]:
    """(splits of the key range per (token, head block), keys a loop step, pipeline depth, merge in the kernel,
    warps). Measured on an H200 at mini's shapes (16 heads of 512, window 128, sel 512; bench/RESULTS.md): under 32
    (token, head block) tiles the step is latency-bound: about 128 programs of 32-key steps, merged by the combine
    kernel (one program per (token, head, 128 columns)); a tile's last split merging them in the kernel took up to
    twice as long there (it reads every split's partial alone). From 32 tiles up the in-kernel merge wins (64
    rows, 2 splits, a CSA layer with 512 selected entries: 38.8 us against 49.9 with the combine kernel); there,
    splits only where they leave 8 key steps each (the CSA layers' entries at 64 rows), gathered entries in 32-key
    steps 3 deep, the window and HCA entries in 64-key steps. One tile (batch 1): 16-key steps, at most 32
    splits (a call with its combine, us: the window alone 5.3 in 8 against 5.6 in 4 splits of 32 keys; 4 HCA
    entries in a table of 4,096 8.4 in 32 (7.8 in 8) against 12.4 in 128; 130-512 CSA entries 8.5 in 32 against
    9.4 in 20). More tiles than SMs (sms): one program a tile on 4 warps in 32-key steps 3 deep, so two fit an SM
    where 8 warps take one a wave (256 rows, us a call, 8 warps in 64-key steps against these: the window 17.1
    against 16.0, every CSA entry of ~47 34.4 against 25.3 and of ~255 61.9 against 46.8, HCA 30.7 against 20.8;
    at 128 rows 8 warps were the faster everywhere).
    hip (ROCm): key steps of at most max(16, 4096 // d) keys (16 at d >= 256), the splits counted in them, and
    8-warp programs 2 deep. AMD gfx942's compiler (Triton 3.6 run on the CPU, given a GPU launch's alignments:
    tests.launches) caps an 8-warp program at 256 VGPRs, and the CUDA plan's steps spill there: at d 512 over bf16
    caches, 8 warps in 32-key steps 3 deep (the CSA picks from 32 tiles up) 106-222 VGPRs a thread (428-892 bytes
    of scratch), in 64-key steps 2-57, in 32-key steps 2 deep 0-8, in 16-key steps 3 deep 34-44 (fp32 caches: up
    to 407); 16-key steps 2 deep spill none, on 8 or 4 warps (109-178 / 144-304 VGPRs). sm90 spills in none of
    these. Chosen by the compiler's counts, not timed (no MI300X here)."""
    tiles = B * hb
    most = max(16, 4096 // d) if hip else 64
    if tiles == 1:
        return max(1, min(triton.cdiv(W, 16) + triton.cdiv(entries, 16), 32)), 16, 2, False, 8
    if tiles < 32:
        bk = min(32, most)
        return max(1, min(triton.cdiv(W, bk) + triton.cdiv(entries, bk), 128 // max(1, tiles))), bk, 2, False, 8
    if tiles > sms:
        return 1, min(32, most), 3, True, 4
    bk, stages = (32, 3) if mode == 1 else (64, 2)
    bk, stages = min(bk, most), 2 if hip else stages
    return max(1, min(128 // tiles, (triton.cdiv(W, bk) + triton.cdiv(entries, bk)) // 8)), bk, stages, True, 8


def _hip(t: torch.Tensor) -> bool:
    """t is on an AMD GPU (ROCm's torch): the decode attention's plan for gfx942 (_attn_plan's hip)."""
    return t.is_cuda and torch.version.hip is not None


def decode_attention(q, win, slots, pos, sink, scale, pool=None, table=None, sel=None, count=None,
                     splits: int | None = None, merge: bool | None = None, unrope=None, fp8=None):
    """decode_attention_ref's result: the key range split `splits` ways per (token, head block), merged with the
    sinks by the last split to finish or by a combine kernel (_attn_plan; merge=True / False forces either).
    fp8 (an FP8 dtype): -> (out, oq) with oq the output's (B, H * d) rows quantized per 1x128 tile as act_quant
    gives them, (q, scales), stored by the same kernels (the output projection's FP8 GEMM input), or None where
    they do not make them (d not a multiple of 128, no Triton)."""
    d = q.shape[-1]
    if not use_triton(q) or d < 16 or d & (d - 1):
        out = decode_attention_ref(q, win, slots, pos, sink, scale, pool, table, sel, count, unrope)
        return out if fp8 is None else (out, None)
    paged = pool is not None
    return _attention(q, win, slots, pos, sink, scale, pool, table, sel, count, splits, merge, unrope, fp8, False,
                      win.shape[1], pool.shape[1] if paged else 1, table.shape[1] * pool.shape[1] if paged else 0,
                      table.shape[1] if paged else 0)


def prefill_attention(q, keys, base, pos, sink, scale, W: int, entries=None, first=None, sel=None, count=None,
                      splits: int | None = None, merge: bool | None = None):
    """Prefill's attention: the decode kernel over many query rows, their keys in linear buffers (no cache).
    q (N, H, d) rows at positions pos (N,); keys (R, d): a row's key at position kp is keys[base[n] + kp], its
    window the positions (pos[n] - W, pos[n]] from 0 on; entries (E, d): its entry i is entries[first[n] + i],
    sel (N, K) the ids it attends to (-1: none; CSA's indexer picks) or count (N,): entries [0, count[n]) (HCA).
    -> (N, H, d) in q's dtype, prefill_attention_ref's function (model.attend's, one query row at a time)."""
    d = q.shape[-1]
    if not use_triton(q) or d < 16 or d & (d - 1):
        return prefill_attention_ref(q, keys, base, pos, sink, scale, W, entries, first, sel, count)
    keys, base, pos, entries, first, count = (None if t is None else t.contiguous()  # (the kernel's addressing)
                                              for t in (keys, base, pos, entries, first, count))
    return _attention(q, keys, base, pos, sink, scale, entries, first, sel, count, splits, merge, None, None, True, W,
                      1, 0 if entries is None else entries.shape[0], 0)


def _attention(q, win, slots, pos, sink, scale, pool, table, sel, count, splits, merge, unrope, fp8, linear: bool,
               W: int, BE: int, cap: int, max_blocks: int):
    """decode_attention's and prefill_attention's launch (linear: prefill's addressing, _decode_attn_kernel's
    LINEAR): cap the entries a row may reach (mode 2's loop bound under the interpreter)."""
    B, H, d = q.shape
    half = 0 if unrope is None else unrope[0].shape[-1]
    quant = fp8 is not None and d % 128 == 0
    cos, sin = (t.float().contiguous() for t in unrope) if half else (q, q)
    out = torch.empty_like(q)
    oq = torch.empty(B, H * d, dtype=fp8, device=q.device) if quant else out
    osc = torch.empty(B, H * d // 128, dtype=torch.float32, device=q.device) if quant else out
    fmax = fp8_max(fp8) if quant else 1.0
    mode = 0 if pool is None else (1 if sel is not None else 2)
    dummy = slots
    bh = 16
    ksel = sel.shape[1] if sel is not None else 0
    hb = triton.cdiv(H, bh)
    ns, bk, stages, fuse, warps = _attn_plan(B, hb, mode, W, ksel if mode == 1 else cap, sm_count(q.device), d,
                                             _hip(q))
    ns, fuse = splits or ns, fuse if merge is None else merge
    pm = torch.empty(B * H * ns if ns > 1 else 0, dtype=torch.float32, device=q.device)
    pl = torch.empty_like(pm)
    pacc = torch.empty(B * H * ns if ns > 1 else 0, d, dtype=torch.float32, device=q.device)
    if B:
        _decode_attn_kernel[(B, hb, ns)](
            q.contiguous(), win, slots, pos, sink, pm, pl, pacc, out,
            tickets(q.device, B * hb) if fuse and ns > 1 else pm,
            pool if pool is not None else win, table if table is not None else dummy,
            sel.contiguous() if sel is not None else dummy, count if count is not None else dummy, cos, sin,
            oq, osc, scale, H, max_blocks, fmax,
            W=W, D=d, BE=BE, KSEL=ksel, CAP=cap, MODE=mode,
            BOUNDED=mode == 1 and count is not None, DYNAMIC=q.is_cuda, NS=ns, MERGE=fuse, BLOCK_H=bh, BLOCK_K=bk,
            HALF=half, PREC=fp8_gemm.F32_DOT, QUANT=quant and (ns == 1 or fuse), num_warps=warps if d >= 256 else 4,
            num_stages=stages, LINEAR=linear, **pdl(q))
        if ns > 1 and not fuse:
            bd = min(d, 128)
            _decode_combine_kernel[(B * H, d // bd)](pm, pl, pacc, sink, out, cos, sin, oq, osc, H, fmax, D=d, NS=ns,
                                                     NSP=max(2, pow2(ns)), BLOCK_D=bd, HALF=half, QUANT=quant,
                                                     num_warps=4, **pdl(q))
    if fp8 is None:
        return out
    return out, ((oq, osc) if quant else None)


# ---------------------------------------------------------------------------------------------------------
# the Lightning Indexer's scores over paged keys


def index_scores_ref(qi, wi, pool, table, count, S: int, w_scale: float = 1.0):
    """qi (B, h, d), wi (B, h) (head weights, times w_scale in fp32) -> (B, S) fp32: scores of entries [0, S),
    -inf at and beyond count."""
    B = qi.shape[0]
    idx = torch.arange(S, device=qi.device).expand(B, S)
    keys = _entry_rows(pool, table, idx).float()
    s = torch.einsum("bhd,bsd->bhs", qi.float(), keys).relu_() * qi.shape[-1] ** -0.5
    s = torch.einsum("bhs,bh->bs", s, wi.float() * w_scale)
    return s.masked_fill(idx >= count[:, None], float("-inf"))


if triton is not None:
    @triton.jit
    def _index_scores_kernel(QI, WI, POOL, TABLE, COUNT, OUT, S, max_blocks, scale, stride_w, w_scale,
                             NH: tl.constexpr, D: tl.constexpr, BE: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_S: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr = False):
        pdl_wait(PDL)
        b, sb = tl.program_id(0), tl.program_id(1)
        rs = sb * BLOCK_S + tl.arange(0, BLOCK_S)
        n = tl.load(COUNT + b)
        valid = rs < n
        if sb * BLOCK_S >= n:  # past this row's entries (the grid covers the table's capacity)
            tl.store(OUT + b * S + rs, tl.full((BLOCK_S,), float("-inf"), tl.float32), mask=rs < S)
            return
        rd = tl.arange(0, D)
        blk = tl.load(TABLE + b * max_blocks + rs // BE, mask=valid, other=0).to(tl.int64)
        k = tl.load(POOL + ((blk * BE + rs % BE)[:, None]) * D + rd[None, :], mask=valid[:, None], other=0.0)
        k = k.to(tl.float32)
        tot = tl.zeros((BLOCK_S,), tl.float32)
        for h0 in range(0, NH, BLOCK_H):
            rh = h0 + tl.arange(0, BLOCK_H)
            mh = rh < NH
            q = tl.load(QI + (b * NH + rh[:, None]) * D + rd[None, :], mask=mh[:, None], other=0.0).to(tl.float32)
            w = tl.load(WI + b * stride_w + rh, mask=mh, other=0.0).to(tl.float32) * w_scale
            s = tl.maximum(tl.dot(q, tl.trans(k), input_precision=PREC), 0.0) * scale
            tot += tl.sum(s * w[:, None], 0)
        tot = tl.where(valid, tot, float("-inf"))
        tl.store(OUT + b * S + rs, tot, mask=rs < S)


def index_scores(qi, wi, pool, table, count, S: int, w_scale: float = 1.0):
    """index_scores_ref on GPUs. qi and wi in any float dtype (the kernel reads them as fp32); wi's rows may be
    strided (a column slice of the engine's fused input GEMM)."""
    B, nh, d = qi.shape
    if not use_triton(qi) or d < 16 or d & (d - 1):
        return index_scores_ref(qi, wi, pool, table, count, S, w_scale)
    out = torch.empty(B, S, dtype=torch.float32, device=qi.device)
    if wi.stride(-1) != 1:
        wi = wi.contiguous()
    # head products in fp8_gemm.F32_DOT's tensor-core passes (IEEE fp32 FMAs took 1.8-3.5x as long: on an H200 with
    # 32 heads of 128, 64 rows x 192 entries 6.4 us against 22.4, 16 x 4,096 25.1 against 85.3; the same top-k);
    # 32 entries a program up to 16k (rows x entries), 64 past (16 x 1,024: 7.0 against 10.2 us)
    bs = 32 if B * S < 16384 else 64
    _index_scores_kernel[(B, triton.cdiv(S, bs))](
        qi.contiguous(), wi, pool, table, count, out, S, table.shape[1], d ** -0.5, wi.stride(0), w_scale, NH=nh,
        D=d, BE=pool.shape[1], BLOCK_H=16, BLOCK_S=bs, PREC=fp8_gemm.F32_DOT, num_warps=4, **pdl(qi))
    return out


def topk_first(sc: torch.Tensor, k: int) -> torch.Tensor:
    """(..., S) scores -> (..., k) int64 indices of the k largest, best first; equal scores (-0.0 equal to 0.0) in
    index order, as _index_topk_kernel sorts them. torch.topk's order among equal values is unspecified and changes
    with the row's length, so the indexer's paths (decode kernel, full forward, prefill) could pick different
    entries where scores tie, e.g. several exactly 0 when every head's ReLU is 0. One int64 topk over the kernel's
    packing: an order-preserving int32 of the score above the reversed index."""
    S = sc.shape[-1]
    bits = sc.float().masked_fill(sc == 0, 0.0).view(torch.int32).to(torch.int64)
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)) << 32 | (S - 1 - torch.arange(S, device=sc.device))
    return S - 1 - (key.topk(k, dim=-1).values & 0xFFFFFFFF)


def index_topk_ref(sc, k: int, count):
    """sc (B, S) scores (-inf at and beyond count) -> (B, k) int64 entries of the k best scores (ties: the lower
    entry first), -1 where fewer than k entries exist."""
    top = topk_first(sc, k)
    return torch.where(top < count[:, None], top, torch.full_like(top, -1))


if triton is not None:
    @triton.jit
    def _score_key(v):
        """fp32 scores -> int32 keys in the same order (signed compare), -0.0 tied with 0.0."""
        bits = tl.where(v == 0.0, 0.0, v).to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _index_topk_kernel(SC, COUNT, OUT, S, K: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr = False):
        """One row: a bitonic sort of (order-preserving int32 of the score, reversed entry index) pairs packed
        in int64, descending (ties: the lower index first); the first K entries, -1 past the row's count."""
        pdl_wait(PDL)
        b = tl.program_id(0)
        rs = tl.arange(0, SP)
        key = _score_key(tl.load(SC + b * S + rs, mask=rs < S, other=float("-inf")))
        srt = tl.sort((key.to(tl.int64) << 32) | (SP - 1 - rs).to(tl.int64), 0, descending=True)
        idx = SP - 1 - (srt & 0xFFFFFFFF)
        n = tl.load(COUNT + b)
        tl.store(OUT + b * K + rs, tl.where(idx < n, idx, -1), mask=rs < K)


    @triton.jit
    def _row_keys(SC, b, S, rs, n):
        """Row b's scores at rs (< n) -> (their _score_key, the same as unsigned int64: its bytes the radix digits)."""
        key = _score_key(tl.load(SC + b * S + rs, mask=rs < n, other=0.0))
        return key, key.to(tl.int64) + 2147483648

    @triton.jit
    def _threshold_step(hist, rem, thr, j):
        """One radix pass's pick from the histogram of the digits of the entries still tied with the threshold:
        the K-th largest's digit; -> (rem: entries still to take among those tied after it, thr with it)."""
        ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # tied entries whose digit is >= j
        dig = tl.max(tl.where(ge >= rem, j, -1), 0)
        return rem - tl.sum(tl.where(j > dig, hist, 0), 0), thr * 256 + dig

    @triton.jit
    def _select_row(SC, OUT, b, n, S, top, K: tl.constexpr, SP: tl.constexpr):
        """_index_topk_select_kernel's picks with the whole row held in SP lanes (the radix state a lane each)
        -> how many it packed into OUT's row."""
        rs = tl.arange(0, SP)
        key, u = _row_keys(SC, b, S, rs, n)
        rem, thr = tl.minimum(n, K), (n * 0).to(tl.int64)
        tied, above = rs < n, rs < 0
        j = tl.arange(0, 256)
        for p in tl.static_range(4):
            d = ((u >> (24 - 8 * p)) & 255).to(tl.int32)
            hist = tl.histogram(d, 256, mask=tied)
            rem, thr = _threshold_step(hist, rem, thr, j)
            dig = (thr & 255).to(tl.int32)
            above = above | (tied & (d > dig))
            tied = tied & (d == dig)
        pick = above | (tied & (tl.cumsum(tied.to(tl.int32), 0) <= rem))
        at = tl.cumsum(pick.to(tl.int32), 0) - 1
        tl.store(OUT + b * K + at, (key.to(tl.int64) << 32) | (top - rs).to(tl.int64), mask=pick)
        return tl.sum(pick.to(tl.int32), 0)

    @triton.jit
    def _select_chunks(SC, OUT, b, n, S, top, K: tl.constexpr, CH: tl.constexpr, NCH: tl.constexpr):
        """_select_row's picks, each pass over the row's first n entries in chunks of CH (NCH cover S): the time
        follows the row's count, not the table's capacity; the keys are read again each pass."""
        rc = tl.arange(0, CH)
        rem, thr = tl.minimum(n, K), (n * 0).to(tl.int64)
        j = tl.arange(0, 256)
        for p in tl.static_range(4):
            hist = tl.zeros((256,), tl.int32)
            for c in range(NCH):
                if c * CH < n:
                    rs = c * CH + rc
                    u = _row_keys(SC, b, S, rs, n)[1]
                    tied = rs < n
                    if p > 0:
                        tied = tied & ((u >> (32 - 8 * p)) == thr)
                    hist += tl.histogram(((u >> (24 - 8 * p)) & 255).to(tl.int32), 256, mask=tied)
            rem, thr = _threshold_step(hist, rem, thr, j)
        ties = (n * 0).to(tl.int32)
        picked = (n * 0).to(tl.int32)
        for c in range(NCH):
            if c * CH < n:
                rs = c * CH + rc
                key, u = _row_keys(SC, b, S, rs, n)
                eq = (rs < n) & (u == thr)
                pick = ((rs < n) & (u > thr)) | (eq & (ties + tl.cumsum(eq.to(tl.int32), 0) <= rem))
                at = picked + tl.cumsum(pick.to(tl.int32), 0) - 1
                tl.store(OUT + b * K + at, (key.to(tl.int64) << 32) | (top - rs).to(tl.int64), mask=pick)
                ties += tl.sum(eq.to(tl.int32), 0)
                picked += tl.sum(pick.to(tl.int32), 0)
        return picked

    @triton.jit
    def _index_topk_select_kernel(SC, COUNT, OUT, S, K: tl.constexpr, SP: tl.constexpr, CH: tl.constexpr,
                                  NCH: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr = False):
        """One row, _index_topk_kernel's output without sorting the row: a radix select finds the K-th largest
        key (order-preserving bits of the score, one byte a pass: a 256-bin histogram of the entries still tied
        with it), the entries above it and the first of those equal to it (in entry order) are packed as
        _index_topk_kernel packs them into OUT's row in entry order, and only those K are sorted. A row whose
        count is past 3/4 of S (SP lanes up to TOPK_ROW_MAX) is held whole in registers (_select_row); a shorter
        one, or any past TOPK_ROW_MAX, is read a chunk at a time up to its count (_select_chunks)."""
        pdl_wait(PDL)
        b = tl.program_id(0)
        n = tl.minimum(tl.load(COUNT + b), S)
        top = S - 1  # entries pack reversed (S - 1 - entry) below the key, as _index_topk_kernel's
        if SP > 0:  # (a constexpr test of its own: no _select_row is compiled at SP 0)
            if n * 4 > S * 3:
                picked = _select_row(SC, OUT, b, n, S, top, K, SP)
            else:
                picked = _select_chunks(SC, OUT, b, n, S, top, K, CH, NCH)
        else:
            picked = _select_chunks(SC, OUT, b, n, S, top, K, CH, NCH)
        tl.debug_barrier()  # the row's packed picks, written by all of this program's threads
        rk = tl.arange(0, KP)
        w = tl.load(OUT + b * K + rk, mask=rk < picked, other=-9223372036854775808)
        srt = tl.sort(w, 0, descending=True)
        tl.store(OUT + b * K + rk, tl.where(rk < picked, top - (srt & 0xFFFFFFFF), -1), mask=rk < K)


# longer rows (max_model_len / csa_ratio past this) take torch.topk: at 16 rows and k = 512 on an H200, a full row
# of 32,768 entries took 129.7 us in the whole-row select kernel against 135.7 in torch, and 152.1 in chunks (a
# quarter full: 44.9 against 135.6); 65,536 full 314.0 in chunks against 177.3 (a quarter: 84.1 against 176.5)
INDEX_TOPK_MAX = 16384
# the select kernel's chunk (entries a step of _select_chunks) and the longest row (SP lanes) it holds whole in
# registers where the row's count is past 3/4 of S. On an H200, 16 rows, k 512, us a call at (S, count), against
# the kernel before (the whole row always): (4,096, 1,021) 18.6 / 18.9, (4,160, 4,157) 31.5 / 31.6, (4,160,
# 1,037) 16.4 / 31.3, (8,192, 8,189) 31.7 / 31.9, (8,192, 2,045) 16.9 / 31.4. Past 8,192 lanes chunks only:
# (8,320, 8,317) 51.4 / 58.8, (8,320, 2,077) 24.4 / 58.3, (16,384, 4,093) 25.3 / 58.6, but (16,384, 16,381)
# 79.2 / 59.4 (a kernel holding both paths at 16,384 lanes took 75.5 there, and 19.0 for (4,096, 1,021), where
# chunks alone took 15.0).
TOPK_CHUNK, TOPK_ROW_MAX = 2048, 8192


def index_topk(sc, k: int, count):
    """index_topk_ref in one kernel per row (torch.topk at these k took a radix sort and a gather kernel, plus
    the masking): up to 1,024 entries a bitonic sort of the row, past that a radix select of its k best and a sort
    of those (on an H200 at 16 rows and k = 512: 1,024 entries 11.2 against 11.5 us, 4,096 70.8 against 19.0,
    8,192 172.9 against 31.6; bench/RESULTS.md), reading only the row's count of entries where it is short
    (TOPK_ROW_MAX)."""
    B, S = sc.shape
    if not use_triton(sc) or S > INDEX_TOPK_MAX:
        return index_topk_ref(sc, k, count)
    out = torch.empty(B, k, dtype=torch.int64, device=sc.device)
    if B:
        sp = max(16, pow2(S))
        if sp <= 1024:
            _index_topk_kernel[(B,)](sc.contiguous(), count, out, S, K=k, SP=sp, num_warps=4, **pdl(sc))
        else:
            ch = min(TOPK_CHUNK, sp)
            _index_topk_select_kernel[(B,)](sc.contiguous(), count, out, S, K=k, SP=sp if sp <= TOPK_ROW_MAX else 0,
                                            CH=ch, NCH=triton.cdiv(S, ch), KP=max(16, pow2(k)),
                                            num_warps=16 if TOPK_ROW_MAX >= sp > 4096 else 8, **pdl(sc))
    return out


def prefill_index_ref(qi, wi, rows, keys, count, k: int, w_scale: float = 1.0):
    """The indexer's picks for prefill's query rows: qi (N, h, d), wi (N, h) packed rows (the head weights, times
    w_scale in fp32); rows (B, T) the packed row of query t of sequence b; keys (B, S, d) each sequence's entries;
    count (T,) the entries query t may see. -> (B, T, k) int64: the k best scores (model.Indexer.scores' function,
    ties to the lower entry: topk_first), -1 at and past count."""
    q, w = qi[rows].float(), wi[rows].float() * w_scale
    s = torch.einsum("bthd,bsd->bths", q, keys.float()).relu_() * qi.shape[-1] ** -0.5
    sc = torch.einsum("bths,bth->bts", s, w)
    allowed = torch.arange(keys.shape[1], device=qi.device) < count[:, None]
    top = topk_first(sc.masked_fill(~allowed, float("-inf")), k)
    return torch.where(top < count[:, None], top, -1)


if triton is not None:
    @triton.jit
    def _prefill_index_kernel(QI, WI, ROWS, KEYS, COUNT, OUT, T, S, scale, stride_w, w_scale, NH: tl.constexpr,
                              D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr):
        """Program (t block, s block, b): the scores of BT query rows of sequence b against BS of its entries, summed
        over the heads in-register (no (rows, heads, entries) tensor), stored in fp32 (-inf at and past each row's
        count) for index_topk, a row a query row."""
        tb, sb, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rt = tb * BT + tl.arange(0, BT)
        rs = sb * BS + tl.arange(0, BS)
        mt = rt < T
        ms = rs < S
        n = tl.load(COUNT + rt, mask=mt, other=0)
        acc = tl.zeros((BT, BS), tl.float32)
        if sb * BS < tl.max(n, 0):  # (causal: a block past every row's count is all -inf)
            rd = tl.arange(0, D)
            row = tl.load(ROWS + b * T + rt, mask=mt, other=0).to(tl.int64)
            k = tl.load(KEYS + (b * S + rs.to(tl.int64))[:, None] * D + rd[None, :], mask=ms[:, None], other=0.0)
            k = tl.trans(k.to(tl.float32))
            for h in range(NH):
                q = tl.load(QI + (row * NH + h)[:, None] * D + rd[None, :], mask=mt[:, None], other=0.0)
                w = tl.load(WI + row * stride_w + h, mask=mt, other=0.0).to(tl.float32) * w_scale
                s = tl.maximum(tl.dot(q.to(tl.float32), k, input_precision=PREC), 0.0) * scale
                acc += s * w[:, None]
        sc = tl.where(rs[None, :] < n[:, None], acc, float("-inf"))
        out = (b * T + rt).to(tl.int64)[:, None] * S + rs[None, :]
        tl.store(OUT + out, sc, mask=mt[:, None] & ms[None, :])


def prefill_index(qi, wi, rows, keys, count, k: int, w_scale: float = 1.0):
    """prefill_index_ref on GPUs: the scores in one kernel (_prefill_index_kernel), then the decode's top-k kernel
    over them, a row a query row (index_topk: it reads each row up to its causal count; torch's topk over
    topk_first's int64 keys of every entry took 0.77-1.07 ms a call at 8,192 rows x 2,048 entries / 4,096 x 4,096 on
    an H200). qi and wi in any float dtype (read as fp32, the head products in fp8_gemm.F32_DOT's passes as
    index_scores'); wi's rows may be strided."""
    nh, d = qi.shape[1:]
    if not use_triton(qi) or d < 16 or d & (d - 1):
        return prefill_index_ref(qi, wi, rows, keys, count, k, w_scale)
    (B, T), S = rows.shape, keys.shape[1]
    sc = torch.empty(B, T, S, dtype=torch.float32, device=qi.device)
    if wi.stride(-1) != 1:
        wi = wi.contiguous()
    if sc.numel():
        bt, bs, warps = PREFILL_INDEX_TILES
        _prefill_index_kernel[(triton.cdiv(T, bt), triton.cdiv(S, bs), B)](
            qi.contiguous(), wi, rows.contiguous(), keys.contiguous(), count.contiguous(), sc, T, S, d ** -0.5,
            wi.stride(0), w_scale, NH=nh, D=d, BT=bt, BS=bs, PREC=fp8_gemm.F32_DOT, num_warps=warps)
    # k is min(top-k, S): a prompt's first chunks have fewer entries than the top-k, and index_topk's kernels take k
    # as a constant, so a power of two of at least k is asked for (a compile per power, not per entry count)
    kp = pow2(k)
    top = index_topk(sc.view(B * T, S), kp, count.repeat(B))
    return (top if kp == k else top[:, :k]).reshape(B, T, k)


# _prefill_index_kernel's (query rows, entries) a program, and its warps. On an H200 (32 heads of 128, top 512),
# prefill_index's ms a call (of which torch's topk ~1.07 / 0.77) at 8,192 rows x 2,048 entries / 4,096 x 4,096 (rows
# from position 12,288): (64, 32, 4) 2.32 / 2.79, (64, 64, 4) 2.51 / 2.99, (128, 64, 8) 2.36 / 2.78, (64, 128, 8)
# 2.58 / 3.00, (32, 64, 4) 2.61 / 3.24, (128, 32, 4) 5.27 / 7.53; prefill_index_ref 7.95 / 7.53. Since the picks
# come from index_topk instead of torch's topk: (64, 32, 4) 1.71-1.72 / 2.48-2.49 (torch's 2.23 / 2.64-2.65 then)
PREFILL_INDEX_TILES = (64, 32, 4)


# ---------------------------------------------------------------------------------------------------------
# training: the softmax of the full-sequence (blocked) attention, forward and backward


if triton is not None:
    @triton.jit
    def _comp_tile(LC, CALLOWED, r, b, tok, mr, s0, S, cb_stride, scale, BS: tl.constexpr):
        """Columns [s0, s0 + BS) of the compressed-entry logits of rows r, scaled, -inf where not allowed."""
        rs = s0 + tl.arange(0, BS)
        ms = mr[:, None] & (rs[None, :] < S)
        okc = tl.load(CALLOWED + b[:, None] * cb_stride + tok[:, None] * S + rs[None, :], mask=ms, other=0) != 0
        lc = tl.load(LC + r[:, None] * S + rs[None, :], mask=ms, other=0.0).to(tl.float32) * scale
        return rs, ms, tl.where(okc, lc, float("-inf"))

    @triton.jit
    def _pair_tile(P, G, r, mr, s0, S, BS: tl.constexpr):
        """Columns [s0, s0 + BS) of rows r of two (R, S) tensors (probabilities and their gradient), fp32."""
        rs = s0 + tl.arange(0, BS)
        ms = mr[:, None] & (rs[None, :] < S)
        off = r[:, None] * S + rs[None, :]
        p = tl.load(P + off, mask=ms, other=0.0).to(tl.float32)
        return rs, ms, p, tl.load(G + off, mask=ms, other=0.0).to(tl.float32)

    @triton.jit
    def _block_softmax_fwd(LW, LC, ALLOWED, CALLOWED, SINK, PW, PC, LSE, R, S, SCAP: tl.constexpr,
                           DYNAMIC: tl.constexpr, cb_stride, scale, H: tl.constexpr, C: tl.constexpr,
                           K: tl.constexpr, KP: tl.constexpr, BR: tl.constexpr, BS: tl.constexpr):
        """BR rows (b, token, head) of softmax([window logits, compressed-entry logits, sink]) * scale -> the
        probabilities of the first two parts (the sink's is dropped) and each row's log-sum-exp."""
        r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        mr = r < R
        tok = (r // H) % C
        b = r // (H * C)
        sink = tl.load(SINK + r % H, mask=mr, other=0.0)
        rk = tl.arange(0, KP)
        mk = mr[:, None] & (rk[None, :] < K)
        ok = tl.load(ALLOWED + tok[:, None] * K + rk[None, :], mask=mk, other=0) != 0
        lw = tl.load(LW + r[:, None] * K + rk[None, :], mask=mk, other=0.0).to(tl.float32) * scale
        lw = tl.where(ok, lw, float("-inf"))
        m = tl.maximum(tl.max(lw, 1), sink)
        lsum = tl.exp(sink - m) + tl.sum(tl.exp(lw - m[:, None]), 1)
        for s0 in range(0, S if DYNAMIC else SCAP, BS):  # the compressed entries, online
            rs, ms, lc = _comp_tile(LC, CALLOWED, r, b, tok, mr, s0, S, cb_stride, scale, BS)
            m2 = tl.maximum(m, tl.max(lc, 1))
            lsum = lsum * tl.exp(m - m2) + tl.sum(tl.exp(lc - m2[:, None]), 1)
            m = m2
        lse = m + tl.log(lsum)
        tl.store(LSE + r, lse, mask=mr)
        tl.store(PW + r[:, None] * K + rk[None, :], tl.exp(lw - lse[:, None]).to(PW.dtype.element_ty), mask=mk)
        for s0 in range(0, S if DYNAMIC else SCAP, BS):
            rs, ms, lc = _comp_tile(LC, CALLOWED, r, b, tok, mr, s0, S, cb_stride, scale, BS)
            tl.store(PC + r[:, None] * S + rs[None, :], tl.exp(lc - lse[:, None]).to(PC.dtype.element_ty), mask=ms)

    @triton.jit
    def _block_softmax_bwd(PW, PC, GPW, GPC, LSE, SINK, GLW, GLC, GSINK, R, S, SCAP: tl.constexpr,
                           DYNAMIC: tl.constexpr, scale, H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                           BR: tl.constexpr, BS: tl.constexpr):
        """gl = p * (gp - sum(p * gp)) * scale per row; the sink's logit gets -p_sink * sum(p * gp) (GSINK per row)."""
        r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        mr = r < R
        rk = tl.arange(0, KP)
        mk = mr[:, None] & (rk[None, :] < K)
        pw = tl.load(PW + r[:, None] * K + rk[None, :], mask=mk, other=0.0).to(tl.float32)
        gw = tl.load(GPW + r[:, None] * K + rk[None, :], mask=mk, other=0.0).to(tl.float32)
        dot = tl.sum(pw * gw, 1)
        for s0 in range(0, S if DYNAMIC else SCAP, BS):
            rs, ms, pc, gc = _pair_tile(PC, GPC, r, mr, s0, S, BS)
            dot += tl.sum(pc * gc, 1)
        tl.store(GLW + r[:, None] * K + rk[None, :], (pw * (gw - dot[:, None]) * scale).to(GLW.dtype.element_ty),
                 mask=mk)
        for s0 in range(0, S if DYNAMIC else SCAP, BS):
            rs, ms, pc, gc = _pair_tile(PC, GPC, r, mr, s0, S, BS)
            tl.store(GLC + r[:, None] * S + rs[None, :], (pc * (gc - dot[:, None]) * scale).to(GLC.dtype.element_ty),
                     mask=ms)
        sink = tl.load(SINK + r % H, mask=mr, other=0.0)
        lse = tl.load(LSE + r, mask=mr, other=0.0)
        tl.store(GSINK + r, -tl.exp(sink - lse) * dot, mask=mr)


_BR = 16


class _BlockSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lw, lc, allowed, comp_allowed, sink, scale, H):
        K = lw.shape[-1]
        C = allowed.shape[0] * allowed.shape[1]
        R = lw.numel() // K
        S = 0 if lc is None else lc.shape[-1]
        lw = lw.contiguous()
        lc = lw.new_empty(R, 0) if lc is None else lc.contiguous()
        pw, pc = torch.empty_like(lw), torch.empty_like(lc)
        lse = torch.empty(R, dtype=torch.float32, device=lw.device)
        ca = comp_allowed if comp_allowed is not None else allowed  # unread when S == 0
        cb_stride = C * S if (comp_allowed is not None and comp_allowed.shape[0] > 1) else 0
        if R:
            _block_softmax_fwd[(triton.cdiv(R, _BR),)](lw, lc, allowed.contiguous().view(torch.uint8),
                                                       ca.contiguous().view(torch.uint8),
                                                       sink.float().contiguous(), pw, pc, lse, R, S,
                                                       S if not lw.is_cuda else 0, lw.is_cuda, cb_stride, scale,
                                                       H=H, C=C, K=K, KP=triton.next_power_of_2(K), BR=_BR, BS=64,
                                                       num_warps=4)
        ctx.save_for_backward(pw, pc, lse, sink)
        ctx.scale, ctx.H, ctx.has_c = scale, H, S > 0
        return pw, (pc if S else None)

    @staticmethod
    def backward(ctx, gpw, gpc):
        pw, pc, lse, sink = ctx.saved_tensors
        K, S, R = pw.shape[-1], pc.shape[-1], lse.shape[0]
        gpw = torch.zeros_like(pw) if gpw is None else gpw.contiguous()
        gpc = torch.zeros_like(pc) if gpc is None else gpc.contiguous()
        glw, glc = torch.empty_like(pw), torch.empty_like(pc)
        gsink = torch.empty(R, dtype=torch.float32, device=pw.device)
        if R:
            _block_softmax_bwd[(triton.cdiv(R, _BR),)](pw, pc, gpw, gpc, lse, sink.float().contiguous(), glw, glc,
                                                       gsink, R, S, S if not pw.is_cuda else 0, pw.is_cuda, ctx.scale,
                                                       H=ctx.H, K=K, KP=triton.next_power_of_2(K), BR=_BR, BS=64,
                                                       num_warps=4)
        gs = gsink.view(-1, ctx.H).sum(0).to(sink.dtype)
        return glw, (glc if ctx.has_c else None), None, None, gs, None, None


def block_softmax(lw, lc, allowed, comp_allowed, sink, scale: float, H: int):
    """The softmax of model._attend_blocks, fused (Triton, forward and backward).

    lw (B, nb, bq * H, K) window logits and lc (B, nb * bq * H, S) compressed-entry logits or None, both raw
    (unscaled) GEMM outputs whose rows are (batch, token, head); allowed (nb, bq, K) bool; comp_allowed
    (B or 1, nb * bq, S) bool; sink (H,) -> probabilities pw like lw, pc like lc (or None), in lw's dtype."""
    return _BlockSoftmax.apply(lw, lc, allowed, comp_allowed, sink, scale, H)
