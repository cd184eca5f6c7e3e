"""Run under torchrun (gloo; NCCL with --device cuda): the sharded actor (FSDP2 + expert parallelism) against
the single-process model.

    torchrun --standalone --nproc-per-node N tests/parallel_check.py --ep E [--ckpt] [--no-reshard] [--device cuda]

Same batch (split across ranks), same weights: the loss, every gradient and the weights after one AdamW step
must equal the unsharded model's within fp32 tolerance, and so must the loss of a no-grad forward after that step
and after a second one; full_state's gather (gather_rows) must equal DTensor.full_tensor() on rows that split
unevenly. Exits non-zero on a mismatch. --no-reshard: blocks keep their gathered weights from
forward to backward, and a no-grad forward (GRPO's pi_old pass) runs first, leaving them gathered.
--device cuda: one GPU a rank and NCCL (the actor's collectives as train_grpo.py runs them), the single-process
model on each rank's GPU too.
"""
import argparse
import atexit
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import ModelConfig, build_model  # noqa: E402
from model.config import load_yaml  # noqa: E402
from model.parallel import (AdamW, clip_grad_norm, close_process_groups, copy_full_state, full_state,  # noqa: E402
                            gather_rows, make_actor_groups, reshard, sharded_actor)


def init_rank(device: str) -> torch.device:
    """This torchrun rank's device (cuda: its LOCAL_RANK's GPU, made current) and process group (NCCL on a GPU,
    else gloo), one CPU thread."""
    torch.set_num_threads(1)
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    atexit.register(close_process_groups)  # (gloo's threads joined before the interpreter's finalization)
    return dev


def torchrun(script: str, n: int, *args: str, timeout: float = 600, **env: str):
    """script under torchrun on n ranks with args, env added to the environment (OMP threads 1): the finished
    process (the tests assert its returncode, its output tail their message)."""
    import subprocess
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                           script, *args], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **env), timeout=timeout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--ckpt", action="store_true")
    ap.add_argument("--no-reshard", action="store_true")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    dev = init_rank(args.device)
    N, rank = dist.get_world_size(), dist.get_rank()
    mesh = make_actor_groups(N, args.ep, dev.type)
    cfg = ModelConfig.from_dict(load_yaml("configs/tiny.yaml", ["model.vocab_size=32"])["model"])
    ref = build_model(cfg, seed=0)
    with torch.no_grad():  # diverse routing: every expert gets tokens from several ranks
        for n, p in ref.named_parameters():
            if p.ndim >= 2 and "hc_" not in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * p.shape[-1] ** -0.5)
    ref.to(dev)
    sharded = sharded_actor(cfg, mesh, torch.float32, dev, reshard_after_forward=not args.no_reshard)
    copy_full_state(sharded, ref.state_dict().items())
    sharded.activation_checkpointing = args.ckpt

    g = torch.Generator().manual_seed(1)
    B, T = 2 * N, 40
    ids = torch.randint(3, 32, (B, T), generator=g).to(dev)
    mask = (torch.rand(B, T - 1, generator=g) < 0.7).float().to(dev)
    total = mask.sum()

    def loss_of(model, rows):
        lp, _ = model(ids[rows], targets_mask=mask[rows])
        return -(lp * mask[rows]).sum() / total

    ref_loss = loss_of(ref, list(range(B)))
    ref_loss.backward()
    mine = list(range(rank, B, N))
    if args.no_reshard:
        with torch.no_grad():
            loss_of(sharded, mine)
    loss = loss_of(sharded, mine)
    loss.backward()
    got = loss.detach().clone()
    dist.all_reduce(got)
    ok = torch.allclose(got, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    errors = [] if ok else [f"loss {got.item()} vs {ref_loss.item()}"]
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    # (the plain collective of full_state's gather, checked against DTensor's own below; the functional one's wait
    # was seen to crash now and then over gloo)
    grad_full = {n: (gather_rows(p.grad) if hasattr(p.grad, "full_tensor") else p.grad) if p.grad is not None else None
                 for n, p in sharded.named_parameters()}
    for n, gfull in grad_full.items():
        if gfull is not None and mesh.ep > 1 and ".ffn.experts." in n:
            parts = [torch.empty_like(gfull) for _ in range(mesh.ep)]
            dist.all_gather(parts, gfull.contiguous(), group=mesh.ep_group)
            gfull = torch.cat(parts)
        want = ref_grads[n]
        if (want is None) != (gfull is None) or (want is not None and not torch.allclose(gfull, want, rtol=1e-4, atol=1e-6)):
            err = None if want is None or gfull is None else (gfull - want).abs().max().item()
            errors.append(f"grad {n}: max diff {err}")
    # one clipped AdamW step on both; eps above fp32 gradient noise (a first Adam step is ~ g / (|g| + eps), so
    # near-zero gradients that differ by rounding would otherwise move by a sizeable fraction of lr)
    opt_ref = AdamW(ref.named_parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
    opt = AdamW(sharded.named_parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
    n_ref = clip_grad_norm([p for _, p, _ in opt_ref.params], 0.5, None)
    n_sh = clip_grad_norm([p for _, p, _ in opt.params], 0.5, mesh.actor_group)
    if abs(n_ref - n_sh) > 1e-4 * max(1.0, n_ref):
        errors.append(f"grad norm {n_sh} vs {n_ref}")
    before = {n: t.clone() for n, t in ref.state_dict().items()}
    for n, full in full_state(sharded, mesh):  # also fills full_state's kept tensors, which must see the step
        if not torch.equal(full, before[n]):
            errors.append(f"weight {n} before the step differs")
    opt_ref.step()
    opt.step()
    after = dict(ref.state_dict())
    for n, full in full_state(sharded, mesh):
        if not torch.allclose(full, after[n], rtol=1e-4, atol=1e-5):
            errors.append(f"weight {n} after the step: max diff {(full - after[n]).abs().max().item()}")
    # the forward after an update sees it: once after the backward's reshard, once after a no-grad forward left
    # the gathered copies in place (a second step from the same gradients, then reshard)
    for k in range(2):
        if k:
            opt_ref.step()
            reshard(sharded)
            opt.step()
        with torch.no_grad():
            want = loss_of(ref, list(range(B)))
            got = loss_of(sharded, mine)
        dist.all_reduce(got)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-6):
            errors.append(f"no-grad loss after step {k + 1}: {got.item()} vs {want.item()}")
    # full_state's gather against DTensor's own, rows that split unevenly or leave ranks empty included
    from torch.distributed.tensor import Shard, distribute_tensor
    dense, _ = mesh.meshes()
    for rows in range(2 * N + 2):
        x = torch.randn(rows, 3, 2, generator=torch.Generator().manual_seed(rows)).to(dev)
        d = distribute_tensor(x, dense, [Shard(0)])
        if not (torch.equal(gather_rows(d), x) and torch.equal(d.full_tensor(), x)):
            errors.append(f"gather_rows of {rows} rows over {N} ranks")
    if errors:
        print(f"rank {rank}: {len(errors)} mismatches: {errors[:5]}", flush=True)
    sys.exit(1 if errors else 0)  # (the process groups close at exit: init_rank registered close_process_groups)


def launch(n: int, ep: int, *extra: str, timeout: float = 600, **env: str):
    """This check under torchrun on n ranks (`--ep ep` plus extra flags): `torchrun`'s finished process."""
    return torchrun(__file__, n, "--ep", str(ep), *extra, timeout=timeout, **env)


if __name__ == "__main__":
    main()
