"""The sampler's one pass over the vocabulary: temperature, counter-based Gumbel noise, argmax, log-prob.

    tok, lp = gumbel_sample(logits, temps, seeds, steps, thr=None)
        logits (B, V) fp32 / bf16 / fp16 (read in its dtype, computed in fp32); temps (B,) fp32 (0 = greedy);
        seeds, steps (B,) int64; thr (B,) fp32 or None: each row's top-k / top-p threshold on logits / t
        (rollout_server.filter_threshold; -inf: none)
        -> tok (B,) int64 = argmax_v(logits / t + g(seed, step, v)) over the v with logits / t >= thr (greedy:
           argmax logits, unfiltered), lp (B,) fp32 = log_softmax(logits / t)[tok] (the unfiltered distribution)

g is rollout_server.gumbel_noise, recomputed in registers (the same int64 hash, IEEE division and libdevice log,
so the tokens are bit-identical to the torch twin, rollout_server.sample, which materializes (B, V) noise through
~25 elementwise kernels). Two launches: SPLIT programs per row reduce slices of the vocabulary, one more
combines them (the earliest index wins ties, as torch.argmax).
"""
from __future__ import annotations

import torch

from .fp8_gemm import pdl, pdl_wait, pow2, sm_count, triton, use_triton

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def _u32(c: tl.constexpr):
        return tl.full((), c, tl.uint32)

    @triton.jit
    def _mix32(x):
        """rollout_server._mix32 on uint32 x: the same bits, since the torch twin keeps only the low 32 bits of
        each int64 product and sum (64-bit multiplies were the vocabulary loop's largest cost)."""
        x = ((x >> 16) ^ x) * _u32(0x45D9F3B)
        x = ((x >> 16) ^ x) * _u32(0x45D9F3B)
        return (x >> 16) ^ x

    @triton.jit
    def _sample_part_kernel(LOGITS, TEMP, SEEDS, STEPS, PART, V, stride, SPLIT: tl.constexpr, CHUNK: tl.constexpr,
                            BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr = False, THR=None):
        pdl_wait(PDL)
        b, sp = tl.program_id(0), tl.program_id(1)
        t = tl.load(TEMP + b).to(tl.float32)  # (fp64 temperatures rounded here as torch's .float() rounds them)
        greedy = t == 0
        t = tl.where(greedy, 1.0, t)
        if THR is not None:
            thr = tl.load(THR + b)
        seed = tl.load(SEEDS + b)
        # of the int64 seed and step only the low 32 bits of each word reach the hash (the twin masks them)
        step = (tl.load(STEPS + b) & 0xFFFFFFFF).to(tl.uint32)
        h0 = _mix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ _mix32(step * _u32(0x27D4EB2D) + _u32(0x165667B1)))
        hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        best = tl.full((), float("-inf"), tl.float32)
        best_i = tl.full((), 0, tl.int64)
        best_s = tl.full((), float("-inf"), tl.float32)
        m = tl.full((), float("-inf"), tl.float32)
        l = tl.full((), 0.0, tl.float32)
        for i in range(0, CHUNK, BLOCK):
            c0 = sp * CHUNK + i
            v = c0 + tl.arange(0, BLOCK)
            mv = v < V
            s = tl.div_rn(tl.load(LOGITS + b * stride + v, mask=mv, other=float("-inf")).to(tl.float32), t)
            h = _mix32(h0 ^ _mix32(v.to(tl.uint32) * _u32(0x9E3779B1) + hi))
            u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23
            if LIBDEVICE:  # the log torch's CUDA/HIP kernels use (the interpreter has none: numpy's)
                g = -libdevice.log(-libdevice.log(u))
            else:
                g = -tl.log(-tl.log(u))
            noisy = s + g
            if THR is not None:  # top-k / top-p: the tokens below the row's threshold are never drawn
                noisy = tl.where(s >= thr, noisy, float("-inf"))
            val = tl.where(mv, tl.where(greedy, s, noisy), float("-inf"))
            cmax, ci = tl.max(val, 0, return_indices=True, return_indices_tie_break_left=True)
            take = cmax > best
            best_s = tl.where(take, tl.sum(tl.where(v - c0 == ci, s, 0.0), 0), best_s)
            best_i = tl.where(take, (c0 + ci).to(tl.int64), best_i)
            best = tl.where(take, cmax, best)
            cm = tl.maximum(m, tl.max(s, 0))
            cm0 = tl.where(cm == float("-inf"), 0.0, cm)  # a slice past the vocabulary's end
            l = l * tl.exp(m - cm0) + tl.sum(tl.where(mv, tl.exp(s - cm0), 0.0), 0)
            m = cm
        base = PART + (b * SPLIT + sp) * 5
        tl.store(base, best)
        tl.store(base + 1, best_i.to(tl.float32))  # exact: V < 2^24
        tl.store(base + 2, best_s)
        tl.store(base + 3, m)
        tl.store(base + 4, l)

    @triton.jit
    def _sample_combine_kernel(PART, TOK, LP, SPLIT: tl.constexpr, SP2: tl.constexpr, PDL: tl.constexpr = False,
                               ALSO=None):
        pdl_wait(PDL)
        b = tl.program_id(0)
        r = tl.arange(0, SP2)
        mr = r < SPLIT
        base = PART + (b * SPLIT + r) * 5
        best = tl.load(base, mask=mr, other=float("-inf"))
        bi = tl.load(base + 1, mask=mr, other=0.0)
        bs = tl.load(base + 2, mask=mr, other=0.0)
        m = tl.load(base + 3, mask=mr, other=float("-inf"))
        l = tl.load(base + 4, mask=mr, other=0.0)
        top, k = tl.max(best, 0, return_indices=True, return_indices_tie_break_left=True)  # slices in vocab order
        mm = tl.max(m, 0)
        lse = mm + tl.log(tl.sum(tl.where(mr, l * tl.exp(m - mm), 0.0), 0))
        tok = tl.sum(tl.where(r == k, bi, 0.0), 0).to(tl.int64)
        tl.store(TOK + b, tok)
        if ALSO is not None:
            tl.store(ALSO + b, tok)
        tl.store(LP + b, tl.sum(tl.where(r == k, bs, 0.0), 0) - lse)


def _slices(B: int, V: int, block: int, device) -> int:
    """Programs a row (vocabulary slices of whole blocks): up to 4 blocks a slice, fewer where B rows would not
    give ~4 programs an SM. On an H200 at mini's vocabulary (129,280, bf16 logits), us a call against 4-block
    slices: 1 row 5.2 against 11.0 (64 slices), 4 rows 6.6 against 11.0, 16 rows 13.7 against 14.7 (32 slices);
    64 rows and more take 4 blocks (42.5 us at 64, compute-bound on the noise)."""
    nblk = -(-V // block)
    per = max(1, min(4, -(-nblk * B // (4 * sm_count(device)))))
    return -(-nblk // per)


def gumbel_sample(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                  block: int = 2048, split: int | None = None, also: torch.Tensor | None = None,
                  thr: torch.Tensor | None = None):
    """temps fp32 or fp64 (rounded to fp32 in the kernel, as .float() would: no conversion launch). also: an int64
    tensor of at least B elements whose first B the tokens are written into as well (the engine's next-step feed:
    a copy launch fewer). thr: (B,) fp32 thresholds (see the module docstring)."""
    B, V = logits.shape
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16) and V < 2 ** 24
    split = split or _slices(B, V, block, logits.device)
    chunk = -(-V // (split * block)) * block
    part = torch.empty(B, split, 5, dtype=torch.float32, device=logits.device)
    tok = torch.empty(B, dtype=torch.int64, device=logits.device)
    lp = torch.empty(B, dtype=torch.float32, device=logits.device)
    if B:
        logits = logits.contiguous()
        temps = (temps if temps.dtype == torch.float64 else temps.float()).contiguous()
        assert thr is None or (thr.dtype == torch.float32 and thr.shape == (B,)), \
            f"gumbel_sample: thr= {thr.dtype} {tuple(thr.shape)} for {B} rows"
        _sample_part_kernel[(B, split)](logits, temps, seeds, steps, part, V, logits.stride(0), SPLIT=split,
                                        CHUNK=chunk, BLOCK=block, LIBDEVICE=logits.is_cuda,
                                        num_warps=8, THR=None if thr is None else thr.contiguous(), **pdl(logits))
        assert also is None or (also.dtype == torch.int64 and also.is_contiguous() and also.numel() >= B), \
            f"gumbel_sample: also= {also.dtype} of {also.numel()} for {B} rows"
        _sample_combine_kernel[(B,)](part, tok, lp, SPLIT=split, SP2=pow2(split), ALSO=also, **pdl(part))
    return tok, lp


# ---------------------------------------------------------------------------------------------------------
# top-k / top-p: each row's threshold by a radix search over its logits' values, no sort

if triton is not None:
    @triton.jit
    def _key_value(key, KEYBITS: tl.constexpr, DT: tl.constexpr):
        """Keys (ordered as the values: the sign bit flipped for positives, every bit for negatives) -> the fp32
        values of DT (the logits' dtype) they stand for."""
        if KEYBITS == 16:
            key = key.to(tl.int32)
        top = key >> (KEYBITS - 1)
        bits = tl.where(top != 0, key ^ (top << (KEYBITS - 1)), ~key & ((1 << KEYBITS) - 1))
        if KEYBITS == 32:
            return bits.to(tl.int32).to(tl.float32, bitcast=True)
        elif DT == tl.bfloat16:  # a bf16 is the top half of the fp32 of the same value
            return (bits << 16).to(tl.float32, bitcast=True)
        else:
            return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _thr_row(TEMP, TOPK, TOPP, b):
        """Row b's filters and temperature: (off: neither, top_k as a count to reach (never: off), top_p as a mass
        to reach (never: off), t (greedy: 1))."""
        k = tl.load(TOPK + b)
        top_p = tl.load(TOPP + b)
        t = tl.load(TEMP + b).to(tl.float32)
        never = 2 ** 31 - 1
        return ((k <= 0) & (top_p >= 1.0), tl.where(k > 0, tl.minimum(k, never), never).to(tl.int32),
                tl.where(top_p >= 1.0, float("inf"), top_p),  # (1: off, though fp32 sums may reach it)
                tl.where(t == 0, 1.0, t))  # (greedy rows draw unfiltered: their threshold is unused)

    @triton.jit
    def _thr_stats_kernel(LOGITS, TEMP, TOPK, TOPP, ST, V, stride, S: tl.constexpr, CHUNK: tl.constexpr,
                          BLOCK: tl.constexpr):
        """Program (row b, slice sp): the slice's max of logits / t, its sum of exp(. - max) and its smallest
        logit, into ST[b, sp] (a row with top-k alone: its smallest logit only, the max -inf and the sum 0). Each of
        the BLOCK element slots keeps its own through the loop (no reduction, so no barrier, an iteration), reduced
        once at the end."""
        b, sp = tl.program_id(0), tl.program_id(1)
        off, k, p_lim, t = _thr_row(TEMP, TOPK, TOPP, b)
        if off:
            return
        inv = 1.0 / t
        row = LOGITS + b.to(tl.int64) * stride
        r = tl.arange(0, BLOCK)
        # each element slot keeps its own running max / sum / min; one reduction a program, after the loop
        lo_v = tl.full((BLOCK,), float("inf"), tl.float32)
        m_all = tl.full((), float("-inf"), tl.float32)  # (a row with top-k alone sums no mass: no logsumexp)
        l_all = tl.full((), 0.0, tl.float32)
        if p_lim < float("inf"):
            m = tl.full((BLOCK,), float("-inf"), tl.float32)
            l = tl.zeros((BLOCK,), tl.float32)
            for i in range(0, CHUNK, BLOCK):
                v = sp * CHUNK + i + r
                mv = v < V
                x = tl.load(row + v, mask=mv, other=float("-inf")).to(tl.float32)
                lo_v = tl.minimum(lo_v, tl.where(mv, x, float("inf")))
                s = x * inv
                cm = tl.maximum(m, s)
                cm0 = tl.where(cm == float("-inf"), 0.0, cm)
                l = l * tl.exp(m - cm0) + tl.exp(s - cm0)
                m = cm
            m_all = tl.max(m, 0)
            l_all = tl.sum(l * tl.exp(m - tl.where(m_all == float("-inf"), 0.0, m_all)), 0)
        else:
            for i in range(0, CHUNK, BLOCK):
                v = sp * CHUNK + i + r
                lo_v = tl.minimum(lo_v, tl.load(row + v, mask=v < V, other=float("inf")).to(tl.float32))
        lo_v = tl.min(lo_v, 0)
        base = ST + (b * S + sp) * 3
        tl.store(base, m_all)
        tl.store(base + 1, l_all)
        tl.store(base + 2, lo_v)

    @triton.jit
    def _thr_lse(ST, b, S: tl.constexpr):
        """Row b's logsumexp of logits / t and smallest logit, from its S slices' stats (in slice order). The sum
        is at least 1 (the max's own term), so the clamp changes nothing but a row with top-k alone (no slice
        summed: 0, unread)."""
        sl = tl.arange(0, S)
        base = ST + (b * S + sl) * 3
        m = tl.load(base)
        mm = tl.max(m, 0)
        mm0 = tl.where(mm == float("-inf"), 0.0, mm)
        return mm0 + tl.log(tl.maximum(tl.sum(tl.load(base + 1) * tl.exp(m - mm0), 0), 1.0)), \
            tl.min(tl.load(base + 2), 0)

    @triton.jit
    def _thr_lo(PC, PM, LO, b, q, k, p_lim, S: tl.constexpr, R: tl.constexpr, RBITS: tl.constexpr,
                KEYBITS: tl.constexpr):
        """Row b's key prefix after pass q (>= 0): pass q's candidates were LO[b, q] + j << shift; the largest j
        whose tokens at or above it number at least k or hold at least p_lim of the mass (the S slices' counts
        PC and masses PM summed in slice order; candidate 0, the prefix itself, holds or the prefix is below
        every token)."""
        sl = tl.arange(0, S)
        j = tl.arange(0, R)
        off = (b * S + sl)[:, None] * R + j[None, :]
        cnt = tl.sum(tl.load(PC + off), 0)
        mass = tl.sum(tl.load(PM + off), 0)
        ok = (cnt >= k) | (mass >= p_lim)
        lo = tl.load(LO + b * (KEYBITS // RBITS) + q)
        return lo + (tl.max(tl.where(ok, j, 0), 0).to(tl.int64) << (KEYBITS - RBITS * (q + 1)))

    @triton.jit
    def _thr_pass_kernel(LOGITS, TEMP, TOPK, TOPP, ST, PC, PM, LO, V, stride, q: tl.constexpr,
                         S: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, RBITS: tl.constexpr,
                         KEYBITS: tl.constexpr):
        """Pass q, program (row b, slice sp): the row's key prefix so far (from pass q - 1's counts and masses,
        in PC / PM[(q - 1) % 2]; slice 0 stores it in LO[b, q]), then the slice's count and probability mass of
        tokens at or above each of the 2^RBITS candidates prefix + j << shift, into PC / PM[q % 2][b, sp]."""
        b, sp = tl.program_id(0), tl.program_id(1)
        off, k, p_lim, t = _thr_row(TEMP, TOPK, TOPP, b)
        if off:
            return
        R: tl.constexpr = 1 << RBITS
        NB = tl.num_programs(0) * S * R  # one parity's partials
        if q == 0:
            lo = tl.full((), 0, tl.int64)
        else:
            lo = _thr_lo(PC + ((q - 1) % 2) * NB, PM + ((q - 1) % 2) * NB, LO, b, q - 1, k, p_lim, S, R, RBITS,
                         KEYBITS)
        if sp == 0:
            tl.store(LO + b * (KEYBITS // RBITS) + q, lo)
        inv = 1.0 / t
        j = tl.arange(0, R)
        cand = _key_value(lo + (j.to(tl.int64) << (KEYBITS - RBITS * (q + 1))), KEYBITS, LOGITS.dtype.element_ty)
        row = LOGITS + b.to(tl.int64) * stride
        r = tl.arange(0, BLOCK)
        # counts and masses a (candidate, element slot): no reduction (so no barrier) an iteration, one at the end
        cnt = tl.zeros((R, BLOCK), tl.int32)
        mass = tl.zeros((R, BLOCK), tl.float32)
        if p_lim < float("inf"):
            lse, _ = _thr_lse(ST, b, S)  # (the masses' normalizer: top-k alone needs none)
            for i in range(0, CHUNK, BLOCK):
                v = sp * CHUNK + i + r
                mv = v < V
                x = tl.load(row + v, mask=mv, other=float("-inf")).to(tl.float32)
                p = tl.exp(x * inv - lse)
                ge = (x[None, :] >= cand[:, None]) & mv[None, :]  # (a NaN candidate's: none)
                cnt += ge.to(tl.int32)
                mass += tl.where(ge, p[None, :], 0.0)
        else:  # top-k alone: counts only (no mass reaches an infinite top_p)
            for i in range(0, CHUNK, BLOCK):
                v = sp * CHUNK + i + r
                mv = v < V
                x = tl.load(row + v, mask=mv, other=float("-inf")).to(tl.float32)
                cnt += ((x[None, :] >= cand[:, None]) & mv[None, :]).to(tl.int32)
        cnt = tl.sum(cnt, 1)
        mass = tl.sum(mass, 1)
        out = (q % 2) * NB + (b * S + sp) * R + j
        tl.store(PC + out, cnt)
        tl.store(PM + out, mass)

    @triton.jit
    def _thr_final_kernel(LOGITS, TEMP, TOPK, TOPP, ST, PC, PM, LO, THR, S: tl.constexpr, RBITS: tl.constexpr,
                          KEYBITS: tl.constexpr):
        """Row b's threshold: the value of its key after the last pass (at least its smallest logit: no
        candidate held where fp32 sums fall short of top_p or top_k passes V), divided by t as the sampler
        divides the logits (a kept token's own value); -inf for a row without top-k / top-p."""
        b = tl.program_id(0)
        off, k, p_lim, t = _thr_row(TEMP, TOPK, TOPP, b)
        if off:
            tl.store(THR + b, float("-inf"))
            return
        P: tl.constexpr = KEYBITS // RBITS
        R: tl.constexpr = 1 << RBITS
        NB = tl.num_programs(0) * S * R
        lo = _thr_lo(PC + ((P - 1) % 2) * NB, PM + ((P - 1) % 2) * NB, LO, b, P - 1, k, p_lim, S, R, RBITS,
                     KEYBITS)
        _, lo_v = _thr_lse(ST, b, S)
        c = _key_value(lo, KEYBITS, LOGITS.dtype.element_ty)
        tl.store(THR + b, tl.div_rn(tl.where(c >= lo_v, c, lo_v), t))


def threshold(logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              block: int = 2048, rbits: int = 2, split: int | None = None) -> torch.Tensor:
    """rollout_server.filter_threshold on GPUs, without sorting: logits (B, V) fp32 / bf16 / fp16, temps (B,) (0:
    greedy, taken as 1), top_k (B,) int (0: off), top_p (B,) (1: off) -> (B,) fp32 thresholds on logits / temps
    (-inf: a row without either), the largest logit c whose tokens at or above it number at least top_k or hold
    at least top_p of the probability mass (c is then the last token the sorted rule keeps). Found rbits bits of
    c's key (its bits ordered as the values) a pass: each pass counts the tokens and sums the mass at or above
    each of the 2^rbits candidates for the next bits, the row split over `split` programs (default: by the batch,
    as gumbel_sample's slices) whose sums the next pass adds in slice order. Launches: the row's logsumexp, 16 /
    rbits passes (bf16, fp16; 32 / rbits for fp32), the threshold. The same rule as the torch twin; its sums
    are the kernels' own (a keep decision at top_p's exact edge may differ)."""
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.float32, device=logits.device)
    if not B:
        return out
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16) and logits.stride(1) == 1
    keybits = 32 if logits.dtype == torch.float32 else 16
    assert keybits % rbits == 0, f"threshold: rbits {rbits} does not divide the {keybits}-bit keys"
    P, R = keybits // rbits, 1 << rbits
    S = pow2(split or _slices(B, V, block, logits.device))  # (a power of two: the sums' vector)
    chunk = -(-V // (S * block)) * block
    dev = logits.device
    temps, top_k, top_p = temps.contiguous(), top_k.contiguous(), top_p.float().contiguous()
    st = torch.empty(B, S, 3, dtype=torch.float32, device=dev)
    pc = torch.empty(2, B, S, R, dtype=torch.int32, device=dev)
    pm = torch.empty(2, B, S, R, dtype=torch.float32, device=dev)
    lo = torch.empty(B, P, dtype=torch.int64, device=dev)  # each row's key prefix before each pass
    args = (logits, temps, top_k, top_p)
    _thr_stats_kernel[(B, S)](*args, st, V, logits.stride(0), S=S, CHUNK=chunk, BLOCK=block, num_warps=8)
    for q in range(P):
        _thr_pass_kernel[(B, S)](*args, st, pc, pm, lo, V, logits.stride(0), q=q, S=S, CHUNK=chunk, BLOCK=block,
                                 RBITS=rbits, KEYBITS=keybits, num_warps=8)
    _thr_final_kernel[(B,)](*args, st, pc, pm, lo, out, S=S, RBITS=rbits, KEYBITS=keybits, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------------------
# a graphed decode step's outputs straight into pinned host memory

if triton is not None:
    @triton.jit
    def _to_host_part(S, H, N, p, r):
        tl.store(H + p * N + r, tl.load(S + r, mask=r < N), mask=r < N)

    @triton.jit
    def _to_host_kernel(CTR, S0, H0, N0, S1, H1, N1, S2, H2, N2, S3, H3, N3, BLOCK: tl.constexpr,
                        PDL: tl.constexpr = False):
        """Program b: bytes [b * BLOCK, (b + 1) * BLOCK) of each device byte array Si (Ni bytes) into row CTR[0] % 2
        of its pinned host bytes Hi (2, Ni). The last program to finish (a ticket in CTR[1]) counts the call in
        CTR[0] and puts the ticket back: every program read the row before."""
        pdl_wait(PDL)
        p = (tl.load(CTR) & 1).to(tl.int64)
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        _to_host_part(S0, H0, N0, p, r)
        _to_host_part(S1, H1, N1, p, r)
        _to_host_part(S2, H2, N2, p, r)
        _to_host_part(S3, H3, N3, p, r)
        tl.debug_barrier()  # every thread has read CTR[0] before the ticket is taken
        if tl.atomic_add(CTR + 1, 1) == tl.num_programs(0) - 1:  # acq_rel
            tl.store(CTR + 1, 0)
            tl.atomic_add(CTR, 1)


TO_HOST_BLOCK = 4096  # bytes a program copies from each array


def to_host(ctr: torch.Tensor, srcs: list[torch.Tensor], hosts: list[torch.Tensor]):
    """Copy each device tensor srcs[i] (up to 4, contiguous) into row ctr[0] % 2 of hosts[i], pinned host bytes
    (2, srcs[i].nbytes) (host_rows gives it back typed), then add 1 to ctr[0] (ctr: (2,) int32 on the device,
    [calls, 0]): one launch that a CUDA graph can hold, the device writing the host memory itself, so the step
    needs no device-to-host copy after it. The caller keeps its own count of calls for the row to read, and reads
    a row after an event recorded behind the launch, before the call two later writes it again. Without Triton,
    the same copies through torch."""
    assert len(srcs) == len(hosts) <= 4
    flat = [s.reshape(-1).view(torch.uint8) for s in srcs]
    for f, h in zip(flat, hosts):
        assert h.shape == (2, f.numel()) and h.dtype == torch.uint8, f"to_host: host bytes {tuple(h.shape)}"
    if not use_triton(ctr):
        p = int(ctr[0]) & 1
        for f, h in zip(flat, hosts):
            h[p].copy_(f)
        ctr[0] += 1
        return
    most = max([f.numel() for f in flat] + [1])
    args = []
    for i in range(4):
        args += [flat[i], hosts[i], flat[i].numel()] if i < len(flat) else [ctr, ctr, 0]
    _to_host_kernel[(triton.cdiv(most, TO_HOST_BLOCK),)](ctr, *args, BLOCK=TO_HOST_BLOCK, num_warps=4, **pdl(ctr))


def host_rows(host: torch.Tensor, p: int, like: torch.Tensor) -> torch.Tensor:
    """Row p of to_host's host bytes for a source like `like`, typed and shaped as it."""
    if not like.numel():  # (a (2, 0) tensor's second row may sit at an offset no dtype divides)
        return torch.empty(like.shape, dtype=like.dtype)
    return host[p].view(like.dtype).view(like.shape)
