"""Score token sequences under a DeepSeek-V4 checkpoint: per-token NLL, perplexity, tokens/s.

    python -m model.score --model DIR [--tokens FILE.jsonl] [--dtype bf16] [--device cuda]
    python -m model.score --init configs/tiny.yaml --save runs/tiny-init   # random model -> release layout -> score

FILE.jsonl holds one JSON list of token ids per line; without it, random sequences of --seq-len tokens are scored.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .config import ConfigError, ModelConfig, load_yaml
from .model import DTYPES, build_model
from .tasks import jsonl_lines
from .weights import load_pretrained, save_pretrained


def read_sequences(path: Path, vocab: int) -> list[list[int]]:
    seqs = []
    try:
        lines = jsonl_lines(path)
    except OSError as e:
        raise SystemExit(f"--tokens {path}: cannot read ({type(e).__name__}: {e})") from None
    except ValueError as e:  # not UTF-8 text
        raise SystemExit(f"--tokens {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ids = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}:{n}: not JSON ({e})")
        if not isinstance(ids, list) or len(ids) < 2 or not all(isinstance(i, int) and not isinstance(i, bool)
                                                                and 0 <= i < vocab for i in ids):
            raise SystemExit(f"{path}:{n}: expected a list of >= 2 token ids in [0, {vocab})")
        seqs.append(ids)
    if not seqs:
        raise SystemExit(f"{path}: no sequences")
    return seqs


@torch.no_grad()
def score(model, seqs: list[list[int]], device) -> dict:
    nll, count, t0 = 0.0, 0, time.perf_counter()
    for ids in seqs:
        x = torch.tensor([ids], device=device)
        logits = model(x)[0, :-1].float()
        nll += F.cross_entropy(logits, x[0, 1:], reduction="sum").item()
        count += len(ids) - 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return {"sequences": len(seqs), "tokens": count, "nll_per_token": nll / count,
            "perplexity": math.exp(nll / count), "tokens_per_s": sum(map(len, seqs)) / dt}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="checkpoint directory (config.json + safetensors)")
    src.add_argument("--init", type=Path, help="YAML config: build a random model from its model: section")
    ap.add_argument("--save", type=Path, help="with --init: write the model here in the release layout, reload it")
    ap.add_argument("--tokens", type=Path, help="JSONL file, one list of token ids per line")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--num-seqs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if args.tokens is None and (args.seq_len < 2 or args.num_seqs < 1):
        ap.error(f"--seq-len {args.seq_len} / --num-seqs {args.num_seqs}: at least 2 tokens (one predicted) and "
                 "one sequence")
    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        ap.error(f"--device {args.device}: {e}")
    dtype = DTYPES[args.dtype]
    try:
        if args.init is not None:
            cfg = ModelConfig.from_dict(load_yaml(args.init).get("model"), f"{args.init}: model")
            model = build_model(cfg, device, dtype, seed=args.seed)
            if args.save is not None:
                save_pretrained(model, args.save)
                print(f"saved {cfg.param_counts()['total'] / 1e6:.2f}M parameters to {args.save}")
                model = load_pretrained(args.save, device, dtype)
        else:
            model = load_pretrained(args.model, device, dtype)
    except (ConfigError, FileNotFoundError, ValueError) as e:  # WeightError is a ValueError
        raise SystemExit(f"{type(e).__name__}: {e}") from None
    cfg = model.cfg
    if args.tokens is not None:
        seqs = read_sequences(args.tokens, cfg.vocab_size)
    else:
        g = torch.Generator().manual_seed(args.seed)
        seqs = torch.randint(0, cfg.vocab_size, (args.num_seqs, args.seq_len), generator=g).tolist()
    r = score(model, seqs, device)
    print(f"{r['sequences']} sequences, {r['tokens']} predicted tokens: nll/token {r['nll_per_token']:.4f}, "
          f"perplexity {r['perplexity']:.2f} (uniform over the vocabulary: {cfg.vocab_size}), "
          f"{r['tokens_per_s']:.0f} tokens/s on {device}")
    return r


if __name__ == "__main__":
    main()
