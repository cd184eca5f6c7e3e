"""train_grpo.py end to end on CPU (gloo, 2 actor ranks + 1 rollout rank), checkpoints and exact resume."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model.config import ConfigError
from train_grpo import RunConfig

SMALL = ["train.prompts_per_step=4", "train.group_size=4", "train.minibatches=2", "task.eval_size=8",
         "eval.every=2", "eval.pass_k=2", "ckpt.every=2", "plot=false", "deploy.backend=gloo"]
TIMING = ("time_", "_per_s", "sync_gb_s")


def launch(out: Path, steps: int, extra=(), resume: str = "", nproc: int = 3):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "train_grpo.py",
           "--config", "configs/tiny.yaml", f"out_dir={out}", f"train.steps={steps}", *SMALL, *extra]
    if resume:
        cmd += ["--resume", resume]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


def finish(p, timeout=300):
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out[-3000:]
    return out


def metrics(out: Path):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def comparable(row):
    return {k: v for k, v in row.items() if not any(t in k for t in TIMING)}


def test_run_checkpoint_and_exact_resume_after_kill(tmp_path):
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    ref = launch(ref_dir, 5)
    finish(ref)
    rows = metrics(ref_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for key in ("step", "reward_mean", "loss", "mismatch_kl", "time_rollout_s", "time_train_s", "time_sync_s",
                "accuracy", "response_len", "entropy", "clip_frac", "tis_trunc_frac", "grad_norm", "tokens_per_s",
                "mismatch_abs_logp"):
        assert key in rows[0], key
    assert "eval_greedy_acc" in rows[1] and "eval_pass@2" in rows[3] and "eval_greedy_acc" in rows[4]
    ck = ref_dir / "checkpoints"
    assert (ck / "latest").read_text() == "step_000005"
    assert sorted(p.name for p in ck.iterdir() if p.is_dir()) == ["step_000004", "step_000005"]  # keep: 2
    assert (ref_dir / "final" / "model.safetensors.index.json").exists()

    # the same run, SIGKILLed once step 3 is logged (the newest checkpoint is step 2), then resumed
    p = launch(cut_dir, 5)
    deadline = time.time() + 300
    while time.time() < deadline:
        f = cut_dir / "metrics.jsonl"
        if f.exists() and any(json.loads(x)["step"] == 3 for x in f.read_text().splitlines() if x.strip()):
            break
        assert p.poll() is None, p.communicate()[0][-3000:]
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    for d in (cut_dir / "checkpoints").glob("step_*"):  # nothing half-written under a final name
        assert (d / "meta.json").exists(), d
    out = finish(launch(cut_dir, 5, resume="auto"))
    assert "resumed from step" in out
    got = metrics(cut_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    for a, b in zip(rows, got):
        assert comparable(a) == comparable(b), (a["step"], comparable(a), comparable(b))


def test_world_and_config_validation(tmp_path):
    cfg = RunConfig.load("configs/tiny.yaml")
    cfg.validate_world(3)
    with pytest.raises(ConfigError, match="rollout_ranks: 1 rollout ranks leave no actor rank in a world of 1"):
        cfg.validate_world(1)
    with pytest.raises(ConfigError, match=r"must split evenly into train.minibatches \(2\) x actor ranks \(3\)"):
        RunConfig.load("configs/tiny.yaml", ["train.prompts_per_step=5"]).validate_world(4)
    with pytest.raises(ConfigError, match=r"train\.loss_agg: must be one of"):
        RunConfig.load("configs/tiny.yaml", ["train.loss_agg=mean"])
    with pytest.raises(ConfigError, match=r"trian: unknown key \(did you mean 'train'\?\)"):
        RunConfig.load("configs/tiny.yaml", ["trian.steps=3"])
    with pytest.raises(ConfigError, match=r"train\.stpes: unknown key \(did you mean 'steps'\?\)"):
        RunConfig.load("configs/tiny.yaml", ["train.stpes=3"])
    with pytest.raises(ConfigError, match=r"train\.lr: expected a number"):
        RunConfig.load("configs/tiny.yaml", ["train.lr=fast"])
    for name in ("tiny", "mini", "dsv4"):
        RunConfig.load(f"configs/{name}.yaml")


def test_needs_torchrun():
    r = subprocess.run([sys.executable, "train_grpo.py", "--config", "configs/tiny.yaml"], capture_output=True,
                       text=True, env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert r.returncode != 0 and "runs under torchrun" in r.stderr


def test_jsonl_task_with_trained_tokenizer_end_to_end(tmp_path):
    """The real-data path through the whole loop: JSONL items, a tokenizer.json, a chat template, math rewards."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>", "<user>", "<bot>"])
    tok.train_from_iterator([f"what is {a} plus {b} ? the answer is {a + b}" for a in range(10) for b in range(10)],
                            trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"what is {a} plus {b} ?", "answer": f"... #### {a + b}"})
                              for a in range(6) for b in range(6)) + "\n{broken\n")
    out = tmp_path / "run"
    extra = ["task.kind=jsonl", f"task.path={data}", f"task.tokenizer={tmp_path}", "task.chat_template=<user> {prompt} <bot>",
             "task.bos_token=<s>", "task.eos_token=</s>", "task.eval_size=4", f"model.vocab_size={tok.get_vocab_size()}",
             "rollout.max_tokens=4"]
    finish(launch(out, 2, extra))
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and "eval_greedy_acc" in rows[1]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
