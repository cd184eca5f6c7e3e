"""Run under torchrun on one rank: a weight sync's bytes from an actor to an engine in the same process, checked
the way `rollout.sync_verify` checks it.

    torchrun --standalone --nproc-per-node 1 tests/sync_graph_check.py [--device cuda] [dotted.key=value ...]

The actor (one rank, configs/tiny.yaml with the overrides) packs its weights into the sync buckets as
`RolloutClient.sync_weights` does: on CUDA through `GraphPacker`'s captured graphs, replayed (the path a real run
takes with one actor rank on a GPU), on CPU by the eager packing. Each bucket is copied into the receiver's
`WeightApplier` buffer and applied to the engine, as `_receive_weights` does after a broadcast. Then the producer's
checksum pass (the one sync_weights makes after a replayed sync) must give exactly the checksums `held_checksums`
reads from the engine, for an FP8 sync (FP8 bytes and scales) and one in the rollout's dtype (the FP8-held tensors
quantized on arrival), before and after an in-place update of the actor's weights (the replayed graphs must see it).
Exits non-zero on a mismatch.
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import build_model  # noqa: E402
from model.parallel import local, make_actor_groups  # noqa: E402
from rollout_server import GraphPacker, WeightApplier, held_checksums, pack_bucket  # noqa: E402
from tests.parallel_check import init_rank, torchrun  # noqa: E402
from train_grpo import DTYPES, Actor, Dist, RunConfig, make_engine  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--bucket-mb", type=float, default=0.05)  # several buckets, FP8 tensors split across them
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    dev = init_rank(args.device)
    if dist.get_world_size() != 1:
        raise SystemExit("tests/sync_graph_check.py runs on one rank (--nproc-per-node 1)")
    cfg = RunConfig.load("configs/tiny.yaml", ["rollout.fp8=true", *args.overrides])
    d = Dist(0, 1, 1, dev, make_actor_groups(1, 1, dev.type), None)
    actor = Actor(cfg, d)
    engine = make_engine(cfg, build_model(cfg.model, dev, DTYPES[cfg.rollout.dtype], seed=None), dev)
    bucket_bytes = int(args.bucket_mb * 2 ** 20)
    rdtype, fp8 = actor.sync_format()
    for mode, q in (("fp8", fp8), (str(rdtype).removeprefix("torch."), None)):
        spec = actor.weight_spec(rdtype, q)
        producer = lambda dst, sums, q=q: actor.full_weights(rdtype, q, sums, dst)  # noqa: E731
        packer = GraphPacker(spec, bucket_bytes, producer, dev) if actor.sync_capturable() else None
        applier = WeightApplier(engine.model, spec, bucket_bytes, dev)
        before = None
        for rnd in range(2):
            # each bucket as the sender makes it (replayed graphs, or the eager packing), in the receiver's buffer
            views = {}
            it = None if packer else iter(producer(views.get, None))
            for k, idx in enumerate(applier.plans):
                if packer is not None:
                    applier.bucket(k).copy_(packer.pack(k))
                else:
                    pack_bucket(spec, idx, applier.bucket(k), it, views)
                applier.apply(k)
            sums = {}
            for _ in producer(None, sums):
                pass
            held = held_checksums(engine.model, spec)
            if held.keys() != sums.keys():
                raise SystemExit(f"{mode} round {rnd}: the engine holds {sorted(held.keys() ^ sums.keys())[:3]} "
                                 f"unlike the sender's checksums")
            bad = [key for key in sums if sums[key] != held[key]]
            if bad:
                raise SystemExit(f"{mode} round {rnd}: {len(bad)} of {len(sums)} tensors differ, first {bad[:3]}")
            if before is not None and sum(before[key] != sums[key] for key in sums) < len(sums) // 2:
                raise SystemExit(f"{mode} round {rnd}: the update changed too few checksums (a stale capture?)")
            before = sums
            print(f"{mode} round {rnd}: {len(applier.plans)} buckets ({'CUDA graphs' if packer else 'eager'}), "
                  f"{len(sums)} checksums match", flush=True)
            with torch.no_grad():  # an optimizer step: in place, after the capture
                for p in actor.params:
                    local(p).mul_(-1.5).add_(0.25)
    print("sync check passed", flush=True)  # (the process groups close at exit: init_rank registered their closing)


def launch(*extra: str, timeout: float = 300):
    """This check under torchrun on one rank, extra its arguments: `torchrun`'s finished process."""
    return torchrun(__file__, 1, *extra, timeout=timeout, NCCL_NVLS_ENABLE="0")


if __name__ == "__main__":
    main()
