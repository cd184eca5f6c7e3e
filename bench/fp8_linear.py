"""FP8 linears and grouped experts at the decode path's shapes, on one GPU: each configuration's time per call.

    python bench/fp8_linear.py --config configs/mini.yaml --batches 1,16,64,256 [--sweep] [--moe [--no-linears]]
    python bench/fp8_linear.py --config configs/dsv4.yaml model.n_routed_experts=32 ...   # dotted model.* overrides

Linears (the engine's FP8 ones: wq_a+wkv as one, wq_b, the indexer's wq_b, wo_a's grouped product, wo_b):
cuBLAS BF16 (torch.nn.functional.linear), act_quant + fp8_gemm (two launches), fp8_linear_fused (one launch) at
its default tiles and, with --sweep, at every (BLOCK_N, K blocks a program), past 16 rows also the GEMM alone on
rows already quantized at every (BLOCK_N, K blocks, pipeline depth), and up to 4 rows the GEMV kernel (--sweep: its
programs x warps; the BF16 input GEMMs too). --moe: fused_moe, FP8 and BF16,
at its default tiles and (with --sweep) others and every (rows a block, x-first / weights-first products, up
kernel warps), and up to 4 tokens its GEMV kernels, the k + shared experts of mini's routing.

Each call reads its weights from HBM, not L2: the CUDA graph that is timed cycles through enough copies of the
weights to exceed the L2 (graph of R calls, replayed; us per call = time / R). Weight GB/s = weight bytes / time
(1 a weight for FP8, 2 for BF16; experts: the ones the batch routes to)."""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.fp8_gemm import (FUSED_ROWS, _fused_blocks, _gemm_blocks, act_quant, fp8_gemm,  # noqa: E402
                               fp8_linear_fused, gemv, scaled_mm, scaled_mm_ok, small_linear)
from kernels.moe import _moe_gemv, _moe_tiles, fused_moe  # noqa: E402
from kernels.quant import fp8_dtype, quant_fp8_block  # noqa: E402
from model import ModelConfig  # noqa: E402
from model.config import load_model_config  # noqa: E402

L2_BYTES = 256 << 20  # the weights a timed graph cycles through: well past any GPU's L2


def graph_us(fns, iters: int = 10) -> float:
    """Microseconds per call of fns (a list of no-argument callables, one per weight copy) under a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):  # the warm-up's stream: its split-K ticket counters exist, no fill in g
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(iters):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) * 1e3 / (len(fns) * iters)


def copies(nbytes: int) -> int:
    return max(4, min(256, -(-L2_BYTES // nbytes)))


def linears(c: ModelConfig, batches, sweep: bool):
    D, G = c.hidden_size, c.o_groups
    shapes = {"wq_a+wkv": (c.q_lora_rank + c.head_dim, D, 1), "wq_b": (c.num_attention_heads * c.head_dim, c.q_lora_rank, 1),
              "index wq_b": (c.index_n_heads * c.index_head_dim, c.q_lora_rank, 1),
              "wo_a": (G * c.o_lora_rank, c.num_attention_heads * c.head_dim // G, G),
              "wo_b": (D, G * c.o_lora_rank, 1)}
    f8 = fp8_dtype("cuda")
    best = {}
    for M in batches:
        for name, (N, K, g) in shapes.items():
            R = copies(N * K)
            w = [torch.randn(N, K, device="cuda") * 0.02 for _ in range(R)]
            q = [quant_fp8_block(t, f8, scale_fmt="fp32") for t in w]
            wb = [t.bfloat16() for t in w]
            del w
            x = torch.randn(M, g * K, device="cuda", dtype=torch.bfloat16)
            xg = x.view(M, g, K)
            row = {"bf16 cuBLAS": graph_us([lambda t=t: torch.einsum("mgk,gnk->mgn", xg, t.view(g, N // g, K))
                                            if g > 1 else torch.nn.functional.linear(x, t) for t in wb])}
            bl = _gemm_blocks(M, N // g, K, g)  # given: the Triton GEMM at every size
            row["act_quant+gemm"] = graph_us([lambda t=t: fp8_gemm(*act_quant(x, f8), *t, groups=g, blocks=bl)
                                              for t in q])
            if g == 1 and scaled_mm_ok(x.device, f8):  # cuBLASLt's block recipe (fp8_gemm's where scaled_mm_takes)
                row["act_quant+_scaled_mm"] = graph_us([lambda t=t: scaled_mm(*act_quant(x, f8), *t) for t in q])
            row["fused"] = graph_us([lambda t=t: fp8_linear_fused(x, *t, groups=g) for t in q])
            if M <= 4:  # the GEMV kernel (default programs and warps; with --sweep, others)
                row["gemv"] = graph_us([lambda t=t: gemv(x, *t, groups=g) for t in q])
                for P, wp in ((128, 4), (128, 8), (256, 4), (256, 8), (512, 4), (512, 8)) if sweep else ():
                    row[f"gemv {P}/{wp}"] = graph_us([lambda t=t: gemv(x, *t, groups=g, programs=P, warps=wp)
                                                      for t in q])
            bm = _fused_blocks(M, N // g, K, g)[0]
            if sweep:
                for bn in (16, 32, 64, 128):
                    for ks in (1, 2, 4, 8, 16):
                        if ks <= K // 128:
                            row[f"fused {bn}/{ks}"] = graph_us(
                                [lambda t=t: fp8_linear_fused(x, *t, groups=g, blocks=(bm, bn, ks)) for t in q])
            if sweep and M > FUSED_ROWS:  # the GEMM alone on rows already quantized (the engine's input GEMM and
                # wq_b past FUSED_ROWS rows: hc_pre / the q norm quantize them), every (BLOCK_N, K blocks, depth)
                xq, sx = act_quant(x, f8)
                row["gemm default"] = graph_us([lambda t=t: fp8_gemm(xq, sx, *t, groups=g) for t in q])
                bm2 = _gemm_blocks(M, N // g, K, g)[0]
                for bn, ks, st in itertools.product((16, 32, 64), (2, 4, 8, 16), (3, 5, 8)):
                    if ks <= K // 128:
                        row[f"gemm {bn}/{ks}/{st}"] = graph_us(
                            [lambda t=t: fp8_linear_fused(xq, *t, groups=g, blocks=(bm2, bn, ks), sx=sx,
                                                          out_dtype=torch.bfloat16, stages=st) for t in q])
            del q, wb
            torch.cuda.empty_cache()
            top = min((v, k) for k, v in row.items() if k.startswith(("fused", "gemv")))[1]
            best[(M, name)] = (top, row[top], row["bf16 cuBLAS"], row["act_quant+gemm"], row["fused"],
                               row.get("act_quant+_scaled_mm", float("nan")))
            cells = "  ".join(f"{k} {v:.1f}" for k, v in row.items())
            print(f"M {M:4d} {name:10s} N {N:5d} K {K:5d} G {g}  us/call  {cells}", flush=True)
    print("\nsummary, us per call (FP8 weight GB/s):")
    for (M, name), (top, t, tb, t2, tf, ts) in best.items():
        N, K, g = shapes[name]
        print(f"M {M:4d} {name:10s} cuBLAS bf16 {tb:5.1f} ({2 * N * K / tb / 1e3:4.0f})  act_quant+gemm {t2:5.1f}"
              f" ({N * K / t2 / 1e3:4.0f})  act_quant+_scaled_mm {ts:5.1f} ({N * K / ts / 1e3:4.0f})  fused default"
              f" {tf:5.1f} ({N * K / tf / 1e3:4.0f})  best {top} {t:5.1f} ({N * K / t / 1e3:4.0f})", flush=True)


def bf16_inputs(c: ModelConfig, batches):
    """The engine's BF16 input GEMMs (a CSA layer's compressor + indexer linears as one, an HCA layer's compressor)
    and the indexer's wq_b: cuBLAS against small_linear (the one-launch kernel with the weight unscaled)."""
    D, hd, ihd = c.hidden_size, c.head_dim, c.index_head_dim
    shapes = {"csa inputs": (4 * hd + 4 * ihd + c.index_n_heads, D), "hca inputs": (2 * hd, D),
              "index wq_b": (c.index_n_heads * ihd, c.q_lora_rank)}
    for M in batches:
        for name, (N, K) in shapes.items():
            wb = [(torch.randn(N, K, device="cuda") * 0.02).bfloat16() for _ in range(copies(2 * N * K))]
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            tb = graph_us([lambda t=t: torch.nn.functional.linear(x, t) for t in wb])
            ts = graph_us([lambda t=t: small_linear(x, t) for t in wb])
            tg = graph_us([lambda t=t: gemv(x, t, None) for t in wb]) if M <= 4 else float("nan")
            print(f"M {M:4d} {name:10s} N {N:5d} K {K:5d} bf16  us/call (GB/s)  cuBLAS {tb:5.1f}"
                  f" ({2 * N * K / tb / 1e3:4.0f})  small_linear {ts:5.1f} ({2 * N * K / ts / 1e3:4.0f})"
                  f"  gemv {tg:5.1f} ({2 * N * K / tg / 1e3:4.0f})", flush=True)
            del wb
            torch.cuda.empty_cache()


def experts(c: ModelConfig, batches, sweep: bool):
    E, k, D, I = c.n_routed_experts + c.n_shared_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size
    f8 = fp8_dtype("cuda")
    gen = torch.Generator("cuda").manual_seed(0)
    for fp8 in (True, False):
        # enough layer copies that even batch 1's experts (k + shared a layer) come from HBM
        R = max(2, -(-L2_BYTES // ((k + c.n_shared_experts) * 3 * I * D * (1 if fp8 else 2))))
        layers = []
        for _ in range(R):
            w = [torch.randn(E, I, D, device="cuda") * 0.02, torch.randn(E, D, I, device="cuda") * 0.02,
                 torch.randn(E, I, D, device="cuda") * 0.02]
            if fp8:
                q = [quant_fp8_block(t, f8, scale_fmt="fp32") for t in w]
                layers.append((q[0][0], q[1][0], q[2][0], q[0][1], q[1][1], q[2][1]))
            else:
                layers.append(tuple(t.bfloat16() for t in w))
            del w
        for M in batches:
            x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
            ids = torch.rand(M, E - c.n_shared_experts, device="cuda", generator=gen).argsort(-1)[:, :k]
            wt = torch.rand(M, k, device="cuda", generator=gen)
            hit = int(ids.unique().numel()) + c.n_shared_experts
            nbytes = hit * 3 * I * D * (1 if fp8 else 2)
            up, down = default = _moe_tiles(M, fp8)
            grid = [default]
            if sweep:  # the up kernel's (BLOCK_N, warps, stages, K ranges) with the default down, then the down's
                # (BLOCK_N, warps, stages) with the default up
                grid += [((bn, nw, ns, ks), down) for bn in (32, 64, 128)
                         for nw, ns in ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3))
                         for ks in (1, 2, 4, 8) if (bn, nw, ns, ks) != up]
                grid += [(up, (bn, nw, ns)) for bn in (32, 64, 128)
                         for nw, ns in ((4, 2), (4, 3), (4, 4), (4, 6), (8, 4)) if (bn, nw, ns) != down]
            row = {}
            for tiles in grid:
                try:
                    row[str(tiles)] = graph_us([lambda a=a: fused_moe(x, ids, wt, *a, n_shared=c.n_shared_experts,
                                                                      tiles=tiles) for a in layers])
                except triton.runtime.errors.OutOfResources:  # e.g. BF16 128-wide tiles at 4 stages
                    torch.cuda.synchronize()
            if sweep and M > 2:  # rows a block x products x-first / weights-first x the up kernel's warps
                for bm, swap, nw in itertools.product((16, 32, 64), (False, True), (4, 8)):
                    t = ((up[0], nw, *up[2:]), down)
                    row[f"rows {bm} {'weights' if swap else 'x'}-first up warps {nw}"] = graph_us(
                        [lambda a=a: fused_moe(x, ids, wt, *a, n_shared=c.n_shared_experts, tiles=t, block_m=bm,
                                               swap=swap) for a in layers])
            if M <= 4:  # the GEMV kernels (fused_moe's default up to MOE_GEMV_TOKENS)
                row["gemv"] = graph_us([lambda a=a: fused_moe(x, ids, wt, *a, n_shared=c.n_shared_experts, gemv=True)
                                        for a in layers])
                for slab, nw in itertools.product((8192, 16384, 32768, 65536), (4, 8)) if sweep else ():
                    row[f"gemv slab {slab} warps {nw}"] = graph_us(
                        [lambda a=a: _moe_gemv(x, ids, wt, *(a + (None,) * 3)[:6], 10.0, c.n_shared_experts,
                                               slab=slab, warps=nw).summed() for a in layers])
            print(f"moe {'fp8' if fp8 else 'bf16'} M {M:4d} ({hit} experts, {nbytes / 1e6:.0f} MB), us a call"
                  f" (weight GB/s), (up tiles), (down tiles) as (BLOCK_N, warps, stages):", flush=True)
            for t, v in sorted(row.items(), key=lambda r: r[1]):
                mark = "  default" if t == str(default) else ""
                print(f"  {v:7.1f} ({nbytes / v / 1e3:4.0f})  {t}{mark}", flush=True)
        del layers
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/mini.yaml")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--sweep", action="store_true", help="time every tile shape, not only the defaults")
    ap.add_argument("--moe", action="store_true", help="also the grouped expert kernels")
    ap.add_argument("--no-linears", action="store_true", help="skip the linears (with --moe: the experts only)")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value on the config's model section, e.g. "
                    "model.n_routed_experts=32")
    args = ap.parse_intermixed_args()
    c = load_model_config(args.config, args.overrides)
    if not torch.cuda.is_available():
        raise SystemExit("bench/fp8_linear.py: needs a CUDA or ROCm GPU (torch.cuda.is_available() is False)")
    batches = [int(b) for b in args.batches.split(",")]
    print(f"{torch.cuda.get_device_name()}, {' '.join([args.config, *args.overrides])}")
    if not args.no_linears:
        linears(c, batches, args.sweep)
        bf16_inputs(c, batches)
    if args.moe:
        experts(c, batches, args.sweep)


if __name__ == "__main__":
    main()
