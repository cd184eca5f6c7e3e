"""train_grpo.py end to end on CPU (gloo, 2 actor ranks + 1 rollout rank); checkpoints, resume and failures are in
test_recovery.py."""
import json
import os
import re
import subprocess
import sys

import pytest

from model.config import ConfigError
from tests.recovery import finish, launch, metrics
from train_grpo import RunConfig


def test_world_and_config_validation(tmp_path):
    cfg = RunConfig.load("configs/tiny.yaml")
    cfg.validate_world(3)
    with pytest.raises(ConfigError, match="rollout_ranks: 1 rollout ranks leave no actor rank in a world of 1"):
        cfg.validate_world(1)
    with pytest.raises(ConfigError, match=r"must split evenly into train.minibatches \(2\) x actor ranks \(3\): "
                       r"with group_size 8, prompts_per_step a multiple of 3 \(e.g. 6\)"):
        RunConfig.load("configs/tiny.yaml", ["train.prompts_per_step=5"]).validate_world(4)
    with pytest.raises(ConfigError, match=r"= 15 sequences .* multiple of 4 \(e.g. 8\)"):
        RunConfig.load("configs/tiny.yaml", ["train.prompts_per_step=5", "train.group_size=3"]).validate_world(3)
    for hinted, world in ((["train.prompts_per_step=6"], 4), (["train.prompts_per_step=8", "train.group_size=3"], 3)):
        RunConfig.load("configs/tiny.yaml", hinted).validate_world(world)  # (the prompts_per_step hinted splits)
    with pytest.raises(ConfigError, match=r"train\.loss_agg: must be one of"):
        RunConfig.load("configs/tiny.yaml", ["train.loss_agg=mean"])
    with pytest.raises(ConfigError, match=r"trian: unknown key \(did you mean 'train'\?\)"):
        RunConfig.load("configs/tiny.yaml", ["trian.steps=3"])
    with pytest.raises(ConfigError, match=r"train\.stpes: unknown key \(did you mean 'steps'\?\)"):
        RunConfig.load("configs/tiny.yaml", ["train.stpes=3"])
    for item, said in [("train.temperature=0.5", "train.temperature: unknown key (rollout.temperature and "
                                                 "eval.temperature take it)"),
                       ("rollout.lr=1e-5", "rollout.lr: unknown key (train.lr takes it)"),
                       ("train.hidden_size=64", "train.hidden_size: unknown key (model.hidden_size takes it)"),
                       ("model.keep=3", "model.keep: unknown key (ckpt.keep takes it)"),
                       ("lr=1e-5", "configs/tiny.yaml: lr: unknown key (train.lr takes it)"),
                       ("train.save_every=5", "train.save_every: unknown key"),
                       ("train.lrr=1", "train.lrr: unknown key (did you mean 'lr'?)")]:
        with pytest.raises(ConfigError) as e:
            RunConfig.load("configs/tiny.yaml", [item])
        assert str(e.value).endswith(said), (item, str(e.value))
    with pytest.raises(ConfigError, match=r"train\.lr: expected a number"):
        RunConfig.load("configs/tiny.yaml", ["train.lr=fast"])
    # fixed cache pools must hold one rollout.max_model_len sequence (tiny: 64 positions, a 64-entry block a pool,
    # plus the scratch block); 0 sizes them from the free memory
    assert RunConfig.load("configs/tiny.yaml", ["rollout.num_blocks=2"]).rollout.num_blocks == 2
    with pytest.raises(ConfigError, match=r"tiny.yaml: rollout.num_blocks: 1 blocks of 64 entries cannot hold one "
                                          r"sequence of rollout.max_model_len 64 \(2 needed, one of them scratch"):
        RunConfig.load("configs/tiny.yaml", ["rollout.num_blocks=1"])
    with pytest.raises(ConfigError, match=r"rollout.num_blocks: 2 blocks of 64 entries cannot hold one sequence of "
                                          r"rollout.max_model_len 512 \(3 needed"):  # (512 / 4: 128 CSA entries)
        RunConfig.load("configs/tiny.yaml", ["rollout.num_blocks=2", "rollout.max_model_len=512"])
    with pytest.raises(ConfigError, match=r"rollout\.num_blocks: must be >= 0"):
        RunConfig.load("configs/tiny.yaml", ["rollout.num_blocks=-1"])
    for item, said in (("task.prompt_key=''", "task.prompt_key: must be a key name"),
                       ("task.answer_key=prompt", "task.answer_key: must be a key name other than task.prompt_key")):
        with pytest.raises(ConfigError, match=re.escape(said)):
            RunConfig.load("configs/tiny.yaml", [item])
    for name in ("tiny", "mini", "dsv4"):
        RunConfig.load(f"configs/{name}.yaml")


def test_needs_torchrun():
    r = subprocess.run([sys.executable, "train_grpo.py", "--config", "configs/tiny.yaml"], capture_output=True,
                       text=True, env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert r.returncode != 0 and "runs under torchrun" in r.stderr


def test_jsonl_task_with_trained_tokenizer_end_to_end(tmp_path, bpe):
    """The real-data path through the whole loop: JSONL items, a tokenizer.json, a chat template, math rewards."""
    tok = bpe([f"what is {a} plus {b} ? the answer is {a + b}" for a in range(10) for b in range(10)])
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"what is {a} plus {b} ?", "answer": f"... #### {a + b}"})
                              for a in range(6) for b in range(6)) + "\n{broken\n")  # (GSM8K's keys)
    out = tmp_path / "run"
    extra = ["task.kind=jsonl", f"task.path={data}", "task.prompt_key=question", f"task.tokenizer={tmp_path}",
             "task.chat_template=<user> {prompt} <bot>", "task.bos_token=<s>", "task.eos_token=</s>", "task.eval_size=4",
             f"model.vocab_size={tok.get_vocab_size()}", "rollout.max_tokens=4"]
    said = finish(launch(out, 2, extra))
    assert f"skipped or cut: malformed_lines 1, long_prompts_skip 0, eval_long_prompts_skip 0 (the first malformed " \
        f"line {data}:37: Expecting property name" in said, said[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and "eval_greedy_acc" in rows[1]
    k = next(int(x[len("eval_pass@"):]) for x in rows[1] if x.startswith("eval_pass@"))
    assert f"step 2: evaluation of 4 prompts: greedy_acc {rows[1]['eval_greedy_acc']:.3f}, pass@{k} " \
        f"{rows[1][f'eval_pass@{k}']:.3f}\n" in said and "time_eval_s" in rows[1] and "time_eval_s" not in rows[0]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
