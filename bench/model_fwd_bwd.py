"""Forward + backward of a DeepSeek-V4 config in BF16 on one GPU: tokens/s, peak memory, MFU.

    python bench/model_fwd_bwd.py --config configs/mini.yaml --batch 4 --seq 2048

MFU = 6 x active parameters x tokens / time / peak, with the peak bf16 matmul rate measured in the same run
(8192^3 torch.matmul). The loss is the training path's: final hidden states, head over every position in chunks.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import ModelConfig, build_model  # noqa: E402
from model.config import load_yaml  # noqa: E402
from train_grpo import token_logprobs  # noqa: E402


def matmul_peak(n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * n ** 3 / sorted(times)[len(times) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/mini.yaml")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ckpt", action="store_true", help="activation checkpointing per block")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/model_fwd_bwd.py: needs a CUDA or ROCm GPU (torch.cuda.is_available() is False)")
    cfg = ModelConfig.from_dict(load_yaml(args.config)["model"], f"{args.config}: model")
    peak = matmul_peak()
    model = build_model(cfg, "cuda", torch.bfloat16, seed=0)
    model.activation_checkpointing = args.ckpt
    counts = cfg.param_counts()
    g = torch.Generator("cuda").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda", generator=g)
    attn = torch.ones_like(ids)
    mask = torch.ones(args.batch, args.seq - 1, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.steps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        lp, _ = token_logprobs(model, ids, attn, mask, 1.0)
        (-lp.sum() / mask.sum()).backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i:  # the first step warms up kernels and the allocator
            times.append(time.perf_counter() - t0)
    dt = sorted(times)[len(times) // 2]
    tokens = args.batch * args.seq
    r = {"device": torch.cuda.get_device_name(), "config": args.config, "params_total": counts["total"],
         "params_active": counts["active"], "batch": args.batch, "seq": args.seq, "activation_checkpointing": args.ckpt,
         "step_s": dt, "tokens_per_s": tokens / dt, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30,
         "bf16_matmul_tflops": peak / 1e12, "mfu": 6 * counts["active"] * tokens / dt / peak}
    print(json.dumps(r))
    print(f"{r['device']}: {args.config} fwd+bwd bf16, {args.batch}x{args.seq} tokens: {r['tokens_per_s']:.0f} tok/s, "
          f"step {dt * 1e3:.0f} ms, peak memory {r['peak_mem_gib']:.1f} GiB, MFU {100 * r['mfu']:.1f}% of the "
          f"{r['bf16_matmul_tflops']:.0f} TFLOP/s bf16 matmul measured here")
    if args.json:
        args.json.write_text(json.dumps(r))


if __name__ == "__main__":
    main()
