"""Actor -> rollout weight sync on 2 GPUs, against the raw broadcast bandwidth measured in the same run.

    torchrun --standalone --nproc-per-node 2 bench/sync.py --config configs/mini.yaml

Rank 0 is the actor (FSDP2 over one rank, fp32 master weights), rank 1 the FP8 rollout engine in its serve loop.
First `dist.broadcast` of 1 GiB buffers between them (the raw rate); then full syncs through the code the trainer
runs (Actor.full_weights -> RolloutClient.sync_weights -> serve -> WeightApplier), FP8-quantized on the sender
and in BF16; achieved GB/s = bytes each receiver got / wall time. Last, the time a DeepSeek-V4-Flash sync would
take at the measured rate, from the memory planner's exact rollout weight bytes.
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
from model.config import ModelConfig, load_yaml  # noqa: E402
from model.plan import param_split  # noqa: E402
from train_grpo import Actor, RunConfig, build_model, init_dist, make_engine  # noqa: E402
from rollout_server import RolloutClient, serve  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/mini.yaml")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=256)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs for the sender's packing (the slow twin)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--profile", type=Path, help="write each rank's torch.profiler table to PROFILE.rank{0,1}.txt")
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("bench/sync.py runs under torchrun: torchrun --standalone --nproc-per-node 2 bench/sync.py [...]")
    if not torch.cuda.is_available():
        raise SystemExit("bench/sync.py: needs a CUDA or ROCm GPU (torch.cuda.is_available() is False)")
    cfg = RunConfig.load(args.config, ["deploy.world_size=2", "deploy.rollout_ranks=1", "train.compile=false"])
    d = init_dist(cfg)
    buf = torch.empty(2 ** 30, dtype=torch.uint8, device=d.device)
    for _ in range(2):
        dist.broadcast(buf, 0, group=d.sync_group)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dist.broadcast(buf, 0, group=d.sync_group)
    torch.cuda.synchronize()
    raw = 5 * buf.numel() / (time.perf_counter() - t0)
    del buf
    prof = None
    if args.profile:  # kernel and op times of the whole run on this rank (both sync formats), to a text table
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA])
    if d.rank == 1:
        engine = make_engine(cfg, build_model(cfg.model, d.device, torch.bfloat16, seed=None), d.device)
        if prof:
            prof.start()
        serve(engine, 0, d.sync_group, d.device)
        if prof:
            prof.stop()
            args.profile.with_suffix(".rank1.txt").write_text(
                prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
        dist.destroy_process_group()
        return
    actor = Actor(cfg, d)
    client = RolloutClient([1], d.sync_group, d.device)
    res = {"device": torch.cuda.get_device_name(), "config": args.config, "raw_broadcast_gb_s": raw / 1e9,
           "bucket_mb": args.bucket_mb}
    rdtype, fp8 = actor.sync_format()
    if prof:
        prof.start()
    bucket = int(args.bucket_mb * 2 ** 20)
    for mode, q in (("fp8", fp8), ("bf16", None)):
        spec = actor.weight_spec(rdtype, q)
        producer = lambda dst, sums, q=q: actor.full_weights(rdtype, q, sums, dst)  # noqa: E731
        graphs = None if args.eager else mode
        client.sync_weights(spec, producer, bucket, graphs=graphs)  # warm-up (and the graphs' capture)
        times, sent = [], 0
        for _ in range(args.iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            sent = client.sync_weights(spec, producer, bucket, graphs=graphs)
            # the rollout has the weights once its serve loop took the last bucket; a verification round trip
            # would add its checksum time, so the sender's completion of the last broadcast marks the end
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        dt = sorted(times)[len(times) // 2]
        # where the time goes on the sender: packing the buckets alone (gather, cast, quantize), not sending
        packer = client.packers.get(graphs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if packer is not None:
            for k in range(len(packer.graphs)):
                packer.pack(k)
        else:
            for _ in producer(None, None):
                pass
        torch.cuda.synchronize()
        alone = time.perf_counter() - t0
        # the same sync once more, checked: every weight the rollout holds (FP8 bytes and scales against the
        # actor's quantization, the rest against what was sent)
        client.sync_weights(spec, producer, bucket, verify=True, graphs=graphs)
        print(f"sender alone ({mode}, {'CUDA graphs' if packer else 'eager'}): packing takes {alone * 1e3:.1f} ms; "
              f"a verified sync matched every weight's checksum", flush=True)
        res[mode] = {"bytes": sent, "wall_s": dt, "gb_s": sent / dt / 1e9, "fraction_of_raw": sent / dt / raw,
                     "sender_alone_s": alone, "graphs": packer is not None, "verified": True}
        print(f"sync {mode}: {sent / 1e9:.2f} GB in {dt:.3f} s = {sent / dt / 1e9:.1f} GB/s, "
              f"{100 * sent / dt / raw:.0f}% of the raw broadcast {raw / 1e9:.1f} GB/s", flush=True)
    flash = ModelConfig.from_dict(load_yaml("configs/dsv4.yaml")["model"])
    ps = param_split(flash)
    fp8_bytes = ps["fp8_dense"] + ps["experts"] + 4 * (ps["fp8_dense_blocks"] + ps["expert_blocks"]) \
        + 2 * (ps["dense"] - ps["fp8_dense"] - ps["fp32_kept"]) + 4 * ps["fp32_kept"]
    rate = res["fp8"]["gb_s"] * 1e9
    res["dsv4_fp8_bytes"] = fp8_bytes
    res["dsv4_sync_s_at_measured_rate"] = fp8_bytes / rate
    res["dsv4_sync_s_at_50GB_s_link"] = fp8_bytes / 50e9
    print(f"DeepSeek-V4-Flash: {fp8_bytes / 1e9:.0f} GB per FP8 sync -> {fp8_bytes / rate:.1f} s at the rate measured "
          f"here (one source broadcasting to every rollout rank, as the trainer does); {fp8_bytes / 50e9:.1f} s if "
          f"the actor->rollout path is one 400 Gb/s NIC between nodes", flush=True)
    client.stop()
    if prof:
        prof.stop()
        args.profile.with_suffix(".rank0.txt").write_text(
            prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    print(json.dumps(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
