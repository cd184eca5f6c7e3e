"""Run under torchrun (gloo, 4 ranks): checkpoint shards written under one actor layout (n actor ranks, train.ep)
and read under another by train_grpo.read_resharded must hold what the reading layout's own shards hold, bit for
bit: every weight and both AdamW moments, for every pair of layouts below (untied embeddings; tied, three); and
model.export's reader must give back the full tensors from each layout's shards.

    torchrun --standalone --nproc-per-node 4 tests/reshard_check.py DIR

The expected shards come from FSDP2 itself (copy_full_state of the same full tensors into the reading layout's
model), not from layout_rows. tiny.yaml's tensors split unevenly over 3 and 4 ranks and leave some ranks empty.
Exits non-zero on a mismatch.
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import ModelConfig, build_model  # noqa: E402
from model.config import load_yaml  # noqa: E402
from model.export import checkpoint_config, checkpoint_tensors  # noqa: E402
from model.parallel import AdamW, copy_full_state, local, make_actor_groups, sharded_actor  # noqa: E402
from model.weights import save_tensors  # noqa: E402
from tests.parallel_check import init_rank  # noqa: E402
from train_grpo import read_resharded, shard_tensors  # noqa: E402

LAYOUTS = {False: [(1, 1), (2, 1), (2, 2), (3, 1), (4, 2), (4, 4)],  # (actor ranks, ep); tiny.yaml has 8 experts
           True: [(1, 1), (3, 1), (4, 2)]}  # tied embeddings (the head's alias is stored once): fewer, for time


def main():
    dev = init_rank("cpu")
    root, rank = Path(sys.argv[1]), dist.get_rank()
    errors = []
    for tied in (False, True):
        cfg = ModelConfig.from_dict(load_yaml("configs/tiny.yaml", [f"model.tie_word_embeddings={tied}"])["model"])
        full = build_model(cfg, seed=0).state_dict()
        g = torch.Generator().manual_seed(1)
        moments = [{k: torch.randn(v.shape, generator=g).abs() * s for k, v in full.items()} for s in (0.1, 1e-3)]
        shards = {}  # layout -> (model, optimizer, what this rank's checkpoint file holds)
        for n, ep in LAYOUTS[tied]:  # every rank makes every layout's groups (a collective); ranks past n hold none
            mesh = make_actor_groups(n, ep, dev.type)
            if mesh is None:
                continue
            model = sharded_actor(cfg, mesh, torch.float32, dev)
            opt = AdamW(model.named_parameters(), lr=1e-3)
            for i, m in enumerate(moments):  # the moments' shards: full tensors laid out by FSDP2 as the weights are
                copy_full_state(model, m.items())
                laid_out = model.state_dict()
                for name in opt.state:
                    opt.state[name][i].copy_(local(laid_out[name]))
            copy_full_state(model, full.items())
            held = shard_tensors(model, opt)
            d = root / f"{'tied' if tied else 'untied'}-{n}x{ep}"
            d.mkdir(parents=True, exist_ok=True)
            save_tensors({"rng.torch": torch.tensor([rank], dtype=torch.uint8), **held},
                         d / f"actor-rank{rank:05d}.safetensors")
            shards[n, ep] = model, opt, held
            if rank == 0:  # what model.export reads besides the shards
                (d / "meta.json").write_text(json.dumps({"n_actor": n, "ep": ep, "config": {"model": cfg.to_dict()}}))
        dist.barrier()
        if rank == 0:  # model.export: every layout's shards back to the full tensors
            for n, ep in LAYOUTS[tied]:
                d = root / f"{'tied' if tied else 'untied'}-{n}x{ep}"
                got = dict(checkpoint_tensors(d, *checkpoint_config(d)))
                errors += [f"export of {d.name}: {k}" for k, v in got.items() if not torch.equal(v, full[k])]
                if len(got) != len(full) - tied:
                    errors.append(f"export of {d.name}: {len(got)} tensors")
        for (n, ep), (model, opt, want) in shards.items():
            for n_w, ep_w in LAYOUTS[tied]:
                if (n_w, ep_w) == (n, ep):
                    continue
                d = root / f"{'tied' if tied else 'untied'}-{n_w}x{ep_w}"
                got = read_resharded(model, opt, d, rank, n_w, ep_w)
                what = f"tied={tied}, written {n_w}x{ep_w}, read {n}x{ep} by rank {rank}"
                if got.pop("rng.torch").tolist() != [rank % n_w]:
                    errors.append(f"{what}: the RNG state of another writer")
                if got.keys() != want.keys():
                    errors.append(f"{what}: names {sorted(got.keys() ^ want.keys())[:4]}")
                errors += [f"{what}: {k} {tuple(got[k].shape)} {got[k].dtype}, want {tuple(v.shape)} {v.dtype}"
                           for k, v in want.items() if k in got and not (got[k].dtype == v.dtype
                                                                         and torch.equal(got[k], v))]
    if errors:
        print(f"rank {rank}: {len(errors)} mismatches: {errors[:5]}", flush=True)
    sys.exit(1 if errors else 0)  # (the process groups close at exit: init_rank registered close_process_groups)


if __name__ == "__main__":
    main()
