"""Failure as a tested path: killed ranks (resume and torchrun restart), hung peers, NaN losses, bad checkpoints,
bad configs and bad data. The trial harness is tests/recovery.py; its 10-trial run is the slow test at the end."""
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.export import main as export_main
from tests import recovery
from tests.recovery import comparable, complete_checkpoints, finish, kill_run, launch, metrics, run_trial
import train_grpo
from train_grpo import RunConfig, check_checkpoint, encode_prompt, make_task

STEPS = 4


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """An uninterrupted 4-step run: the metrics every recovered run must reproduce, and checkpoints to break."""
    root = tmp_path_factory.mktemp("recovery")
    rows, _ = recovery.reference(root, STEPS)
    return root / "reference", rows


def tree_digest(d: Path) -> dict:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def test_reference_run_metrics_and_checkpoints(ref):
    out, rows = ref
    for key in ("step", "reward_mean", "loss", "mismatch_kl", "time_rollout_s", "time_train_s", "time_sync_s",
                "time_generate_s", "time_step_s",
                "accuracy", "response_len", "entropy", "clip_frac", "tis_trunc_frac", "grad_norm", "tokens_per_s",
                "mismatch_abs_logp", "nonfinite_updates"):
        assert key in rows[0], key
    assert [("eval_greedy_acc" in r, "eval_pass@2" in r) for r in rows] == [(False, False), (True, True)] * 2
    ck = out / "checkpoints"
    assert (ck / "latest").read_text() == "step_000004"
    assert complete_checkpoints(out) == [2, 4]  # ckpt.every=2, keep 2
    assert not [p.name for p in ck.iterdir() if p.name.startswith(".")]  # no temporary or half-deleted directories
    assert (out / "final" / "model.safetensors.index.json").exists()


def test_rollout_killed_mid_sync_torchrun_restarts_and_resumes(ref, tmp_path):
    """The rollout rank dies with part of the weight sync after step 3 applied; torchrun --max-restarts 1 restarts
    every rank, and the new attempt resumes from step 2 by itself. Every step's metrics equal the reference's (the
    steps before the kill are a second, independent run of the same seed: determinism)."""
    rec = run_trial(tmp_path, 0, {"rank": 2, "point": "sync", "nth": 4, "restart": True}, ref[1], STEPS)
    assert rec["killed"] and rec["phase"] == "weight sync"
    assert rec["resumed_from"] == 2 and rec["mismatches"] == 0, rec


def test_actor_killed_mid_checkpoint_resumes_from_newest_complete(ref, tmp_path):
    """Actor rank 1 dies after writing its shard of the step-4 checkpoint: step 4 never appears under its final
    name, `--resume auto` picks step 2, and the rerun steps 3-4 equal the reference."""
    rec = run_trial(tmp_path, 0, {"rank": 1, "point": "ckpt", "nth": 2, "restart": False}, ref[1], STEPS)
    assert rec["killed"] and rec["phase"] == "checkpoint"
    assert rec["resumed_from"] == 2 and rec["mismatches"] == 0, rec


def test_off_policy_resume_repeats_the_uninterrupted_run(tmp_path):
    """train.off_policy_steps=1: the checkpoint at step 2 is written after step 3's first round was submitted
    (with the weights before step 2's update) and its prompts drawn. The checkpoint keeps that round
    (pending.json / pending.safetensors), so a run killed in step 3 and resumed trains step 3 on it as the
    uninterrupted run does: the same metrics (before, the resume drew the next prompts and generated on-policy)."""
    X = ["train.off_policy_steps=1"]
    finish(launch(tmp_path / "ref", 3, X))
    # the run as if killed in step 3: the reference's out_dir without its step-3 checkpoint (a resume rewrites
    # metrics.jsonl past its checkpoint)
    shutil.copytree(tmp_path / "ref", tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_000003")
    assert (tmp_path / "run" / "checkpoints" / "step_000002" / "pending.json").exists()
    assert "resumed from step 2" in finish(launch(tmp_path / "run", 3, X, resume="auto"))
    ref, run = metrics(tmp_path / "ref"), metrics(tmp_path / "run")
    assert ref[2]["staleness"] > 0 and [comparable(r) for r in run] == [comparable(r) for r in ref]
    # a resume under another group size (or sampling, task, seed) cannot train on the kept round: it is dropped
    cfg = RunConfig.load("configs/tiny.yaml", [*recovery.SMALL, *X])
    ck = tmp_path / "run" / "checkpoints" / "step_000002"
    items, got, version = train_grpo.load_round(ck, cfg)
    assert len(got.outs) == len(items) * cfg.train.group_size and version == 1
    assert got.cache == {"preemptions": 0, "cache_waits": 0}
    # a round kept before the cache counts had a key of their own held its preemptions only
    meta = json.loads((ck / "pending.json").read_text())
    del meta["cache"]
    (ck / "pending.json").write_text(json.dumps({**meta, "preemptions": 3}))
    assert train_grpo.load_round(ck, cfg)[1].cache == {"preemptions": 3}
    other = RunConfig.load("configs/tiny.yaml", [*recovery.SMALL, *X, "train.group_size=2"])
    assert train_grpo.load_round(ck, other) is None


@pytest.mark.parametrize("fault, says", [
    ("2:generate:7:hang", "rank 0: during a rollout request (waiting on rollout rank 2): no progress for"),
    pytest.param("1:train:3:hang", "rank 0: during train step 3 (waiting on actor ranks 0-1): no progress for",
                 marks=pytest.mark.slow),  # the same path as above, kept out of CI's ten minutes
    # a rollout rank frozen in the weight sync: the driver names it; actor rank 1, which waits on the driver there,
    # has twice the patience (it spoke first in 2 of 3 runs before)
    pytest.param("2:sync:4:hang", "rank 0: during weight sync (waiting on rollout ranks [2]): no progress for",
                 marks=pytest.mark.slow),
])
def test_hung_peer_ends_the_run_naming_rank_and_phase(tmp_path, fault, says):
    """A rank freezes (SIGSTOP) in step 3: the others exit within deploy.timeout_s naming the rank, phase and peer,
    and the checkpoints written before stay complete and loadable. (torchrun itself reaps a frozen rank only 30 s
    after its SIGTERM; the test ends the process group once the watchdog has spoken.)"""
    out = tmp_path / "run"
    p = launch(out, STEPS, ["deploy.timeout_s=6", "ckpt.every=1", "eval.every=0"], env={"GRPO_FAULT": fault})
    guard = threading.Timer(240, kill_run, (p,))
    guard.start()
    log, frozen_at, said_at = [], None, None
    for line in p.stdout:  # universal newlines: tqdm's \r ends a line too
        log.append(line)
        if "GRPO_FAULT" in line and "hang" in line:
            frozen_at = time.time()
        if says in line:
            said_at = time.time()
            break
    guard.cancel()
    kill_run(p)  # the frozen rank too
    p.communicate()
    assert frozen_at and said_at, "".join(log)[-3000:]
    assert said_at - frozen_at < 20, said_at - frozen_at  # the waiting rank entered its phase before the freeze
    have = complete_checkpoints(out)
    assert have and max(have) == 2, have
    cfg = RunConfig.load("configs/tiny.yaml", [*recovery.SMALL, f"out_dir={out}"])
    for r in range(2):
        check_checkpoint(out / "checkpoints" / "step_000002", cfg, r, 2, 1)


def test_nan_loss_steps_are_skipped_and_k_in_a_row_stop_the_run(ref, tmp_path):
    out = tmp_path / "run"
    p = launch(out, 5, ["train.max_nonfinite_steps=2"], env={"GRPO_FAULT": "1:loss:2:nan,0:loss:4:nan,1:loss:5:nan"})
    log = finish(p, timeout=300, ok=False)
    assert p.returncode != 0
    assert "stopping: 2 steps in a row with NaN/Inf loss or gradients (steps 4-5" in log, log[-3000:]
    assert "the weights are those from before them, as in the newest checkpoint, step_000004" in log, log[-3000:]
    # strict JSON lines: a NaN loss is null (json.dumps wrote NaN, which other parsers refuse)
    strict = [json.loads(ln, parse_constant=lambda c: pytest.fail(f"metrics.jsonl has {c}"))
              for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] is None for r in strict] == [False, True, False, True, True]
    assert "step 2: 2 update(s) skipped, NaN/Inf loss or gradient (1 step(s) in a row)" in log, log[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert comparable(rows[0]) == comparable(ref[1][0])
    assert [r["nonfinite_updates"] > 0 for r in rows] == [False, True, False, True, True]
    assert all(r["grad_norm"] == 0.0 for r in rows if r["nonfinite_updates"])
    assert complete_checkpoints(out) == [2, 4]  # no checkpoint of the stopping step


def test_weights_an_update_breaks_stop_the_run_unsaved(tmp_path):
    """train.lr=1e30: the first minibatch's update (finite loss and gradient) sends the weights to ~1e30, every
    later loss is NaN and skipped, and the run went on with broken weights (dynamic sampling kept no groups, so
    max_nonfinite_steps never fired). Now the next step's pi_old pass (entropy, mismatch NaN) stops it, before
    its evaluation and checkpoint."""
    out = tmp_path / "run"
    p = launch(out, 4, ["train.lr=1e30"])
    log = finish(p, timeout=300, ok=False)
    assert p.returncode != 0
    assert ("stopping at step 2: the policy's log-probs before its update were not finite (entropy nan, "
            "mismatch_kl nan): an earlier update broke the weights (train.lr=1e+30: too large?); this step was not "
            "checkpointed") in log, log[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["nonfinite_updates"] == 1
    assert complete_checkpoints(out) == []  # (ckpt.every 2)
    # an update that leaves a weight NaN (injected on rank 0 after the run's first update) stops its step at once
    out = tmp_path / "poisoned"
    p = launch(out, 4, env={"GRPO_FAULT": "0:update:1:nan"})
    log = finish(p, timeout=300, ok=False)
    said = re.search(r"stopping at step (\d+): its update left 1 weight tensor\(s\) holding NaN/Inf, with a finite "
                     r"loss and gradient norm \(train.lr=0.001: too large\?\); this step was not checkpointed", log)
    assert p.returncode != 0 and said, log[-3000:]
    rows, step = metrics(out), int(said.group(1))
    assert [r["step"] for r in rows] == list(range(1, step + 1)) and rows[-1]["param_nonfinite"] == 1
    assert all("param_nonfinite" not in r for r in rows[:-1]) and step not in complete_checkpoints(out)


def test_an_error_is_reported_in_the_phase_it_left():
    """train_grpo's report of an exception names the innermost phase it left: the phases unwind before the report,
    so every crash in the training loop read 'during start-up'."""
    from rollout_server import Watchdog
    w = Watchdog()
    with pytest.raises(ZeroDivisionError):
        with w.phase("step 3"), w.phase("rewards", "nobody"):
            1 / 0
    assert w.where() == "rank None: during start-up" and w.raised_in == "rank None: during rewards (waiting on nobody)"
    with w.phase("step 4"):  # handled: the next phase clears it
        pass
    assert w.raised_in is None


def test_idle_ranks_take_the_drivers_progress_as_their_own(monkeypatch):
    """A follower (or rollout rank) waiting for the driver counted its wait from the last command, so a long run of
    healthy driver phases (30 rollout rounds of a refilling step, an evaluation) past 2 x deploy.timeout_s ended
    the run as a stuck driver. The driver now shares its progress through the launcher's store: an idle phase
    restarts its clock when the driver has moved on, and only then (a stopped driver still ends the run)."""
    import torch.distributed as dist

    from rollout_server import Watchdog
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(master.port))
    drv, fol = Watchdog(), Watchdog()
    for w, driver in ((drv, True), (fol, False)):
        w.timeout = 5.0
        w.share(driver=driver)
        assert w.beat is not None
    with fol.phase("waiting for the driver", "rank 0", idle=True):
        fol.since -= 8.0                      # 8 s into a wait whose limit is 10
        fol._share_beat()
        assert fol.since < time.monotonic() - 7.0
        for _ in range(3):                    # the driver's rollout rounds
            with drv.phase("a rollout request", "rollout rank 2"):
                pass
        drv._share_beat()
        fol._share_beat()
        assert fol.since > time.monotonic() - 1.0   # the driver moved: the wait starts again
        fol.since -= 8.0
        drv._share_beat()                     # a stopped driver: no new progress
        fol._share_beat()
        assert fol.since < time.monotonic() - 7.0
    with fol.phase("train step 3", "actor ranks 0-1"):  # not idle: its own clock only
        fol.since -= 4.0
        with drv.phase("a rollout request"):
            pass
        drv._share_beat()
        fol._share_beat()
        assert fol.since < time.monotonic() - 3.0
    drv.unshare(), fol.unshare()
    assert drv.beat is None and fol.beat is None


def test_the_trial_harness_reads_each_form_of_the_resume_line():
    """tests.recovery reads the step a run resumed from, also in the line a run resumed past train.steps prints (a
    torchrun restart after the last step's checkpoint): the harness once took that line's last word for the step."""
    from tests.recovery import resumed_steps
    log = ("[W] restarting\nresumed from step 2\nstep 3 ...\n"
           "resumed from step 4: train.steps=4 already reached, nothing to train\n")
    assert resumed_steps(log) == [2, 4] and resumed_steps("no resume here\n") == []


def test_an_earlier_runs_checkpoints_are_set_aside_and_damaged_ones_never_counted(tmp_path):
    """A run starting at step 0 in an out_dir with an earlier run's checkpoints moves them (and its metrics) to
    previous-<n>/: before, the keep rule counted the earlier run's newer steps (deleting this run's own) and
    --resume auto took them up (another seed's weights; a gap in metrics.jsonl). The keep rule counts complete
    checkpoints only: before, a damaged newer one (no meta.json) made it delete the checkpoint just written."""
    from train_grpo import prune_checkpoints, set_aside
    out = tmp_path / "run"
    assert set_aside(out) is None  # a new out_dir: nothing to move
    ck = out / "checkpoints"
    for step in (2, 4):
        (ck / f"step_{step:06d}").mkdir(parents=True)
        (ck / f"step_{step:06d}" / "meta.json").write_text("{}")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert set_aside(out) == out / "previous-1" and not ck.exists() and not (out / "metrics.jsonl").exists()
    assert sorted(p.name for p in (out / "previous-1" / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    (ck / "step_000001").mkdir(parents=True)
    assert set_aside(out) == out / "previous-2"  # a damaged one alone is an earlier run's too
    for step in (1, 2, 3):  # 2: damaged (meta.json gone), 1 and 3: complete
        (ck / f"step_{step:06d}").mkdir(parents=True)
        if step != 2:
            (ck / f"step_{step:06d}" / "meta.json").write_text("{}")
    prune_checkpoints(ck, 1)
    assert sorted(p.name for p in ck.iterdir()) == ["step_000002", "step_000003"]


def test_bad_checkpoints_are_refused_naming_the_file(ref, tmp_path):
    src = ref[0] / "checkpoints" / "step_000004"
    cfg = RunConfig.load("configs/tiny.yaml", recovery.SMALL)
    assert check_checkpoint(src, cfg, 1, 2, 1)["step"] == 4
    assert check_checkpoint(src, cfg, 3, 4, 2)["step"] == 4  # another layout: read by resharding

    def broken(name, edit):
        d = tmp_path / name
        shutil.copytree(src, d)
        edit(d)
        return d
    cases = [
        (broken("no_meta", lambda d: (d / "meta.json").unlink()), cfg, 2, r"no_meta: not a checkpoint \(no meta.json\)"),
        (broken("bad_meta", lambda d: (d / "meta.json").write_text('{"step": 4')), cfg, 2,
         r"bad_meta/meta.json: corrupt \(JSONDecodeError"),
        (broken("no_shard", lambda d: (d / "actor-rank00001.safetensors").unlink()), cfg, 2,
         "no_shard: missing actor-rank00001.safetensors"),
        (broken("cut_shard", lambda d: os.truncate(d / "actor-rank00001.safetensors", 5000)), cfg, 2,
         r"cut_shard/actor-rank00001.safetensors: corrupt checkpoint shard"),
        (broken("bad_layout", lambda d: (d / "meta.json").write_text(
            json.dumps(dict(json.loads((src / "meta.json").read_text()), n_actor=3, ep=2)))), cfg, 2,
         r"bad_layout/meta.json: corrupt \(written by 3 actor ranks with ep=2, not a layout of 8 experts\)"),
        (broken("no_shard0", lambda d: (d / "actor-rank00000.safetensors").unlink()), cfg, 3,
         "no_shard0: missing actor-rank00000.safetensors"),  # another layout: every rank reads every writer's file
        (src, RunConfig.load("configs/tiny.yaml", ["model.moe_intermediate_size=48"]), 2,
         r"the checkpoint's model does not match the config: model.moe_intermediate_size: checkpoint \d+, config 48"),
    ]
    for path, c, n_actor, msg in cases:
        with pytest.raises(SystemExit, match=msg):
            check_checkpoint(path, c, 1, n_actor, 1)
    # in a run's checkpoints directory a damaged file's error names the newest complete checkpoint before it
    ck = tmp_path / "run" / "checkpoints"
    for step in (1, 2, 3, 4, 10):
        shutil.copytree(src, ck / f"step_{step:06d}")
    (ck / "step_000003" / "meta.json").unlink()  # damaged too: not the one to go on from
    os.truncate(ck / "step_000004" / "actor-rank00001.safetensors", 5000)
    with pytest.raises(SystemExit, match=r"corrupt checkpoint shard .*; move it out of .*checkpoints and --resume "
                                         r"auto goes on from the newest complete checkpoint before it, "
                                         r".*/step_000002 \(or --resume that path\)$"):
        check_checkpoint(ck / "step_000004", cfg, 1, 2, 1)
    os.replace(ck / "step_000010", ck / "step_999999")  # past 999,999 steps the number orders, not the name
    shutil.copytree(src, ck / "step_1000000")
    (ck / "step_1000000" / "actor-rank00001.safetensors").unlink()
    with pytest.raises(SystemExit, match=r"step_1000000: missing actor-rank00001.safetensors; .* before it, "
                                         r".*/step_999999 "):
        check_checkpoint(ck / "step_1000000", cfg, 1, 2, 1)
    (ck / "step_000001" / "actor-rank00001.safetensors").unlink()
    with pytest.raises(SystemExit, match=r"step_000001: missing actor-rank00001.safetensors$"):  # none before it
        check_checkpoint(ck / "step_000001", cfg, 1, 2, 1)


def test_shards_read_under_another_layout_equal_that_layouts_own(tmp_path):
    """train_grpo.read_resharded for every pair of 6 actor layouts (1-4 ranks, ep 1-4; 3 with tied embeddings):
    the weights and moments each rank reads equal, bit for bit, what FSDP2 gives that rank, and model.export's reader
    gives back the full tensors from each layout's shards (tests/reshard_check.py)."""
    from tests.parallel_check import torchrun
    r = torchrun("tests/reshard_check.py", 4, str(tmp_path))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]


def test_resume_on_another_layout_goes_on_from_the_checkpoints_weights(ref, tmp_path):
    """A checkpoint of 2 actor ranks resumed by 4 under train.ep=2, then by 1 (nodes added or lost): each rank reads
    its rows from the shards that hold them. Resumed at its last step, the exported model is the uninterrupted run's
    bit for bit; its metrics.jsonl keeps the steps before, and a step further trains on."""
    out = tmp_path / "run"
    shutil.copytree(ref[0] / "checkpoints" / "step_000004", out / "checkpoints" / "step_000004")
    shutil.copy(ref[0] / "metrics.jsonl", out / "metrics.jsonl")
    log = finish(launch(out, STEPS, ["train.ep=2"], resume="auto", nproc=5))
    assert ("written by 2 actor ranks with train.ep=1, read by 4 with train.ep=2" in log
            and "nothing to train" in log), log[-3000:]
    want, got = release(ref[0] / "final"), release(out / "final")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]
    log = finish(launch(out, STEPS + 1, resume="auto", nproc=2))  # one actor rank now
    assert "written by 2 actor ranks with train.ep=1, read by 1 with train.ep=1" in log, log[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and math.isfinite(rows[-1]["loss"]), rows[-1]
    assert complete_checkpoints(out)[-1] == 5
    export_main([str(out / "checkpoints" / "step_000005"), str(tmp_path / "step5")])  # written by 1 rank
    want, got = release(out / "final"), release(tmp_path / "step5")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def release(d: Path) -> dict:
    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_a_checkpoint_exports_offline_as_the_run_exported_it(ref, tmp_path, capsys, locked_dir):
    """python -m model.export: a 2-rank training checkpoint as a release, in one process, equal bit for bit (and in
    config.json) to what the run wrote to final/ at that step; FP8 too; bad arguments named before any writing."""
    from model import load_pretrained
    src = ref[0] / "checkpoints" / "step_000004"
    export_main([str(src), str(tmp_path / "bf16")])
    want, got = release(ref[0] / "final"), release(tmp_path / "bf16")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text()) == json.loads(
        (ref[0] / "final" / "config.json").read_text())
    assert "written by 2 actor ranks with ep=1" in capsys.readouterr().out
    export_main([str(src), str(tmp_path / "fp8"), "--fp8"])
    ids = torch.tensor([[1, 5, 7, 3, 4, 11]])
    with torch.no_grad():
        a = load_pretrained(tmp_path / "fp8", progress=False)(ids)
        b = load_pretrained(tmp_path / "bf16", progress=False)(ids)
    assert (a - b).abs().max() < 0.1 * b.abs().max()
    cut = tmp_path / "cut"
    shutil.copytree(src, cut)
    (cut / "actor-rank00001.safetensors").unlink()
    for args, said in [([str(ref[0]), str(tmp_path / "x")], r"not a training checkpoint \(no meta.json\); it holds 2 "
                        r"complete checkpoint\(s\), the newest .*/step_000004$"),
                       ([str(ref[0] / "final"), str(tmp_path / "x")], r"config.json without meta.json: a release"),
                       ([str(cut), str(tmp_path / "x")], r"cut: missing actor-rank00001.safetensors"),
                       ([str(src), str(src)], r"the checkpoint itself"),
                       ([str(src), str(locked_dir / "x")], r"cannot write in")]:
        with pytest.raises(SystemExit, match=said):
            export_main(args)
    assert not (tmp_path / "x").exists()
    with pytest.raises(FileNotFoundError, match=r"step_000004: a training checkpoint \(meta.json and actor shards\), "
                                                r"not a model directory; python -m model.export .*step_000004 OUT"):
        load_pretrained(src)  # (and so Engine, rollout_server.py --model, model.score, init_from)


@pytest.mark.parametrize("damage", ["dtype", "nan"])
def test_checkpoint_with_a_wrong_tensor_exits_before_training_and_changes_nothing(ref, tmp_path, damage):
    """A tensor of another dtype, or one holding NaN / Inf (which a run never saves: the NaN one loaded and the run
    stopped a step later, blaming the update and naming this very checkpoint as the one to resume)."""
    out = tmp_path / "run"
    for step in (2, 4):
        shutil.copytree(ref[0] / "checkpoints" / f"step_{step:06d}", out / "checkpoints" / f"step_{step:06d}")
    f = out / "checkpoints" / "step_000004" / "actor-rank00001.safetensors"
    t = load_file(str(f))
    name = next(k for k in sorted(t) if k.startswith("model.") and t[k].dim() == 2)
    if damage == "dtype":
        t[name] = t[name].to(torch.float16)
        said = [f"actor-rank00001.safetensors: {name} is torch.float16", "this run expects torch.float32"]
    else:
        moment = next(k for k in sorted(t) if k.endswith(".exp_avg_sq"))
        t[name].view(-1)[3] = float("nan")
        t[moment].view(-1)[-1] = float("inf")
        said = ["actor-rank00001.safetensors: 2 tensor(s) hold NaN / Inf, which a run never saves",
                "--resume auto goes on from the newest complete checkpoint before it, "
                f"{out / 'checkpoints' / 'step_000002'}"]
    save_file(t, str(f))
    before = tree_digest(out / "checkpoints")
    p = launch(out, STEPS, resume="auto")
    log = finish(p, timeout=200, ok=False)
    assert p.returncode != 0 and all(x in log for x in said), log[-3000:]
    assert "grpo:" not in log  # no step was started
    assert tree_digest(out / "checkpoints") == before


def test_a_damaged_checkpoint_is_said_once_by_the_driver(ref, tmp_path):
    """What the actor ranks find wrong with the checkpoint to resume is gathered and said by the driver, once: a
    shard that one rank reads, naming that rank (it spoke alone, amid the others' output), and a meta.json that
    every rank reads alike, without the ranks (each rank said it)."""
    out = tmp_path / "run"
    for step in (2, 4):
        shutil.copytree(ref[0] / "checkpoints" / f"step_{step:06d}", out / "checkpoints" / f"step_{step:06d}")
    ck = out / "checkpoints" / "step_000004"
    (ck / "actor-rank00001.safetensors").unlink()
    log = finish(launch(out, STEPS, resume="auto"), timeout=200, ok=False)
    said = [ln for ln in log.splitlines() if "missing actor-rank00001.safetensors" in ln]
    assert said == [f"rank 0: actor rank(s) 1: {ck}: missing actor-rank00001.safetensors; move it out of "
                    f"{out / 'checkpoints'} and --resume auto goes on from the newest complete checkpoint before it, "
                    f"{out / 'checkpoints' / 'step_000002'} (or --resume that path)"], log[-3000:]
    shutil.copy(ref[0] / "checkpoints" / "step_000004" / "actor-rank00001.safetensors", ck)
    (ck / "meta.json").write_text("{")
    log = finish(launch(out, STEPS, resume="auto"), timeout=200, ok=False)
    said = [ln for ln in log.splitlines() if "meta.json: corrupt" in ln]
    assert len(said) == 1 and said[0].startswith(f"rank 0: {ck / 'meta.json'}: corrupt (JSONDecodeError"), log[-3000:]

def test_tied_embeddings_checkpoint_resume_and_export(tmp_path):
    """tie_word_embeddings: the head is the embedding's Parameter; checkpoints hold it once (safetensors refuses
    aliases), a resumed run continues, and the exported model loads with the tie in place."""
    from model import load_pretrained
    out = tmp_path / "tied"
    finish(launch(out, 2, ["model.tie_word_embeddings=true"]))
    assert complete_checkpoints(out) == [2]
    finish(launch(out, 3, ["model.tie_word_embeddings=true"], resume="auto"))
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    m = load_pretrained(out / "final", progress=False)
    assert m.cfg.tie_word_embeddings and m.head.weight is m.embed.weight
    with torch.no_grad():
        assert torch.isfinite(m(torch.tensor([[1, 5, 7, 12]]))).all()


def test_init_from_a_checkpoint_starts_from_its_weights(tmp_path):
    """init_from=DIR, the way a run starts from a release: each actor rank reads its part of an FP8 checkpoint (block
    scales dequantized; its FSDP rows, under train.ep=2 its half of the experts) and the rollout gets the weights by
    the first sync. After one step at lr 1e-12 the exported model is the checkpoint's to BF16 rounding, and the
    step's mismatch_kl is FP8's alone (a rollout or an actor left at random weights would be far off)."""
    from model import ModelConfig, build_model, load_pretrained, save_pretrained
    from model.config import load_yaml
    ckpt, out = tmp_path / "release", tmp_path / "run"
    save_pretrained(build_model(ModelConfig.from_dict(load_yaml("configs/tiny.yaml")["model"]), seed=5), ckpt,
                    fp8=True, dtype=torch.float32)
    finish(launch(out, 1, [f"init_from={ckpt}", "train.ep=2", "train.lr=1e-12", "ckpt.every=0", "eval.every=0"]))
    [row] = metrics(out)
    assert row["mismatch_kl"] < 1e-2, row
    want = load_pretrained(ckpt, progress=False).state_dict()
    got = load_pretrained(out / "final", progress=False).state_dict()
    assert got.keys() == want.keys()
    for k, w in want.items():
        if w.is_floating_point():
            assert (got[k] - w).abs().max() <= 2 ** -8 * w.abs().max() + 1e-9, k  # (+ the 1e-12 step)
        else:
            assert torch.equal(got[k], w), k


def test_bad_launches_say_why_once_and_exit_nonzero(tmp_path, capsys, locked_dir):
    msg = "config error: configs/tiny.yaml: deploy.world_size: the config expects 4 ranks, torchrun started 3"
    p = launch(tmp_path / "run", STEPS, ["deploy.world_size=4"])
    log = finish(p, timeout=120, ok=False)
    assert p.returncode != 0 and log.count(msg) == 1, log[-3000:]  # said once, by rank 0
    assert not (tmp_path / "run").exists()
    (tmp_path / "afile").write_text("x")
    for argv, said in [(["train.stpes=3"], "train.stpes: unknown key (did you mean 'steps'?)"),
                       (["--resume", str(tmp_path / "nowhere")],
                        f"--resume {tmp_path / 'nowhere'}: not a complete checkpoint (no meta.json)"),
                       # overrides on both sides of --resume (argparse had refused the ones after it)
                       ([f"out_dir={tmp_path / 'run'}", "--resume", "auto", "train.stpes=3"],
                        "train.stpes: unknown key"),
                       ([f"out_dir={tmp_path / 'afile' / 'run'}"],
                        f"out_dir {tmp_path / 'afile' / 'run'}: {tmp_path / 'afile'} exists and is not a directory"),
                       ([f"out_dir={locked_dir / 'run'}"], f"out_dir {locked_dir / 'run'}: cannot write in {locked_dir} (")]:
        with pytest.raises(SystemExit) as e:  # before torchrun's environment is even looked at
            train_grpo.main(["--config", "configs/tiny.yaml", *argv])
        assert said in str(e.value.code)


def test_a_native_crash_prints_the_python_stacks():
    """A rank that dies in native code (here a segfault where main makes the task; in a run, gloo or the allocator)
    prints every thread's Python stack to stderr before it goes (faulthandler), so torchrun's log says where."""
    code = ("import ctypes, train_grpo\n"
            "def make_task(cfg):\n"
            "    return ctypes.string_at(0)\n"
            "train_grpo.make_task = make_task\n"
            "train_grpo.main(['--config', 'configs/tiny.yaml'])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=recovery.ROOT, env=dict(os.environ, PYTHONPATH=str(recovery.ROOT)))
    assert r.returncode != 0 and "Fatal Python error: Segmentation fault" in r.stderr, r.stderr[-2000:]
    assert 'line 3 in make_task' in r.stderr and "in main" in r.stderr, r.stderr[-2000:]


def test_dataset_lines_long_prompts_and_strict_mode(tmp_path, bpe):
    tok = bpe([f"what is {a} plus {b} ? the answer is {a + b}" for a in range(10) for b in range(10)])
    lines = [json.dumps({"prompt": f"what is {a} plus {b} ?", "answer": f"#### {a + b}"}) for a in range(5)
             for b in range(5)]
    long_prompt = " ".join(["what is 1 plus 2 ?"] * 8)
    lines[3] = json.dumps({"prompt": long_prompt, "answer": "3"})
    lines += ["{broken", json.dumps({"prompt": "", "answer": "1"}), json.dumps({"prompt": "what is 1 plus 1 ?"})]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(lines) + "\n")
    base = ["task.kind=jsonl", f"task.path={data}", f"task.tokenizer={tmp_path}", "task.eval_size=4",
            f"model.vocab_size={tok.get_vocab_size()}", "rollout.max_model_len=24", "rollout.max_tokens=4"]

    def load(*extra):
        return make_task(RunConfig.load("configs/tiny.yaml", [*base, *extra]))
    task, _ = load()   # default: skipped and counted
    assert task.load_stats["malformed_lines"] == 3 and task.first_bad.startswith(f"{data}:26: Expecting property")
    assert task.load_stats["long_prompts_skip"] + task.load_stats["eval_long_prompts_skip"] == 1
    assert len(task.items) + len(task.eval_items()) == 24 and long_prompt not in {i.prompt for i in task.items}
    cfg = RunConfig.load("configs/tiny.yaml", [*base, "task.long_prompts=truncate"])
    task, tk = make_task(cfg)
    assert task.load_stats["long_prompts_truncate"] + task.load_stats["eval_long_prompts_truncate"] == 1
    ids = encode_prompt(cfg, tk, long_prompt)
    assert len(ids) == 20 and ids == tk.apply_chat(long_prompt)[-20:]  # no template: the text's last ids
    # with a chat template and BOS: the template's head, then the text's last ids and the template's tail
    chat = ["task.chat_template=<user>{prompt}<bot>", "task.bos_token=<s>"]
    cfg = RunConfig.load("configs/tiny.yaml", [*base, "task.long_prompts=truncate", *chat])
    task, tk = make_task(cfg)
    full, (s, u, b) = tk.apply_chat(long_prompt), (tok.token_to_id(t) for t in ("<s>", "<user>", "<bot>"))
    ids = encode_prompt(cfg, tk, long_prompt)
    assert full[:2] == [s, u] and full[-1] == b and len(full) > 20
    assert ids == [s, u] + full[-18:], (ids, full)
    assert encode_prompt(cfg, tk, "what is 1 plus 2 ?") == tk.apply_chat("what is 1 plus 2 ?")  # fits: as it is
    cfg = RunConfig.load("configs/tiny.yaml", [*base, "task.long_prompts=truncate", *chat, "rollout.max_model_len=8"])
    assert encode_prompt(cfg, tk, long_prompt) == [s, u, full[-2], b]  # a budget of 4: one id of text
    with pytest.raises(SystemExit, match=r"train.jsonl: a prompt of \d+ tokens leaves no room for rollout.max_tokens"):
        load("task.long_prompts=error")
    with pytest.raises(SystemExit, match=r"task: .*train.jsonl:26: malformed line"):
        load("task.strict=true")
    with pytest.raises(SystemExit, match=r"train.jsonl: no training prompts left"):
        load("rollout.max_model_len=6")


@pytest.mark.slow
def test_ten_kill_and_resume_trials(tmp_path, capsys):
    """python -m tests.recovery --trials 10: seeded kills of actor and rollout ranks at fault points and at random
    moments, resumed by --resume auto or by torchrun restarts; no mismatched step."""
    assert recovery.main(["--trials", "10", "--keep", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "mismatches 0" in out and out.count("killed in") >= 8, out
