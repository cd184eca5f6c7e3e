"""The actor's training step on 1..N GPUs: FSDP2 (+ expert parallelism), BF16 compute, fp32 master weights.

    torchrun --standalone --nproc-per-node 2 bench/train.py --config configs/mini.yaml --batch 4 --seq 2048 [--ckpt]

A step is what the GRPO actor does per mini-batch: forward to per-token log-probs (head only where needed),
a policy-gradient loss, backward (FSDP reduce-scatter), global-norm clipping and AdamW. Tokens per GPU per step =
batch x seq. MFU = 6 x active parameters x tokens / step time / peak, with the peak bf16 matmul rate measured on
each GPU in the same run (8192^3), summed over GPUs. --profile prints the top CUDA kernels of one step.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import build_model  # noqa: E402
from model.parallel import (AdamW, clip_coef, clip_grad_norm, copy_full_state, make_actor_groups,  # noqa: E402
                            reshard, sharded_actor)
from bench.model_fwd_bwd import matmul_peak  # noqa: E402
from train_grpo import RunConfig  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/mini.yaml")
    ap.add_argument("--batch", type=int, help="sequences per GPU (default: the config's train.micro_batch)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--ckpt", action="store_true", help="activation checkpointing per block")
    ap.add_argument("--reshard", action=argparse.BooleanOptionalAction,
                    help="FSDP reshard_after_forward (default: the config's train.reshard_after_forward); "
                         "--no-reshard keeps the gathered bf16 weights from forward to backward")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--trace", type=Path, help="with --profile: also write the step's Chrome trace (.json.gz) here")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the torch twins of the fused ops (no effect where the Triton kernels run)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("bench/train.py runs under torchrun: torchrun --standalone --nproc-per-node N bench/train.py [...]")
    if not torch.cuda.is_available():
        raise SystemExit("bench/train.py: needs a CUDA or ROCm GPU (torch.cuda.is_available() is False)")
    run = RunConfig.load(args.config)  # the whole config validated, as train_grpo.py loads it
    cfg = run.model
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if args.batch is None:  # the config's micro-batch; 0 there means a rank's whole mini-batch
        t = run.train
        args.batch = t.micro_batch or max(1, t.prompts_per_step * t.group_size // (t.minibatches * world))
    if args.reshard is None:
        args.reshard = run.train.reshard_after_forward
    peak = matmul_peak()
    mesh = make_actor_groups(world, args.ep, "cuda")
    model = sharded_actor(cfg, mesh, torch.bfloat16, "cuda", args.reshard)
    full = build_model(cfg, "cuda", torch.float32, seed=0)
    copy_full_state(model, full.state_dict().items())
    del full
    torch.cuda.empty_cache()
    model.activation_checkpointing = args.ckpt
    if args.compile:
        from model.model import compile_fusions
        compile_fusions(True)
    model.train()
    opt = AdamW(model.named_parameters(), 1e-5, (0.9, 0.95))
    params = [p for _, p, _ in opt.params]
    g = torch.Generator("cuda").manual_seed(rank)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda", generator=g)
    mask = torch.ones(args.batch, args.seq - 1, device="cuda")
    adv = torch.randn(args.batch, 1, device="cuda", generator=g)

    def step():
        lp, _ = model(ids, attention_mask=torch.ones_like(ids), targets_mask=mask)
        loss = -(lp * adv * mask).sum() / (mask.sum() * world)
        loss.backward()
        norm = clip_grad_norm(params, 1.0, mesh.actor_group, scale=False)
        reshard(model)  # as train_grpo does before its update
        opt.step(clip=clip_coef(norm, 1.0))
        opt.zero_grad()

    step()  # warm up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    dt = sorted(times)[len(times) // 2]
    peaks = torch.tensor([peak], device="cuda")
    dist.all_reduce(peaks)
    tokens = args.batch * args.seq * world
    counts = cfg.param_counts()
    r = {"device": torch.cuda.get_device_name(), "gpus": world, "config": args.config, "ep": args.ep, "compile": args.compile,
         "batch_per_gpu": args.batch, "seq": args.seq, "activation_checkpointing": args.ckpt,
         "reshard_after_forward": args.reshard, "step_s": dt,
         "tokens_per_s": tokens / dt, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30,
         "bf16_matmul_tflops_per_gpu": peak / 1e12, "params_active": counts["active"],
         "mfu": 6 * counts["active"] * tokens / dt / float(peaks)}
    if rank == 0:
        print(json.dumps(r))
        print(f"{r['device']} x{world}: {args.config} train step, {args.batch}x{args.seq} tokens/GPU, ckpt={args.ckpt}, "
              f"reshard={args.reshard}, "
              f"compile={args.compile}: "
              f"{r['tokens_per_s']:.0f} tok/s, step {dt * 1e3:.0f} ms, peak {r['peak_mem_gib']:.1f} GiB, "
              f"MFU {100 * r['mfu']:.1f}% of {r['bf16_matmul_tflops_per_gpu']:.0f} TFLOP/s per GPU measured here", flush=True)
        if args.json:
            args.json.write_text(json.dumps(r))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            step()
            torch.cuda.synchronize()
        if rank == 0:  # ops and kernels by their own GPU time, then the ops by input shapes
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=90, max_name_column_width=70),
                  flush=True)
            print(prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=40, max_shapes_column_width=90),
                flush=True)
            if args.trace:
                prof.export_chrome_trace(str(args.trace))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
