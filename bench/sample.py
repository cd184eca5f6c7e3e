"""The decode step's draw on one GPU: the sampler's kernels against their torch twins, in one run.

    python bench/sample.py --rows 1,16,64,256 --vocab 129280 [--top-p 0.9] [--top-k 50] [--sweep] [--json F]

Per row count and filter (plain; top-p alone; top-k alone; both), bf16 logits N(0, --std^2) at --vocab tokens
(mini's and the release's vocabulary: 129,280), temperature 1:
- draw: what a decode step runs, kernels.sample.gumbel_sample (plain) or rollout_server.sample_filtered (the radix
  threshold search, then the Gumbel kernel given the thresholds), against the torch twins the CPU runs
  (sample_plain / sample_filtered(fused=False): torch.topk of the largest top-k where every row has one, else a
  sort of the vocabulary);
- threshold: kernels.sample.threshold alone against filter_threshold(fused=False), and the one torch op the twin
  ranks with (torch.topk of k, or the sort) as a floor for any rank-based threshold;
- checks, from the same calls: rows whose tokens differ between the kernels and the twins, rows whose
  thresholds differ.
Each time is one call's share of a CUDA graph that cycles through copies of the logits past the L2 (as the engine
replays its decode step in a graph; bench/fp8_linear.py's graph_us). --sweep: the threshold at 1 / 2 / 4 key
bits a pass and 4 / 16 / 64 slices a row too. --device cpu is a smoke run (wall time of eager calls; the kernels
are the twins there, or Triton's interpreter under TRITON_INTERPRET=1)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FILTERS = ("plain", "top-p", "top-k", "both")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--std", type=float, default=2.0, help="the logits' standard deviation")
    ap.add_argument("--filters", default=",".join(FILTERS), help=f"a comma list of {', '.join(FILTERS)}")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    try:
        args.rows = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        args.rows = [0]
    if not args.rows or min(args.rows) < 1:
        ap.error(f"--rows {args.rows!r}: positive integers separated by commas")
    if not 2 <= args.vocab < 2 ** 24:
        ap.error(f"--vocab {args.vocab}: 2 to 2^24 - 1 tokens (the sampler's indices are exact in fp32)")
    if not 0 < args.top_p < 1:
        ap.error(f"--top-p {args.top_p}: in (0, 1) (1 filters nothing)")
    if not 1 <= args.top_k <= args.vocab:
        ap.error(f"--top-k {args.top_k}: 1 to --vocab")
    if not args.std > 0:
        ap.error(f"--std {args.std}: positive")
    args.filters = [f.strip() for f in args.filters.split(",") if f.strip()]
    if not args.filters or any(f not in FILTERS for f in args.filters):
        ap.error(f"--filters {','.join(args.filters)!r}: a comma list of {', '.join(FILTERS)}")
    return args


def wall_us(fns, iters: int = 3) -> float:
    """Microseconds a call of fns (no-argument callables), eager, by the host's clock (the CPU smoke run)."""
    for f in fns:
        f()
    t0 = time.perf_counter()
    for _ in range(iters):
        for f in fns:
            f()
    return (time.perf_counter() - t0) * 1e6 / (iters * len(fns))


def main(argv=None):
    args = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/sample.py: needs a CUDA or ROCm GPU (torch.cuda.is_available() is False); "
                         "--device cpu for a smoke run")
    from kernels.fp8_gemm import use_triton
    from kernels.sample import gumbel_sample, threshold
    from rollout_server import filter_threshold, sample_filtered, sample_plain
    if args.device == "cuda":  # (bench.fp8_linear imports triton: GPUs only)
        from bench.fp8_linear import copies, graph_us
    else:
        copies, graph_us = (lambda nbytes: 1), wall_us

    dev, V = args.device, args.vocab
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
           "vocab": V, "std": args.std, "commit": commit, "rows": []}
    print(f"{res['device']}, commit {res['commit']}, vocab {V}, bf16 logits N(0, {args.std:g}^2), us a call "
          + ("(a CUDA graph's share)" if dev == "cuda" else "(eager, the host's clock: a smoke run)"), flush=True)
    g = torch.Generator(dev).manual_seed(0)
    for B in args.rows:
        n = copies(B * V * 2)  # copies of the logits, together past the L2
        logits = [(torch.randn(B, V, device=dev, generator=g) * args.std).to(torch.bfloat16) for _ in range(n)]
        temps = torch.ones(B, device=dev)
        seeds = torch.randint(0, 2 ** 62, (B,), device=dev, generator=g)
        steps = torch.arange(B, device=dev)
        for f in args.filters:
            k = torch.full((B,), args.top_k if f in ("top-k", "both") else 0, device=dev)
            p = torch.full((B,), args.top_p if f in ("top-p", "both") else 1.0, device=dev)
            cand = args.top_k if f in ("top-k", "both") else None  # filter_candidates' count for these rows
            r = {"rows": B, "filter": f, "copies": n}
            if f == "plain":
                plain = gumbel_sample if use_triton(logits[0]) else sample_plain  # (the CPU's: the twin)
                kern = [lambda x=x: plain(x, temps, seeds, steps) for x in logits]
                twin = [lambda x=x: sample_plain(x, temps, seeds, steps) for x in logits]
            else:
                kern = [lambda x=x: sample_filtered(x, temps, k, p, seeds, steps, cand) for x in logits]
                twin = [lambda x=x: sample_filtered(x, temps, k, p, seeds, steps, cand, fused=False) for x in logits]
            r["draw_us"], r["draw_twin_us"] = graph_us(kern), graph_us(twin)
            r["tokens_differing"] = int((kern[0]()[0] != twin[0]()[0]).sum())
            line = (f"rows {B:4d} {f:6s}: draw {r['draw_us']:8.1f} against the twin's {r['draw_twin_us']:8.1f} "
                    f"({r['draw_twin_us'] / r['draw_us']:.1f}x)")
            if f != "plain":
                r["threshold_us"] = graph_us([lambda x=x: filter_threshold(x, temps, k, p) for x in logits])
                r["threshold_twin_us"] = graph_us([lambda x=x: filter_threshold(x, temps, k, p, cand, fused=False)
                                                   for x in logits])
                rank = "topk" if cand is not None else "sort"
                r[f"{rank}_us"] = graph_us([(lambda x=x: x.float().topk(cand, -1)) if cand is not None else
                                            (lambda x=x: x.float().sort(-1, descending=True)) for x in logits])
                r["thresholds_differing"] = int((filter_threshold(logits[0], temps, k, p) !=
                                                 filter_threshold(logits[0], temps, k, p, cand, fused=False)).sum())
                line += (f"; threshold {r['threshold_us']:8.1f} against the twin's {r['threshold_twin_us']:8.1f}, "
                         f"torch {rank} alone {r[f'{rank}_us']:8.1f}; thresholds differing {r['thresholds_differing']}")
                if args.sweep and use_triton(logits[0]):
                    r["sweep"] = {f"rbits {rb} split {sp or 'default'}": graph_us(
                        [lambda x=x, rb=rb, sp=sp: threshold(x, temps, k, p, rbits=rb, split=sp) for x in logits])
                        for rb in (1, 2, 4) for sp in (None, 4, 16, 64)}
                    line += "\n    sweep: " + ", ".join(f"{s} {t:.1f}" for s, t in r["sweep"].items())
            print(line + f"; tokens differing {r['tokens_differing']} of {B}", flush=True)
            res["rows"].append(r)
        del logits
        torch.cuda.empty_cache()
    print(json.dumps(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
