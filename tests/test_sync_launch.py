"""Weight sync (exact FP8 weights on the rollout after a sync, from FSDP- and EP-sharded actors), off-policy
overlap, and the multi-node launch script: three torchrun agents with --nnodes 3 on 127.0.0.1."""
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_server import bucket_layout, bucket_plan
from tests.recovery import N_ACTOR, ROOT, SMALL, finish, launch, metrics
from train_grpo import RunConfig


@pytest.mark.parametrize("extra", [[], ["train.ep=2"], ["rollout.sync_fp8=false", "rollout.dtype=bf16"],
                                   ["rollout.engine=simple"], ["fnuz"],
                                   ["rollout.fp8=false", "rollout.dtype=bf16", "deploy.rollout_ranks=2", "rollout.ep=2"]],
                         ids=["fsdp-fp8-send", "ep2-fp8-send", "fsdp-bf16-rollout-unquantized-send", "simple-engine",
                              "fnuz-fp8-send", "bf16-rollout-ep2"])
def test_sync_leaves_exactly_the_fp8_quantized_actor_weights(tmp_path, extra):
    """With rollout.sync_verify every sync compares checksums of every weight the rollout holds: its FP8 bytes and
    scales with the quantization of the actor's full (fp32) weights, the other tensors with what was sent; any
    difference fails the run. With sync_fp8 off the FP8-held weights travel in the actor's dtype, so a BF16 rollout
    quantizes what the actor holds (it quantized a BF16 copy before: other FP8 bytes than sync_fp8 gives). fnuz:
    every rank's FP8 is float8_e4m3fnuz, as on AMD gfx942 (tests/fnuz_train.py). A BF16 rollout (no FP8) holds
    exactly what was sent, under rollout expert parallelism each rank its slice of the experts (on one
    rank: the next test, where all but the damaged tensor match)."""
    out, fnuz = tmp_path / "run", extra == ["fnuz"]
    log = finish(launch(out, 2, ["rollout.sync_verify=true", "ckpt.every=0", "eval.every=0", *extra[fnuz:]],
                        script="tests/fnuz_train.py" if fnuz else "train_grpo.py",
                        nproc=N_ACTOR + (2 if "deploy.rollout_ranks=2" in extra else 1)))  # + rollout ranks
    assert [r["step"] for r in metrics(out)] == [1, 2]
    assert not fnuz or log.count("-> float8_e4m3fnuz") == 3, log[-3000:]  # (each rank's first ask)


@pytest.mark.parametrize("extra,damaged", [([], ["hc_head_fn", "layers.0.attn.wq_a.weight"]),
                                           (["rollout.fp8=false"], ["hc_head_fn"])], ids=["fp8", "bf16"])
def test_sync_verify_catches_a_damaged_weight(tmp_path, extra, damaged):
    """sync_verify can fail: the rollout rank flips one byte of what it received (GRPO_FAULT's nan at its first
    sync: the first tensor sent and the first FP8-held one) and the driver stops the run naming them, in an FP8
    rollout and in a BF16 one (before, a BF16 rollout's sync was checked against nothing); the other 124 or 125
    tensors match."""
    p = launch(tmp_path / "run", 1, ["rollout.sync_verify=true", "ckpt.every=0", "eval.every=0", *extra],
               env={"GRPO_FAULT": "2:sync:1:nan"})
    log = finish(p, ok=False)
    assert p.returncode != 0 and (f"weight sync verification: rollout rank 2 holds different weights for "
                                  f"{len(damaged)} of 126 tensors, first {damaged}") in log, log[-3000:]
    assert metrics(tmp_path / "run") == []


def test_off_policy_one_step_stale_and_still_learns(tmp_path):
    out = tmp_path / "run"
    extra = ["train.off_policy_steps=1", "train.dynamic_sampling=false", "ckpt.every=0", "eval.every=0",
             "train.prompts_per_step=16", "train.group_size=8", "train.lr_schedule=constant"]
    finish(launch(out, 40, extra), timeout=900)
    rows = metrics(out)
    assert rows[0]["staleness"] == 0.0 and all(r["staleness"] == 1.0 for r in rows[1:])
    first = sum(r["reward_mean"] for r in rows[:5]) / 5
    last = sum(r["reward_mean"] for r in rows[-10:]) / 10
    assert first < 0.15 and last > 0.22, (first, last)  # (0.074 and 0.290 at 40 steps; 0.419 at 60 steps)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_three_node_launch_script_puts_the_rollout_rank_on_the_last_node(tmp_path):
    """launch/torchrun_3node.sh as three torchrun agents (--nnodes 3, one rank a "node", on 127.0.0.1): the fixed node
    ranks decide the global ranks, so the rollout rank is node 2's whatever order the agents start in. Its cache
    pools fixed at 3 blocks (rollout.num_blocks: 2 sequences at once), the rollout rank says so at start-up, and
    the driver warns once that sequences waited for blocks, which metrics.jsonl counts."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), NPROC_PER_NODE="1", CONFIG="configs/tiny.yaml",
               PYTHONUNBUFFERED="1")
    env.pop("NODE_RANK", None)
    r = subprocess.run(["bash", "launch/torchrun_3node.sh"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0 and "set NODE_RANK" in r.stderr, r.stderr
    out = tmp_path / "run"
    cmd = ["bash", "launch/torchrun_3node.sh", f"out_dir={out}", "train.steps=3", *SMALL, "ckpt.every=0",
           "rollout.num_blocks=3"]
    procs = {n: subprocess.Popen(cmd, env=dict(env, NODE_RANK=str(n)), cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for n in (2, 1, 0)}  # the rollout node's agent first
    logs = {}
    try:
        for n, p in procs.items():
            logs[n] = p.communicate(timeout=300)[0]
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert all(p.returncode == 0 for p in procs.values()), {n: log[-2000:] for n, log in logs.items()}
    assert "roles: actor ranks 0-1 on nodes ['0', '1'], rollout ranks 2-2 on nodes ['2']" in logs[0], logs[0][-2000:]
    assert "--resume auto: no complete checkpoint" in logs[0]  # the script always resumes (a restarted job goes on)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the rollout rank says what its engine holds: a 64-entry block a sequence of 64 positions, one block scratch
    cfg = RunConfig.load("configs/tiny.yaml", SMALL)
    r, t = cfg.rollout, cfg.train
    assert re.search(rf"rollout rank 2: engine on cpu: weights [0-9.]+ [KMG]iB \((FP8|BF16)\) and a cache of "
                     rf"[0-9.]+ [KMG]iB, whose blocks hold 2 sequence\(s\) of rollout.max_model_len "
                     rf"{r.max_model_len} at once \(rollout.max_seqs {r.max_seqs}\); a step's first round asks "
                     rf"{t.prompts_per_step} x {t.group_size} sequences of the 1 rollout group\(s\)", logs[2]), \
        logs[2][-2000:]
    assert f"({'FP8' if r.fp8 else 'BF16'})" in logs[2]
    # 16 sequences a round, 2 at a time: the driver's warning, once, with the first step's count (no preemption:
    # a started sequence's 2 new tokens stay in its one block)
    first = next(row for row in rows if row["rollout_cache_waits"])
    assert all(row["rollout_preemptions"] == 0 for row in rows)
    said = [line for line in logs[0].replace("\r", "\n").splitlines() if "ran short of cache blocks" in line]
    assert said == [f"warning: step {first['step']}: the rollout ran short of cache blocks ("
                    f"{first['rollout_cache_waits']} sequence(s) waited for cache blocks with a slot free: a larger "
                    f"rollout.num_blocks gives the cache pools more blocks); said once, metrics.jsonl's "
                    f"rollout_cache_waits and rollout_preemptions count each step's"], logs[0][-2000:]


def test_two_rollout_ranks_equal_one_rollout_rank(tmp_path):
    """Two rollout ranks produce exactly what one rank produces: holding half the experts each (rollout.ep=2), with
    every sync leaving each rank exactly its slice (sync_verify); or as two rollout groups, each generating half
    the prompt groups (each sequence samples with its index in the whole request: before, both groups sampled
    theirs with the same noise, so half the samples were near-copies of the other half's)."""
    common = ["rollout.sync_verify=true", "rollout.dtype=fp32", "ckpt.every=0", "eval.every=0"]
    finish(launch(tmp_path / "one", 3, common))
    # one bucket holds the whole tiny model: every tensor is written in place into its slot of the same bucket
    two = {"ep": launch(tmp_path / "ep", 3, [*common, "deploy.rollout_ranks=2", "rollout.ep=2",
                                             "rollout.sync_bucket_mb=256"], nproc=4)}
    finish(two["ep"])
    two["groups"] = launch(tmp_path / "groups", 3, [*common, "deploy.rollout_ranks=2"], nproc=4)
    finish(two["groups"])
    for name in two:
        for a, b in zip(metrics(tmp_path / "one"), metrics(tmp_path / name)):
            for k in ("reward_mean", "mismatch_kl", "response_len", "loss"):
                # the same tokens; two groups batch their prompts apart, so their log-probs (and what uses them)
                # may differ in the last bits
                assert a[k] == b[k] if name == "ep" or k in ("reward_mean", "response_len") else \
                    a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (name, k, a[k], b[k])


def test_bucket_layout_aligns_every_tensor():
    """The receiver views each tensor of a bucket in place, so each starts on a 16-byte boundary."""
    spec = [["a", "torch.float8_e4m3fn", [3, 5]], ["b", "torch.float32", [7]], ["c", "torch.bfloat16", [2, 3]]]
    assert bucket_layout(spec, [0, 1, 2]) == ([0, 16, 48], [15, 28, 12], 64)
    assert bucket_plan(spec, 48) == [[0, 1], [2]] and bucket_plan(spec, 47) == [[0], [1], [2]]


def test_sync_checksums_match_what_the_applier_leaves():
    """tests/sync_graph_check.py on CPU (eager packing; tests/test_gpu.py runs it on CUDA, where the packing is
    replayed CUDA graphs): the sender's checksum pass equals held_checksums of the engine the buckets were applied
    to, FP8 syncs and syncs in the rollout's dtype, before and after an in-place update of the actor."""
    from tests import sync_graph_check
    r = sync_graph_check.launch()
    assert r.returncode == 0 and "sync check passed" in r.stdout, (r.stdout + r.stderr)[-4000:]
