"""GRPO for DeepSeek-V4-class MoE models: every rank of one torchrun world runs this file.

    torchrun --standalone --nproc-per-node 3 train_grpo.py --config configs/tiny.yaml [dotted.key=value ...]
    torchrun --nnodes 3 --nproc-per-node 8 ... train_grpo.py --config configs/dsv4.yaml --resume auto

Roles: the last `deploy.rollout_ranks` ranks serve rollouts (rollout_server.py); the others are actor ranks.
Actor rank 0 is the driver: it draws prompts, asks the rollout ranks for completions, scores them, hands the
batch to the actor ranks, and broadcasts the updated weights back.

The algorithm, every choice named (defaults in TrainConfig):
  * G = train.group_size samples per prompt, train.prompts_per_step prompts per step.
  * Advantage of sample i in its group: A_i = (r_i - mean(r)) / (std(r) + 1e-6), std unbiased;
    train.adv_std_norm=false drops the division (Dr. GRPO). One advantage for every token of a completion.
  * Dynamic sampling (train.dynamic_sampling): groups whose rewards are all equal carry no signal; they are
    dropped and replaced by fresh prompts, up to train.max_refill_rounds extra rollout rounds; if still short,
    the batch is filled back with dropped groups (zero advantage).
  * Policy loss per completion token: max(-A * rho, -A * clip(rho, 1 - eps_low, 1 + eps_high)) with
    rho = pi_theta / pi_old (clip-higher: eps_high > eps_low). pi_old is the actor's own policy before this
    step's updates, recomputed in BF16 (or the actor dtype) from the rollout's tokens.
  * Truncated importance sampling: the rollout sampled from its FP8 policy mu, so each token's loss is weighted
    by min(pi_old / mu, train.tis_cap) (detached).
  * Optional KL to a frozen reference (train.kl_coef > 0, default 0): k3 = exp(ref - logp) - (ref - logp) - 1.
  * Aggregation (train.loss_agg): token-mean (sum over tokens / tokens in the mini-batch), seq-mean-token-mean
    (mean over sequences of per-sequence token means), seq-mean-token-sum-norm (sum over tokens / (sequences x
    rollout.max_tokens), Dr. GRPO). Denominators count the whole mini-batch across actor ranks.
  * train.minibatches optimizer steps per rollout batch; AdamW, linear warmup to train.lr over
    train.warmup_steps optimizer steps, then constant or cosine-decayed to train.min_lr_ratio x lr (late in a
    run few groups carry signal, and Adam's step does not shrink with the gradient: a constant rate random-walks);
    gradient clipping at train.grad_clip (global norm).
    A batch in which every advantage is zero is not stepped on (Adam's momentum would move the weights with no
    signal); the metrics record it as skipped_update.
  * Routing replay (train.routing_replay): off; R2 = every update pass uses the expert ids the actor's own pi_old
    pass picked; or R3 = the actor's forward uses the expert ids the rollout engine picked. Gate weights still come
    from the actor's scores, so the router learns. routing_mismatch: the fraction of (token, top-k layer) expert
    sets the pi_old pass picks differently from the rollout, over the tokens the rollout fed.
  * Logged mismatch between the rollout and the actor: mismatch_kl = mean k3 estimate of KL(mu || pi_old)
    over completion tokens, and mean |log mu - log pi_old|.
  * A mini-batch whose loss or global gradient norm is NaN/Inf is not stepped on (nonfinite_updates in the
    metrics); train.max_nonfinite_steps such steps in a row stop the run with an error. Weights broken by an
    update with a finite loss and gradient (NaN/Inf weights after it, or NaN/Inf entropy / mismatch in the next
    step's pi_old pass) stop it at once, before that step's evaluation and checkpoint.

Failure handling: checkpoints are complete or absent (per-rank shards written into a temporary directory that
is renamed once every shard and meta.json are on disk); `--resume auto` continues from the newest one with the
same metrics as an uninterrupted run (or, on another number of actor ranks or train.ep, from the same state:
read_resharded); every blocking wait runs in a named phase and a rank that makes no progress in one for
deploy.timeout_s exits naming itself, the phase and the peers it waits on (rollout_server.WATCHDOG).
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import faulthandler
import json
import math
import os
import random
import re
import shutil
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from tqdm import tqdm

from model import ModelConfig, build_model, save_pretrained
from model.config import ConfigError, build_section, closest, load_yaml, resolve_config, write_denied
from model.model import DTYPES, Experts, Transformer, compile_fusions
from model.parallel import (AdamW, EPExperts, clip_coef, clip_grad_norm, copy_full_state, full_state,
                            close_process_groups, layout_error, local, make_actor_groups, reshard, row_pieces,
                            shard_rows, sharded_actor)
from model.plan import GB, plan
from model.weights import load_state, release_tensors, save_tensors
from model.tasks import DigitTask, Item, JsonlTask, completion_text
from model.tokenizer import CharTokenizer, HFTokenizer
from kernels.fp8_gemm import block_quant
from kernels.quant import fp8_dtype
from rollout_server import (CACHE_COUNTS, FP8_SCALE, WATCHDOG, Engine, Output, PagedCache, RolloutClient,
                            SamplingParams, SimpleEngine, cache_note, checksum, fault_point, is_fp8_held, phase,
                            serve)

# ---------------------------------------------------------------------------------------------------------
# configuration


def _need(obj, key: str, ok: bool, what: str):
    """A range check that names the key: `key: must be <what>, got <value>`."""
    if not ok:
        raise ConfigError(f"{key}: must be {what}, got {getattr(obj, key)!r}")


@dataclass
class DeployConfig:
    rollout_ranks: int = 1            # the last ranks of the world; on multi-node runs, a node of their own
    world_size: int = 0               # expected torchrun world size (0 = any); the memory planner needs it
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0       # per GPU, for the memory planner
    host_memory_gb: float = 1024.0    # per node, for the memory planner
    backend: str = "auto"             # auto = nccl when CUDA is available, else gloo
    timeout_s: float = 1800.0         # a rank that makes no progress in one phase for this long exits, naming it
    cpu_threads: int = 0              # torch threads per rank on CPU; 0 = cores / local ranks

    def __post_init__(self):
        _need(self, "rollout_ranks", self.rollout_ranks >= 1, ">= 1 (at least one rollout rank)")
        _need(self, "world_size", self.world_size >= 0, ">= 0 (0 = any)")
        _need(self, "gpus_per_node", self.gpus_per_node >= 1, ">= 1")
        for k in ("gpu_memory_gb", "host_memory_gb", "timeout_s"):
            _need(self, k, 0 < getattr(self, k) < math.inf, "> 0 and finite")
        _need(self, "cpu_threads", self.cpu_threads >= 0, ">= 0 (0 = automatic)")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ConfigError(f"backend: must be auto, nccl or gloo, got {self.backend!r}")


@dataclass
class TaskConfig:
    kind: str = "digits"              # digits (built-in) | jsonl
    digits_kind: str = "reverse"      # reverse | sort | addmod
    digits_length: int = 3
    path: str = ""                    # jsonl: {"prompt": ..., "answer": ...} per line
    eval_path: str = ""
    prompt_key: str = "prompt"        # jsonl: the lines' keys (GSM8K's own files: question; MATH's: problem,
    answer_key: str = "answer"        # solution)
    strict: bool = False              # jsonl: a malformed line is fatal instead of skipped and counted
    tokenizer: str = ""               # jsonl: tokenizer.json (or a directory holding one)
    chat_template: str = "{prompt}"
    bos_token: str = ""
    eos_token: str = ""
    eval_size: int = 64
    long_prompts: str = "skip"        # prompts that leave no room for rollout.max_tokens: skip | truncate | error

    def __post_init__(self):
        if self.kind not in ("digits", "jsonl"):
            raise ConfigError(f"kind: must be digits or jsonl, got {self.kind!r}")
        if self.kind == "jsonl" and not (self.path and self.tokenizer):
            raise ConfigError("path: a jsonl task needs task.path and task.tokenizer")
        if self.digits_kind not in DigitTask.KINDS:
            raise ConfigError(f"digits_kind: must be one of {DigitTask.KINDS}, got {self.digits_kind!r}")
        _need(self, "digits_length", self.digits_length >= 1, ">= 1")
        _need(self, "eval_size", self.eval_size >= 1, ">= 1")
        _need(self, "long_prompts", self.long_prompts in ("skip", "truncate", "error"), "skip, truncate or error")
        _need(self, "prompt_key", bool(self.prompt_key), "a key name")
        _need(self, "answer_key", bool(self.answer_key) and self.answer_key != self.prompt_key,
              "a key name other than task.prompt_key")


@dataclass
class TrainConfig:
    steps: int = 100
    prompts_per_step: int = 16
    group_size: int = 8
    minibatches: int = 2
    micro_batch: int = 0              # sequences per forward/backward on a rank; 0 = the whole mini-batch
    lr: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    warmup_steps: int = 10
    lr_schedule: str = "constant"     # constant | cosine (to min_lr_ratio x lr at the last optimizer step)
    min_lr_ratio: float = 0.1
    grad_clip: float = field(default=1.0, metadata={"inf": "no clipping"})
    eps_low: float = 0.2
    eps_high: float = field(default=0.28, metadata={"inf": "no upper clip"})
    loss_agg: str = "token-mean"
    adv_std_norm: bool = True
    kl_coef: float = 0.0
    tis_cap: float = field(default=2.0, metadata={"inf": "no truncation"})
    dynamic_sampling: bool = True
    max_refill_rounds: int = 2
    routing_replay: str = "R3"        # off | R2 (the actor's own routing from the pi_old pass) | R3 (the rollout's)
    off_policy_steps: int = 0         # 1: the next step's rollouts are generated while this step trains
    dtype: str = "fp32"               # compute dtype (FSDP2 param_dtype); master weights and grads are fp32
    ep: int = 1                       # expert-parallel degree over the actor ranks
    optimizer_offload: bool = False   # AdamW moments in host memory, streamed through the GPU per parameter
    compile: bool = False             # torch.compile the torch twins (CPU; GPUs run the Triton kernels instead)
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True  # False: blocks keep their gathered weights from forward to backward (no
    #                                     backward all-gathers; the whole model's working copy stays on each rank)
    max_nonfinite_steps: int = 3      # NaN/Inf loss or gradient: the update is skipped; this many steps in a row stop

    LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")

    def __post_init__(self):
        for k in ("steps", "prompts_per_step", "group_size", "minibatches"):
            if getattr(self, k) < 1:
                raise ConfigError(f"{k}: must be >= 1")
        if self.group_size < 2:
            raise ConfigError("group_size: GRPO needs at least 2 samples per prompt")
        if self.loss_agg not in self.LOSS_AGGS:
            raise ConfigError(f"loss_agg: must be one of {self.LOSS_AGGS}, got {self.loss_agg!r}")
        if self.off_policy_steps not in (0, 1):
            raise ConfigError(f"off_policy_steps: must be 0 or 1, got {self.off_policy_steps}")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ConfigError(f"lr_schedule: must be constant or cosine, got {self.lr_schedule!r}")
        if self.routing_replay not in ("off", "R2", "R3"):
            raise ConfigError(f"routing_replay: must be off, R2 or R3, got {self.routing_replay!r}")
        if self.ep < 1:
            raise ConfigError(f"ep: must be >= 1, got {self.ep}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: must be one of {list(DTYPES)}, got {self.dtype!r}")
        for k in ("lr", "tis_cap", "grad_clip"):
            _need(self, k, getattr(self, k) > 0, "> 0")
        for k in ("micro_batch", "warmup_steps", "max_refill_rounds", "weight_decay", "kl_coef", "eps_high"):
            _need(self, k, getattr(self, k) >= 0, ">= 0")
        _need(self, "eps_low", 0 <= self.eps_low < 1, "in [0, 1)")
        _need(self, "min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]")
        for k in ("beta1", "beta2"):
            _need(self, k, 0 <= getattr(self, k) < 1, "in [0, 1)")
        _need(self, "max_nonfinite_steps", self.max_nonfinite_steps >= 1, ">= 1")


@dataclass
class RolloutConfig:
    engine: str = "paged"             # paged | simple (the slow twin)
    fp8: bool = True
    dtype: str = "bf16"               # compute dtype of the engine
    max_seqs: int = 256               # sequences decoded together (paged engine)
    ep: int = 1                       # routed experts split over this many rollout ranks
    max_model_len: int = 4096         # prompt + completion tokens a sequence may reach
    mem_fraction: float = 0.85        # of the GPU memory left after the weights, for the cache pools
    num_blocks: int = 0               # cache blocks a pool, fixed (0: as many as mem_fraction gives; the CPU: in full)
    cuda_graphs: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 8
    sync_bucket_mb: float = 256.0
    sync_fp8: bool = True             # quantize on the actor: FP8 bytes + block scales cross the link (with fp8)
    sync_verify: bool = False         # after each sync, compare checksums of every weight the rollout holds
    sync_graphs: bool = True          # replay the sender's bucket packing as CUDA graphs (one actor rank, GPU)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.engine not in ("paged", "simple"):
            raise ConfigError(f"engine: must be paged or simple, got {self.engine!r}")
        if self.max_tokens >= self.max_model_len:
            raise ConfigError(f"max_tokens: {self.max_tokens} leaves no room for a prompt in max_model_len "
                              f"{self.max_model_len}")
        _need(self, "temperature", self.temperature > 0, "> 0")
        _need(self, "max_tokens", self.max_tokens >= 1, ">= 1")
        _need(self, "top_p", 0 < self.top_p <= 1, "in (0, 1]")
        _need(self, "top_k", self.top_k >= 0, ">= 0 (0 = off)")
        _need(self, "max_seqs", self.max_seqs >= 1, ">= 1")
        _need(self, "ep", self.ep >= 1, ">= 1")
        _need(self, "mem_fraction", 0 < self.mem_fraction <= 1, "in (0, 1]")
        _need(self, "num_blocks", self.num_blocks >= 0, ">= 0 (0: sized from the free memory)")
        _need(self, "sync_bucket_mb", 0 < self.sync_bucket_mb < math.inf, "> 0 and finite")


@dataclass
class EvalConfig:
    every: int = 25                   # steps; 0 = never (the last step is always evaluated when > 0)
    pass_k: int = 4
    temperature: float = 1.0

    def __post_init__(self):
        _need(self, "every", self.every >= 0, ">= 0 (0 = never)")
        _need(self, "pass_k", self.pass_k >= 0, ">= 0 (0 = off)")
        _need(self, "temperature", self.temperature > 0, "> 0")


@dataclass
class CkptConfig:
    every: int = 50                   # steps; 0 = never
    keep: int = 2                     # complete checkpoints kept; 0 = all
    export_final: bool = True         # <out_dir>/final in the release layout

    def __post_init__(self):
        _need(self, "every", self.every >= 0, ">= 0 (0 = never)")
        _need(self, "keep", self.keep >= 0, ">= 0 (0 = keep all)")


SECTIONS = {"deploy": DeployConfig, "task": TaskConfig, "train": TrainConfig, "rollout": RolloutConfig,
            "eval": EvalConfig, "ckpt": CkptConfig}


# each section's keys (the model's too), for naming the section a misplaced key belongs to
SECTION_KEYS = {name: frozenset(f.name for f in dataclasses.fields(sec))
                for name, sec in {"model": ModelConfig, **SECTIONS}.items()}


def _home(key: str, section: str = "") -> str:
    """' (rollout.temperature and eval.temperature take it)' for a key that is a field of other sections than
    `section`; '' where none has it."""
    homes = [f"{name}.{key}" for name, keys in SECTION_KEYS.items() if name != section and key in keys]
    return f" ({' and '.join(homes)} {'takes' if len(homes) == 1 else 'take'} it)" if homes else ""


@dataclass
class RunConfig:
    out_dir: str = "runs/default"
    seed: int = 0
    init_from: str = ""               # checkpoint directory to start from; empty = random init
    plot: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    deploy: DeployConfig = field(default_factory=DeployConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)

    @classmethod
    def load(cls, path, overrides=()) -> "RunConfig":
        path = resolve_config(path)
        d = load_yaml(path, overrides)
        top = {f.name for f in dataclasses.fields(cls)}
        for k in d:
            if k not in top:
                raise ConfigError(f"{path}: {k}: unknown key{closest(k, top) or _home(k)}")
        for name, mine in SECTION_KEYS.items():
            sub = d.get(name)
            for k in sub if isinstance(sub, dict) else ():
                if k not in mine and not closest(k, mine) and (home := _home(k, name)):  # in the wrong section
                    raise ConfigError(f"{path}: {name}.{k}: unknown key{home}")
        kw = {}
        for k in ("out_dir", "seed", "init_from", "plot"):
            if k in d:
                want = type(getattr(cls, k))
                if not isinstance(d[k], want) or isinstance(d[k], bool) and want is not bool:
                    raise ConfigError(f"{path}: {k}: expected {want.__name__}, got {d[k]!r}")
                kw[k] = d[k]
        if "model" not in d and not d.get("init_from"):
            raise ConfigError(f"{path}: model: a model section (or init_from) is required")
        if "model" in d:
            kw["model"] = ModelConfig.from_dict(d["model"], f"{path}: model")
        for name, sec in SECTIONS.items():
            kw[name] = build_section(sec, d.get(name), f"{path}: {name}")
        if not 0 <= kw.get("seed", 0) < 2 ** 32:
            raise ConfigError(f"{path}: seed: expected an integer in [0, 2**32), got {kw['seed']}")
        cfg = cls(**kw)
        if cfg.init_from:
            from model.config import load_hf_config
            try:
                cfg.model = load_hf_config(cfg.init_from)
            except (OSError, ConfigError) as e:  # (no such directory was a FileNotFoundError traceback)
                raise ConfigError(f"{path}: init_from: {e}") from None
            if "model" in d:
                cls._init_from_differs(cfg.init_from, kw["model"].to_dict(), cfg.model.to_dict(), overrides)
        cfg._check_pools(path)
        return cfg

    def _check_pools(self, path):
        """rollout.num_blocks, where set, must hold one sequence of rollout.max_model_len in each pool the model's
        layers write (the engine's blocks of BLOCK_ENTRIES entries; one block a pool is scratch)."""
        n = self.rollout.num_blocks
        short = n and PagedCache.too_few_blocks(self.model, n, self.rollout.max_model_len, "rollout.max_model_len")
        if short:
            raise ConfigError(f"{path}: rollout.num_blocks: {n} {short}; 0 sizes the pools from the free memory)")

    @staticmethod
    def _init_from_differs(init_from: str, mine: dict, theirs: dict, overrides):
        """With init_from the model is the checkpoint's config.json (the config file's model section is not read):
        a model.* override asking for something else (compared key by key, down to the overridden leaf) is an
        error."""
        bad = []
        for item in overrides:
            key = item.partition("=")[0]
            if not key.startswith("model."):
                continue
            a, b = mine, theirs
            for part in key.split(".")[1:]:
                a = a.get(part) if isinstance(a, dict) else None
                b = b.get(part) if isinstance(b, dict) else None
            if a != b:
                bad.append(f"{key}: the override asks {a!r}, but init_from {init_from} takes the model from its "
                           f"config.json ({b!r})")
        if bad:
            raise ConfigError("; ".join(bad))

    def validate_world(self, world: int):
        if self.deploy.world_size and self.deploy.world_size != world:
            raise ConfigError(f"deploy.world_size: the config expects {self.deploy.world_size} ranks, torchrun started "
                              f"{world}")
        n_actor = world - self.deploy.rollout_ranks
        if n_actor < 1:
            raise ConfigError(f"deploy.rollout_ranks: {self.deploy.rollout_ranks} rollout ranks leave no actor rank "
                              f"in a world of {world}")
        if n_actor % self.train.ep or self.model.n_routed_experts % self.train.ep:
            raise ConfigError(f"train.ep: {self.train.ep} must divide the actor ranks ({n_actor}) and "
                              f"model.n_routed_experts ({self.model.n_routed_experts})")
        if self.deploy.rollout_ranks % self.rollout.ep or self.model.n_routed_experts % self.rollout.ep:
            raise ConfigError(f"rollout.ep: {self.rollout.ep} must divide deploy.rollout_ranks "
                              f"({self.deploy.rollout_ranks}) and model.n_routed_experts ({self.model.n_routed_experts})")
        total = self.train.prompts_per_step * self.train.group_size
        split = n_actor * self.train.minibatches
        if total % split:
            unit = split // math.gcd(self.train.group_size, split)  # the prompts_per_step that split, its multiples
            raise ConfigError(f"train.prompts_per_step x train.group_size = {total} sequences must split evenly "
                              f"into train.minibatches ({self.train.minibatches}) x actor ranks ({n_actor}): with "
                              f"group_size {self.train.group_size}, prompts_per_step a multiple of {unit} (e.g. "
                              f"{-(-self.train.prompts_per_step // unit) * unit})")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------------------
# the GRPO algorithm


def group_advantages(rewards: torch.Tensor, group_size: int, std_norm: bool = True) -> torch.Tensor:
    """rewards (P * G,) grouped consecutively -> advantages (P * G,) in rewards' dtype. A group whose rewards are
    all equal gets exactly 0 (in float32 the mean of eight rewards of 1/3 is not 1/3: with std_norm that rounding
    was divided by a std of ~1e-8 + 1e-6, an advantage of 0.03 on every sample of a group with no signal)."""
    r = rewards.view(-1, group_size).double()
    a = r - r.mean(-1, keepdim=True)
    if std_norm:
        a = a / (r.std(-1, keepdim=True) + 1e-6)
    flat = (r == r[:, :1]).all(-1, keepdim=True)
    return torch.where(flat, 0.0, a).reshape(-1).to(rewards.dtype)


def policy_loss(logp, old_logp, rollout_logp, adv, mask, cfg: TrainConfig, norm: dict, ref_logp=None,
                max_tokens: int = 1):
    """Per-token clipped surrogate with truncated importance sampling, aggregated per cfg.loss_agg.

    logp/old_logp/rollout_logp/mask: (S, T); adv: (S,). norm: global counts of the mini-batch across ranks:
    {"tokens": ..., "seqs": ...}. Returns (loss summed over this rank's share, stats of sums)."""
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    pg1, pg2 = -a * ratio, -a * ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    pg = torch.maximum(pg1, pg2)
    behav = torch.exp(old_logp - rollout_logp)
    tis = behav.clamp(max=cfg.tis_cap).detach()
    tok = tis * pg
    if cfg.kl_coef > 0 and ref_logp is not None:
        d = ref_logp - logp
        tok = tok + cfg.kl_coef * (torch.exp(d) - d - 1)
    tok = tok * mask
    if cfg.loss_agg == "token-mean":
        loss = tok.sum() / norm["tokens"]
    elif cfg.loss_agg == "seq-mean-token-mean":
        loss = (tok.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / norm["seqs"]
    else:
        loss = tok.sum() / (norm["seqs"] * max_tokens)
    stats = {"clip": ((pg2 > pg1).float() * mask).sum().item(),
             "tis_trunc": ((behav > cfg.tis_cap).float() * mask).sum().item()}
    return loss, stats


def token_logprobs(model, ids, attn_mask, loss_mask, temperature: float, replay=None):
    """log pi(ids[t+1] | ids[:t+1]) at every position (S, T-1) (zero off loss_mask) and the entropy summed over
    loss_mask positions; the head runs only where loss_mask is set (see Transformer.forward)."""
    return model(ids, attention_mask=attn_mask, replay_experts=replay, targets_mask=loss_mask, temperature=temperature)


# ---------------------------------------------------------------------------------------------------------
# distributed plumbing


@dataclass
class Dist:
    rank: int
    world: int
    n_actor: int
    device: torch.device
    mesh: object          # model.parallel.ActorMesh on actor ranks, None on rollout ranks
    sync_group: object
    rollout_ep: object = None  # (group, size, rank) on rollout ranks under rollout expert parallelism

    @property
    def is_actor(self):
        return self.rank < self.n_actor

    @property
    def actor_group(self):
        return self.mesh.actor_group

    @property
    def rollout_ranks(self):
        return list(range(self.n_actor, self.world))


def init_dist(cfg: RunConfig) -> Dist:
    if "RANK" not in os.environ:
        raise SystemExit("train_grpo.py runs under torchrun, e.g.\n"
                         "  torchrun --standalone --nproc-per-node 3 train_grpo.py --config configs/tiny.yaml")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    backend = cfg.deploy.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(cfg.deploy.cpu_threads or max(1, (os.cpu_count() or 1) // local_world))
    # the watchdog (deploy.timeout_s per phase) ends a stuck rank with a message naming the phase; the backend's own
    # timeout is a backstop behind it
    WATCHDOG.start(rank, cfg.deploy.timeout_s)
    timeout = timedelta(seconds=2 * cfg.deploy.timeout_s + 60)
    with phase("rendezvous", "every rank"):
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if attempt != "0" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # after a torchrun restart the agent's store still holds the failed attempt's keys, and a rank could
            # read a dead peer's address from them (pytorch#135712): each attempt gets its own key space
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timeout)
            dist.init_process_group(backend, store=dist.PrefixStore(f"grpo-attempt-{attempt}", store), rank=rank,
                                    world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    atexit.register(close_process_groups)  # (the groups' gloo threads joined before the interpreter's finalization)
    n_actor = world - cfg.deploy.rollout_ranks
    mesh = make_actor_groups(n_actor, cfg.train.ep, device.type)  # collective: every rank creates the groups
    sync_group = dist.new_group([0] + list(range(n_actor, world)))
    ep = cfg.rollout.ep
    ep_groups = [dist.new_group(list(range(i, i + ep))) for i in range(n_actor, world, ep)] if ep > 1 else []
    rollout_ep = None
    if ep > 1 and rank >= n_actor:
        rollout_ep = (ep_groups[(rank - n_actor) // ep], ep, (rank - n_actor) % ep)
    check_placement(rank, world, n_actor, device, cfg)
    WATCHDOG.share(driver=rank == 0)
    return Dist(rank, world, n_actor, device, mesh, sync_group, rollout_ep)


def memory_plan_line(cfg: RunConfig, world: int, actor_bytes: int, rollout_bytes: int, host_bytes: int = 0,
                     actors_per_host: int = 1) -> str:
    """model.plan's per-rank bytes for the world of this launch (not deploy.world_size) against the smallest GPU of
    each role, 95% of it usable as the planner counts, and its host term (AdamW moments offloaded) against the
    smallest actor host's memory (host_bytes; 0: not checked), 90% usable, for the most actor ranks one host holds:
    one line, a warning naming the role and its largest terms where the plan is over. The plan is an estimate (its
    terms are added as if they peaked together: mini.yaml's actor planned 1.12-1.17x of the peak measured), so over
    it is a warning."""
    run = dataclasses.replace(cfg, deploy=dataclasses.replace(cfg.deploy, world_size=world,
                                                              gpus_per_node=actors_per_host))
    p = plan(run)
    parts, over = [], []
    for role, have, usable in (("actor", actor_bytes, 0.95), ("rollout", rollout_bytes, 0.95),
                               ("host", host_bytes, 0.9)):
        need = sum(p[role].values())
        if role == "host" and not (have and need):
            continue
        name, its = ("actor host", "its") if role == "host" else (f"{role} rank", "its GPU's")
        parts.append(f"{name} {need / GB:.1f} GB of {its} {usable * have / GB:.1f} usable")
        # the engine sizes its pools to what is free: fewer blocks, no error (unless rollout.num_blocks fixes them)
        pools = 0.0 if cfg.rollout.num_blocks else p[role].get("cache pools", 0.0)
        if need > usable * have and need - pools <= usable * have:
            parts[-1] += " (the engine's cache pools get what is left, less than their planned full size)"
        if need - pools > usable * have:
            top = sorted(p[role].items(), key=lambda kv: -kv[1])[:3]
            over.append((role, have, f"{name} (largest: " + ", ".join(f"{k} {v / GB:.1f} GB" for k, v in top) + ")"))
    line = "memory plan: " + "; ".join(parts)
    if not over:
        return line
    hint = [f"deploy.world_size={world}"]
    gpu = [have for role, have, _ in over if role != "host"]
    hint += [f"deploy.gpu_memory_gb={gpu[0] / GB:.0f}"] if gpu else []
    hint += [f"deploy.gpus_per_node={actors_per_host}", f"deploy.host_memory_gb={host_bytes / GB:.0f}"] \
        if over[-1][0] == "host" else []
    return (f"warning: {line}: over the plan for the {' and the '.join(o for *_, o in over)}; expect out-of-memory "
            f"errors (python -m model.plan --config <this run's config and overrides> {' '.join(hint)} lists every "
            f"term)")


def check_placement(rank: int, world: int, n_actor: int, device, cfg: RunConfig):
    """On a multi-host run the rollout ranks must have a host of their own (its memory is for the KV cache);
    say so on rank 0 when they share one with actor ranks. On GPUs rank 0 also prints the memory plan of this
    world against the smallest GPU of each role and the smallest actor host (memory_plan_line)."""
    rec = torch.zeros(80, dtype=torch.uint8)  # host name, GPU bytes, host RAM bytes
    host = f"{os.environ.get('GROUP_RANK', '0')}:{socket.gethostname()}".encode()[:64]
    rec[:len(host)] = torch.frombuffer(bytearray(host), dtype=torch.uint8)
    mem = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not on this OS: the host term is not checked
        ram = 0
    rec[64:] = torch.tensor([mem, ram], dtype=torch.int64).view(torch.uint8)
    recs = [torch.zeros_like(rec).to(device) for _ in range(world)]
    dist.all_gather(recs, rec.to(device))
    recs = [r.cpu() for r in recs]
    nodes, hosts = zip(*(r[:64].numpy().tobytes().rstrip(b"\0").decode().split(":", 1) for r in recs))
    mems, rams = zip(*(r[64:].view(torch.int64).tolist() for r in recs))
    if rank == 0:
        print(f"roles: actor ranks 0-{n_actor - 1} on nodes {sorted(set(nodes[:n_actor]))}, rollout ranks "
              f"{n_actor}-{world - 1} on nodes {sorted(set(nodes[n_actor:]))}", flush=True)
        if min(mems) > 0:
            per_host = max(hosts[:n_actor].count(h) for h in hosts[:n_actor])
            print(memory_plan_line(cfg, world, min(mems[:n_actor]), min(mems[n_actor:]), min(rams[:n_actor]),
                                   per_host), flush=True)
    actor_hosts, rollout_hosts = set(hosts[:n_actor]), set(hosts[n_actor:])
    if rank == 0 and len(set(hosts)) > 1 and actor_hosts & rollout_hosts:
        print(f"warning: rollout ranks share hosts {sorted(actor_hosts & rollout_hosts)} with actor ranks; launch with "
              f"fixed node ranks (launch/torchrun_3node.sh) so the last node holds only rollout ranks", flush=True)


def bcast_batch(batch: dict | None, d: Dist) -> dict:
    """Driver -> every actor rank: a dict of tensors, header first (JSON), then raw bytes."""
    if d.n_actor == 1:
        return batch
    if d.rank == 0:
        spec = json.dumps([[k, str(v.dtype), list(v.shape)] for k, v in batch.items()]).encode()
        n = torch.tensor([len(spec)], dtype=torch.int64, device=d.device)
        dist.broadcast(n, 0, group=d.actor_group)
        dist.broadcast(torch.frombuffer(bytearray(spec), dtype=torch.uint8).to(d.device), 0, group=d.actor_group)
        for v in batch.values():
            dist.broadcast(v.contiguous().to(d.device), 0, group=d.actor_group)
        return batch
    n = torch.zeros(1, dtype=torch.int64, device=d.device)
    dist.broadcast(n, 0, group=d.actor_group)
    buf = torch.zeros(int(n), dtype=torch.uint8, device=d.device)
    dist.broadcast(buf, 0, group=d.actor_group)
    out = {}
    for k, dt, shape in json.loads(buf.cpu().numpy().tobytes().decode()):
        t = torch.zeros(shape, dtype=getattr(torch, dt.replace("torch.", "")), device=d.device)
        dist.broadcast(t, 0, group=d.actor_group)
        out[k] = t
    return out


# ---------------------------------------------------------------------------------------------------------
# tasks, tokenizer


def make_task(cfg: RunConfig):
    t = cfg.task
    if t.kind == "digits":
        task = DigitTask(t.digits_kind, t.digits_length, cfg.seed, eval_size=t.eval_size)
        tok = CharTokenizer("0123456789:")
    else:
        try:
            task = JsonlTask(t.path, cfg.seed, t.eval_path or None, t.eval_size, t.strict, t.prompt_key, t.answer_key)
            tok = HFTokenizer(t.tokenizer, t.chat_template, t.bos_token or None, t.eos_token or None)
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"task: {e}") from None
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the task's tokenizer "
                          f"({tok.vocab_size})")
    cfg.model.end_with(tok.eos_id)
    budget = cfg.rollout.max_model_len - cfg.rollout.max_tokens
    if isinstance(task, JsonlTask):
        stats = {"malformed_lines": task.bad_lines}
        for name in ("items", "_eval"):
            kept, long = [], 0
            for it in getattr(task, name):
                n = len(tok.apply_chat(it.prompt))
                if n > budget:
                    long += 1
                    if t.long_prompts == "error":
                        raise SystemExit(f"{t.path}: a prompt of {n} tokens leaves no room for rollout.max_tokens "
                                         f"({cfg.rollout.max_tokens}) in rollout.max_model_len "
                                         f"({cfg.rollout.max_model_len}): {it.prompt[:80]!r} (task.long_prompts="
                                         f"skip or truncate to go on)")
                    if t.long_prompts == "skip":
                        continue
                kept.append(it)
            setattr(task, name, kept)
            stats[f"{'eval_' if name == '_eval' else ''}long_prompts_{t.long_prompts}"] = long
        if not task.items or not task._eval:
            raise SystemExit(f"{t.path}: no {'training' if not task.items else 'evaluation'} prompts left after "
                             f"skipping {stats}")
        task.load_stats = stats
    else:
        n = max(len(tok.apply_chat(it.prompt)) for it in task.eval_items())
        if n > budget:
            raise ConfigError(f"rollout.max_model_len ({cfg.rollout.max_model_len}) leaves {budget} tokens for "
                              f"prompts after rollout.max_tokens; the digit prompts need {n}")
    return task, tok


def encode_prompt(cfg: RunConfig, tok, prompt: str) -> list[int]:
    """Token ids of a prompt with its chat template. One longer than rollout.max_model_len - rollout.max_tokens
    (task.long_prompts=truncate) loses the start of its text: the template's head (BOS, the user tag: the ids it
    shares with the template around an empty prompt) stays, and then as many of the last ids as fit, the
    template's tail (the assistant tag) among them."""
    ids = tok.apply_chat(prompt)
    budget = cfg.rollout.max_model_len - cfg.rollout.max_tokens
    if len(ids) <= budget:
        return ids
    bare = tok.apply_chat("")
    n = min(len(bare), len(ids))
    head = next((i for i in range(n) if ids[i] != bare[i]), n)
    tail = next((i for i in range(n - head) if ids[-1 - i] != bare[-1 - i]), n - head)
    head = min(head, max(0, budget - tail - 1))  # one id of the text at least, where the budget passes the tail
    return ids[:head] + ids[len(ids) - (budget - head):]


# ---------------------------------------------------------------------------------------------------------
# the driver: rollouts -> batch


def sampling(cfg: RunConfig, seed: int, n: int, temperature: float | None = None) -> list[SamplingParams]:
    r = cfg.rollout
    return [SamplingParams(temperature=r.temperature if temperature is None else temperature, top_p=r.top_p,
                           top_k=r.top_k, max_tokens=r.max_tokens, seed=seed)] * n


def start_rollouts(cfg: RunConfig, step: int, task, tok, client: RolloutClient, version: int):
    """Submit a step's first rollout round; returns what finish_rollouts needs."""
    G = cfg.train.group_size
    items = task.batch(cfg.train.prompts_per_step)
    prompts = [encode_prompt(cfg, tok, it.prompt) for it in items for _ in range(G)]
    seed = cfg.seed * 1_000_003 + step * 101
    return items, client.submit(prompts, sampling(cfg, seed, len(prompts)), group_size=G), version


@dataclass
class Collected:
    """A submitted round's outputs, already collected (a checkpoint holds the next step's first round this way)."""
    outs: list
    gen_s: float
    cache: dict = field(default_factory=dict)  # the rollout's cache_counts over the round (RolloutClient.last_cache)


def collected(client: RolloutClient, handle) -> Collected:
    return handle if isinstance(handle, Collected) else \
        Collected(client.collect(handle), client.last_gen_s, client.last_cache)  # (collect sets last_*: first)


def collect_round(client: RolloutClient, started):
    """started (start_rollouts') with its first round's outputs collected."""
    items, handle, version = started
    return items, collected(client, handle), version


def round_settings(cfg: RunConfig) -> dict:
    """What a saved round was made under: a resume with other values cannot train on it (a group size cuts its
    samples into other groups; the sampling, the task's prompts and rewards)."""
    r = cfg.rollout
    return {"seed": cfg.seed, "train": {"group_size": cfg.train.group_size}, "task": dataclasses.asdict(cfg.task),
            "rollout": {k: getattr(r, k) for k in ("fp8", "dtype", "temperature", "top_p", "top_k", "max_tokens",
                                                   "max_model_len")}}


def save_round(path: Path, started, cfg: RunConfig):
    """A collected first round (collect_round's) as pending.json + pending.safetensors in a checkpoint directory."""
    items, got, version = started
    outs = got.outs
    meta = {"version": version, "gen_s": got.gen_s, "cache": got.cache, "settings": round_settings(cfg),
            "items": [dataclasses.asdict(it) for it in items],
            "prompts": [o.prompt_token_ids for o in outs], "tokens": [o.token_ids for o in outs],
            "finish": [o.finish_reason for o in outs]}
    save_tensors({"logprobs": torch.tensor([x for o in outs for x in o.logprobs], dtype=torch.float64),
                  "routing": torch.cat([o.routed_experts for o in outs]).contiguous()}, path / "pending.safetensors")
    (path / "pending.json").write_text(json.dumps(meta))


def load_round(path: Path, cfg: RunConfig):
    """save_round's first round back (None where the checkpoint holds none, or holds one made under other
    settings: said, and dropped; the step then draws new prompts)."""
    if not (path / "pending.json").exists():
        return None
    try:
        meta = json.loads((path / "pending.json").read_text())
        bad = [d.lstrip(".") for d in _diff(meta["settings"], json.loads(json.dumps(round_settings(cfg))), "")]
        if bad:
            print(f"{path}: its next step's rollout round was made under other settings ({'; '.join(bad[:3])}); "
                  f"dropped, the step draws new prompts", flush=True)
            return None
        t = load_file(str(path / "pending.safetensors"))
        lp, rt = t["logprobs"].tolist(), t["routing"]
        outs, o, r = [], 0, 0
        for p, tk, fin in zip(meta["prompts"], meta["tokens"], meta["finish"], strict=True):
            nr = len(p) + len(tk) - 1
            outs.append(Output(p, tk, lp[o:o + len(tk)], rt[r:r + nr], fin))
            o, r = o + len(tk), r + nr
        if o != len(lp) or r != rt.shape[0]:
            raise ValueError(f"{o} log-probs and {r} routing rows for {len(lp)} and {rt.shape[0]} stored")
        cache = meta.get("cache", {"preemptions": meta.get("preemptions", 0)})  # before "cache": preemptions only
        got = Collected(outs, float(meta["gen_s"]), {k: int(n) for k, n in cache.items()})
        return [Item(**it) for it in meta["items"]], got, int(meta["version"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{path}: corrupt pending rollout round ({type(e).__name__}: {e})") from None


def finish_rollouts(cfg: RunConfig, step: int, task, tok, client: RolloutClient, started, version: int):
    """Collect, score and (with dynamic sampling) refill a step's groups. Returns the groups, rollout statistics
    and each group's generation version (the actor version whose weights the rollout held)."""
    G, P = cfg.train.group_size, cfg.train.prompts_per_step
    kept, dropped, stats = [], [], {"gen_tokens": 0, "reward_sum": 0.0, "correct": 0, "samples": 0, "rounds": 0,
                                    "gen_s": 0.0, **dict.fromkeys(CACHE_COUNTS, 0)}
    items, handle, first_version = started
    for rnd in range(1 + (cfg.train.max_refill_rounds if cfg.train.dynamic_sampling else 0)):
        if rnd > 0:
            need = P - len(kept)
            if need <= 0:
                break
            items = task.batch(need)
            prompts = [encode_prompt(cfg, tok, it.prompt) for it in items for _ in range(G)]
            handle = client.submit(prompts, sampling(cfg, cfg.seed * 1_000_003 + step * 101 + rnd, len(prompts)),
                                   group_size=G)
        got = collected(client, handle)
        outs = got.outs
        stats["gen_s"] += got.gen_s
        for k in CACHE_COUNTS:
            stats[k] += got.cache.get(k, 0)
        gen_version = first_version if rnd == 0 else version
        stats["rounds"] += 1
        for j, it in enumerate(items):
            grp = outs[j * G:(j + 1) * G]
            texts = [completion_text(tok, o) for o in grp]
            rewards = [task.reward(t, it.answer) for t in texts]
            if rnd == 0:  # the step's reward statistics describe the policy on a fresh batch
                stats["reward_sum"] += sum(rewards)
                stats["correct"] += sum(task.correct(t, it.answer) for t in texts)
                stats["samples"] += G
            stats["gen_tokens"] += sum(len(o.token_ids) for o in grp)
            group = (grp, rewards, gen_version)
            (kept if (max(rewards) > min(rewards) or not cfg.train.dynamic_sampling) else dropped).append(group)
    stats["groups_kept"] = min(len(kept), P)
    groups = (kept + dropped)[:P]
    return [(g, r) for g, r, _ in groups], stats, [v for _, _, v in groups]


def fed_positions(attn: torch.Tensor) -> torch.Tensor:
    """attention mask (S, T) -> the positions whose routing the rollout reported: each real token but a row's last
    (never fed to the rollout; make_batch copies the row before)."""
    return F.pad(attn[:, 1:], (0, 1))


def routing_diff(own: torch.Tensor, rollout: torch.Tensor, attn: torch.Tensor, n_hash: int) -> tuple[float, float]:
    """(token, layer) expert sets that differ between own and rollout routing (S, T, L, k), and how many were
    compared: the top-k layers (past the n_hash hash layers) at the positions the rollout fed (each real token
    but a row's last, whose row make_batch copies); the gates' replay statistics count the same under R3."""
    fed = fed_positions(attn).bool()
    a, b = own[:, :, n_hash:].sort(-1).values, rollout[:, :, n_hash:].to(own.dtype).sort(-1).values
    diff = (a != b).any(-1) & fed[:, :, None]
    return float(diff.sum()), float(fed.sum()) * a.shape[2]


def make_batch(groups, cfg: RunConfig, pad_id: int, n_layers: int, top_k: int) -> dict:
    """Right-padded tensors for the actor: ids, attention mask, loss mask (position t predicts token t+1),
    rollout log-probs aligned with it, advantages, and the rollout's routing for replay."""
    G = cfg.train.group_size
    outs = [o for grp, _ in groups for o in grp]
    rewards = torch.tensor([r for _, rs in groups for r in rs], dtype=torch.float32)
    adv = group_advantages(rewards, G, cfg.train.adv_std_norm)
    T = max(len(o.prompt_token_ids) + len(o.token_ids) for o in outs)
    S = len(outs)
    ids = torch.full((S, T), pad_id, dtype=torch.int64)
    attn = torch.zeros(S, T, dtype=torch.int64)
    loss_mask = torch.zeros(S, T - 1)
    roll_lp = torch.zeros(S, T - 1)
    routing = torch.zeros(S, T, n_layers, top_k, dtype=torch.uint8)
    for i, o in enumerate(outs):
        p, c = len(o.prompt_token_ids), len(o.token_ids)
        ids[i, :p + c] = torch.tensor(o.prompt_token_ids + o.token_ids)
        attn[i, :p + c] = 1
        loss_mask[i, p - 1:p + c - 1] = 1
        roll_lp[i, p - 1:p + c - 1] = torch.tensor(o.logprobs)
        r = o.routed_experts
        routing[i, :r.shape[0]] = r
        routing[i, r.shape[0]:] = r[-1]  # positions never fed to the rollout: their outputs are not used
    return {"ids": ids, "attn": attn, "loss_mask": loss_mask, "rollout_lp": roll_lp, "adv": adv,
            "rewards": rewards, "routing": routing}


# ---------------------------------------------------------------------------------------------------------
# the actor


class Actor:
    """The policy on the actor ranks: FSDP2 (+ expert parallelism), fp32 master weights, AdamW over the shards."""

    def __init__(self, cfg: RunConfig, d: Dist):
        self.cfg, self.d = cfg, d
        t = cfg.train
        model = sharded_actor(cfg.model, d.mesh, DTYPES[t.dtype], d.device, t.reshard_after_forward)
        if cfg.init_from:  # each rank reads only its experts and its FSDP rows
            load_state(model, cfg.init_from, d.device, progress=d.rank == 0)
        else:
            # tensor by tensor into the shards: the whole fp32 model (1.1 TB for DeepSeek-V4-Flash) is never on a GPU
            full = build_model(cfg.model, "meta", torch.float32, seed=None)
            copy_full_state(model, full.random_state(cfg.seed, device=d.device))
        model.activation_checkpointing = t.activation_checkpointing
        if t.compile:
            compile_fusions(True)
        self.model = model.train()
        self.opt = AdamW(model.named_parameters(), t.lr, (t.beta1, t.beta2), weight_decay=t.weight_decay,
                         offload=t.optimizer_offload)
        self.params = [p for _, p, _ in self.opt.params]
        self.opt_steps = 0
        self.ref = None
        if t.kl_coef > 0:  # a frozen copy, sharded the same way
            ref = sharded_actor(cfg.model, d.mesh, DTYPES[t.dtype], d.device)
            for (_, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items()):
                local(a).copy_(local(b))
            self.ref = ref.eval().requires_grad_(False)

    def lr_at(self, opt_step: int) -> float:
        t = self.cfg.train
        warm = min(1.0, (opt_step + 1) / max(1, t.warmup_steps))
        if t.lr_schedule == "constant":
            return t.lr * warm
        total = max(1, t.steps * t.minibatches - t.warmup_steps)
        frac = min(1.0, max(0, opt_step + 1 - t.warmup_steps) / total)
        return t.lr * warm * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))

    def minibatches(self, S: int, step: int) -> list[tuple[list[int], list[int]]]:
        """(rows of the mini-batch on all ranks, this rank's share) for every mini-batch: a seeded shuffle of
        the batch, cut into train.minibatches, each dealt across actor ranks."""
        order = torch.randperm(S, generator=torch.Generator().manual_seed(self.cfg.seed * 7 + step)).tolist()
        M, n = self.cfg.train.minibatches, self.d.n_actor
        per = S // M
        return [(g, g[self.d.rank::n]) for g in (order[m * per:(m + 1) * per] for m in range(M))]

    def micro(self, rows):
        mb = self.cfg.train.micro_batch or len(rows)
        return [rows[i:i + mb] for i in range(0, len(rows), mb)]

    def forward_lp(self, model, b, rows, replay, return_routing=False):
        # attention_mask (statistics only): the fed positions, so that routing_mismatch counts only rollout choices
        out = model(b["ids"][rows], attention_mask=fed_positions(b["attn"][rows]), replay_experts=replay,
                    targets_mask=b["loss_mask"][rows], temperature=self.cfg.rollout.temperature,
                    return_routing=return_routing)
        return out

    def routing_mismatch(self) -> tuple[float, float]:
        st = torch.zeros(2, dtype=torch.float64, device=self.d.device)
        for layer in self.model.layers:
            g = layer.ffn.gate
            if getattr(g, "replay_stats", None) is not None:
                st += g.replay_stats.double().to(st.device)
                g.replay_stats = None
        return float(st[0]), float(st[1])

    def train_step(self, b: dict, step: int) -> dict:
        cfg, d = self.cfg, self.d
        b = {k: v.to(d.device) for k, v in b.items()}
        mode = cfg.train.routing_replay
        mbs = self.minibatches(b["ids"].shape[0], step)
        mine = sorted(r for _, mb in mbs for r in mb)
        # pi_old (and the reference) for this rank's rows, before any update
        old = torch.zeros_like(b["rollout_lp"])
        ref = torch.zeros_like(b["rollout_lp"]) if self.ref is not None else None
        replay = b["routing"].long() if mode == "R3" else None
        own = torch.zeros_like(b["routing"]) if mode != "R3" else None
        ent = 0.0
        with torch.no_grad():
            for rows in self.micro(mine):
                rp = None if replay is None else replay[rows]
                if own is not None:
                    (lp, e), routing = self.forward_lp(self.model, b, rows, None, return_routing=True)
                    own[rows] = routing.to(own.dtype)
                else:
                    lp, e = self.forward_lp(self.model, b, rows, rp)
                old[rows], ent = lp, ent + e.item()
                if self.ref is not None:
                    ref[rows] = self.forward_lp(self.ref, b, rows, rp)[0]
        # routing_mismatch: the pi_old pass's expert sets (the policy the rollout sampled from, in BF16) against the
        # rollout's, over the tokens it fed; R3's gates count them as they replay, else they are compared here
        if own is None:
            s_replay = self.routing_mismatch()
        else:
            s_replay = routing_diff(own[mine], b["routing"][mine], b["attn"][mine], self.cfg.model.num_hash_layers)
        if mode == "R2":
            replay = own.long()
        mask = b["loss_mask"]
        s = {"tokens": mask[mine].sum().item(), "entropy": ent, "clip": 0.0, "tis_trunc": 0.0, "loss": 0.0,
             "grad_norm": 0.0}
        diff = (old - b["rollout_lp"])[mine][mask[mine].bool()]
        s["mismatch_kl"] = (torch.exp(diff) - 1 - diff).sum().item()
        s["mismatch_abs"] = diff.abs().sum().item()
        s["skipped"] = float(bool((b["adv"] == 0).all()))
        s["nonfinite"], applied = 0.0, 0
        poison = fault_point("loss")  # the recovery tests' NaN
        for i, (rows_all_ranks, rows) in enumerate(mbs):
            if s["skipped"]:  # no group carries signal: a step would only replay Adam's momentum (drift)
                break
            norm = {"tokens": mask[rows_all_ranks].sum().item(), "seqs": len(rows_all_ranks)}
            self.opt.zero_grad()
            finite = True
            for mrows in self.micro(rows):
                lp, _ = self.forward_lp(self.model, b, mrows, None if replay is None else replay[mrows])
                loss, st = policy_loss(lp, old[mrows], b["rollout_lp"][mrows], b["adv"][mrows], mask[mrows],
                                       cfg.train, norm, None if ref is None else ref[mrows], cfg.rollout.max_tokens)
                if poison:
                    loss = loss * float("nan")
                loss.backward()
                finite = finite and math.isfinite(loss.item())
                s["loss"] += loss.item()
                s["clip"] += st["clip"]
                s["tis_trunc"] += st["tis_trunc"]
            if i == 0:
                fault_point("train")
            gn = clip_grad_norm(self.params, cfg.train.grad_clip, d.actor_group, scale=False)  # AdamW applies it
            bad = torch.tensor([0.0 if finite and math.isfinite(gn) else 1.0], device=d.device)
            if d.n_actor > 1:  # every rank skips the same updates
                dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=d.actor_group)
            if bad.item():
                s["nonfinite"] += 1
                self.opt.zero_grad()
                continue
            s["grad_norm"] += gn
            applied += 1
            reshard(self.model)  # no gathered copy may outlive the update (a no-grad pass leaves them gathered)
            self.opt.step(self.lr_at(self.opt_steps), clip=clip_coef(gn, cfg.train.grad_clip))
            self.opt_steps += 1
            if fault_point("update"):  # the recovery tests' broken weight
                with torch.no_grad():
                    local(self.params[0]).view(-1)[0] = float("nan")
        # a finite loss and gradient can still step the weights out of range (a huge lr): count the tensors that
        # hold a NaN / Inf after this step's updates (the driver stops before checkpointing them)
        s["param_nonfinite"] = float(torch.stack([~torch.isfinite(local(p)).all() for p in self.params]).sum()) \
            if applied else 0.0
        s["grad_norm"] /= max(applied, 1)
        s["loss"] /= len(mbs)
        self.routing_mismatch()  # (clears what the updates' replaying passes counted)
        s["replay_diff"], s["replay_total"] = s_replay
        return self._reduce(s)

    def _reduce(self, s: dict) -> dict:
        keys = ["tokens", "entropy", "clip", "tis_trunc", "loss", "mismatch_kl", "mismatch_abs", "replay_diff",
                "replay_total", "param_nonfinite"]
        v = torch.tensor([s[k] for k in keys], dtype=torch.float64, device=self.d.device)
        if self.d.n_actor > 1:
            dist.all_reduce(v, group=self.d.actor_group)
        r = dict(zip(keys, v.tolist()))
        n = max(r["tokens"], 1)
        out = {"loss": r["loss"], "entropy": r["entropy"] / n, "clip_frac": r["clip"] / n, "skipped_update": s["skipped"],
               "nonfinite_updates": s["nonfinite"],
               "tis_trunc_frac": r["tis_trunc"] / n, "mismatch_kl": r["mismatch_kl"] / n,
               "mismatch_abs_logp": r["mismatch_abs"] / n, "grad_norm": s["grad_norm"], "train_tokens": r["tokens"],
               "param_nonfinite": r["param_nonfinite"]}
        if r["replay_total"]:
            out["routing_mismatch"] = r["replay_diff"] / r["replay_total"]
        return out

    def sync_format(self):
        """(dtype for tensors sent as is, FP8 dtype for FP8-held tensors or None)."""
        r = self.cfg.rollout
        return DTYPES[r.dtype], (fp8_dtype(self.d.device) if r.fp8 and r.sync_fp8 else None)

    def sync_capturable(self) -> bool:
        """Whether full_weights runs no collectives and reads storage that stays put (one actor rank on a GPU), so
        the weight sync may capture its packing as CUDA graphs."""
        return self.d.n_actor == 1 and self.d.device.type == "cuda"

    def weight_spec(self, dtype, fp8=None) -> list:
        """[name, dtype, full shape] of every tensor the rollout needs, in full_weights order. With fp8, the
        tensors the rollout holds in FP8 travel quantized, each followed by its 128x128 block scales."""
        experts = {n for n, m in self.model.named_modules() if isinstance(m, EPExperts)}
        spec = []
        for name, t in self.model.state_dict().items():
            shape = list(t.shape)
            if name.rpartition(".")[0] in experts:
                shape[0] *= self.d.mesh.ep
            if fp8 is not None and is_fp8_held(name):
                spec.append([name, str(fp8), shape])
                spec.append([name + FP8_SCALE, str(torch.float32), shape[:-2] + [-(-shape[-2] // 128), -(-shape[-1] // 128)]])
                continue
            dt = t.dtype if self._sent_as_held(name, t) else dtype
            spec.append([name, str(dt), shape])
        return spec

    def _sent_as_held(self, name: str, t: torch.Tensor) -> bool:
        """Whether a tensor the actor does not quantize travels in its own dtype: integers, the fp32-kept ones,
        and (an FP8 rollout with sync_fp8 off) the FP8-held weights, which the rollout quantizes on arrival from
        the actor's own values (cast to the rollout dtype first, they were rounded twice: other FP8 bytes than
        sync_fp8 gives)."""
        return (not t.is_floating_point() or Transformer.keeps_fp32(name)
                or (self.cfg.rollout.fp8 and is_fp8_held(name)))

    def full_weights(self, dtype, fp8=None, checksums: dict | None = None, dst=None):
        """Collective over the actor ranks: the tensors of weight_spec(dtype, fp8), in order. checksums, if given,
        collects what each rollout rank must end up holding (for sync verification, `held_checksums`' keys and
        sums): an FP8 rollout's FP8 bytes and scales, quantized from the actor's own values whatever travelled;
        every other tensor as sent. Under rollout expert parallelism per expert slice, keyed 'name[a:b]'. dst(j),
        if given, is where the j-th tensor is to be written (a view into a weight-sync bucket) or None: cast and
        quantization write there directly, sparing a copy."""
        j, ep = 0, self.cfg.rollout.ep
        for name, t in full_state(self.model, self.d.mesh):
            quantized = fp8 is not None and is_fp8_held(name)
            keep = quantized or self._sent_as_held(name, t)
            d = dst(j) if dst is not None and not quantized else None
            out = d.copy_(t) if d is not None else t if keep else t.to(dtype)
            held = (out,)
            if quantized or (checksums is not None and self.cfg.rollout.fp8 and is_fp8_held(name)):
                # the rollout quantizes on arrival (from the actor's own values either way)
                into = (dst(j), dst(j + 1)) if quantized and dst is not None else None
                held = block_quant(t, fp8 if quantized else fp8_dtype(self.d.device),
                                   into if into and None not in into else None)
            j += 2 if quantized else 1
            if checksums is not None:
                if ep > 1 and ".ffn.experts." in name:
                    n = held[0].shape[0] // ep
                    for r in range(ep):
                        part = slice(r * n, (r + 1) * n)
                        checksums[f"{name}[{part.start}:{part.stop}]"] = sum(checksum(h[part]) for h in held)
                else:
                    checksums[name] = sum(checksum(h) for h in held)
            if quantized:
                yield from held
            else:
                yield out


# ---------------------------------------------------------------------------------------------------------
# checkpoints: <out>/checkpoints/step_XXXXXX/{meta.json, actor-rankNNNNN.safetensors}, written to a temporary
# directory, renamed when complete; <out>/checkpoints/latest names the newest.


def _rng_state() -> dict:
    st = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def shard_tensors(model: Transformer, opt: AdamW) -> dict:
    """An actor rank's part of a checkpoint, on the host: its local shard of every stored tensor (model.<name>) and
    its AdamW moments (optim.<parameter>.exp_avg, .exp_avg_sq)."""
    out = {f"model.{k}": local(v).cpu().contiguous() for k, v in model.stored_state().items()}
    out.update({f"optim.{k}": v.contiguous() for k, v in opt.state_tensors().items()})
    return out


def save_checkpoint(actor: Actor, step: int, task, out: Path, cfg: RunConfig, pending=None):
    """Every actor rank's shards, then (rank 0) meta.json, under a temporary name renamed when complete. pending
    (off_policy_steps=1): the next step's first rollout round, collected (collect_round), generated with the
    weights before this step's update; a resume trains on it as the uninterrupted run does, whose task cursor
    (in meta.json) is past its prompts."""
    d = actor.d
    root = out / "checkpoints"
    final, tmp = root / f"step_{step:06d}", root / f".tmp_step_{step:06d}"
    if d.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier(group=d.actor_group)
    # every actor rank writes its own shards: parameters (local FSDP shards of its experts and dense rows),
    # AdamW moments, RNG states
    tensors = {f"rng.{k}": v for k, v in _rng_state().items()}
    tensors.update(shard_tensors(actor.model, actor.opt))
    save_tensors(tensors, tmp / f"actor-rank{d.rank:05d}.safetensors")
    fault_point("ckpt")  # the recovery tests: a rank dies with the shards half written
    dist.barrier(group=d.actor_group)
    if d.rank == 0:
        if pending is not None:
            save_round(tmp, pending, cfg)
        meta = {"step": step, "opt_steps": actor.opt_steps, "adam_t": actor.opt.t, "task": task.state(),
                "world": d.world, "n_actor": d.n_actor, "ep": d.mesh.ep, "python_rng": list(random.getstate()[1]),
                "config": cfg.to_dict()}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = root / ".latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, root / "latest")
        prune_checkpoints(root, cfg.ckpt.keep)
    dist.barrier(group=d.actor_group)


def _step(p: Path) -> int | None:
    """The step of a checkpoint directory named step_N, else None."""
    m = re.fullmatch(r"step_(\d+)", p.name)
    return int(m.group(1)) if m else None


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints (step_N directories with a meta.json) under root, oldest step first."""
    return sorted((p for p in root.glob("step_*") if _step(p) is not None and (p / "meta.json").exists()), key=_step)


def prune_checkpoints(root: Path, keep: int):
    """Delete all but the newest `keep` complete checkpoints (0: keep all). Complete ones only are counted: a
    damaged one (no meta.json) is no stand-in for a newer complete one."""
    done = complete_checkpoints(root)
    for old in done[:-keep] if keep > 0 else []:
        gone = root / f".del_{old.name}"  # renamed first: never a half-deleted directory under a final name
        os.replace(old, gone)
        shutil.rmtree(gone, ignore_errors=True)
    for junk in root.glob(".del_step_*"):  # left by a crash mid-deletion
        shutil.rmtree(junk, ignore_errors=True)


def find_checkpoint(out: Path, resume: str) -> Path | None:
    if resume in ("", "none"):
        return None
    if resume != "auto":
        p = Path(resume)
        if not (p / "meta.json").exists():
            raise SystemExit(f"--resume {resume}: not a complete checkpoint (no meta.json)")
        return p
    done = complete_checkpoints(out / "checkpoints")
    return done[-1] if done else None


def _diff(a, b, prefix: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [x for k in sorted(set(a) | set(b)) for x in _diff(a.get(k), b.get(k), f"{prefix}.{k}")]
    return [] if a == b else [f"{prefix}: checkpoint {a!r}, config {b!r}"]


def _older(path: Path) -> str:
    """For an error about a damaged checkpoint step_N: '; ...' naming the newest complete one before it in its
    directory, which --resume auto takes once the damaged one is moved aside, or ''."""
    step = _step(path)
    if step is None:
        return ""
    older = [p for p in complete_checkpoints(path.parent) if _step(p) < step]
    return (f"; move it out of {path.parent} and --resume auto goes on from the newest complete checkpoint before "
            f"it, {older[-1]} (or --resume that path)" if older else "")


def check_checkpoint(path: Path, cfg: RunConfig, rank: int, n_actor: int, ep: int) -> dict:
    """Everything about a checkpoint that can be wrong, checked before the actor is built: meta.json, the layout
    it was written with, the model config, and the shard files this rank reads (their headers and sizes): its own,
    or under another layout (n_actor, ep) every writer's. Returns meta. A damaged file's error names the newest
    complete checkpoint before this one, if any."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        saved_model = meta["config"]["model"]
        int(meta["step"]), int(meta["opt_steps"]), int(meta["adam_t"]), meta["task"], meta["python_rng"]
        written = (int(meta["n_actor"]), int(meta.get("ep", 1)))
    except FileNotFoundError:
        raise SystemExit(f"{path}: not a checkpoint (no meta.json)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{path / 'meta.json'}: corrupt ({type(e).__name__}: {e}){_older(path)}") from None
    bad = _diff(saved_model, dataclasses.asdict(cfg.model), "model")
    if bad:
        raise SystemExit(f"{path}: the checkpoint's model does not match the config: " + "; ".join(bad[:5]))
    n_w, ep_w = written
    if written == (n_actor, ep):
        files = [rank]
    elif layout_error(n_w, ep_w, cfg.model.n_routed_experts):
        raise SystemExit(f"{path / 'meta.json'}: corrupt ({layout_error(n_w, ep_w, cfg.model.n_routed_experts)})"
                         f"{_older(path)}")
    else:  # another layout: this rank reads its rows from whichever shards hold them (read_resharded)
        files = range(n_w)
    for i in files:
        f = path / f"actor-rank{i:05d}.safetensors"
        if not f.exists():
            raise SystemExit(f"{path}: missing {f.name}{_older(path)}")
        try:  # parses the header and checks that the file holds every byte it declares
            with safe_open(str(f), "pt") as h:
                h.keys()
        except Exception as e:
            raise SystemExit(f"{f}: corrupt checkpoint shard ({type(e).__name__}: {e}){_older(path)}") from None
    return meta


def read_resharded(model: Transformer, opt: AdamW, path: Path, rank: int, n_w: int, ep_w: int) -> dict:
    """This rank's checkpoint tensors, named as in its own shard file, from a checkpoint that n_w actor ranks wrote
    under train.ep=ep_w. Each sharded tensor of a rank is one run of dim-0 rows of the tensor's full form (a
    layer's experts stacked: layout_rows), so the rank reads just its rows, slice by slice, from the writers' files
    that hold them; a tensor every rank holds whole, and the RNG states, come from writer rank % n_w."""
    experts = {n: m for n, m in model.named_modules() if isinstance(m, Experts)}
    rows = {}  # stored name -> (rows of the full form, this rank's first, end, expert), None for one held whole
    for k, t in model.stored_state().items():
        mod = experts.get(k.rpartition(".")[0])
        if mod is None and not hasattr(t, "device_mesh"):
            rows[k] = None
            continue
        start, n = shard_rows(t)
        off, full = (mod.expert_offset, model.cfg.n_routed_experts) if mod is not None else (0, t.shape[0])
        rows[k] = (full, off + start, off + start + n, mod is not None)
    holders = {f"model.{k}": (k, local(t)) for k, t in model.stored_state().items()}  # key -> (stored name, local)
    for n, (m, _) in opt.state.items():
        holders[f"optim.{n}.exp_avg"] = holders[f"optim.{n}.exp_avg_sq"] = (n, m)
    own = rank % n_w
    files = [path / f"actor-rank{i:05d}.safetensors" for i in range(n_w)]
    out = {}
    with contextlib.ExitStack() as stack:
        h = [stack.enter_context(safe_open(str(f), "pt")) for f in files]
        names = [set(x.keys()) for x in h]
        out.update({k: h[own].get_tensor(k) for k in names[own] if k.startswith("rng.")})
        for key, (name, t) in holders.items():
            # pieces: (writer, the rows it holds, the rows of them to read)
            pieces = [(own, t.shape[:1], slice(None))] if rows[name] is None else \
                [(w, [n], sl) for w, n, sl in row_pieces(*rows[name][:3], n_w, ep_w, rows[name][3])]
            parts = [torch.empty((0, *t.shape[1:]), dtype=t.dtype)]  # (an empty shard: rows < ranks)
            for w, held, sl in pieces:
                if key not in names[w]:
                    raise SystemExit(f"{files[w]}: missing tensor {key}")
                shape = list(h[w].get_slice(key).get_shape())
                if shape != [*held, *t.shape[1:]]:
                    raise SystemExit(f"{files[w]}: {key} is {shape}; written by {n_w} actor ranks with ep={ep_w} it "
                                     f"would be {[*held, *t.shape[1:]]}")
                part = h[w].get_tensor(key) if t.dim() == 0 else h[w].get_slice(key)[sl]
                if part.dtype != t.dtype:
                    raise SystemExit(f"{files[w]}: {key} is {part.dtype}, this run expects {t.dtype}")
                parts.append(part)
            out[key] = parts[-1] if len(parts) == 2 else torch.cat(parts)
    return out


def load_checkpoint(actor: Actor, task, path: Path, meta: dict) -> int:
    d = actor.d
    f = path / f"actor-rank{d.rank:05d}.safetensors"
    n_w, ep_w = int(meta["n_actor"]), int(meta.get("ep", 1))
    if (n_w, ep_w) == (d.n_actor, d.mesh.ep):
        mine = load_file(str(f))
    else:
        if d.rank == 0:
            print(f"resuming from {path}: written by {n_w} actor ranks with train.ep={ep_w}, read by {d.n_actor} with "
                  f"train.ep={d.mesh.ep} (each rank reads its rows from the shards that hold them)", flush=True)
        f = path / "actor-rank*.safetensors"
        mine = read_resharded(actor.model, actor.opt, path, d.rank, n_w, ep_w)
    want = {f"model.{k}": local(v) for k, v in actor.model.stored_state().items()}
    for n, (m, v) in actor.opt.state.items():
        want[f"optim.{n}.exp_avg"], want[f"optim.{n}.exp_avg_sq"] = m, v
    for k, v in want.items():
        if k not in mine:
            raise SystemExit(f"{f}: missing tensor {k}")
        if mine[k].shape != v.shape or mine[k].dtype != v.dtype:
            raise SystemExit(f"{f}: {k} is {mine[k].dtype} {list(mine[k].shape)}, this run expects {v.dtype} "
                             f"{list(v.shape)}")
    # a run saves no NaN / Inf weight or moment (the driver stops before checkpointing one), so one here is damage;
    # loaded, it would stop the run a step later blaming the update (aminmax: one read, NaN propagates)
    bad = [k for k, v in want.items() if v.is_floating_point() and mine[k].numel()
           and not all(map(math.isfinite, (x.item() for x in torch.aminmax(mine[k]))))]
    if bad:
        raise SystemExit(f"{f}: {len(bad)} tensor(s) hold NaN / Inf, which a run never saves (the file is damaged), "
                         f"first: {bad[:3]}{_older(path)}")
    with torch.no_grad():
        for k, v in actor.model.stored_state().items():
            local(v).copy_(mine[f"model.{k}"])
    actor.opt.load_state_tensors({k[len("optim."):]: v for k, v in mine.items() if k.startswith("optim.")},
                                 meta["adam_t"])
    actor.opt_steps = meta["opt_steps"]
    torch.set_rng_state(mine["rng.torch"])
    if "rng.cuda" in mine and torch.cuda.is_available():
        torch.cuda.set_rng_state(mine["rng.cuda"])
    random.setstate((3, tuple(meta["python_rng"]), None))
    task.load_state(meta["task"])
    return meta["step"]


# ---------------------------------------------------------------------------------------------------------
# evaluation


def evaluate(cfg: RunConfig, task, tok, client: RolloutClient, step: int) -> dict:
    items = task.eval_items()
    prompts = [encode_prompt(cfg, tok, it.prompt) for it in items]
    greedy = client.generate(prompts, sampling(cfg, 0, len(prompts), temperature=0.0))
    acc = sum(task.correct(completion_text(tok, o), it.answer) for o, it in zip(greedy, items)) / len(items)
    k = cfg.eval.pass_k
    res = {"eval_greedy_acc": acc}
    if k > 0:
        rep = [p for p in prompts for _ in range(k)]
        outs = client.generate(rep, sampling(cfg, 10_000_019 + step, len(rep), cfg.eval.temperature), group_size=k)
        hit = [any(task.correct(completion_text(tok, o), it.answer) for o in outs[j * k:(j + 1) * k])
               for j, it in enumerate(items)]
        res[f"eval_pass@{k}"] = sum(hit) / len(items)
    return res


# ---------------------------------------------------------------------------------------------------------
# main loops


def metrics_line(m: dict) -> str:
    """One metrics.jsonl line, strict JSON: a non-finite number (a NaN loss) is null (json.dumps wrote NaN, which
    JSON parsers other than Python's refuse)."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in m.items()},
                      allow_nan=False)


def write_plot(metrics_path: Path, png: Path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib not installed: no plot; pip install '.[plot]' for {png.name})")
        return
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    keys = [k for k in ("reward_mean", "accuracy", "eval_greedy_acc", "loss", "entropy", "mismatch_kl",
                        "response_len") if any(k in r for r in rows)]
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3))
    for ax, k in zip(np.atleast_1d(axes), keys):
        xs = [r["step"] for r in rows if k in r]
        ax.plot(xs, [np.nan if r[k] is None else r[k] for r in rows if k in r],
                marker="." if k.startswith("eval") else None)
        ax.set_title(k)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def _write_atomic(path: Path, text: str):
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def set_aside(out: Path) -> Path | None:
    """A run starting at step 0 in an out_dir whose checkpoints/ holds an earlier run's step_* directories: those
    checkpoints and that run's metrics.jsonl move to out_dir/previous-<n>/, nothing deleted, so that --resume auto
    and the keep rule see this run's checkpoints only. -> where they went (None: nothing to move)."""
    if not any((out / "checkpoints").glob("step_*")):
        return None
    n = 1
    while (out / f"previous-{n}").exists():
        n += 1
    dest = out / f"previous-{n}"
    dest.mkdir()
    for p in (out / "checkpoints", out / "metrics.jsonl"):
        if p.exists():
            os.replace(p, dest / p.name)
    return dest


def restore_metrics(path: Path, start: int):
    """On resume: keep the lines of steps up to the checkpoint (later steps are redone identically); a line cut
    short by a crash is dropped."""
    keep = []
    for ln in path.read_text().splitlines() if path.exists() else []:
        try:
            if json.loads(ln)["step"] <= start:
                keep.append(ln)
        except (ValueError, KeyError, TypeError):
            continue
    _write_atomic(path, "".join(ln + "\n" for ln in keep))


def run_driver(cfg: RunConfig, d: Dist, actor: Actor, task, tok, start: int, ckpt: Path | None = None):
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    client = RolloutClient(d.rollout_ranks, d.sync_group, d.device, cfg.rollout.ep)
    bucket = int(cfg.rollout.sync_bucket_mb * 2 ** 20)
    if getattr(task, "load_stats", None):
        print(f"task: {len(task.items)} training and {len(task.eval_items())} evaluation prompts; skipped or cut: "
              + ", ".join(f"{k} {v}" for k, v in task.load_stats.items())
              + (f" (the first malformed line {task.first_bad}; task.strict=true stops at one)" if task.first_bad
                 else ""), flush=True)
    if start == 0:
        moved = set_aside(out)
        if moved is not None:
            print(f"{out}: an earlier run's checkpoints and metrics.jsonl moved to {moved} (a run starting at step 0 "
                  f"begins clean; --resume auto continues a run)", flush=True)
        _write_atomic(metrics_path, "")
        _write_atomic(out / "config.json", json.dumps(cfg.to_dict(), indent=1))
    else:
        restore_metrics(metrics_path, start)
        print(f"resumed from step {start}" + (f": train.steps={cfg.train.steps} already reached, nothing to train"
                                              if start >= cfg.train.steps else ""), flush=True)
    rdtype, fp8 = actor.sync_format()
    spec = actor.weight_spec(rdtype, fp8)
    rollout_peers = f"rollout ranks {d.rollout_ranks[0]}-{d.rollout_ranks[-1]}"
    graphs = "actor" if cfg.rollout.sync_graphs and actor.sync_capturable() else None

    def sync(step):
        with phase(f"weight sync after step {step}", f"actor ranks and {rollout_peers}"):
            _send_cmd(d, "sync", step)
            sent = client.sync_weights(spec, lambda dst, sums: actor.full_weights(rdtype, fp8, sums, dst), bucket,
                                       cfg.rollout.sync_verify, graphs)
            if d.device.type == "cuda":  # the broadcasts are queued on the GPU: time_sync_s counts until they end
                torch.cuda.synchronize(d.device)
            return sent
    sync(start)
    nonfinite_run = 0   # consecutive steps with a skipped non-finite update
    short_cache_said = False  # the warning of a rollout short of cache blocks, given once a run
    n_layers, top_k = cfg.model.num_hidden_layers, cfg.model.num_experts_per_tok
    bar = tqdm(range(start + 1, cfg.train.steps + 1), initial=start, total=cfg.train.steps, desc="grpo",
               dynamic_ncols=True)
    version = start     # the actor version the rollout holds: optimizer steps taken = train steps done
    # off_policy_steps=1: the next step's first round, submitted before this step trains (a resume takes the one its
    # checkpoint holds)
    pending = None
    if ckpt is not None and cfg.train.off_policy_steps and start < cfg.train.steps:
        pending = load_round(ckpt, cfg)
    try:
        for step in bar:
            with phase(f"GRPO step {step}"):
                t0 = time.perf_counter()
                started = pending or start_rollouts(cfg, step, task, tok, client, version)
                groups, rs, versions = finish_rollouts(cfg, step, task, tok, client, started, version)
                pending = None
                if cfg.train.off_policy_steps and step < cfg.train.steps:
                    pending = start_rollouts(cfg, step + 1, task, tok, client, version)
                batch = make_batch(groups, cfg, tok.pad_id, n_layers, top_k)
                t1 = time.perf_counter()
                with phase(f"train step {step}", f"actor ranks 0-{d.n_actor - 1}"):
                    _send_cmd(d, "train", step)
                    bcast_batch(batch, d)
                    ts = actor.train_step(batch, step)
                t2 = time.perf_counter()
                sent = sync(step)
                version = step
                t3 = time.perf_counter()
                m = {"step": step, "reward_mean": rs["reward_sum"] / rs["samples"],
                     "accuracy": rs["correct"] / rs["samples"],
                     **{k: ts[k] for k in ("loss", "entropy", "clip_frac", "tis_trunc_frac", "mismatch_kl",
                                           "mismatch_abs_logp", "grad_norm", "routing_mismatch", "skipped_update",
                                           "nonfinite_updates")
                        if k in ts},
                     **({"param_nonfinite": ts["param_nonfinite"]} if ts["param_nonfinite"] else {}),
                     "response_len": float(batch["loss_mask"].sum(-1).mean()), "groups_kept": rs["groups_kept"],
                     "rollout_rounds": rs["rounds"], **{f"rollout_{k}": rs[k] for k in CACHE_COUNTS},
                     "lr": actor.lr_at(actor.opt_steps - 1),
                     "staleness": float(np.mean([step - 1 - v for v in versions])),
                     "time_rollout_s": t1 - t0, "time_train_s": t2 - t1, "time_sync_s": t3 - t2,
                     "time_generate_s": rs["gen_s"], "time_step_s": t3 - t0,
                     "sync_gb_s": sent / max(t3 - t2, 1e-9) / 1e9,
                     "rollout_tokens_per_s": rs["gen_tokens"] / max(rs["gen_s"], 1e-9),  # the engine's own time
                     "tokens_per_s": float(batch["attn"].sum()) / max(t3 - t0, 1e-9)}
                last = step == cfg.train.steps
                nonfinite_run = nonfinite_run + 1 if ts["nonfinite_updates"] else 0
                # weights out of range (after this step's update, or before it: the pi_old pass's entropy and
                # mismatch are NaN / Inf) stop the run at once, unevaluated and not checkpointed
                broken = ts["param_nonfinite"] or not (math.isfinite(ts["entropy"]) and
                                                       math.isfinite(ts["mismatch_kl"]))
                stop = nonfinite_run >= cfg.train.max_nonfinite_steps or broken
                if cfg.eval.every > 0 and (step % cfg.eval.every == 0 or last) and not stop:
                    t4 = time.perf_counter()
                    ev = evaluate(cfg, task, tok, client, step)
                    m.update(ev, time_eval_s=time.perf_counter() - t4)
                    tqdm.write(f"step {step}: evaluation of {len(task.eval_items())} prompts: "
                               + ", ".join(f"{k.removeprefix('eval_')} {v:.3f}" for k, v in ev.items()))
                with open(metrics_path, "a") as f:  # before the checkpoint: a resume from it finds this step's line
                    f.write(metrics_line(m) + "\n")
                if cfg.ckpt.every > 0 and (step % cfg.ckpt.every == 0 or last) and not stop:
                    if pending is not None:  # the checkpoint keeps it: a resume trains on what this run does
                        pending = collect_round(client, pending)
                    with phase(f"checkpoint at step {step}", f"actor ranks 0-{d.n_actor - 1}"):
                        _send_cmd(d, "ckpt", step)
                        save_checkpoint(actor, step, task, out, cfg, pending)
                bar.set_postfix(reward=f"{m['reward_mean']:.2f}", acc=f"{m['accuracy']:.2f}",
                                kl=f"{m['mismatch_kl']:.1e}")
                if any(rs[k] for k in CACHE_COUNTS) and not short_cache_said:
                    short_cache_said = True  # (metrics.jsonl counts every step's)
                    note = cache_note(rs, bool(cfg.rollout.num_blocks),
                                      ("rollout.num_blocks", "rollout.mem_fraction", "rollout.max_seqs"))
                    tqdm.write(f"warning: step {step}: the rollout ran short of cache blocks{note}; said once, "
                               f"metrics.jsonl's rollout_cache_waits and rollout_preemptions count each step's")
                if ts["nonfinite_updates"]:
                    print(f"step {step}: {int(ts['nonfinite_updates'])} update(s) skipped, NaN/Inf loss or gradient "
                          f"({nonfinite_run} step(s) in a row)", flush=True)
                if broken:
                    newest = find_checkpoint(out, "auto")
                    what = (f"its update left {int(ts['param_nonfinite'])} weight tensor(s) holding NaN/Inf, with a "
                            "finite loss and gradient norm" if ts["param_nonfinite"] else
                            f"the policy's log-probs before its update were not finite (entropy {ts['entropy']}, "
                            f"mismatch_kl {ts['mismatch_kl']}): an earlier update broke the weights")
                    raise SystemExit(f"stopping at step {step}: {what} (train.lr={cfg.train.lr:g}: too large?); this "
                                     "step was not checkpointed" + (f"; the newest checkpoint is {newest.name}, which "
                                                                    "--resume auto takes (check its steps' metrics)"
                                                                    if newest is not None else ""))
                if stop:
                    newest = find_checkpoint(out, "auto")
                    raise SystemExit(f"stopping: {nonfinite_run} steps in a row with NaN/Inf loss or gradients (steps "
                                     f"{step - nonfinite_run + 1}-{step}; train.max_nonfinite_steps="
                                     f"{cfg.train.max_nonfinite_steps}); their updates were skipped, so the weights "
                                     f"are those from before them" + (f", as in the newest checkpoint, {newest.name}"
                                                                       if newest is not None else ""))
        if cfg.ckpt.export_final:
            with phase("export", f"actor ranks 0-{d.n_actor - 1}"):
                _send_cmd(d, "export", cfg.train.steps)
                export(actor, out / "final")
    finally:
        _send_cmd(d, "stop")
        client.stop()
    if cfg.plot:
        write_plot(metrics_path, out / "curves.png")
    rows = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
    if rows:
        first, last10 = rows[:5], rows[-10:]
        print(f"done: reward first 5 steps {np.mean([r['reward_mean'] for r in first]):.3f}, "
              f"last 10 steps {np.mean([r['reward_mean'] for r in last10]):.3f}; metrics in {metrics_path}")


CMDS = {"train": 1, "ckpt": 2, "stop": 3, "sync": 4, "export": 5}


def export(actor: Actor, path: Path | None):
    """The trained model in the release layout (BF16). Collective: every actor rank streams its shards; only
    the driver (path given) writes."""
    named = zip((n for n, _, _ in actor.weight_spec(torch.float32)), actor.full_weights(torch.float32))
    if path is None:
        for _ in named:
            pass
        return
    save_pretrained(None, path, cfg=actor.cfg.model, tensors=release_tensors(named, actor.cfg.model))


def _send_cmd(d: Dist, cmd: str, step: int = 0):
    """Driver -> other actor ranks: what to do next (train, ckpt, stop) and for which step."""
    if d.n_actor > 1:
        dist.broadcast(torch.tensor([CMDS[cmd], step], device=d.device), 0, group=d.actor_group)


def agree_checkpoint(cfg: RunConfig, d: Dist, resume: str) -> tuple[Path | None, dict | None]:
    """All actor ranks resume from the driver's choice; each checks it (its own shard, or under another layout every
    writer's) before the actor is built, and the driver alone says what they found wrong, once: a finding every
    rank made alike (a damaged meta.json) as it is, others naming the ranks that made them (a shard one rank reads)."""
    path = find_checkpoint(Path(cfg.out_dir), resume) if d.rank == 0 else None
    name = torch.zeros(1024, dtype=torch.uint8, device=d.device)
    if d.rank == 0 and path is not None:
        b = str(path).encode()
        if len(b) > name.numel():
            raise SystemExit(f"{path}: checkpoint path longer than {name.numel()} bytes")
        name[:len(b)] = torch.frombuffer(bytearray(b), dtype=torch.uint8)
    if d.n_actor > 1:
        with phase("choosing the checkpoint", "rank 0, the driver"):
            dist.broadcast(name, 0, group=d.actor_group)
    s = name.cpu().numpy().tobytes().rstrip(b"\0").decode()
    if not s:
        if d.rank == 0 and resume == "auto":
            print(f"--resume auto: no complete checkpoint in {Path(cfg.out_dir) / 'checkpoints'}; starting at step 0",
                  flush=True)
        return None, None
    try:
        meta, err = check_checkpoint(Path(s), cfg, d.rank, d.n_actor, d.mesh.ep), None
    except SystemExit as e:
        meta, err = None, str(e.code)
    errs = [err]
    if d.n_actor > 1:
        errs = [None] * d.n_actor
        with phase("checking the checkpoint", "every actor rank"):
            dist.all_gather_object(errs, err, group=d.actor_group)
    if any(errs):
        quiet_exit(d.rank)  # (the driver says it)
        said = {}
        for r, e in enumerate(errs):
            if e:
                said.setdefault(e, []).append(r)
        raise SystemExit("\n".join(e if len(said) == 1 and len(ranks) == d.n_actor else
                                   f"actor rank(s) {', '.join(map(str, ranks))}: {e}" for e, ranks in said.items()))
    return Path(s), meta


def run_follower(cfg: RunConfig, d: Dist, actor: Actor, task):
    """Actor ranks other than the driver: train on the driver's batches, join checkpoints, until told to stop."""
    out = Path(cfg.out_dir)
    peers = f"actor ranks 0-{d.n_actor - 1}"
    while True:
        cmd = torch.zeros(2, dtype=torch.int64, device=d.device)
        with phase("waiting for the driver", "rank 0, the driver", idle=True):
            dist.broadcast(cmd, 0, group=d.actor_group)
        code, step = int(cmd[0]), int(cmd[1])
        if code == CMDS["stop"]:
            return
        if code == CMDS["train"]:
            with phase(f"train step {step}", peers):
                actor.train_step(bcast_batch(None, d), step)
        elif code == CMDS["ckpt"]:
            with phase(f"checkpoint at step {step}", peers):
                save_checkpoint(actor, step, task, out, cfg)
        elif code == CMDS["sync"]:  # the driver broadcasts what the actor ranks gather together
            # (idle: the driver also waits on the rollout ranks here; a stuck one is for the driver to name)
            with phase(f"weight sync after step {step}", peers, idle=True):
                for _ in actor.full_weights(*actor.sync_format()):
                    pass
        elif code == CMDS["export"]:
            with phase("export", peers):
                export(actor, None)


def make_engine(cfg: RunConfig, model, device, ep=None):
    r = cfg.rollout
    if r.engine == "simple":
        return SimpleEngine(model, fp8=r.fp8, dtype=DTYPES[r.dtype], device=device, ep=ep)
    return Engine(model, fp8=r.fp8, dtype=DTYPES[r.dtype], device=device, max_seqs=r.max_seqs,
                  max_model_len=r.max_model_len, mem_fraction=r.mem_fraction, num_blocks=r.num_blocks or None,
                  cuda_graphs=r.cuda_graphs, ep=ep)


def run_rollout(cfg: RunConfig, d: Dist):
    # on meta: the weights arrive by broadcast, and the engine gives device memory only to what this rank holds (in
    # FP8, its slice of the experts), never to the whole BF16 model
    model = build_model(cfg.model, "meta", DTYPES[cfg.rollout.dtype], seed=None)
    engine = make_engine(cfg, model, d.device, d.rollout_ep)
    del model
    lead = d.rollout_ep is None or d.rollout_ep[2] == 0  # (a group's ranks run one schedule: its first speaks)
    if lead and isinstance(engine, Engine):
        t, groups = cfg.train, cfg.deploy.rollout_ranks // cfg.rollout.ep
        note = engine.footprint_note("rollout.max_model_len", "rollout.max_seqs")
        print(f"rollout rank {d.rank}: engine on {d.device}: {note}; a step's first round asks {t.prompts_per_step} x "
              f"{t.group_size} sequences of the {groups} rollout group(s)", flush=True)
    serve(engine, 0, d.sync_group, d.device, reply=lead)


def quiet_exit(rank: int, grace_s: float = 10.0):
    """A failure every rank meets alike: ranks other than 0 exit (code 2) without a word, after a grace period,
    so torchrun, which stops every rank once one has exited, does not stop rank 0 before it has said why (the
    launch ends as soon as rank 0 exits)."""
    if rank != 0:
        time.sleep(grace_s)
        raise SystemExit(2)


def main(argv=None):
    ap = argparse.ArgumentParser(description="GRPO for DeepSeek-V4 MoE models (run under torchrun).")
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default="", help="'auto' = newest complete checkpoint in out_dir, or a path")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value")
    args = ap.parse_intermixed_args(argv)  # overrides before and after --resume
    rank = int(os.environ.get("RANK", "0"))
    # a crash in native code (a segfault, an abort: gloo, the allocator) prints every thread's Python stack to
    # the process's stderr, where torchrun's log has it, before the process dies
    try:
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
    except (AttributeError, OSError, ValueError):  # no stderr file descriptor (closed, or none at all)
        pass
    try:
        cfg = RunConfig.load(args.config, args.overrides)
        if "RANK" in os.environ:
            try:
                cfg.validate_world(int(os.environ["WORLD_SIZE"]))
            except ConfigError as e:
                raise ConfigError(f"{args.config}: {e}") from None
        # every rank checks the path; the driver, which writes there, also makes a file (before the model is built)
        denied = write_denied(Path(cfg.out_dir), probe=rank == 0)
        if denied:
            raise ConfigError(f"out_dir {cfg.out_dir}: {denied}")
        if args.resume not in ("", "auto", "none") and not (Path(args.resume) / "meta.json").exists():
            raise ConfigError(f"--resume {args.resume}: not a complete checkpoint (no meta.json)")
        task, tok = make_task(cfg)
    except ConfigError as e:  # the same on every rank: said once, by rank 0
        quiet_exit(rank)
        raise SystemExit(f"config error: {e}") from None
    except SystemExit as e:
        quiet_exit(rank)
        raise SystemExit(e.code) from None
    d = init_dist(cfg)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    try:
        if d.is_actor:
            ckpt, meta = agree_checkpoint(cfg, d, args.resume)
            actor = Actor(cfg, d)
            start = load_checkpoint(actor, task, ckpt, meta) if ckpt else 0
            if d.rank == 0:
                run_driver(cfg, d, actor, task, tok, start, ckpt)
            else:
                run_follower(cfg, d, actor, task)
        else:
            run_rollout(cfg, d)
    except SystemExit as e:  # a clear error: say it and leave (peers are torn down by torchrun or their watchdog)
        if e.code not in (None, 0):
            sys.stdout.flush()
            sys.stderr.write(f"rank {d.rank}: {e.code}\n" if isinstance(e.code, str) else "")
            sys.stderr.flush()
            os._exit(e.code if isinstance(e.code, int) else 1)
        WATCHDOG.unshare()
        raise
    except BaseException as e:
        sys.stdout.flush()
        traceback.print_exc()
        sys.stderr.write(f"{WATCHDOG.raised_in or WATCHDOG.where()}: {type(e).__name__}: {e}\n")
        sys.stderr.flush()
        os._exit(1)
    WATCHDOG.unshare()  # (the process groups close at exit: init_dist registered close_process_groups)


if __name__ == "__main__":
    main()
