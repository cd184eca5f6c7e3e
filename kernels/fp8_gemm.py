"""Block-scaled FP8 GEMM: e4m3 weights with 128x128 scales, activations quantized per 1x128 tile on the fly,
fp32 accumulation (DeepSeek's W8A8 recipe).

    y = fp8_linear(x, qweight, scale)     # x (..., K) bf16/fp32; qweight (N, K) fp8; scale (N/128, K/128) fp32
    y = fp8_linear_grouped(x, qweight, scale)   # x (..., G, K/G) -> (..., G, N/G), block-diagonal (wo_a)

Triton on CUDA/ROCm (`use_triton(x)`), pure torch elsewhere; both compute
    y[m, n] = sum_kb (xq[m, kb] . wq[n, kb]) * sx[m, kb] * sw[n // 128, kb].
"""
from __future__ import annotations

import os
import warnings
from typing import NamedTuple

import torch

from .quant import BLOCK, fp8_max, quant_fp8_block

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


_SMS: dict = {}


def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors (compute units on ROCm); 1 off CUDA (the CPU interpreter)."""
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return _SMS[device]


def pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1): Triton block sizes."""
    return 1 << max(0, (n - 1).bit_length())


def divisor_at_most(n: int, k: int) -> int:
    """The largest divisor of n that is <= k (at least 1): a kernel's K split into equal ranges of 128-blocks."""
    k = max(1, min(k, n))
    while n % k:
        k -= 1
    return k


# tl.dot's input_precision for fp32 products at about fp32 accuracy on tensor cores: three TF32 passes on NVIDIA;
# ROCm's Triton takes no tf32x3, its bf16x6 (six BF16 passes) is the equivalent there
F32_DOT = "bf16x6" if torch.version.hip else "tf32x3"


def use_triton(t: torch.Tensor) -> bool:
    """Triton on GPU tensors, or anywhere under TRITON_INTERPRET=1 (tests of the kernels' logic on CPU); never on
    meta tensors (a model built on meta is given its holders' shapes by the torch twins, which run there)."""
    return triton is not None and not t.is_meta and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


# Programmatic dependent launch (NVIDIA sm90+): a kernel launched with it may start while the kernel before it in
# the stream is still running; each program first waits for that kernel to finish (pdl_wait: griddepcontrol.wait,
# whose memory is then visible) and then lets the next kernel start. What the decode step's ~300-400 small
# kernels gain: the next kernel's launch and the loads that need nothing from the one before (the GEMV's weights)
# overlap the current one. KERNELS_PDL=0 turns it off.
_PDL: dict = {}


def pdl(t: torch.Tensor) -> dict:
    """The launch arguments of a kernel with a PDL constexpr on t's device: PDL and launch_pdl on CUDA GPUs of
    compute capability 9.0 or later (not under the interpreter, not on ROCm), else PDL=False."""
    dev = t.device
    if dev not in _PDL:
        _PDL[dev] = (t.is_cuda and gdc_wait is not None and torch.version.hip is None
                     and os.environ.get("TRITON_INTERPRET") != "1"
                     and os.environ.get("KERNELS_PDL", "1") != "0" and torch.cuda.get_device_capability(dev)[0] >= 9)
    return {"PDL": True, "launch_pdl": True} if _PDL[dev] else {"PDL": False}


if triton is not None:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # a Triton without them: pdl() must then stay off
        gdc_launch_dependents = gdc_wait = None

    @triton.jit
    def quant_rows(x, fmax):
        """x (R, 128) fp32, each row a 1x128 tile -> (q (R, 128) fp32, clamped to +-fmax, ready for the cast to
        fp8; s (R,) the tiles' scales): act_quant's arithmetic, which every kernel that quantizes activations
        shares so they give the same bytes (torch's differs in rare last bits: its scale is amax times 1/fmax, its
        x / s IEEE; see test_act_quant_bit_exact)."""
        s = tl.maximum(tl.max(tl.abs(x), 1), 1e-12) / fmax
        return tl.clamp(x / s[:, None], -fmax, fmax), s

    @triton.jit
    def dot32(a, b, PREC: tl.constexpr):
        """tl.dot(a, b), fp32 operands at about fp32 accuracy (an FP32 engine's products). PREC: the launch's
        F32_DOT. On NVIDIA three TF32 passes, where tl.dot's own default is one (~1e-3 relative); on ROCm tl.dot's
        default, "ieee" (exact; bf16x6 spilled the decode attention at head_dim 512 on gfx942). BF16 / FP8
        operands: tl.dot as is."""
        if a.dtype == tl.float32 and PREC == "tf32x3":
            d = tl.dot(a, b, input_precision=PREC)
        else:
            d = tl.dot(a, b)
        return d

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """A PDL kernel's first step before it reads or writes what other kernels use: wait for the kernel before
        it, then let the next one launch."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
else:
    pdl_wait = gdc_wait = gdc_launch_dependents = quant_rows = dot32 = None


# ---------------------------------------------------------------------------------------------------------
# activation quantization, 1 x 128 tiles


def act_quant_ref(x: torch.Tensor, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K), K % 128 == 0 -> (xq (M, K) fp8, sx (M, K/128) fp32) with sx = amax / fp8_max per tile."""
    M, K = x.shape
    t = x.float().view(M, K // BLOCK, BLOCK)
    s = t.abs().amax(-1).clamp(min=1e-12) / fp8_max(fp8)
    q = (t / s[..., None]).clamp(-fp8_max(fp8), fp8_max(fp8)).to(fp8)
    return q.view(M, K), s


# 1x128 tiles of a row an act_quant program takes. One tile a program took 3.7 us at 64 x 8192 and 11.1 at
# 256 x 8192 on an H200 (4-16k tiny programs); 8 a program 1.6 and 2.6, 1.2-1.6 at the decode step's other sizes
# (1 to 32 measured at 1-256 rows x K 1024-8192: 8 within 0.2 us of the fastest everywhere)
ACT_TILES = 8

if triton is not None:
    @triton.jit
    def _act_quant_kernel(X, Q, S, NKB, stride_x, fmax, TILES: tl.constexpr, BLOCK_K: tl.constexpr,
                          PDL: tl.constexpr = False):
        """Program (m, j): row m's 1x128 tiles [j*TILES, (j+1)*TILES) as one (TILES, 128) block."""
        pdl_wait(PDL)
        m, j = tl.program_id(0), tl.program_id(1)
        t = j * TILES + tl.arange(0, TILES)
        mask = (t < NKB)[:, None]
        offs = t[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
        x = tl.load(X + m * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        q, s = quant_rows(x, fmax)
        tl.store(Q + m * NKB * BLOCK_K + offs, q.to(Q.dtype.element_ty), mask=mask)
        tl.store(S + m * NKB + t, s, mask=t < NKB)


def act_quant(x: torch.Tensor, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    assert K % BLOCK == 0, f"act_quant needs K % {BLOCK} == 0, got K={K}"
    if not use_triton(x):
        return act_quant_ref(x, fp8)
    x = x.contiguous()
    q = torch.empty(M, K, dtype=fp8, device=x.device)
    s = torch.empty(M, K // BLOCK, dtype=torch.float32, device=x.device)
    if M:
        nkb = K // BLOCK
        tiles = min(ACT_TILES, pow2(nkb))
        _act_quant_kernel[(M, triton.cdiv(nkb, tiles))](x, q, s, nkb, x.stride(0), fp8_max(fp8), TILES=tiles,
                                                          BLOCK_K=BLOCK, **pdl(x))
    return q, s


# ---------------------------------------------------------------------------------------------------------
# weight quantization, 128 x 128 blocks with fp32 scales (the weight sync's sender, FP8 engine loads)


if triton is not None:
    @triton.jit
    def _block_quant_kernel(W, Q, S, N, K, R, C, fmax, BLOCK_B: tl.constexpr):
        rb, cb, e = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        rows = rb * BLOCK_B + tl.arange(0, BLOCK_B)
        cols = cb * BLOCK_B + tl.arange(0, BLOCK_B)
        mask = (rows[:, None] < N) & (cols[None, :] < K)
        offs = e * N * K + rows[:, None].to(tl.int64) * K + cols[None, :]
        x = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.div_rn(tl.maximum(tl.max(tl.max(tl.abs(x), 1), 0), 1e-12), fmax)
        q = tl.clamp(tl.div_rn(x, s), -fmax, fmax)
        tl.store(Q + offs, q.to(Q.dtype.element_ty), mask=mask)
        tl.store(S + (e * R + rb) * C + cb, s)


def block_quant(w: torch.Tensor, fp8: torch.dtype, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """quant_fp8_block(w, fp8, 128, "fp32") in one pass over w (any float dtype, (..., N, K)): Triton on GPU,
    the torch reference elsewhere. Same bytes and scales as the reference on CPU (IEEE division). out: optional
    contiguous (q, scale) tensors to write into (a weight-sync bucket)."""
    if not use_triton(w) or (out is not None and w.device != out[0].device):
        q, s = quant_fp8_block(w, fp8, BLOCK, "fp32")
        if out is not None:
            out[0].copy_(q)
            out[1].copy_(s)
            return out
        return q, s
    w = w.contiguous()
    N, K = w.shape[-2:]
    R, C = -(-N // BLOCK), -(-K // BLOCK)
    lead = w.shape[:-2]
    E = w.numel() // max(N * K, 1)
    if out is not None:
        q, s = out
        assert q.is_contiguous() and s.is_contiguous() and q.shape == w.shape and s.shape == (*lead, R, C)
    else:
        q = torch.empty(w.shape, dtype=fp8, device=w.device)
        s = torch.empty(*lead, R, C, dtype=torch.float32, device=w.device)
    if E and N and K:
        _block_quant_kernel[(R, C, E)](w, q, s, N, K, R, C, fp8_max(fp8), BLOCK_B=BLOCK)
    return q, s


# ---------------------------------------------------------------------------------------------------------
# GEMM


def fp8_gemm_ref(xq, sx, wq, sw, out_dtype=torch.float32) -> torch.Tensor:
    """xq (M, K) fp8, sx (M, K/128); wq (N, K) fp8, sw (ceil(N/128), K/128) -> (M, N)."""
    N = wq.shape[0]
    x = xq.float() * sx.repeat_interleave(BLOCK, 1)
    w = wq.float() * sw.repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)
    return (x @ w.T).to(out_dtype)


# past this many weight bytes (groups x N x K) fp8_gemm up to 64 rows and the one-launch kernel up to 16 take
# _big_tiles (the GEMV kernel, up to GEMV_ROWS, keeps its own): the release's linears (6-34 MB); mini's are at most
# 4 MiB, where the small tiles were fitted. The release's layer shapes in the engine (bench/rollout.py --config
# configs/dsv4.yaml with bench/gpu_suite.sh's `release` overrides, one H200), FP8 tok/s with these tiles against
# without: batch 64 35,955 / 35,944 against 33,160 (33-64 rows), 32 19,380 / 19,326 against 18,870 (17-32 rows), 16
# 10,956 / 11,033 against 10,757 / 10,713 and 8 5,982 / 5,948 against 5,897 / 5,924 (up to 16 rows; the trees
# alternated); BF16 24,696 / 13,380 / 7,311 at 64 / 32 / 16.
GEMM_BIG_WEIGHT = 4 << 20


def _big_tiles(N: int, K: int, groups: int, programs: int, widths: tuple[int, ...]) -> tuple[int, int]:
    """(BLOCK_N, K blocks a program) for a weight past GEMM_BIG_WEIGHT: of the tile widths (narrower first) x K
    ranges of 16 / 8 / 4 / 2 / 1 blocks, the one with the fewest programs >= `programs` (none reaching it: the
    most). Each program then streams a long run of the weight, and there are enough of them to fill the GPU."""
    nkb = K // BLOCK
    opts = [(-(-N // bn) * groups * (nkb // ks), bn, ks) for bn in widths for ks in (16, 8, 4, 2, 1) if nkb % ks == 0]
    enough = [o for o in opts if o[0] >= programs]
    _, bn, ks = min(enough, key=lambda o: o[0]) if enough else max(opts, key=lambda o: o[0])
    return bn, ks


def _gemm_blocks(M: int, N: int, K: int, groups: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, K blocks a program, pipeline stages) of fp8_gemm (_fp8_linear_kernel on act_quant's
    output). At decode sizes each call is latency-bound, so the K blocks are split over programs. Picked from 24
    shapes at 32-256 rows x mini's linears (bench/fp8_linear.py, H200; each within 0.4 us of the fastest): up to
    64 rows 32-wide tiles and 4-block ranges, 5 stages; up to 256 rows 64 x 64 tiles, 8-block ranges, 128 wide
    where that would exceed 256 programs (wq_b's 8192 rows at 256: 6.8 us against 8.7), 3 stages (within 0.3 us
    of 5 at 128 rows, faster at 256). Past 256 rows (prefill) no split: each range's fp32 partial would cost M x N
    x 4 bytes.
    Past GEMM_BIG_WEIGHT: 64-wide tiles and the longest K range (of 16 / 8 / 4 / 2 / 1 blocks) that leaves at
    least 96 programs at 17-64 rows, 192 up to 16 (_big_tiles), 3 stages up to 8 blocks, 5 past. bench/fp8_linear.py
    --config configs/dsv4.yaml --batches 64 (32, 16) --sweep on an H200 (the GEMM alone, rows already quantized;
    every 16 / 32 / 64 wide x 2-16 blocks x 3 / 5 / 8 stages), us a call, these tiles against the 32-wide 4-block
    ones, at 64 rows (32 rows; 16 rows): wq_a+wkv (1536 x 4096) 7.6 against 8.1 (7.2 against 6.5; 5.7 against
    5.2), wq_b (32768 x 1024) 11.3 against 26.8 (13.2 against 18.3; 12.1 against 14.4), the indexer's wq_b (8192 x
    1024) 5.8 against 8.9 (6.0 against 8.1; 5.5 against 5.7), wo_a (8 groups of 1024 x 4096) 14.6 against 28.1
    (14.6 against 20.2; 12.1 against 15.6), wo_b (4096 x 8192) 14.9 against 32.3 (14.7 against 20.3; 12.1 against
    15.5); the sweep's best within 1.1 us of these tiles in each of the 15; cuBLAS BF16 8.4 / 22.0 / 7.0 / 22.0 /
    24.9 at 64 rows."""
    nkb = K // BLOCK
    if M <= 64:
        bm = 16 if M <= 16 else 32 if M <= 32 else 64
        if groups * N * K > GEMM_BIG_WEIGHT:
            bn, ks = _big_tiles(N, K, groups, 192 if M <= 16 else 96, (64,))
            return bm, bn, ks, (3 if ks <= 8 else 5)
        return bm, 32, 4, 5
    if M > 256:
        return 64, 64, nkb, 3
    ks = 8
    programs = triton.cdiv(N, 64) * triton.cdiv(M, 64) * groups * (nkb // divisor_at_most(nkb, ks))
    return 64, (128 if programs > 256 else 64), ks, 3


# torch._scaled_mm takes DeepSeek's recipe (1x128 activation tiles, 128x128 weight blocks, fp32 scales) through
# cuBLASLt (CUDA 12.9+, sm90). fp8_gemm calls it from SCALED_MM_ROWS rows where the output has SCALED_MM_ELEMS
# elements or more (prefill; None: never). bench/fp8_linear.py, H200, us a call (act_quant included), Triton /
# _scaled_mm: 1024 rows wq_a+wkv (N 1024) 13.0 / 16.1, wq_b (N 8192) 25.2 / 21.2, index wq_b (N 4096) 14.2 /
# 13.5, wo_b (N 2048) 23.6 / 16.3; 1536 rows 17.5 / 17.3, 35.7 / 26.7, 19.7 / 19.2, 29.7 / 24.0; 2048 rows 26.5 /
# 18.8, 47.0 / 32.7, 26.0 / 22.7, 40.7 / 26.0; at 512 rows mixed (wq_b 14.1 / 13.0, index wq_b 9.1 / 10.4); up to
# 256 rows the Triton GEMM by 1.3-3x (cuBLASLt's ~9 us floor).
SCALED_MM_ROWS: int | None = 1024
SCALED_MM_ELEMS = 1 << 21
_SCALED_MM: dict = {}


def scaled_mm(xq, sx, wq, sw, out_dtype=torch.bfloat16) -> torch.Tensor:
    """fp8_gemm's product (one group) through torch._scaled_mm: A = xq (M, K) with sx column-major, B = wq^T
    (column-major), its scales sw^T; M padded to a multiple of 4 (cuBLASLt's rule for these scales), the padding
    rows' scales 0."""
    M, K = xq.shape
    Mp = M + (-M % 4)
    sa = torch.zeros(K // BLOCK, Mp, dtype=torch.float32, device=xq.device).t()
    sa[:M] = sx
    if Mp == M:
        a = xq.contiguous()
    else:
        a = torch.zeros(Mp, K, dtype=xq.dtype, device=xq.device)
        a[:M] = xq
    return torch._scaled_mm(a, wq.t(), scale_a=sa, scale_b=sw.t(), out_dtype=out_dtype)[:M]


def scaled_mm_takes(M: int, N: int, K: int, groups: int) -> bool:
    """Whether fp8_gemm gives an (M, K) x (N, K)^T product to torch._scaled_mm (where scaled_mm_ok): one group, N
    a whole number of 128-blocks, K of four (cuBLASLt's layout), and past the thresholds above."""
    return (groups == 1 and SCALED_MM_ROWS is not None and M >= SCALED_MM_ROWS and M * N >= SCALED_MM_ELEMS
            and N % BLOCK == 0 and K // BLOCK % 4 == 0)


def scaled_mm_ok(device: torch.device, fp8: torch.dtype) -> bool:
    """Whether torch._scaled_mm takes the block recipe on this device and dtype: probed once (not while a CUDA graph
    is being captured) with a 4 x 512 x 256 product against fp8_gemm_ref (a misread layout or scale is off by about
    100%; the probe allows 5%)."""
    key = (device, fp8)
    if key not in _SCALED_MM:
        if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
            _SCALED_MM[key] = False
        elif torch.cuda.is_current_stream_capturing():
            return False
        else:
            g = torch.Generator(device).manual_seed(0)
            x = torch.randn(4, 512, device=device, generator=g)
            wq, sw = block_quant(torch.randn(256, 512, device=device, generator=g) * 0.05, fp8)
            xq, sx = act_quant_ref(x, fp8)
            try:
                want = fp8_gemm_ref(xq, sx, wq, sw)
                _SCALED_MM[key] = bool(((scaled_mm(xq, sx, wq, sw, torch.float32) - want).norm()
                                        <= 5e-2 * want.norm()).item())
            except (RuntimeError, NotImplementedError, ValueError):  # no such recipe in this torch / cuBLAS / GPU
                _SCALED_MM[key] = False
    return _SCALED_MM[key]


def fp8_gemm(xq, sx, wq, sw, out_dtype=torch.bfloat16, blocks=None, groups: int = 1) -> torch.Tensor:
    """xq (M, G*K) fp8, sx (M, G*K/128); wq (G*N, K) fp8, sw (ceil(G*N/128), K/128) -> (M, G*N): with groups G > 1
    the block-diagonal product (group g: x's g-th K columns times the g-th N weight rows; N % 128 == 0).
    blocks: (BLOCK_M, BLOCK_N, K blocks a program[, pipeline stages]) (default _gemm_blocks)."""
    M, GK = xq.shape
    GN, K = wq.shape
    N = GN // groups
    assert K % BLOCK == 0 and GK == groups * K and (groups == 1 or N % BLOCK == 0), \
        f"fp8_gemm: x {tuple(xq.shape)} vs w {tuple(wq.shape)} in {groups} groups"
    assert sw.shape == (-(-GN // BLOCK), K // BLOCK), \
        f"fp8_gemm: weight scale {tuple(sw.shape)} for w {tuple(wq.shape)}"
    if not use_triton(xq):
        r = N // BLOCK
        return torch.cat([fp8_gemm_ref(xq[:, g * K:(g + 1) * K], sx[:, g * (K // BLOCK):(g + 1) * (K // BLOCK)],
                                       wq[g * N:(g + 1) * N], sw[g * r:(g + 1) * r] if groups > 1 else sw, out_dtype)
                          for g in range(groups)], 1)
    if blocks is None and scaled_mm_takes(M, N, K, groups) and scaled_mm_ok(xq.device, wq.dtype):
        return scaled_mm(xq, sx, wq, sw, out_dtype)
    bm, bn, ks, *stages = blocks or _gemm_blocks(M, N, K, groups)
    return fp8_linear_fused(xq, wq, sw, groups, (bm, bn, ks), sx=sx, out_dtype=out_dtype,
                            stages=stages[0] if stages else _gemm_blocks(M, N, K, groups)[3])


if triton is not None:
    @triton.jit
    def _fp8_linear_kernel(X, SX, W, SW, Y, PART, CNT, M, N, stride_x, stride_sx, stride_w, stride_y, fmax,
                           K: tl.constexpr, KS: tl.constexpr, KSP: tl.constexpr, SPLIT: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr,
                           XQ: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr = False):
        """The FP8 linear / GEMM: program (n tile, K range s, group g x row tile) quantizes x's 1x128 tiles of K
        blocks [s*KS, (s+1)*KS) itself (act_quant's arithmetic) and multiplies them with the weight tiles (XQ: x
        is act_quant's output, SX its scales: fp8_gemm; not SCALED: a BF16 weight, x in its dtype, no
        quantization). SPLIT == 1: it stores its tile. Else it stores the range's fp32 partial in PART[s], and
        the last of the tile's SPLIT programs to finish (a ticket counter, reset to 0 after) adds the partials in
        range order and stores the tile: the same sum whichever program finishes last.
        The scales of the program's K range are loaded once, before the K loop (KSP = pow2(KS); a tile's rows
        share one 128-row block of weight scales), and each step picks its own: Triton's pipeliner issues only
        tl.dot's operand loads ahead, so a scale load in the loop was a synchronous load every K step."""
        pdl_wait(PDL)
        pid_n, sp, pid_mg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        mt = tl.cdiv(M, BLOCK_M)
        g, pid_m = pid_mg // mt, pid_mg % mt
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        mm, mn = rm < M, rn < N
        nkb: tl.constexpr = K // BLOCK_K
        wrow = g * N + rn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SCALED:
            tl.static_assert(BLOCK_K % BLOCK_N == 0)
            kk = tl.arange(0, KSP)
            mk = kk < KS
            sw_all = tl.load(SW + (g * N + pid_n * BLOCK_N) // BLOCK_K * nkb + sp * KS + kk, mask=mk, other=0.0)
            if XQ:
                sx_all = tl.load(SX + rm[:, None] * stride_sx + g * nkb + sp * KS + kk[None, :],
                                 mask=mm[:, None] & mk[None, :], other=0.0)
        for j in range(KS):
            kb = sp * KS + j
            w = tl.load(W + wrow[:, None] * stride_w + kb * BLOCK_K + rk[None, :], mask=mn[:, None], other=0.0)
            x = tl.load(X + rm[:, None] * stride_x + g * K + kb * BLOCK_K + rk[None, :], mask=mm[:, None],
                        other=0.0)
            if SCALED:
                sw = tl.sum(tl.where(kk == j, sw_all, 0.0), 0)
            if XQ:  # x already quantized (act_quant): its tiles' scales from SX
                sx = tl.sum(tl.where(kk[None, :] == j, sx_all, 0.0), 1)
                acc += tl.dot(x, tl.trans(w)) * sx[:, None] * sw
            elif SCALED:
                q, sx = quant_rows(x.to(tl.float32), fmax)
                acc += tl.dot(q.to(W.dtype.element_ty), tl.trans(w)) * sx[:, None] * sw
            else:
                acc += dot32(x.to(W.dtype.element_ty), tl.trans(w), PREC)
        out = Y + rm[:, None] * stride_y + g * N + rn[None, :]
        mask = mm[:, None] & mn[None, :]
        if SPLIT == 1:
            tl.store(out, acc.to(Y.dtype.element_ty), mask=mask)
        else:
            GN = tl.num_programs(2) // mt * N
            part = PART + rm[:, None] * GN + g * N + rn[None, :]
            tl.store(part + sp * M * GN, acc, mask=mask)
            tl.debug_barrier()  # the whole partial is written before the ticket is taken
            tile = pid_mg * tl.num_programs(0) + pid_n
            if tl.atomic_add(CNT + tile, 1) == SPLIT - 1:  # acq_rel: the other ranges' partials are visible
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(SPLIT):
                    acc += tl.load(part + s * M * GN, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out, acc.to(Y.dtype.element_ty), mask=mask)
                tl.store(CNT + tile, 0)


if triton is not None:
    @triton.jit
    def slab_dot(w, sw, x, fmax, SCALED: tl.constexpr):
        """The GEMV kernels' product of a weight slab w (BN, NKBP, 128) [scales sw (BN, NKBP)] with one row x
        (NKBP, 128) fp32 -> (BN,) fp32: SCALED, x quantized per 1x128 tile in act_quant's arithmetic and each
        tile's fp32 sum times both scales; else the plain products. fp32 FMAs, no tensor cores."""
        if SCALED:
            q, sx = quant_rows(x, fmax)  # sx (NKBP,)
            q = q.to(w.dtype).to(tl.float32)
            part = tl.sum(w.to(tl.float32) * q[None, :, :], 2)  # (BN, NKBP): each 1x128 block's sum
            return tl.sum(part * sx[None, :] * sw, 1)
        else:
            return tl.sum(tl.sum(w.to(tl.float32) * x[None, :, :], 2), 1)

    @triton.jit
    def _gemv_kernel(X, W, SW, Y, M, N, stride_x, stride_w, stride_y, fmax, K: tl.constexpr, BN: tl.constexpr,
                     NKBP: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr,
                     PDL: tl.constexpr = False, NW=None, eps=0.0, NORM: tl.constexpr = False):
        """Weight rows [pid * BN, (pid + 1) * BN) of y = x W^T for the M <= ROWS rows of x (a decode step's few
        rows): the program loads its whole (BN, K) weight slab with one load, so all of it is in flight at once
        (these calls are latency-bound), and takes slab_dot with each row. SCALED: W fp8 with 128 x 128 scales
        SW, x quantized per 1x128 tile; else W BF16/FP16, x as it is. Groups: the program's rows lie in one
        group g (BN divides N), which reads x's g-th K columns. Under PDL the weights load before the wait for
        the kernel before (which must not be writing them: no decode kernel does). NORM (one group): each row
        RMS-normed with weight NW first and rounded to X's dtype, the norm kernel's arithmetic (kernels.fused
        _rms_row) with its sum of squares in another order."""
        pid = tl.program_id(0)
        NKB: tl.constexpr = K // BLOCK_K
        rn = pid * BN + tl.arange(0, BN)
        g = pid * BN // N
        kb = tl.arange(0, NKBP)
        mk = kb < NKB
        rk = tl.arange(0, BLOCK_K)
        w = tl.load(W + rn[:, None, None] * stride_w + kb[None, :, None] * BLOCK_K + rk[None, None, :],
                    mask=mk[None, :, None], other=0.0)  # (BN, NKBP, 128)
        sw = w
        if SCALED:
            sw = tl.load(SW + (rn // BLOCK_K)[:, None] * NKB + kb[None, :], mask=mk[None, :], other=0.0)
        if NORM:
            nw = tl.load(NW + kb[:, None] * BLOCK_K + rk[None, :], mask=mk[:, None], other=0.0)
        pdl_wait(PDL)  # the weights are loading; x is the kernel before's output
        for m in tl.static_range(ROWS):
            if m < M:
                x = tl.load(X + m * stride_x + g * K + kb[:, None] * BLOCK_K + rk[None, :], mask=mk[:, None],
                            other=0.0)
                if NORM:
                    xf = x.to(tl.float32)
                    inv = tl.rsqrt(tl.sum(tl.sum(xf * xf, 1), 0) / K + eps)
                    x = (nw * (xf * inv)).to(X.dtype.element_ty)
                x = x.to(tl.float32)
                tl.store(Y + m * stride_y + rn, slab_dot(w, sw, x, fmax, SCALED).to(Y.dtype.element_ty))
else:
    slab_dot = None


# Rows up to which the linears take the GEMV kernel, the programs it aims for, its warps. On an H200, mini's
# linears from HBM (bench/fp8_linear.py), us a call at 1 / 2 rows against the one-launch kernel: FP8 wq_a+wkv
# 2.9 / 3.6 against 4.6 / 4.7, wq_b 3.5 / 4.4 against 5.0 / 5.4, the indexer's wq_b 2.9 / 3.8 against 4.7 / 5.0,
# wo_a 3.5 / 4.6 against 6.2 / 6.3, wo_b 3.5 / 4.6 against 5.5 / 5.7; at 4 rows the best of 6 configurations
# 4.6-6.7 against 4.8-6.4, at 8 and 16 rows up to 3x slower. BF16, one row: a CSA layer's input linears
# (2,592 x 2,048) 5.1 against cuBLAS's 6.3, an HCA layer's (1,024 x 2,048) 3.2 against the one-launch kernel's
# 4.9, the indexer's wq_b 3.0 against 4.0. The default, 256 programs of 8 warps, was within 0.25 us of the
# fastest of 128 / 256 / 512 programs x 4 / 8 warps (--sweep) at one row, within 0.42 at two.
GEMV_ROWS, GEMV_PROGRAMS, GEMV_WARPS = 2, 256, 8
GEMV_SLAB = 32768  # most weight bytes a program holds


def slab_rows(N: int, row_bytes: int, most: int = 64, slab: int | None = None) -> int:
    """The rows of a GEMV program's weight slab: the largest power of two up to 64 (and up to `most`) that divides
    N and keeps the slab within `slab` bytes (default GEMV_SLAB)."""
    bn = 1
    while bn * 2 <= min(64, most) and N % (bn * 2) == 0 and bn * 2 * row_bytes <= (slab or GEMV_SLAB):
        bn *= 2
    return bn


def gemv(x2: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor | None, groups: int = 1, programs: int | None = None,
         warps: int | None = None, norm=None) -> torch.Tensor:
    """x2 (M, G*K), M a few rows (a row stride of their own: a column slice is read in place) -> (M, G*N) in x2's
    dtype through _gemv_kernel: fp8_linear_fused's numerics (sw None: a plain BF16 / FP16 weight, the product
    unquantized) with the sums in another order. Each program takes BN weight rows, a power of two that divides N
    (its slab of at most GEMV_SLAB bytes), for about `programs` programs (default GEMV_PROGRAMS). norm: an RMSNorm
    (its weight (K,) fp32 and eps) of x2's rows first, one group (see Prenorm)."""
    M, GK = x2.shape
    GN, K = wq.shape
    N = GN // groups
    assert K % BLOCK == 0 and GK == groups * K, f"gemv: x {tuple(x2.shape)} vs w {tuple(wq.shape)} in {groups} groups"
    assert norm is None or (groups == 1 and norm.weight.shape == (K,)), "gemv: norm= takes one group of K columns"
    bn = slab_rows(N, K * wq.element_size(), GN // (programs or GEMV_PROGRAMS))
    y = torch.empty(M, GN, dtype=x2.dtype, device=x2.device)
    if M:
        x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
        scaled = sw is not None
        nw = {} if norm is None else {"NW": norm.weight.float().contiguous(), "eps": float(norm.eps), "NORM": True}
        _gemv_kernel[(GN // bn,)](x2, wq, sw.contiguous() if scaled else wq, y, M, N, x2.stride(0), wq.stride(0),
                                  y.stride(0), fp8_max(wq.dtype) if scaled else 1.0, K=K, BN=bn, NKBP=pow2(K // BLOCK),
                                  ROWS=pow2(M), BLOCK_K=BLOCK, SCALED=scaled, num_warps=warps or GEMV_WARPS, **nw,
                                  **pdl(x2))
    return y


_COUNTERS: dict = {}
_RETIRED: list = []  # counters a larger request replaced: CUDA graphs captured with them still use them


def tickets(device: torch.device, n: int) -> torch.Tensor:
    """The split-K ticket counters of `device` and its current stream (int32 zeros, >= n): each launch's last
    programs put theirs back to 0, so launches in one stream share them; kernels of two streams may run at once,
    so each stream has its own (for a graph's kernels, the stream that captured it: rollout_server.Runner captures
    on a stream of its own, so two engines' graphs replaying at once do not share counters). A request past the
    current size takes a larger buffer and keeps the old one alive: a graph captured before still reads and resets
    that one, and freed, its memory would go to other tensors whose bytes the graph's kernels would take for
    tickets. A CUDA device without an index is the current one: "cuda" and "cuda:<current>" share counters (an engine
    made on "cuda" made its capture stream's counters under the one key, and its kernels asked under the other,
    inside the capture: a zero fill every replay ran). A buffer made while the stream captures a graph works but
    puts that zero fill in the graph, so it warns: make the capturing stream's counters before the capture (call
    this on that stream, or run the warm-up there), as rollout_server.Runner._capture does."""
    device = _indexed(device)
    key = (device, torch.cuda.current_stream(device).stream_id) if device.type == "cuda" else (device, 0)
    cnt = _COUNTERS.get(key)
    if cnt is None or cnt.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            warnings.warn(f"kernels.fp8_gemm.tickets: the ticket counters of {device}, stream {key[1]} ({n} asked for) "
                          "are made during CUDA graph capture, so their zero fill is a node that every replay of the "
                          "graph runs; call tickets(device, n) on the capturing stream, or run the warm-up there, "
                          "before the capture", stacklevel=2)
        if cnt is not None:
            _RETIRED.append(cnt)
        cnt = _COUNTERS[key] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return cnt


def tickets_left(device: torch.device) -> int:
    """The sum of |counter| over every stream's ticket counters of `device` (0 after every launch finished)."""
    device = _indexed(device)
    return sum(int(c.abs().sum()) for (d, _), c in _COUNTERS.items() if d == device)


_STAGES: dict = {}


def launch_fitting(kernel, grid, args: tuple, kwargs: dict, stages: int, key: tuple):
    """kernel[grid](*args, **kwargs, num_stages=stages), or on fewer stages where that many stages' tiles do not
    fit a program's shared memory on this GPU: Triton then raises OutOfResources at the launch, before the kernel
    runs (e.g. the FP32 engine's expert tiles, twice BF16's bytes: the up kernel's 64-row blocks on 3 stages take
    256 KiB, against 227 KiB a program on an H100 / H200; 160 KiB on 2). key: what decides the tiles' bytes;
    with the kernel, device and stages it keys the stages that fitted, so the next launch takes them at once."""
    memo = (kernel, args[0].device, stages, key)  # (a tensor's CUDA device carries its index)
    ns = _STAGES.get(memo, stages)
    while True:
        try:
            out = kernel[grid](*args, **kwargs, num_stages=ns)
        except triton.runtime.errors.OutOfResources:
            if ns == 1:
                raise
            ns -= 1
            continue
        _STAGES[memo] = ns
        return out


def _indexed(device: torch.device) -> torch.device:
    """device, a CUDA one with its index (the current device's where it has none)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


# fp8_linear takes the one-launch kernel (x quantized in each program) up to this many rows, act_quant + fp8_gemm
# past them. bench/fp8_linear.py on an H200, mini's linears from HBM, us a call: at 1-16 rows one launch 4.2-6.3
# against 4.7-10.4; at 24-64 rows the two launches 5.8-8.9 against 6.3-11.0 (one launch wins only wq_a+wkv at
# 24-32 rows, by 0.2 us).
FUSED_ROWS = 16


def _fused_blocks(M: int, N: int, K: int, groups: int, scaled: bool = True) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, K blocks a program) of the one-launch kernel: the fastest measured at mini's shapes
    (bench/fp8_linear.py --sweep). Up to 16 rows: 64-wide tiles, K ranges of 2 blocks (K 512: one range); past
    that, about 128-256 programs: 32-wide tiles and 2-block ranges, or 64 and 4 with 4 groups.
    FP8 weights past GEMM_BIG_WEIGHT up to 16 rows: 64- or 128-wide tiles, the fewest programs >= 192 (_big_tiles).
    bench/fp8_linear.py --config configs/dsv4.yaml --batches 16 --sweep on an H200 (every 16 / 32 / 64 / 128 wide
    x 1-16 blocks), us a call, these tiles against 64-wide 2-block ones: wq_a+wkv 6.7 against 7.8 (64 / 4), wq_b
    15.3 against 17.8 (128 / 8), the indexer's wq_b 6.6 against 8.2 (64 / 4), wo_a 16.7 against 20.6 (64 / 16),
    wo_b 16.4 against 25.1 (64 / 16): each the sweep's best; cuBLAS BF16 7.8 / 20.9 / 6.7 / 20.5 / 23.3."""
    nkb = K // BLOCK
    if M <= 16 and scaled and groups * N * K > GEMM_BIG_WEIGHT:
        return (16, *_big_tiles(N, K, groups, 192, (64, 128)))
    if M <= 16:
        return 16, (64 if N >= 1024 else 32), (2 if nkb > 4 else nkb)
    bm = 32 if M <= 32 else 64
    return (bm, 64, 4) if groups > 1 else (bm, 32, 2)


def fp8_linear_fused(x2: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor | None, groups: int = 1, blocks=None,
                     sx: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, stages: int = 3):
    """x2 (M, G*K) bf16/fp32 -> (M, G*N) in x2's dtype, in one launch (_fp8_linear_kernel): fp8_linear's numerics
    (1x128 activation tiles, block scales, fp32 sums), with the K blocks split over programs. blocks: (BLOCK_M,
    BLOCK_N, K blocks a program). sw None: wq is a plain (BF16) weight, the product unquantized (small_linear).
    sx given: x2 is already quantized (act_quant's xq and sx), the output out_dtype."""
    M, GK = x2.shape
    GN, K = wq.shape
    N = GN // groups
    nkb = K // BLOCK
    bm, bn, ks = blocks or _fused_blocks(M, N, K, groups, sw is not None)
    ks = divisor_at_most(nkb, ks)
    split = nkb // ks
    y = torch.empty(M, GN, dtype=out_dtype or x2.dtype, device=x2.device)
    if M:
        x2 = x2.contiguous()
        grid = (triton.cdiv(N, bn), split, groups * triton.cdiv(M, bm))
        part = torch.empty(split, M, GN, dtype=torch.float32, device=x2.device) if split > 1 else y
        cnt = tickets(x2.device, grid[0] * grid[2]) if split > 1 else y
        scaled = sw is not None
        sx = sx.contiguous() if sx is not None else None
        _fp8_linear_kernel[grid](x2, x2 if sx is None else sx, wq, sw.contiguous() if scaled else wq, y, part, cnt,
                                 M, N, x2.stride(0), 0 if sx is None else sx.stride(0), wq.stride(0), y.stride(0),
                                 fp8_max(wq.dtype) if scaled else 1.0, K=K, KS=ks, KSP=pow2(ks), SPLIT=split,
                                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK, SCALED=scaled, XQ=sx is not None,
                                 PREC=F32_DOT, num_warps=4, num_stages=stages, **pdl(x2))
    return y


class Prenorm(NamedTuple):
    """An RMSNorm module (weight (K,), eps; calling it norms rows) that a linear applies to its input first, passed
    where a linear takes its input's quantized rows (`xq`): the rollout engine's q norm, which the wq_b GEMVs take
    at a few rows instead of a launch of its own."""
    norm: torch.nn.Module


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, norm=None) -> torch.Tensor:
    """x (..., K) -> (..., N) in x's dtype: quantize x per 1x128 tile, block-scaled FP8 GEMM, fp32 accumulation.
    norm: an RMSNorm of x first (Prenorm's module): in the GEMV kernel up to GEMV_ROWS rows on Triton, else a
    call of it."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if norm is not None:
        if x2.shape[0] <= GEMV_ROWS and use_triton(x2) and x2.shape[1] % BLOCK == 0:
            return gemv(x2, wq, sw, norm=norm).view(*shape[:-1], wq.shape[0])
        return fp8_linear(norm(x), wq, sw)
    if x2.shape[1] % BLOCK:  # K not a multiple of 128 (tiny test models): dequantize the weight instead
        from .quant import dequant_fp8_block
        return torch.nn.functional.linear(x, dequant_fp8_block(wq, sw, x.dtype))
    return _linear_2d(x2, wq, sw).view(*shape[:-1], wq.shape[0])


def _linear_2d(x2: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """x2 (M, G*K) -> (M, G*N) in x2's dtype: on Triton the GEMV up to GEMV_ROWS rows, the one-launch kernel up to
    FUSED_ROWS, else act_quant + fp8_gemm."""
    if x2.shape[0] <= GEMV_ROWS and use_triton(x2):
        return gemv(x2, wq, sw, groups)
    if x2.shape[0] <= FUSED_ROWS and use_triton(x2):
        return fp8_linear_fused(x2, wq, sw, groups=groups)
    xq, sx = act_quant(x2, wq.dtype)
    return fp8_gemm(xq, sx, wq, sw, x2.dtype, groups=groups)


def small_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) for a BF16 / FP16 weight. On a GPU (K a multiple of 128): the GEMV kernel at one row (any
    size: see GEMV_ROWS) and up to GEMV_ROWS rows for weights up to 2^21 elements (2 rows, us a call against
    cuBLAS: an HCA layer's input GEMM 3.9 against 8.0, the indexer's wq_b 3.6 against 4.1; but a CSA layer's
    five input linears as one, 2592 x 2048, 7.0 against 6.3). Then up to 16 rows and 2^21 weight elements the
    one-launch kernel, K split over programs (fp32 sums in another order than cuBLAS's). That kernel, measured on
    an H200 (bench/fp8_linear.py, weights from HBM), one row / 16 rows, us a call against cuBLAS: an HCA layer's
    BF16 input GEMM (1024 x 2048) 4.9 / 5.3 against 12.6 / 5.8; the indexer's wq_b (4096 x 512) 4.0 / 4.1 against
    4.0 / 4.1; larger, a CSA layer's five BF16 input linears as one (2592 x 2048), 6.7 / 7.5 against 6.3 / 6.4."""
    x2 = x.reshape(-1, x.shape[-1])
    if (x2.shape[0] > 16 or x2.shape[1] % BLOCK or w.dtype not in (torch.bfloat16, torch.float16)
            or x.dtype != w.dtype or not use_triton(x2)):
        return torch.nn.functional.linear(x, w)
    if x2.shape[0] == 1 or (x2.shape[0] <= GEMV_ROWS and w.numel() <= 1 << 21):
        return gemv(x2, w, None).view(*x.shape[:-1], w.shape[0])
    if w.numel() > 1 << 21:
        return torch.nn.functional.linear(x, w)
    return fp8_linear_fused(x2, w, None).view(*x.shape[:-1], w.shape[0])


def fp8_linear_grouped(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, fused: bool = True,
                       xq=None) -> torch.Tensor:
    """x (..., G, K/G) -> (..., G, N/G): the block-diagonal product with the G row groups of the weight (N/G and
    K/G multiples of 128): one act_quant over the G*K/G row (its 1x128 tiles never straddle groups) and one
    grouped GEMM launch; fused=False runs one fp8_linear per group (the twin). xq: x's (rows, G*K/G) already
    quantized, (q, scales) as act_quant gives them: the GEMM launch alone."""
    G, Kg = x.shape[-2:]
    rows, r = wq.shape[0] // G, wq.shape[0] // G // BLOCK
    if xq is not None:
        return fp8_gemm(*xq, wq, sw, x.dtype, groups=G).view(*x.shape[:-1], rows)
    if not fused:
        return torch.stack([fp8_linear(x[..., g, :], wq[g * rows:(g + 1) * rows], sw[g * r:(g + 1) * r])
                            for g in range(G)], dim=-2)
    return _linear_2d(x.reshape(-1, G * Kg), wq, sw, groups=G).view(*x.shape[:-1], rows)
