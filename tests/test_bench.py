"""The benchmarks' own arithmetic (their GPU runs are in bench/; this is what they compute from the events)."""
import random

import pytest
import torch

from bench.rollout import (TARGET_RUN, TARGETS, group_rollout, kernel_shares, main, profile_prefill, sampling_list,
                           step_trace, target_checks, target_report)
from model import ModelConfig, build_model
from model.config import ConfigError, load_yaml
from rollout_server import Engine


def _busy(iv):
    total, cur = 0.0, None
    for s, e in sorted(iv):
        if cur is None or s > cur[1]:
            total += 0.0 if cur is None else cur[1] - cur[0]
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    return total + (0.0 if cur is None else cur[1] - cur[0])


def test_kernel_shares_count_overlap_once():
    # a (0-10) with b launched early under PDL (5-12), a side-stream kernel inside a (1-3), an idle gap, c (20-25)
    k = kernel_shares([("a", 0, 10), ("b", 5, 12), ("side", 1, 3), ("c", 20, 25)])
    assert k == {"side": [1, 2.0, 2.0], "a": [1, 10.0, 8.0], "b": [1, 7.0, 2.0], "c": [1, 5.0, 5.0]}
    rng = random.Random(0)
    for _ in range(200):  # the shares add up to the time some kernel ran, each within its own duration
        ev = [(f"k{rng.randrange(5)}", s, s + rng.uniform(0.1, 5)) for s in (rng.uniform(0, 50) for _ in range(30))]
        k = kernel_shares(ev)
        assert abs(sum(v[2] for v in k.values()) - _busy([(s, e) for _, s, e in ev])) < 1e-9
        assert all(0 <= v[2] <= v[1] + 1e-12 for v in k.values()) and sum(v[0] for v in k.values()) == 30


def test_target_checks_compare_what_the_run_measured():
    def rate(batch, tps, **kw):
        return {"batch": batch, "decode_tokens_per_s": tps, **kw}
    res = {"fp8": [rate(1, 1000.0, roofline_fraction=0.59), rate(64, 30000.0, roofline_fraction=0.4)],
           "bf16": [rate(64, 20000.0)], "hf": {"batch": 64, "decode_tokens_per_s": 1000.0},
           "long": [rate(16, 6000.0, prompt_len=16384), rate(16, 7500.0, prompt_len=1024)]}
    got = {c["name"]: (round(c["value"], 6), c["rule"], c["met"]) for c in target_checks(res)}
    assert got == {"batch-1 FP8 fraction of copy": (0.59, ">=", TARGETS["roofline_b1"] <= 0.59),
                   "batch-64 FP8 / BF16": (1.5, ">=", TARGETS["fp8_over_bf16_b64"] <= 1.5),
                   "batch-64 FP8 / transformers": (30.0, ">=", TARGETS["fp8_over_hf"] <= 30.0),
                   "long context 1024 / 16384 tok/s": (1.25, "<=", 1.25 <= TARGETS["long_ratio"])}
    assert not got["batch-1 FP8 fraction of copy"][2] and got["batch-64 FP8 / BF16"][2]
    # only what ran is checked: no BF16 at 64, transformers at a batch FP8 did not run, one context
    part = {"fp8": res["fp8"], "bf16": [rate(16, 1.0)], "hf": {"batch": 8, "decode_tokens_per_s": 1.0},
            "long": res["long"][:1]}
    assert [c["name"] for c in target_checks(part)] == ["batch-1 FP8 fraction of copy"]
    assert target_checks({}) == []
    # the printed lines, and a run other than the one the targets are set for says so
    gpu, config, prompt_len, gen_len = TARGET_RUN
    res["device"] = f"NVIDIA {gpu}"
    as_set = target_report({**res, "config": config}, prompt_len, gen_len)
    assert as_set[0] == f"target batch-1 FP8 fraction of copy: 0.59 (>= {TARGETS['roofline_b1']:g}) UNMET"
    assert len(as_set) == 4 and as_set[3].startswith("target long context 1024 / 16384 tok/s: 1.25 (<= ")
    for dev, run in ((gpu, (config + " model.num_hidden_layers=4", prompt_len, gen_len)),
                     (gpu, (config, prompt_len, 256)), ("AMD Instinct MI300X", (config, prompt_len, gen_len))):
        r = {**res, "device": dev, "config": run[0]}
        lines = target_report(r, *run[1:])
        assert all(line.startswith(a) and line.endswith("this run differs)") for line, a in zip(lines, as_set))
        assert [c["run_as_set"] for c in r["targets"]] == [False] * 4


def test_step_trace_takes_a_middle_step_in_start_order():
    # four steps of (x, y started 2 us early under PDL, to_host), 100 us apart, listed out of order; the step
    # taken is the one between the 2nd and 3rd ends (x at 200), its times from its first start
    ev = [(n, 100 * i + s, 100 * i + e) for i in range(4)
          for n, s, e in (("_to_host_kernel", 90, 95), ("y", 8, 20), ("x", 0, 10))][::-1]
    out = step_trace(ev).splitlines()
    assert out[0].startswith("3 kernels, 95.0 us from the first start to the last end, 70.0 us with none running")
    assert [line.split() for line in out[1:]] == [["0.0", "10.0", "0.0", "x"], ["8.0", "12.0", "-2.0", "y"],
                                                 ["90.0", "5.0", "70.0", "_to_host_kernel"]]
    # without zero-copy outputs the steps end with their device-to-host copies (a run of them: one end)
    cp = [(n.replace("_to_host_kernel", "Memcpy DtoH (Device -> Pinned)"), s, e) for n, s, e in ev]
    cp += [("Memcpy DtoH (Device -> Pinned)", s + 6, e + 2) for n, s, e in cp if n.startswith("Memcpy")]
    out = step_trace(cp).splitlines()
    assert out[0].startswith("4 kernels, 97.0 us") and out[1].split()[3] == "x" and out[4].split()[:2] == ["96.0", "1.0"]
    with pytest.raises(ValueError, match="fewer than two step ends"):
        step_trace(ev[:4])


def test_rollout_bench_checks_its_config_before_the_gpu(monkeypatch):
    """Dotted overrides of the model section are applied and validated before anything needs a GPU: a bad key or
    value names itself, so does a non-model key, a good set reaches the GPU check."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError, match="num_hiden_layers"):
        main(["--config", "configs/tiny.yaml", "model.num_hiden_layers=2"])
    with pytest.raises(ConfigError, match="compress_ratios"):
        main(["--config", "configs/tiny.yaml", "model.compress_ratios=[0, 4]"])
    with pytest.raises(ConfigError, match="train.lr=1: only model"):
        main(["--config", "configs/tiny.yaml", "train.lr=1"])
    for flag, bad in (("--grpo", "32:8"), ("--grpo", "32:0:64"), ("--grpo", "a:8:64"), ("--profile-prefill", "4"),
                      ("--profile-prefill", "4:0:1"), ("--profile-prefill", "0:16"), ("--grpo-sampling", ""),
                      ("--grpo-sampling", "plain,top_p=1.5"), ("--grpo-sampling", "top_q=3"),
                      ("--grpo-sampling", "top_k=5/top_k=6"), ("--grpo-sampling", "top_k=0.5")):  # before the GPU
        with pytest.raises(SystemExit) as e:
            main(["--config", "configs/tiny.yaml", flag, bad])
        assert e.value.code == 2
    with pytest.raises(SystemExit, match="needs a CUDA or ROCm GPU"):
        main(["--config", "configs/dsv4.yaml", "--batches", "1,64", "model.num_hidden_layers=4",
              "model.compress_ratios=[0, 0, 4, 128]", "model.n_routed_experts=32", "model.num_hash_layers=1"])


def test_gpu_suite_names_an_unknown_part():
    """bench/gpu_suite.sh checks every part it is given before it runs any (a typo would otherwise run nothing)."""
    import subprocess
    r = subprocess.run(["bash", "bench/gpu_suite.sh", "tests", "rolout"], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "OUT": "/nonexistent/out"})
    assert r.returncode == 2 and "no part 'rolout'" in r.stderr and "release" in r.stderr, r.stderr


def test_group_rollout_times_both_prefill_paths():
    """bench/rollout.py's GRPO-step rollout (on the CPU here): both prefill paths timed, the switch put back."""
    cfg = ModelConfig.from_dict(load_yaml("configs/tiny.yaml", ["model.vocab_size=32"])["model"])
    eng = Engine(build_model(cfg, seed=0), fp8=False, dtype=torch.float32, device="cpu", max_seqs=6, max_model_len=32)
    r = group_rollout(eng, 2, 3, 5, 4)
    assert (r["prompts"], r["group"], r["prompt_len"], r["gen_len"]) == (2, 3, 5, 4)
    for k in ("grouped", "one_at_a_time"):
        t = r[k]
        assert 0 < t["prefill_s"] and 0 < t["decode_s"] and t["prefill_s"] + t["decode_s"] <= t["wall_s"]
        assert t["step_ms"] * 3 == pytest.approx(1e3 * t["decode_s"])  # (3 decode steps: the first token is prefill's)
    assert eng.runner.batch_prefill
    assert eng.stats["prefill_tokens"] == 2 * 5 and eng.stats["decode_tokens"] == 6 * 3  # (the last call's)
    # --grpo-sampling's other items: the grouped path only, the filter reaching the engine's requests
    seen = []
    real = eng.generate
    eng.generate = lambda ps, sp: seen.append(sp) or real(ps, sp)
    r = group_rollout(eng, 2, 3, 5, 4, sampling={"top_k": 5, "top_p": 0.9}, paths=("grouped",))
    assert "one_at_a_time" not in r and r["sampling"] == {"top_k": 5, "top_p": 0.9} and r["grouped"]["wall_s"] > 0
    assert [(sp.top_k, sp.top_p, sp.temperature, sp.max_tokens) for sp in seen] == [(5, 0.9, 1.0, 4)] * 2
    assert sampling_list("plain, top_k=50/top_p=0.95,temperature=0.7") == [{}, {"top_k": 50, "top_p": 0.95},
                                                                          {"temperature": 0.7}]


def test_profile_prefill_reports_the_timed_prefill():
    """--profile-prefill's report (on the CPU here, torch's ops for kernels): the header's sizes and rates, and the
    rows in the order of their shares of the running time."""
    cfg = ModelConfig.from_dict(load_yaml("configs/tiny.yaml", ["model.vocab_size=32"])["model"])
    out = profile_prefill(build_model(cfg, seed=0), 2, 24, fp8=False).splitlines()
    assert out[0].startswith("profile, BF16 prefill of 2 x 24 tokens: wall ") and "prompt tok/s" in out[0], out[0]
    shares = [float(line.split()[0]) for line in out[1:]]
    assert 0 < len(shares) <= 30 and shares == sorted(shares, reverse=True) and shares[0] > 0


def test_sample_bench_runs_and_checks_its_arguments(tmp_path, capsys):
    """bench/sample.py: a bad flag is a usage error naming it; the CPU smoke run (the twins on both sides) times
    every filter and finds the kernels' path and the twins' tokens and thresholds equal."""
    import json
    from bench.sample import main as sample_main
    for argv in (["--rows", "0"], ["--rows", "a"], ["--top-p", "1"], ["--top-k", "0"], ["--vocab", "1"],
                 ["--filters", "top-p,topk"], ["--std", "0"]):
        with pytest.raises(SystemExit) as e:
            sample_main(argv)
        assert e.value.code == 2, argv
        assert argv[0] in capsys.readouterr().err
    sample_main(["--device", "cpu", "--rows", "1,3", "--vocab", "300", "--top-k", "7",
                 "--json", str(tmp_path / "s.json")])
    res = json.loads((tmp_path / "s.json").read_text())
    assert res["device"] == "cpu" and [(r["rows"], r["filter"]) for r in res["rows"]] == \
        [(b, f) for b in (1, 3) for f in ("plain", "top-p", "top-k", "both")]
    for r in res["rows"]:
        assert r["tokens_differing"] == 0 and r["draw_us"] > 0 and r["draw_twin_us"] > 0
        assert r["filter"] == "plain" or (r["thresholds_differing"] == 0 and r["threshold_us"] > 0 and
                                          r["sort_us" if r["filter"] == "top-p" else "topk_us"] > 0)
