"""A training checkpoint (train_grpo.py's checkpoints/step_N: meta.json and one shard file per actor rank) as a
model in the release layout, in one process, a tensor at a time:

    python -m model.export runs/tiny/checkpoints/step_000150 runs/tiny-150 [--fp8] [--dtype bf16]

A tensor's full form is the rows its writers held, in row order (model.parallel.row_pieces under meta.json's
n_actor and ep), so a checkpoint of any actor layout exports, and host memory holds one tensor at a time. The
result loads wherever a release does: load_pretrained, Engine, `rollout_server.py --model`, `model.score`,
transformers. It is what the run would have written to out_dir/final had it stopped at that step.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from .config import ConfigError, ModelConfig, write_denied
from .model import DTYPES, Experts, Transformer
from .parallel import layout_error, row_pieces
from .weights import WeightError, release_tensors, save_pretrained


def _hint(path: Path) -> str:
    """For a directory that is no checkpoint: the checkpoints it holds, newest named."""
    steps = sorted((p for d in (path, path / "checkpoints") for p in d.glob("step_*")
                    if re.fullmatch(r"step_\d+", p.name) and (p / "meta.json").exists()),
                   key=lambda p: int(p.name[5:]))
    if steps:
        return f"; it holds {len(steps)} complete checkpoint(s), the newest {steps[-1]}"
    if (path / "config.json").exists():
        return " (config.json without meta.json: a release, which loads as it is)"
    return ""


def checkpoint_config(path: Path) -> tuple[ModelConfig, int, int]:
    """The model config of a training checkpoint and the layout it was written with (actor ranks, ep), checked."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        cfg = ModelConfig.from_dict(meta["config"]["model"], f"{path / 'meta.json'}: config.model")
        n_w, ep = int(meta["n_actor"]), int(meta.get("ep", 1))
    except FileNotFoundError:
        raise WeightError(f"{path}: not a training checkpoint (no meta.json){_hint(path)}") from None
    except (ValueError, KeyError, TypeError, ConfigError, OSError) as e:
        raise WeightError(f"{path / 'meta.json'}: corrupt ({type(e).__name__}: {e})") from None
    bad = layout_error(n_w, ep, cfg.n_routed_experts)
    if bad:
        raise WeightError(f"{path / 'meta.json'}: corrupt ({bad})")
    return cfg, n_w, ep


def checkpoint_tensors(path: Path, cfg: ModelConfig, n_w: int, ep: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(state_dict name, full fp32 tensor) for every tensor of the model, in state_dict order, each read from the
    shards that hold its rows; a tensor every writer holds whole (a buffer; everything on one rank) is writer 0's.
    Every file, name and shape is checked when this is called, before a tensor is read."""
    with torch.device("meta"):
        model = Transformer(cfg)
    experts = {n for n, m in model.named_modules() if isinstance(m, Experts)}
    files = [path / f"actor-rank{i:05d}.safetensors" for i in range(n_w)]
    handles = []
    for f in files:
        try:
            handles.append(safe_open(str(f), "pt"))
        except FileNotFoundError:
            raise WeightError(f"{path}: missing {f.name} (meta.json says {n_w} actor ranks wrote the checkpoint)") \
                from None
        except Exception as e:
            raise WeightError(f"{f}: corrupt checkpoint shard ({type(e).__name__}: {e})") from None
    names = [set(h.keys()) for h in handles]
    plan = []  # (name, [writers holding its rows, in row order])
    for name, t in model.stored_state().items():
        key, full = f"model.{name}", list(t.shape)
        for f, have in zip(files, names):
            if key not in have:
                raise WeightError(f"{f}: missing tensor {key}")
        shapes = [list(h.get_slice(key).get_shape()) for h in handles]
        if all(s == full for s in shapes):
            plan.append((name, [0]))
            continue
        pieces = row_pieces(full[0], 0, full[0], n_w, ep, name.rpartition(".")[0] in experts)
        for w, n, _ in pieces:
            if shapes[w] != [n, *full[1:]]:
                raise WeightError(f"{files[w]}: {key} is {shapes[w]}; the model's {full} written by {n_w} actor ranks "
                                  f"with ep={ep} would be {[n, *full[1:]]} there")
        plan.append((name, [w for w, _, _ in pieces]))

    def read():
        for name, writers in plan:
            parts = [handles[w].get_tensor(f"model.{name}") for w in writers]
            yield name, parts[0] if len(parts) == 1 else torch.cat(parts)
    return read()


def export_checkpoint(path: str | Path, out: str | Path, fp8: bool = False, dtype=torch.bfloat16,
                      progress: bool = False) -> Path:
    """Write the training checkpoint `path` to `out` in the release layout (save_pretrained's fp8 and dtype)."""
    path, out = Path(path), Path(out)
    cfg, n_w, ep = checkpoint_config(path)
    return save_pretrained(None, out, fp8=fp8, dtype=dtype, cfg=cfg, progress=progress,
                           tensors=release_tensors(checkpoint_tensors(path, cfg, n_w, ep), cfg))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path, help="a training checkpoint directory (checkpoints/step_N)")
    ap.add_argument("out", type=Path, help="the release directory to write")
    ap.add_argument("--fp8", action="store_true", help="linears as float8_e4m3fn with 128x128 block scales")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="every other tensor's dtype")
    args = ap.parse_args(argv)
    if args.out.resolve() == args.checkpoint.resolve():
        raise SystemExit(f"{args.out}: the checkpoint itself; name another directory")
    try:
        cfg, n_w, ep = checkpoint_config(args.checkpoint)
        denied = write_denied(args.out)
        if denied:
            raise SystemExit(f"{args.out}: {denied}")
        print(f"{args.checkpoint}: {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts, written by {n_w} "
              f"actor ranks with ep={ep}", flush=True)
        export_checkpoint(args.checkpoint, args.out, args.fp8, DTYPES[args.dtype], progress=True)
    except WeightError as e:
        raise SystemExit(str(e)) from None
    print(f"wrote {args.out} (release layout{', FP8 linears' if args.fp8 else ''}, {args.dtype})")


if __name__ == "__main__":
    main()
