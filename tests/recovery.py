"""Crash-recovery trials for train_grpo.py on CPU (gloo, tiny config, 2 actor ranks + 1 rollout rank).

A trial runs the tiny config, SIGKILLs one rank (actor or rollout, chosen by the trial's seed) either at a fault
point (GRPO_FAULT: mid checkpoint, mid weight sync, mid train step, mid generation) or at a random moment, checks
that no checkpoint directory is half written under a final name, resumes with `--resume auto` and checks that the
resumed run starts from the newest complete checkpoint and that every step's metrics equal those of an
uninterrupted reference run (timings aside). A trial may instead let `torchrun --max-restarts 1` restart the run
by itself (the first attempt runs with `--resume auto` too, and finds nothing).

    python -m tests.recovery --trials 10 [--seed 0] [--steps 5] [--keep DIR]

prints one line per trial and a summary: trials, kills by phase, resumes, mismatches. The test suite imports the
launch helpers from here.
"""
import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from itertools import count
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["train.prompts_per_step=4", "train.group_size=4", "train.minibatches=2", "task.eval_size=8",
         "eval.every=2", "eval.pass_k=2", "ckpt.every=2", "plot=false", "deploy.backend=gloo",
         "rollout.sync_bucket_mb=0.05"]
TIMING = ("time_", "_per_s", "sync_gb_s")
WORLD, N_ACTOR = 3, 2   # tiny.yaml: ranks 0-1 actor (0 drives), rank 2 rollout
# fault points and the ranks that pass them (see rollout_server.fault_point) with how often they are passed in a
# 5-step run with the settings above (an occurrence is drawn from 1..n)
_launches = count()
POINTS = {"ckpt": ([0, 1], 2), "sync": ([0, 2], 5), "train": ([0, 1], 5), "generate": ([2], 8)}


FAULT_PHASE = {"ckpt": "checkpoint", "sync": "weight sync", "train": "train step", "generate": "generation"}


def phase_kind(name: str) -> str:
    """A watchdog phase name without its step and sizes: "checkpoint at step 4" -> "checkpoint"."""
    if name.startswith("GRPO step"):
        return "driver, between phases"
    name = re.sub(r" \(.*\)", "", name)
    return re.sub(r" (after|at) step \d+$| \d+$", "", name)


def launch(out: Path, steps: int, extra=(), resume: str = "", nproc: int = WORLD, env=None, max_restarts: int = 0,
           script: str = "train_grpo.py"):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
    cmd += [script, "--config", "configs/tiny.yaml", f"out_dir={out}", f"train.steps={steps}", *SMALL, *extra]
    if resume:
        cmd += ["--resume", resume]
    full = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    full.pop("GRPO_FAULT", None)
    full["GRPO_TRIAL"] = f"{os.getpid()}-{next(_launches)}"  # finds this run's ranks in /proc (rank_pids)
    full.update(env or {})
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full, cwd=ROOT,
                         start_new_session=True)
    p.tag = full["GRPO_TRIAL"]
    return p


def kill_run(p):
    """SIGKILL torchrun and every rank of its run (torchrun starts each rank in a session of its own)."""
    for pid in rank_pids(p.tag).values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def finish(p, timeout=300, ok=True):
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_run(p)
        out, _ = p.communicate()
        raise AssertionError(f"run did not finish in {timeout} s:\n{out[-3000:]}") from None
    if ok:
        assert p.returncode == 0, out[-3000:]
    return out


def metrics(out: Path):
    f = out / "metrics.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.exists() else []


def comparable(row):
    return {k: v for k, v in row.items() if not any(t in k for t in TIMING)}


def complete_checkpoints(out: Path) -> list[int]:
    """Steps of the checkpoints under final names; asserts that each is whole (meta.json and every rank's shard)."""
    steps = []
    for d in sorted((out / "checkpoints").glob("step_*")) if (out / "checkpoints").exists() else []:
        assert (d / "meta.json").exists(), f"{d}: a checkpoint directory without meta.json under a final name"
        meta = json.loads((d / "meta.json").read_text())
        for r in range(meta["n_actor"]):
            assert (d / f"actor-rank{r:05d}.safetensors").stat().st_size > 0, f"{d}: shard of rank {r} missing"
        steps.append(meta["step"])
    return steps


def rank_pids(tag: str) -> dict[int, int]:
    """Worker pids by RANK for the run whose environment carries GRPO_TRIAL=tag (read from /proc)."""
    pids = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            env = dict(x.split("=", 1) for x in (p / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in x)
        except OSError:
            continue
        if env.get("GRPO_TRIAL") == tag and "RANK" in env and "LOCAL_RANK" in env:
            pids[int(env["RANK"])] = int(p.name)
    return pids


def reference(root: Path, steps: int) -> tuple[list[dict], float]:
    t0 = time.time()
    finish(launch(root / "reference", steps))
    rows = metrics(root / "reference")
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows
    return rows, time.time() - t0


def plan_trial(rng: random.Random, ref_seconds: float) -> dict:
    """One trial's kill: the victim's role (actor or rollout, even odds), then a fault point it passes (rank,
    point, occurrence) or a random moment; and whether torchrun restarts the run or `--resume auto` does."""
    restart = rng.random() < 0.3
    ranks = list(range(N_ACTOR)) if rng.random() < 0.5 else list(range(N_ACTOR, WORLD))
    points = sorted(p for p, (rs, _) in POINTS.items() if set(rs) & set(ranks))
    if rng.random() < 0.6:
        point = rng.choice(points)
        rank = rng.choice([r for r in POINTS[point][0] if r in ranks])
        return {"rank": rank, "point": point, "nth": rng.randint(1, POINTS[point][1]), "restart": restart}
    return {"rank": rng.choice(ranks), "at_s": round(rng.uniform(0.15, 0.9) * ref_seconds, 1), "restart": restart}


def resumed_steps(log: str) -> list[int]:
    """The steps a run's log says it resumed from, in order ("resumed from step N", and past train.steps "resumed
    from step N: train.steps=... already reached")."""
    return [int(m) for m in re.findall(r"resumed from step (\d+)", log)]


def run_trial(root: Path, i: int, plan: dict, ref: list[dict], steps: int) -> dict:
    """Kill, check the checkpoints, resume, compare. Returns a record with the phase the victim was in."""
    out, trace = root / f"trial{i:02d}", root / f"trial{i:02d}.phases"
    trace.mkdir(parents=True)
    env = {"GRPO_PHASE_DIR": str(trace)}
    if "point" in plan:
        env["GRPO_FAULT"] = f"{plan['rank']}:{plan['point']}:{plan['nth']}"
    restart = 1 if plan["restart"] else 0
    p = launch(out, steps, env=env, max_restarts=restart, resume="auto" if restart else "")
    rec = {"trial": i, **plan, "killed": False, "phase": None}
    if "at_s" in plan:
        deadline = time.time() + plan["at_s"]
        while time.time() < deadline and p.poll() is None:
            time.sleep(0.05)
        pid = rank_pids(p.tag).get(plan["rank"])
        if pid is not None and p.poll() is None:
            ph = trace / f"rank{plan['rank']}.phase"
            rec["phase"] = ph.read_text() if ph.exists() else "start-up"
            os.kill(pid, signal.SIGKILL)
            rec["killed"] = True
    log = finish(p, timeout=600, ok=restart == 1)
    if "point" in plan:
        rec["killed"] = f"GRPO_FAULT: rank {plan['rank']} kill at {plan['point']}" in log
        rec["phase"] = FAULT_PHASE[plan["point"]]
    rec["phase"] = phase_kind(rec["phase"]) if rec["killed"] else None
    have = complete_checkpoints(out)            # nothing partial under a final name, after the kill
    rec["resumed_from"] = None
    if restart:
        if rec["killed"]:
            starts = resumed_steps(log)
            rec["resumed_from"] = starts[-1] if starts else 0
    elif p.returncode != 0 or rec["killed"]:
        newest = max(have, default=0)
        log2 = finish(launch(out, steps, resume="auto"), timeout=600)
        rec["resumed_from"] = resumed_steps(log2)[0] if newest else 0
        assert rec["resumed_from"] == newest, (rec, "did not resume from the newest complete checkpoint", have)
        complete_checkpoints(out)
    got = metrics(out)
    rec["mismatches"] = sum(comparable(a) != comparable(b) for a, b in zip(ref, got)) + abs(len(ref) - len(got))
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--keep", default="", help="keep the runs under this directory (default: a temporary one)")
    args = ap.parse_args(argv)
    root = Path(args.keep or tempfile.mkdtemp(prefix="grpo-recovery-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    ref, secs = reference(root, args.steps)
    print(f"reference: {args.steps} steps in {secs:.0f} s", flush=True)
    recs = []
    for i in range(args.trials):
        plan = plan_trial(rng, secs)
        rec = run_trial(root, i, plan, ref, args.steps)
        recs.append(rec)
        how = f"{rec['point']} #{rec['nth']}" if "point" in rec else f"t={rec['at_s']} s"
        what = f"killed in {rec['phase']}" if rec["killed"] else "the run ended first"
        print(f"trial {i}: kill rank {rec['rank']} at {how} -> {what}; "
              f"{'torchrun restart' if rec['restart'] else '--resume auto'} from step {rec['resumed_from']}; "
              f"mismatched steps {rec['mismatches']}", flush=True)
    killed = [r for r in recs if r["killed"]]
    phases = Counter(r["phase"] for r in killed)
    ranks = Counter("rollout" if r["rank"] >= N_ACTOR else "actor" for r in killed)
    bad = sum(r["mismatches"] for r in recs)
    by_rank = ", ".join(f"{k} {v}" for k, v in sorted(ranks.items()))
    print(f"summary: trials {len(recs)}, kills {len(killed)} ({by_rank}); "
          f"kills by phase: {', '.join(f'{k} {v}' for k, v in phases.most_common())}; "
          f"resumes {sum(r['resumed_from'] is not None for r in recs)} "
          f"(torchrun restarts {sum(r['restart'] and r['killed'] for r in recs)}); mismatches {bad}")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
