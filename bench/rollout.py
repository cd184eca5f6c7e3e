"""Rollout engine throughput on one GPU, against the memory-bandwidth roofline and two peers, in one run.

    python bench/rollout.py --config configs/mini.yaml --batches 1,16,64,256 --prompt-len 512 --gen-len 1024
    python bench/rollout.py --config configs/dsv4.yaml model.num_hidden_layers=4 ...   # dotted overrides

Per batch size: decode tokens/s of the FP8 paged engine (CUDA graphs) and of our BF16 path (same engine,
weights in BF16); the decode step's bytes -- the FP8 weights of the dense layers and of the experts the step
actually routes to, BF16 head and router, plus the cache a step must read (window, indexer keys, selected CSA
entries, HCA entries) -- over its time is the achieved bandwidth, reported as a fraction of the device-to-device
copy bandwidth measured here. `transformers` DeepseekV4ForCausalLM.generate (BF16, same weights) gives the
peer decode rate at --hf-batch. Long context: decode tokens/s at batch --long-batch with 1k vs 16k tokens of
prompt. Random weights (init std 0.02) and random prompts; generation ignores EOS so lengths are fixed.
Last, a `target ...: met / UNMET` line for each of the engine's targets (TARGETS) that this run's parts measure.
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import ModelConfig, build_model, save_pretrained  # noqa: E402
from model.weights import transformers_deepseek_v4  # noqa: E402
from model.config import load_model_config  # noqa: E402
from rollout_server import Engine, EngineExperts, SamplingParams  # noqa: E402


def copy_bandwidth(nbytes: int = 2 ** 31, iters: int = 10) -> float:
    """Device-to-device copy: (read + write) bytes per second."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(2):
        y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * nbytes * iters / (time.perf_counter() - t0)


def weight_bytes(engine: Engine) -> tuple[int, dict, int]:
    """Bytes of everything a decode step reads from the weights except the embedding table and the routed
    experts (counted per step), each layer's bytes per routed expert, and the bytes of the indexers' query
    projections (wq_b), which a step skips where no CSA layer holds more entries than the indexer's top-k."""
    dense, per_expert, index_q = 0, {}, 0
    for name, mod in engine.model.named_modules():
        if isinstance(mod, EngineExperts):
            layer = int(name.split(".")[1])
            per_expert[layer] = sum(t[0].numel() * t.element_size() for t in (mod.w1, mod.w2, mod.w3)) + \
                sum(t[0].numel() * 4 for t in (mod.s1, mod.s2, mod.s3) if t is not None)
    for name, t in list(engine.model.named_parameters()) + list(engine.model.named_buffers()):
        if ".experts." in name or name.startswith("embed.") or "inv_freq" in name:
            continue
        dense += t.numel() * t.element_size()
        index_q += t.numel() * t.element_size() if ".indexer.wq_b." in name else 0
    return dense, per_expert, index_q


def cache_bytes(cfg: ModelConfig, ctx: int, esize: int, every: bool = False) -> int:
    """Cache one sequence's decode step must read at context length ctx. every: a step within Runner.every_upto,
    which reads every CSA entry without the indexer, so none of its keys."""
    total = 0
    for i in range(cfg.num_hidden_layers):
        total += min(ctx, cfg.sliding_window) * cfg.head_dim * esize
        t = cfg.layer_type(i)
        if t == "compressed_sparse_attention":
            n = ctx // cfg.csa_ratio
            total += (0 if every else n * cfg.index_head_dim * 4) + min(n, cfg.index_topk) * cfg.head_dim * esize
        elif t == "heavily_compressed_attention":
            total += (ctx // cfg.hca_ratio) * cfg.head_dim * esize
    return total


def run(engine: Engine, B: int, prompt_len: int, gen_len: int, seed: int = 0) -> dict:
    cfg = engine.cfg
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, cfg.vocab_size, (B, prompt_len), generator=g).tolist()
    # B other prompts of the same length first: this batch's CUDA graph is captured (the one for steps past the
    # indexer's top-k of entries where the run's are, Runner.every_upto: ~1.5 s) and prefill's Triton kernels are
    # compiled for the run's chunk shapes (integer arguments specialize by divisibility: a 16k prompt's chunks took
    # ~3-6 s of compiling inside a timed prefill of ~3.4 s where the warm-up's prompts were shorter)
    warm = torch.randint(0, cfg.vocab_size, (B, prompt_len), generator=g).tolist()
    engine.generate(warm, SamplingParams(max_tokens=2, ignore_eos=True))
    for k in engine.stats:
        engine.stats[k] = 0 * engine.stats[k]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=gen_len, seed=seed, ignore_eos=True))
    total = time.perf_counter() - t0
    st = engine.stats
    dense, per_expert, index_q = weight_bytes(engine)
    esize = torch.empty(0, dtype=engine.dtype).element_size()
    routing = torch.stack([o.routed_experts for o in outs])  # (B, P + gen - 1, L, k)
    step_bytes = 0
    for t in range(1, gen_len):  # decode step t feeds the token at position prompt_len + t - 1
        rows = routing[:, prompt_len + t - 1]  # (B, L, k)
        hit = sum(per_expert.get(layer, 0) * rows[:, layer].unique().numel() for layer in range(rows.shape[1]))
        every = prompt_len + t - 1 <= engine.runner.every_upto  # (Runner.decode's every: no indexer wq_b or keys)
        step_bytes += dense - (index_q if every else 0) + hit + B * cfg.hidden_size * esize + \
            B * cache_bytes(cfg, prompt_len + t, esize, every)
    return {"batch": B, "prompt_len": prompt_len, "gen_len": gen_len, "total_s": total,
            "prefill_s": st["prefill_s"], "decode_s": st["decode_s"], "decode_steps": st["decode_steps"],
            "preemptions": st["preemptions"], "cache_waits": st["cache_waits"],
            "decode_tokens_per_s": st["decode_tokens"] / st["decode_s"],
            "generated_tokens_per_s": B * gen_len / total, "step_ms": 1e3 * st["decode_s"] / max(st["decode_steps"], 1),
            "decode_gb_s": step_bytes / st["decode_s"] / 1e9, "bytes_per_step_mb": step_bytes / max(gen_len - 1, 1) / 1e6}


def group_rollout(engine: Engine, prompts: int, group: int, prompt_len: int, gen_len: int, seed: int = 0,
                  sampling: dict | None = None, paths=("grouped", "one_at_a_time")) -> dict:
    """A GRPO step's rollout: `prompts` random prompts of prompt_len tokens, `group` samples each (temperature 1,
    and `sampling`'s SamplingParams fields, e.g. top_p / top_k), gen_len new tokens each; the wall time of
    engine.generate, the engine's own prefill and decode times and its decode step, with prefill's new sequences
    in padded groups and (the peer, Runner.batch_prefill off) one at a time (`paths`: which of the two). Each
    timed call follows an untimed one of the same shapes (graphs captured, kernels compiled)."""
    g = torch.Generator().manual_seed(seed)
    ps = [p for p in torch.randint(0, engine.cfg.vocab_size, (prompts, prompt_len), generator=g).tolist()
          for _ in range(group)]
    sp = SamplingParams(**{"temperature": 1.0, **(sampling or {}), "max_tokens": gen_len, "seed": seed,
                           "ignore_eos": True})
    res = {"prompts": prompts, "group": group, "prompt_len": prompt_len, "gen_len": gen_len,
           "sampling": dict(sampling or {})}
    keep = engine.runner.batch_prefill
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    try:
        for name in paths:
            engine.runner.batch_prefill = name == "grouped"
            engine.generate(ps, sp)
            for k in engine.stats:
                engine.stats[k] = 0 * engine.stats[k]
            sync()
            t0 = time.perf_counter()
            engine.generate(ps, sp)
            sync()
            st = engine.stats
            res[name] = {"wall_s": time.perf_counter() - t0, "prefill_s": st["prefill_s"],
                         "decode_s": st["decode_s"], "step_ms": 1e3 * st["decode_s"] / max(1, st["decode_steps"])}
    finally:
        engine.runner.batch_prefill = keep
    return res


def sampling_list(text: str) -> list[dict]:
    """--grpo-sampling: comma-separated items, each 'plain' or fields joined by '/' (top_p=0.9, top_k=50,
    temperature=0.7) -> SamplingParams keyword dicts; ValueError naming the item that is malformed or out of range."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        kw = {}
        for field in ([] if item == "plain" else item.split("/")):
            key, eq, val = (t.strip() for t in field.partition("="))
            if not eq or key not in ("top_p", "top_k", "temperature"):
                raise ValueError(f"{field!r} in {item!r}: 'plain', or top_p=P / top_k=K / temperature=T joined by '/'")
            if key in kw:
                raise ValueError(f"{item!r}: {key} given twice")
            try:
                kw[key] = int(val) if key == "top_k" else float(val)
            except ValueError:
                raise ValueError(f"{field!r}: {key} takes {'an integer' if key == 'top_k' else 'a number'}") from None
        SamplingParams(**kw)  # (a value out of range: its ValueError names the field)
        out.append(kw)
    if not out:
        raise ValueError("no items ('plain' for the default)")
    return out


def hf_decode_rate(model, B: int, prompt_len: int, new_tokens: int) -> dict:
    """transformers generate in BF16 on the same weights: decode tokens/s from two runs (1 and N new tokens)."""
    DeepseekV4ForCausalLM = transformers_deepseek_v4()[1]
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(model, d)
        # one dtype throughout: the fp32-kept modules would otherwise hand fp32 activations to bf16 linears
        hf = DeepseekV4ForCausalLM.from_pretrained(d, dtype=torch.bfloat16).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (B, prompt_len), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def timed(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    timed(2)
    t1, tn = timed(1), timed(new_tokens)  # the model is freed on return
    return {"batch": B, "prompt_len": prompt_len, "new_tokens": new_tokens, "t_1_s": t1, "t_n_s": tn,
            "decode_tokens_per_s": B * (new_tokens - 1) / (tn - t1)}


def kernel_shares(events) -> dict:
    """events: (name, start, end) of GPU kernels -> {name: [launches, summed durations, share of the running time]}. In
    order of their ends, a kernel's share is the part of its interval no kernel that ended before it covered, so
    PDL's early starts (a kernel launched while the one before runs, waiting for it) and a side stream's overlap
    count once: the shares add up to the time some kernel was running."""
    kern, done = {}, []  # done: the union of the intervals so far, disjoint, in order
    for name, start, end in sorted(events, key=lambda e: e[2]):
        k = kern.setdefault(name, [0, 0.0, 0.0])
        k[0] += 1
        k[1] += end - start
        lo, i = start, len(done)
        while i and done[i - 1][1] >= start:  # the intervals overlapping [start, end] (all end by end)
            i -= 1
        covered = sum(min(e, end) - max(s, start) for s, e in done[i:])
        if i < len(done):
            lo = min(start, done[i][0])
        k[2] += (end - start) - covered
        done[i:] = [(lo, end)]
    return kern


def step_trace(events, markers=("_to_host_kernel", "Memcpy DtoH")) -> str:
    """events (name, start, end) of several decode steps -> one step's kernels in start order, a line each: its
    start (us from the step's first), duration, gap (its start less the latest end before it: negative where it
    started early, under PDL or on the other stream), name. A step ends with the first of `markers` found (the
    kernel writing the step's outputs to the host; without zero-copy outputs their copies, a run of them one end);
    the step taken is the middle one of those between two ends (steady state, not the run's first or last)."""
    ev = sorted(events, key=lambda e: e[1])
    for marker in markers:
        ends = [i for i, e in enumerate(ev) if marker in e[0] and not (i + 1 < len(ev) and marker in ev[i + 1][0])]
        if len(ends) >= 2:
            break
    else:
        raise ValueError(f"step_trace: fewer than two step ends ({' or '.join(markers)}) among {len(ev)} events")
    mid = len(ends) // 2
    step = ev[ends[mid - 1] + 1:ends[mid] + 1]
    t0, last = step[0][1], step[0][1]
    lines, idle = [], 0.0
    for name, start, end in step:
        lines.append(f"  {start - t0:8.1f} {end - start:7.1f} {start - last:7.1f}  {name[:100]}")
        idle += max(0.0, start - last)
        last = max(last, end)
    return "\n".join([f"{len(step)} kernels, {last - t0:.1f} us from the first start to the last end, {idle:.1f} us "
                      "with none running; start, duration, gap (us), kernel:"] + lines)


def _profiled(eng, prompt, n: int) -> tuple[float, list]:
    """Wall seconds and the device's events (name, start, end) of eng.generate(prompt) for n new tokens, profiled:
    CUDA kernels on a GPU, torch's CPU ops (nested) on the CPU."""
    from torch.profiler import ProfilerActivity, profile
    cuda = eng.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        eng.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        sync()
        wall = time.perf_counter() - t0
    kind = "CUDA" if cuda else "CPU"
    return wall, [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == kind]


def profile_decode(model, max_len: int, B: int, fp8: bool, steps: int = 32, prompt_len: int = 64,
                   trace: bool = False) -> str:
    """CUDA kernels of batch-B decode steps as the engine runs them (graphs on): two profiled runs of the same prompts
    (prompt_len tokens, fewer where max_len has no room) that differ only in `steps` extra decode steps; their
    difference, per step. Each kernel's share of the time some kernel was running (kernel_shares; on one chain of
    dependent kernels, the critical path less the idle gaps) beside its summed durations, which overcount: under PDL a
    kernel starts while the one before runs and waits for it. trace: then one step's kernels in order (step_trace)."""
    eng = Engine(model, fp8=fp8, dtype=torch.bfloat16, max_seqs=B, max_model_len=max_len)
    prompt_len = max(1, min(prompt_len, max_len - steps - 2))  # room for the 2 + steps new tokens
    prompt = [list(range(1 + i, 1 + i + prompt_len)) for i in range(B)]
    eng.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    runs = [_profiled(eng, prompt, n) for n in (2, 2 + steps)]
    order = step_trace(runs[1][1]) if trace else ""
    runs = [(wall, kernel_shares(ev)) for wall, ev in runs]
    (w0, k0), (w1, k1) = runs
    rows = sorted(((*(a - b for a, b in zip(k1[k], k0.get(k, (0, 0.0, 0.0)))), k) for k in k1),
                  key=lambda r: -r[2])
    n_k = sum(r[0] for r in rows) / steps
    busy = sum(r[1] for r in rows) / steps
    lines = [f"profile, batch-{B} {'FP8' if fp8 else 'BF16'} decode (graphs): {n_k:.0f} kernels a step, "
             f"kernel time {busy:.0f} us a step, a kernel running {sum(r[2] for r in rows) / steps:.0f} us, wall "
             f"{1e6 * (w1 - w0) / steps:.0f} us a step; by kernel: share of the running time, summed time, launches"]
    for cnt, us, crit, k in rows[:30]:
        lines.append(f"  {crit / steps:8.1f} us  {us / steps:8.1f} us  {cnt / steps:6.1f}x  {k[:100]}")
    if trace:
        lines.append(f"one batch-{B} step in order: {order}")
    del eng
    return "\n".join(lines)


def profile_prefill(model, B: int, L: int, fp8: bool = True) -> str:
    """The GPU kernels (on the CPU: torch's ops) of the FP8 (or BF16) engine's prefill of B random prompts of L tokens
    (one new token each; the same shapes run once untimed first, so Triton's compiles are out of it), by
    kernel_shares, with the wall time and prompt tokens/s."""
    eng = Engine(model, fp8=fp8, dtype=torch.bfloat16, max_seqs=B, max_model_len=L + 2)
    g = torch.Generator().manual_seed(1)
    warm, prompts = (torch.randint(0, model.cfg.vocab_size, (B, L), generator=g).tolist() for _ in range(2))
    eng.generate(warm, SamplingParams(max_tokens=1, ignore_eos=True))
    wall, ev = _profiled(eng, prompts, 1)
    k = kernel_shares(ev)
    rows = sorted(((*v, name) for name, v in k.items()), key=lambda r: -r[2])
    lines = [f"profile, {'FP8' if fp8 else 'BF16'} prefill of {B} x {L} tokens: wall {wall:.3f} s "
             f"({B * L / wall:,.0f} prompt tok/s), {sum(r[0] for r in rows)} kernels, a kernel running "
             f"{sum(r[2] for r in rows) / 1e3:.1f} ms; by kernel: share of the running time, summed time, launches"]
    for cnt, us, crit, name in rows[:30]:
        lines.append(f"  {crit / 1e3:8.2f} ms  {us / 1e3:8.2f} ms  {cnt:6d}x  {name[:100]}")
    del eng
    return "\n".join(lines)


# The rollout engine's targets (the FP8 engine issue's "Show" list): batch-1 FP8 decode at >= 60% of the copy
# roofline; at batch 64 FP8 >= 1.4x our BF16 path and >= 20x transformers generate; at batch 16, 16k tokens of
# context within 1.3x of 1k.
TARGETS = {"roofline_b1": 0.60, "fp8_over_bf16_b64": 1.4, "fp8_over_hf": 20.0, "long_ratio": 1.3}
TARGET_RUN = ("H200", "configs/mini.yaml", 512, 1024)  # the run they are set for: GPU, config, prompt, new tokens


def target_checks(res: dict) -> list[dict]:
    """What this run measured against TARGETS, for whichever parts it ran: dicts of name, value, rule (">=" or
    "<="), target and met.
    FP8 over BF16 and over transformers compare the same batch; the long-context ratio is the shortest context's
    tokens/s over the longest's."""
    fp8 = {r["batch"]: r for r in res.get("fp8", [])}
    bf16 = {r["batch"]: r for r in res.get("bf16", [])}
    out = []

    def check(name, value, target, higher=True):
        out.append({"name": name, "value": value, "rule": ">=" if higher else "<=", "target": target,
                    "met": value >= target if higher else value <= target})
    if 1 in fp8:
        check("batch-1 FP8 fraction of copy", fp8[1]["roofline_fraction"], TARGETS["roofline_b1"])
    if 64 in fp8 and 64 in bf16:
        check("batch-64 FP8 / BF16", fp8[64]["decode_tokens_per_s"] / bf16[64]["decode_tokens_per_s"],
              TARGETS["fp8_over_bf16_b64"])
    hf = res.get("hf")
    if hf and hf.get("batch") in fp8:
        check(f"batch-{hf['batch']} FP8 / transformers", fp8[hf["batch"]]["decode_tokens_per_s"]
              / hf["decode_tokens_per_s"], TARGETS["fp8_over_hf"])
    long = sorted(res.get("long", []), key=lambda r: r["prompt_len"])
    if len(long) > 1:
        check(f"long context {long[0]['prompt_len']} / {long[-1]['prompt_len']} tok/s",
              long[0]["decode_tokens_per_s"] / long[-1]["decode_tokens_per_s"], TARGETS["long_ratio"], higher=False)
    return out


def target_report(res: dict, prompt_len: int, gen_len: int) -> list[str]:
    """res["targets"] = target_checks(res), each marked run_as_set (this run's GPU is TARGET_RUN's and its config,
    prompt and new tokens are too), and one `target ...` line for each (a run that differs says so on every line)."""
    gpu, config, prompt, new = TARGET_RUN
    as_set = gpu in res["device"] and (res["config"], prompt_len, gen_len) == (config, prompt, new)
    res["targets"] = [{**c, "run_as_set": as_set} for c in target_checks(res)]
    differs = "" if as_set else f" (set for an {gpu}, {config}, prompt {prompt}, {new} new tokens: this run differs)"
    return [f"target {c['name']}: {c['value']:.2f} ({c['rule']} {c['target']:g}) {'met' if c['met'] else 'UNMET'}"
            + differs for c in res["targets"]]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/mini.yaml")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=1024)
    ap.add_argument("--bf16-batches", default="1,16,64,256")
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--hf-tokens", type=int, default=16)
    ap.add_argument("--long-batch", type=int, default=16)
    ap.add_argument("--long-ctx", default="1024,16384")
    ap.add_argument("--long-gen", type=int, default=128)
    ap.add_argument("--profile", default="", help="B:fp8|bf16,...: the top CUDA kernels of batch-B decode steps "
                    "at the timed runs' mean context (--prompt-len + --gen-len / 2) "
                    "(with programmatic dependent launch a kernel's time includes its wait for the one before: "
                    "KERNELS_PDL=0 gives each kernel's own)")
    ap.add_argument("--profile-prefill", default="", help="B:L: the top CUDA kernels of the FP8 engine's prefill of "
                    "B prompts of L tokens ('' for none)")
    ap.add_argument("--trace", action="store_true", help="with --profile: also one decode step's kernels in start "
                    "order, with their durations and the gaps between them")
    ap.add_argument("--grpo", default="32:8:64", help="P:G:L: a GRPO step's rollout, P prompts of L tokens x G "
                    "samples, --grpo-gen new tokens each (FP8): generate's wall time, prefill and decode, prefill's "
                    "new sequences grouped and one at a time ('' for none)")
    ap.add_argument("--grpo-gen", type=int, default=256)
    ap.add_argument("--grpo-sampling", default="plain", help="the GRPO rollout's sampling, a comma list of 'plain' "
                    "or fields joined by '/', e.g. plain,top_p=0.9,top_k=50,top_k=50/top_p=0.95: each item a "
                    "rollout (the first also with prefill one prompt at a time)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("overrides", nargs="*", help="dotted.key=value on the config's model section, e.g. "
                    "model.num_hidden_layers=4 (the JSON's config names them)")
    args = ap.parse_intermixed_args(argv)
    cfg = load_model_config(args.config, args.overrides)

    def sizes(flag: str, text: str) -> list[int]:
        """A comma list of positive integers ('' for none), or a usage error naming the flag."""
        try:
            out = [int(b) for b in text.split(",") if b.strip()]
        except ValueError:
            out = [0]
        if any(b < 1 for b in out):
            ap.error(f"{flag} {text!r}: positive integers separated by commas ('' for none)")
        return out
    batches, bf16_batches = sizes("--batches", args.batches), sizes("--bf16-batches", args.bf16_batches)

    def colon_ints(text: str, n: int) -> list[int] | None:
        """n positive integers joined by ':' ([] for '', None if malformed)."""
        vals = text.split(":") if text.strip() else []
        ok = not vals or (len(vals) == n and all(v.strip().isdigit() and int(v) > 0 for v in vals))
        return [int(v) for v in vals] if ok else None
    grpo = colon_ints(args.grpo, 3)
    if grpo is None or (grpo and args.grpo_gen < 1):
        ap.error(f"--grpo {args.grpo!r} / --grpo-gen {args.grpo_gen}: P:G:L, three positive integers ('' for none), "
                 "and at least one new token")
    try:
        samplings = sampling_list(args.grpo_sampling)
    except ValueError as e:
        ap.error(f"--grpo-sampling {args.grpo_sampling!r}: {e}")
    ctxs = sizes("--long-ctx", args.long_ctx)
    profiles = []
    for item in filter(str.strip, args.profile.split(",")):
        b, _, kind = item.partition(":")
        if kind not in ("fp8", "bf16") or len(sizes("--profile", b)) != 1:
            ap.error(f"--profile {args.profile!r}: B:fp8 or B:bf16 items separated by commas")
        profiles.append((int(b), kind))
    pre = colon_ints(args.profile_prefill, 2)
    if pre is None:
        ap.error(f"--profile-prefill {args.profile_prefill!r}: B:L, two positive integers ('' for none)")
    if args.trace and not profiles:
        ap.error("--trace: with --profile B:fp8|bf16 (the decode steps it traces)")
    if args.gen_len < 2 or args.prompt_len < 1:
        ap.error(f"--gen-len {args.gen_len} / --prompt-len {args.prompt_len}: at least 2 new tokens, a 1-token "
                 "prompt")
    if not torch.cuda.is_available():
        raise SystemExit("bench/rollout.py: needs a CUDA or ROCm GPU (torch.cuda.is_available() is False)")
    res = {"device": torch.cuda.get_device_name(), "config": " ".join([args.config, *args.overrides]),
           "torch": torch.__version__,
           # "-dirty": the tracked files differ from that commit (a copy of the tree whose git metadata lags it)
           "commit": subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                                    text=True).stdout.strip()}
    res["copy_gb_s"] = copy_bandwidth() / 1e9
    model = build_model(cfg, "cuda", torch.bfloat16, seed=0)
    max_len = args.prompt_len + args.gen_len + 1
    for name, fp8, bs in (("fp8", True, batches), ("bf16", False, bf16_batches)):
        if not bs:
            continue
        eng = Engine(model, fp8=fp8, dtype=torch.bfloat16, max_seqs=max(bs), max_model_len=max_len)
        res[name] = []
        for B in bs:
            r = run(eng, B, args.prompt_len, args.gen_len)
            r["roofline_fraction"] = r["decode_gb_s"] / res["copy_gb_s"]
            res[name].append(r)
            print(f"{name} batch {B}: {r['decode_tokens_per_s']:.0f} decode tok/s, step {r['step_ms']:.2f} ms, "
                  f"{r['decode_gb_s']:.0f} GB/s = {100 * r['roofline_fraction']:.0f}% of copy {res['copy_gb_s']:.0f} GB/s",
                  flush=True)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    for B, kind in profiles:
        print(profile_decode(model, max_len, B, kind == "fp8", prompt_len=args.prompt_len + args.gen_len // 2,
                             trace=args.trace), flush=True)
    if pre:
        print(profile_prefill(model, *pre), flush=True)
    if ctxs and args.long_batch:
        eng = Engine(model, fp8=True, dtype=torch.bfloat16, max_seqs=args.long_batch,
                     max_model_len=max(ctxs) + args.long_gen + 1)
        res["long"] = []
        for c in ctxs:
            r = run(eng, args.long_batch, c, args.long_gen)
            res["long"].append(r)
            print(f"long context {c}: batch {args.long_batch} {r['decode_tokens_per_s']:.0f} decode tok/s "
                  f"(prefill {r['prefill_s']:.2f} s, {r['preemptions']} preemptions)", flush=True)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    if grpo:
        P, G, L = grpo
        eng = Engine(model, fp8=True, dtype=torch.bfloat16, max_seqs=P * G, max_model_len=L + args.grpo_gen + 1)
        res["grpo"] = []
        for i, kw in enumerate(samplings):
            res["grpo"].append(r := group_rollout(eng, P, G, L, args.grpo_gen, sampling=kw,
                                                  paths=("grouped", "one_at_a_time") if i == 0 else ("grouped",)))
            what = "/".join(f"{k}={v:g}" for k, v in kw.items()) or "plain"
            print(f"grpo rollout {P} prompts x {G}, prompt {L}, {args.grpo_gen} new, {what}: " + ", ".join(
                f"{k.replace('_', ' ')} wall {v['wall_s']:.2f} s (prefill {v['prefill_s']:.2f}, decode "
                f"{v['decode_s']:.2f}, step {v['step_ms']:.2f} ms)" for k, v in r.items() if isinstance(v, dict) and
                "wall_s" in v), flush=True)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    if args.hf_batch:
        res["hf"] = hf_decode_rate(model, args.hf_batch, args.prompt_len, args.hf_tokens)
        print(f"transformers generate bf16 batch {args.hf_batch}: {res['hf']['decode_tokens_per_s']:.1f} decode tok/s",
              flush=True)
    for line in target_report(res, args.prompt_len, args.gen_len):
        print(line, flush=True)
    print(json.dumps(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
