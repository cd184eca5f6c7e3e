"""FP8 linear at the decode path's shapes: act_quant + fp8_gemm at tile widths 16-128 (the heuristic's pick
marked), the small-M split kernel (fp8_linear_split) at tile widths 16-64 and 1-4 K blocks a program, and cuBLAS
BF16 (torch.nn.functional.linear) on the same GPU.

    python bench/fp8_linear.py --config configs/mini.yaml --batches 1,16,64,256

Per shape: microseconds per call under a CUDA graph (20 calls captured, replayed), and the weight bandwidth
that implies (weight bytes read / time: 1 a weight for FP8, 2 for BF16)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.fp8_gemm import _gemm_blocks, _split_blocks, act_quant, fp8_gemm, fp8_linear_split  # noqa: E402
from kernels.quant import fp8_dtype, quant_fp8_block  # noqa: E402
from model import ModelConfig  # noqa: E402
from model.config import load_yaml  # noqa: E402


def graph_us(fn, reps: int = 20, iters: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(iters):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) * 1e3 / (reps * iters)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/mini.yaml")
    ap.add_argument("--batches", default="1,16,64,256")
    args = ap.parse_args()
    c = ModelConfig.from_dict(load_yaml(args.config)["model"], f"{args.config}: model")
    D = c.hidden_size
    shapes = {"wq_a": (c.q_lora_rank, D), "wq_b": (c.num_attention_heads * c.head_dim, c.q_lora_rank),
              "wkv": (c.head_dim, D), "wo_b": (D, c.o_groups * c.o_lora_rank),
              "shared w1": (c.moe_intermediate_size, D), "shared w2": (D, c.moe_intermediate_size),
              "csa compressor": (2 * c.head_dim, D)}
    f8 = fp8_dtype("cuda")
    print(f"{torch.cuda.get_device_name()}: us per call (weight GB/s)")
    for M in [int(b) for b in args.batches.split(",")]:
        for name, (N, K) in shapes.items():
            w = torch.randn(N, K, device="cuda") * 0.02
            wq, ws = quant_fp8_block(w, f8, scale_fmt="fp32")
            wb = w.bfloat16()
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            row = {"bf16 cuBLAS": graph_us(lambda: torch.nn.functional.linear(x, wb))}
            bm, bn0 = _gemm_blocks(M, N)
            for bn in (16, 32, 64, 128):
                row[f"fp8 bn{bn}"] = graph_us(lambda: fp8_gemm(*act_quant(x, f8), wq, ws, blocks=(bm, bn)))
            for bn in (16, 32, 64):
                for ks in (1, 2, 4):
                    row[f"split bn{bn} ks{ks}"] = graph_us(lambda: fp8_linear_split(x, wq, ws, blocks=(bn, ks)))
            cells = "  ".join(f"{k} {v:6.1f} ({N * K * (2 if k.startswith('bf16') else 1) / v / 1e3:5.0f})"
                              for k, v in row.items())
            print(f"M {M:4d} {name:15s} N {N:5d} K {K:5d} (heuristic bn {bn0}, split {_split_blocks(N)}):"
                  f" {cells}", flush=True)


if __name__ == "__main__":
    main()
