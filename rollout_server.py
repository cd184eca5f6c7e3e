"""The rollout side: the FP8 DeepSeek-V4 generation engine, the serve loop that answers the trainer, the trainer's
client for it, and a command line.

    Engine(model_or_path, fp8=True, dtype=torch.bfloat16, device=None, ...)
    engine.generate(prompts: list[list[int]], SamplingParams(...)) -> [Output(token_ids, logprobs, routed_experts)]
    python rollout_server.py --model DIR --prompts FILE.jsonl --out FILE.jsonl   (with --tokenizer, answers scored)
    python rollout_server.py --model DIR --bench
    torchrun --nproc-per-node N rollout_server.py ... [--ep E]   (groups of E ranks split the routed experts)

`Engine` is the paged engine: fixed-size per-sequence state (the sliding window's ring, each compressor's partial
window and overlap series) lives in slot pools, the growing state (CSA / HCA compressed entries, indexer keys) in
block pools with per-sequence block tables; the G samples of a GRPO group share their prompt's blocks (prefilled
once, the last partial block copied on fork); a scheduler runs chunked prefill and batched decode steps,
admitting and retiring sequences every step and preempting (by recompute) when the block pool runs out; decode
steps replay CUDA graphs captured per batch bucket. `SimpleEngine` is its slow twin: the same math with
per-sequence tensors and a Python loop over sequences for attention. Both share the sampler, the FP8 weight
holders and the per-sequence prefill math.

FP8: the release's dense linears and the routed experts are e4m3 (float8_e4m3fnuz on MI300-class GPUs) with
128x128 block scales; activations are quantized per 1x128 tile; router, norms, mHC, sinks, embeddings, head and
the compressor / indexer-key projections stay in the compute dtype.
Outputs: `routed_experts` has one row per token fed through the model (prompt + completion[:-1]):
(n, layers, top_k) uint8. Log-probs are of the sampled tokens under the temperature-scaled distribution (before
top-p / top-k). Sampling noise is a hash of (request seed, sequence index, token index), so a request's samples do
not depend on what else is in the batch, on preemption, or on which engine runs it: exactly so in fp32 without FP8;
in BF16, and with FP8 weights (each row's activations quantized), the logits themselves may round differently with
the rows beside them (README).
"""
from __future__ import annotations

import argparse
import atexit
import copy
import functools
import json
import math
import numbers
import operator
import os
import re
import signal
import sys
import threading
import time
import warnings
from collections import deque
from datetime import timedelta
from collections.abc import Iterable
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from kernels.attention import (decode_attention, index_scores, index_topk, prefill_attention, prefill_index,
                               prefill_index_ref)
from kernels.compress import compress_decode
from kernels.fp8_gemm import (GEMV_ROWS, Prenorm, block_quant, fp8_gemm, fp8_linear, fp8_linear_grouped, pow2,
                              small_linear, tickets, use_triton)
from kernels.moe import fused_moe, moe_gemv_early, moe_kernels_take
from kernels.sample import gumbel_sample, host_rows, threshold, to_host
from kernels.step import step_inputs
from kernels.quant import BLOCK, dequant_fp8_block, fp8_dtype, quant_fp8_block
from model.config import CSA, HCA, ModelConfig, load_hf_config
from model.model import Attention, Experts, Linear, MoE, Transformer, attend, hc_post_mix
from model.parallel import close_process_groups
from model.weights import FP8_LINEAR, float_dtype, load_pretrained, load_state, pretrained_skeleton, stored_scale_fmt


MIN_TEMPERATURE = 1e-30


@dataclass
class SamplingParams:
    temperature: float = 1.0      # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                # 0 = off
    max_tokens: int = 16
    seed: int | None = None       # per request: sequence i of a generate() call samples with (seed, first_index + i);
    #                               None samples as seed 0 does (runs are reproducible unless seeds are varied)
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        """Checks every field up front (a bad one named, before any work) and normalizes the integers to int."""
        bad = []

        def whole(name, lo=None):  # an integer (numpy and 0-d tensor integers too), >= lo
            v = getattr(self, name)
            try:
                i = operator.index(v) if not isinstance(v, bool) else None
            except TypeError:
                i = None
            if i is None or (lo is not None and i < lo):
                bad.append(f"{name}={v!r} ({'an integer' if i is None else f'>= {lo}'})")
            else:
                setattr(self, name, i)

        def real(name, ok, rule):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or not ok(v):
                bad.append(f"{name}={v!r} ({rule})")
            else:
                setattr(self, name, float(v))
        # below MIN_TEMPERATURE, logits / temperature overflows fp32 (NaN log-probs); such a temperature is greedy
        real("temperature", lambda t: t == 0 or t >= MIN_TEMPERATURE,
             f">= 0, 0 = greedy; a positive one >= {MIN_TEMPERATURE:g}")
        real("top_p", lambda p: 0 < p <= 1, "in (0, 1]")
        whole("top_k", 0)
        whole("max_tokens", 1)
        if self.seed is not None:
            whole("seed")
        try:
            self.stop_token_ids = [operator.index(t) for t in self.stop_token_ids]
        except TypeError:
            bad.append(f"stop_token_ids={self.stop_token_ids!r} (a list of token ids)")
        if bad:
            raise ValueError(f"invalid sampling parameters: {', '.join(bad)}")

    @property
    def filtered(self) -> bool:
        """Top-k or top-p: drawn above a threshold (filter_threshold), inside the decode step's own graphs."""
        return self.top_k > 0 or self.top_p < 1.0


@dataclass
class Output:
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    routed_experts: torch.Tensor  # (len(prompt) + len(token_ids) - 1, layers, top_k) uint8
    finish_reason: str            # "stop" | "length"
    # with record_index: (len(prompt) + len(token_ids) - 1, CSA layers, index_topk) int32, the compressed entries
    # the indexer chose for each position in each CSA layer (layer order), ascending, -1 past them; else None
    index_entries: torch.Tensor | None = None


# ---------------------------------------------------------------------------------------------------------
# sampling


def seq_seed(seed, idx: int) -> int:
    return ((0 if seed is None else int(seed)) * 1_000_003 + idx * 7919 + 17) % (2 ** 62)


def _mix32(x):
    x = x & 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    return (x >> 16) ^ x


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, V: int) -> torch.Tensor:
    """(B,) seeds, (B,) token indices -> (B, V) fp32 Gumbel noise, a pure function of (seed, step, vocab id)."""
    v = torch.arange(V, device=seeds.device, dtype=torch.int64)
    h = _mix32(seeds[:, None] ^ _mix32(steps[:, None] * 0x27D4EB2D + 0x165667B1))
    h = _mix32(h ^ _mix32(v[None] * 0x9E3779B1 + (seeds[:, None] >> 32)))
    u = ((h >> 9).float() + 0.5) * 2.0 ** -23  # in (0, 1): 23 random bits, exactly representable
    return -torch.log(-torch.log(u))


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], steps: list[int],
           fused: bool = True):
    """logits (B, V) (taken in fp32) -> tokens (B,) long, log-probs (B,) fp32 of those tokens under logits /
    temperature (before any top-k / top-p). GPUs draw with kernels.sample.gumbel_sample (one pass; same tokens);
    fused=False forces the torch path, its twin."""
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], device=dev)
    filtered = any(p.filtered for p in params)
    seeds = torch.tensor(seeds, device=dev, dtype=torch.int64)
    steps = torch.tensor(steps, device=dev, dtype=torch.int64)
    if fused and use_triton(logits) and not filtered:
        return gumbel_sample(logits, temps, seeds, steps)
    if not filtered:
        return sample_plain(logits, temps, seeds, steps)
    return sample_filtered(logits, temps, torch.tensor([p.top_k for p in params], device=dev),
                           torch.tensor([p.top_p for p in params], device=dev), seeds, steps,
                           filter_candidates(params), fused)


def sample_plain(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor):
    """`sample` without top-k / top-p, from tensors (B,): the torch twin of kernels.sample.gumbel_sample, which
    the decode step runs in itself on CPUs (logits taken in fp32)."""
    scaled = _scaled(logits, temps)
    return _pick(logits, temps == 0, scaled, scaled, seeds, steps)


def filter_candidates(params: list[SamplingParams]) -> int | None:
    """How many of each row's largest logits filter_threshold must rank for these rows: the largest top_k when
    every filtered row has one (its top-p can only keep fewer); None (the whole vocabulary, a sort) when a row
    filters by top-p alone. From the host's parameters: nothing waits for the device."""
    rows = [p for p in params if p.filtered]
    return max(p.top_k for p in rows) if rows and all(p.top_k > 0 for p in rows) else None


def filter_threshold(logits: torch.Tensor, temps: torch.Tensor | None, top_k: torch.Tensor, top_p: torch.Tensor,
                     candidates: int | None = None, fused: bool = True) -> torch.Tensor:
    """logits (B, V), temps (B,) (0: greedy, taken as 1; None: all 1); top_k (B,) (0: off), top_p (B,) fp32 ->
    (B,) fp32: the smallest scaled logit (logits / temperature, in fp32) each row keeps (-inf: a row without top-k
    / top-p). A row keeps its largest logits, at most top_k of them, and with top_p < 1 only while the
    probability mass of those before each is below top_p (at least the largest); a token tied with the last one
    kept is kept too. GPUs search each row's values in one launch, no sort (kernels.sample.threshold); fused=False
    (or CPUs) ranks them here, the twin: torch.topk of filter_candidates' count (candidates) where given, else a
    sort of the vocabulary (the same threshold)."""
    if fused and use_triton(logits):
        temps = torch.ones(logits.shape[0], device=logits.device) if temps is None else temps
        return threshold(logits, temps, top_k, top_p)
    scaled = _scaled(logits, temps)
    B, V = scaled.shape
    K = V if candidates is None else min(candidates, V)
    vals = scaled.topk(K, -1).values if K < V else scaled.sort(-1, descending=True).values
    probs = (vals - scaled.logsumexp(-1, keepdim=True)).exp()
    keep = torch.arange(K, device=scaled.device)[None] < torch.where(top_k > 0, top_k, V)[:, None]
    keep &= ((probs.cumsum(-1) - probs) < top_p[:, None]) | (top_p[:, None] >= 1)  # (1: off, though fp32 sums
    # may reach 1 before the tail)
    thr = vals.gather(-1, (keep.sum(-1, keepdim=True) - 1).clamp(min=0))[:, 0]
    return torch.where((top_k > 0) | (top_p < 1), thr, float("-inf"))


def _scaled(logits: torch.Tensor, temps: torch.Tensor | None) -> torch.Tensor:
    """logits / temperature in fp32 (greedy rows: 1; bf16 / fp16 logits promoted in the division itself: the bits
    of logits.float() / t, one pass fewer)."""
    if temps is None:
        return logits.float()
    return logits / torch.where(temps == 0, torch.ones_like(temps), temps).float()[:, None]


def sample_filtered(logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    seeds: torch.Tensor, steps: torch.Tensor, candidates: int | None = None, fused: bool = True,
                    also: torch.Tensor | None = None):
    """`sample` with top-k / top-p, from tensors (B,) (top_k 0: off; top_p fp32): the Gumbel-max over each row's
    tokens at or above filter_threshold (GPUs: its one-launch search, then gumbel_sample's one pass given the
    thresholds, the logits read as they are; fused=False, or CPUs: the torch twins). It reads no host value, so
    a decode step with such rows draws them inside itself (and its CUDA graph). also: the tokens copied into
    also[:B] too (gumbel_sample's)."""
    thr = filter_threshold(logits, temps, top_k, top_p, candidates, fused)
    if fused and use_triton(logits):
        return gumbel_sample(logits, temps, seeds, steps, thr=thr, also=also)
    scaled = _scaled(logits, temps)
    tok, lp = _pick(logits, temps == 0, scaled, scaled.masked_fill(scaled < thr[:, None], float("-inf")), seeds,
                    steps)
    if also is not None:
        also[:tok.shape[0]].copy_(tok)
    return tok, lp


def _pick(logits, greedy, scaled, masked, seeds, steps):
    """Argmax (greedy rows) or Gumbel-max over the masked scaled logits; the log-probs under scaled."""
    tok = torch.where(greedy, logits.argmax(-1), (masked + gumbel_noise(seeds, steps, logits.shape[1])).argmax(-1))
    return tok, scaled.log_softmax(-1).gather(-1, tok[:, None])[:, 0]


# ---------------------------------------------------------------------------------------------------------
# FP8 (and BF16) weight holders for the engines


def quantize(w: torch.Tensor, fp8: torch.dtype, scale_fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 block FP8: one Triton pass on GPU for fp32 scales (kernels.fp8_gemm.block_quant), else the
    torch reference."""
    return block_quant(w, fp8) if scale_fmt == "fp32" else quant_fp8_block(w, fp8, BLOCK, scale_fmt)


class FP8Linear(nn.Module):
    """e4m3 weight with 128x128 block scales; forward = act quant per 1x128 tile + block-scaled FP8 GEMM."""

    def __init__(self, w: torch.Tensor, fp8: torch.dtype, scale_fmt: str, dtype: torch.dtype):
        super().__init__()
        self.fp8, self.scale_fmt, self.dtype = fp8, scale_fmt, dtype
        q, s = quantize(w, fp8, scale_fmt)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", s.float())

    @property
    def weight(self):
        return dequant_fp8_block(self.qweight, self.scale, self.dtype)

    def forward(self, x, xq=None):
        """xq: x's rows already quantized per 1x128 tile, (q, scales) as act_quant gives them: one GEMM launch. A
        Prenorm: x normed by its module first (in the GEMV kernel at a few rows)."""
        if xq is None or isinstance(xq, Prenorm):
            return fp8_linear(x, self.qweight, self.scale, None if xq is None else xq.norm)
        return fp8_gemm(*xq, self.qweight, self.scale, x.dtype).view(*x.shape[:-1], self.qweight.shape[0])

    def grouped(self, x, xq=None):
        """x (..., G, K/G) -> (..., G, N/G): block-diagonal product with the G row groups of the weight. xq: x's
        rows already quantized per 1x128 tile (the decode attention kernel's), for the GEMM launch alone."""
        G = x.shape[-2]
        rows = self.qweight.shape[0] // G
        if rows % BLOCK or x.shape[-1] % BLOCK:
            w = self.weight.view(G, rows, -1)
            return torch.einsum("...gi,gri->...gr", x, w)
        return fp8_linear_grouped(x, self.qweight, self.scale, xq=xq)

    @torch.no_grad()
    def load_(self, w: torch.Tensor):
        q, s = quantize(w.to(self.qweight.device), self.fp8, self.scale_fmt)
        self.qweight.copy_(q)
        self.scale.copy_(s.float())

    @classmethod
    def holding(cls, q: torch.Tensor, s: torch.Tensor, like: "FP8Linear") -> "FP8Linear":
        """A holder of already quantized q, s (no copy), in `like`'s formats."""
        lin = cls.__new__(cls)
        nn.Module.__init__(lin)
        lin.fp8, lin.scale_fmt, lin.dtype = like.fp8, like.scale_fmt, like.dtype
        lin.register_buffer("qweight", q)
        lin.register_buffer("scale", s)
        return lin


def hold_view(lin: nn.Module, w: torch.Tensor, scale: torch.Tensor | None = None):
    """Make linear `lin` hold w (and its block scales, for an FP8 holder): views of a larger weight it now shares."""
    if isinstance(lin, FP8Linear):
        lin.qweight, lin.scale = w, scale
    else:
        lin.weight = nn.Parameter(w, requires_grad=False)


class InputGEMMs:
    """One GEMM per weight format over the linears of an attention layer that read its input h (wq_a, wkv, the
    compressors' wkv / wgate, the indexer's weights_proj: 2 in FP8 + 5 in BF16 at a CSA layer of the FP8
    engine), instead of one each. The linears keep views of their rows of the concatenated weight, so weight
    syncs into them land in it. Calling it gives each linear's output (a column slice of the group's)."""

    def __init__(self, lins: dict):
        self.groups = []
        kinds = {}
        for key, lin in lins.items():
            kinds.setdefault(type(lin), []).append((key, lin))
        for kind, members in kinds.items():
            fp8 = kind is FP8Linear
            held = [lin.qweight if fp8 else lin.weight.data for _, lin in members]
            if len(members) < 2 or (fp8 and any(w.shape[0] % BLOCK for w in held)):
                continue  # computed by its own linear
            w = torch.cat(held)
            scale = torch.cat([lin.scale for _, lin in members]) if fp8 else None
            spans, a = [], 0
            for (key, lin), h in zip(members, held):
                b = a + h.shape[0]
                hold_view(lin, w[a:b], scale[a // BLOCK:b // BLOCK] if fp8 else None)
                spans.append((key, a, b))
                a = b
            self.groups.append((FP8Linear.holding(w, scale, members[0][1]) if fp8 else w, spans))

    def __call__(self, h, hq=None, fp8: bool | None = None) -> dict:
        """hq: h's rows quantized per 1x128 tile, (q, scales), for the FP8 group (else it quantizes h itself).
        fp8: only the FP8 group (True) or only the others (False); None: all."""
        out = {}
        for holder, spans in self.groups:
            if fp8 is not None and isinstance(holder, FP8Linear) != fp8:
                continue
            y = holder(h, hq) if isinstance(holder, FP8Linear) else small_linear(h, holder)
            out.update((key, y[..., a:b]) for key, a, b in spans)
        return out

    @staticmethod
    def linears(attn) -> dict:
        """The linears of an attention layer that read its input, by the key `projections` uses."""
        lins = {"wq_a": attn.wq_a, "wkv": attn.wkv}
        if attn.compressor is not None:
            lins["ckv"], lins["cgate"] = attn.compressor.wkv, attn.compressor.wgate
        if attn.indexer is not None:
            ic = attn.indexer.compressor
            lins["ikv"], lins["igate"], lins["iw"] = ic.wkv, ic.wgate, attn.indexer.weights_proj
        return lins


class EngineExperts(nn.Module):
    """Routed experts for inference: FP8 with block scales (fp8 given) or in the compute dtype, always through
    the grouped kernel (`fused_moe`: only the experts a batch routes to are read).

    Under rollout expert parallelism (ep = (group, size, rank)) this rank holds experts [offset, offset + n_local)
    of each layer, computes only the token slots routed to them, and the group sums the routed output.
    Without it the layer's shared expert joins the stacks as expert n_local (`fold_shared`): one more slot a token
    in the same launches, instead of three linears, a SwiGLU and an add of its own."""

    def __init__(self, ex: Experts, fp8: torch.dtype | None, scale_fmt: str, dtype: torch.dtype, ep=None,
                 device=None, n_total: int | None = None):
        """device: where the stacks go (ex's may be in host memory: each of this rank's slices moves alone).
        n_total: the layer's routed experts, where ex holds fewer than all (a checkpoint read for one EP rank:
        load_pretrained's experts=); ex must then hold this rank's."""
        super().__init__()
        self.group, size, rank = ep if ep is not None else (None, 1, 0)
        self.n_total = n_total or ex.n_local
        self.n_local = self.n_total // size
        self.expert_offset, self.limit = rank * self.n_local, ex.limit
        self.fp8, self.scale_fmt, self.dtype = fp8, scale_fmt, dtype
        self.n_shared = 0
        first = self.expert_offset - ex.expert_offset
        if not 0 <= first <= ex.n_local - self.n_local:
            raise ValueError(f"EngineExperts: rank {rank} of {size} holds experts [{self.expert_offset}, "
                             f"{self.expert_offset + self.n_local}), the layer's given ones are [{ex.expert_offset}, "
                             f"{ex.expert_offset + ex.n_local})")
        sl = slice(first, first + self.n_local)
        for name in ("w1", "w2", "w3"):
            w = onto(getattr(ex, name).data[sl], device)
            if fp8 is not None:
                q, s = quantize(w, fp8, scale_fmt)
                self.register_buffer(name, q)
                self.register_buffer("s" + name[1], s.float())
            else:
                self.register_buffer(name, w.to(dtype))
                setattr(self, "s" + name[1], None)

    gives_slot_rows = True  # forward(summed=False) may give fused_moe's SlotRows (MoE.forward asks for them)

    def early_rows(self, x, k: int):
        """fused_moe's buffers for x's slots made before the routing (moe_gemv_early), whose shared slots then run
        beside the router -> rows for forward, or None (no folded shared expert, expert parallelism, or more tokens
        than the GEMV path takes). The caller makes them before it launches the router."""
        if self.group is not None:
            return None
        return moe_gemv_early(x, k, self.w1, self.n_shared)

    def forward(self, x, idx, w, xq=None, summed=True, rows=None):
        """xq: x already quantized per 1x128 tile, (q, scales) (FP8 experts; fused_moe's xq). summed=False: the
        slot rows may come back unsummed (fused_moe's SlotRows; summed here under expert parallelism). rows:
        early_rows', made before the router."""
        if self.group is not None:  # other ranks' experts -> the skipped bucket
            idx = idx - self.expert_offset
            idx = torch.where((idx >= 0) & (idx < self.n_local), idx, torch.full_like(idx, self.n_local))
        y = fused_moe(x, idx, w, self.w1, self.w2, self.w3, self.s1, self.s2, self.s3, self.limit, self.n_shared,
                      xq=xq, summed=summed or self.group is not None, rows=rows)
        if self.group is not None:
            dist.all_reduce(y, group=self.group)
        return y

    def routed(self, name: str) -> torch.Tensor:
        """The routed experts' part of stack `name` (w1, s1, ...), without a folded shared expert."""
        return getattr(self, name)[: self.n_local]

    @torch.no_grad()
    def fold_shared(self, mlp: nn.Module) -> bool:
        """Move the shared expert `mlp` (w1/w3 (I, D), w2 (D, I): one routed expert's shapes) into the stacks as
        expert n_local; its linears keep views of their slices, so weight syncs into them land in the stacks.
        -> False (nothing changed) where it does not fit: expert parallelism, other shapes."""
        names = ("w1", "w2", "w3")
        lins = [getattr(mlp, n) for n in names]
        if self.group is not None or any(isinstance(lin, FP8Linear) != (self.fp8 is not None) for lin in lins):
            return False
        held = [lin.qweight if self.fp8 is not None else lin.weight for lin in lins]
        if any(h.shape != getattr(self, n).shape[1:] or h.dtype != getattr(self, n).dtype for h, n in zip(held, names)):
            return False
        for n, lin, h in zip(names, lins, held):
            stack = torch.cat([getattr(self, n), h[None]])
            setattr(self, n, stack)
            if self.fp8 is not None:
                setattr(self, "s" + n[1], torch.cat([getattr(self, "s" + n[1]), lin.scale[None]]))
            hold_view(lin, stack[-1], None if self.fp8 is None else getattr(self, "s" + n[1])[-1])
        self.n_shared = 1
        return True

    @torch.no_grad()
    def load_(self, name: str, w: torch.Tensor, e: int | None = None):
        """Stack `name` (w1, w2, w3) of this rank's routed experts from w, quantized where they are FP8 (e: w is
        that one local expert's alone)."""
        w = w.to(self.w1.device)
        dst, scale = self.routed(name), None if self.fp8 is None else self.routed("s" + name[1])
        if e is not None:
            dst, scale = dst[e], None if scale is None else scale[e]
        if scale is None:
            dst.copy_(w)
            return
        q, s = quantize(w, self.fp8, self.scale_fmt)
        dst.copy_(q)
        scale.copy_(s.float())


def onto(t: torch.Tensor, device) -> torch.Tensor:
    """t on device (None: where it is); a meta tensor stays meta (its memory is given later, by to_empty)."""
    return t if device is None or t.is_meta else t.to(device)


def prepare_inference_model(model_or_path, fp8: bool, dtype: torch.dtype, device, scale_fmt: str | None = None,
                            progress: bool = False, ep=None, stream: bool = True,
                            cfg: ModelConfig | None = None) -> Transformer:
    """A copy of the model on `device` in `dtype`, frozen, with FP8 holders swapped in (fp8=True) and the
    routed experts behind the grouped kernel (this rank's slice of them under rollout expert parallelism).
    scale_fmt: the FP8 block scales, "fp32" or "ue8m0" (powers of two); None: a checkpoint directory's own
    (stored_scale_fmt: its FP8 weights keep their bits), else fp32.
    The device gets only what this rank holds, in the formats it holds them, and no whole BF16 model is made on
    any device (DeepSeek-V4-Flash's is 569 GB): a checkpoint's model is built on meta and its tensors stream in one
    at a time, read onto the device, cast as load_pretrained casts them and quantized there (stream=False, the
    twin: the checkpoint read whole into host memory, then each weight moved alone); a model built on the meta
    device (weights to come by update_weights, as a rollout rank's arrive by broadcast) is given memory for the
    held tensors only; a model with weights is copied on meta and its weights streamed in by update_weights, cast
    as set_dtype casts them (none beside the caller's, on its device or another; one holding only some experts,
    load_pretrained's experts=, is copied; stream=False copies any model whole first, the twin). Under expert
    parallelism only this rank's experts are read from a checkpoint. On a GPU, held tensors that exceed its free
    memory are refused before any is made there (check_weights_fit). cfg: a checkpoint directory's config, where the
    caller has read it already (None: read from its config.json)."""
    if scale_fmt not in (None, "fp32", "ue8m0"):
        raise ValueError(f"fp8_scale_fmt={scale_fmt!r}: fp32 or ue8m0")
    source = skeleton = None  # a model / a checkpoint's model on meta, whose weights are streamed in at the end
    if isinstance(model_or_path, (str, Path)):
        share = None if ep is None else ep[1:]
        if stream:
            skeleton = pretrained_skeleton(model_or_path, dtype, cfg, experts=share, who="Engine")
            model = meta_copy(skeleton)
        else:
            model = load_pretrained(model_or_path, "cpu", dtype, progress=progress, cfg=cfg, experts=share)
        scale_fmt = scale_fmt or stored_scale_fmt(model_or_path)
    elif not isinstance(model_or_path, Transformer):
        raise TypeError(f"model_or_path: a checkpoint directory (str or Path) or a model (model.Transformer), got "
                        f"{type(model_or_path).__name__}")
    else:
        whole = all(m.n_local == model_or_path.cfg.n_routed_experts for m in model_or_path.modules()
                    if type(m) is Experts)
        source = model_or_path if stream and whole and not any(p.is_meta for p in model_or_path.parameters()) else None
        model = (meta_copy(source) if source is not None else copy.deepcopy(model_or_path)).set_dtype(dtype)
    model.eval().requires_grad_(False)
    scale_fmt = scale_fmt or "fp32"
    # the holders counted against the device's free memory before any is made there (a release's load takes
    # minutes): on meta, the model's own; a model copied whole (the twin, one with some experts), a meta copy's
    if any(t.is_meta for t in model.parameters()):  # (the holders' shapes and dtypes made on meta too)
        check_weights_fit(swap_holders(model, fp8, scale_fmt, dtype, ep, device), device)
        model.to_empty(device=device).tie_weights()
    else:
        check_weights_fit(swap_holders(meta_copy(model), fp8, scale_fmt, dtype, ep, device), device)
        swap_holders(model, fp8, scale_fmt, dtype, ep, device)
    model.to(device).reset_buffers()  # the rest: embeddings, head, norms, router, mHC, compressors
    for mod in model.modules():  # after the swaps: the linears are FP8 holders by now
        if isinstance(mod, MoE) and mod.shared_experts is not None:
            mod.shared_in_experts = mod.experts.fold_shared(mod.shared_experts)
        elif isinstance(mod, Attention):
            mod.input_gemms = InputGEMMs(InputGEMMs.linears(mod))
    if skeleton is not None:  # a checkpoint: each tensor read onto the device, cast, put in its holder
        mods = dict(model.named_modules())

        def sink(target, t):
            if isinstance(target, tuple):  # (an experts stack, a local expert): its EngineExperts quantizes it
                stack, e = target
                parent, _, leaf = stack.rpartition(".")
                mods[parent].load_(leaf, t, e)
            else:
                update_weights(model, [(target, t)])
        load_state(skeleton, model_or_path, device if device is not None else torch.get_default_device(), progress,
                   sink)
    elif source is not None:
        update_weights(model, ((n, Transformer.held_as(n, t, dtype)) for n, t in source.stored_state().items()))
    return model


def swap_holders(model: Transformer, fp8: bool, scale_fmt: str, dtype: torch.dtype, ep, device) -> Transformer:
    """model with the engine's holders in place of its modules: FP8 linears (fp8=True; the release's FP8 set) and
    the routed experts behind the grouped kernel, each made on device (meta weights stay meta)."""
    q = fp8_dtype(device) if fp8 else None
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if fp8 and type(child) is Linear and FP8_LINEAR.search(full + ".weight"):
                setattr(parent, name, FP8Linear(onto(child.weight.data, device), q, scale_fmt, dtype))
            elif type(child) is Experts:
                setattr(parent, name, EngineExperts(child, q, scale_fmt, dtype, ep, device,
                                                    model.cfg.n_routed_experts))
    return model


def size_text(n: int) -> str:
    """Bytes in GiB, MiB or KiB (the largest that keeps a unit or more), three significant digits."""
    unit = next(u for u in range(3, 0, -1) if n >= 1024 ** u or u == 1)
    v = n / 1024 ** unit
    return f"{v:.3g} {'KMG'[unit - 1]}iB" if v < 1000 else f"{v:.0f} {'KMG'[unit - 1]}iB"


def free_device_memory(device: torch.device) -> int | None:
    """Bytes free on a GPU, what earlier frees left in torch's cache included; None on the CPU (no fixed budget)."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def held_bytes(model: nn.Module) -> tuple[int, int]:
    """Bytes of the model's parameters and buffers (on meta, each tensor once: what they will take; else each
    storage once: a folded shared expert's linears are views of the stacks), and of those the experts' stacks
    (EngineExperts) hold: the routed experts' until fold_shared adds a shared one."""
    sizes = {}
    for m in model.modules():
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
            key, n = ((id(t), t.numel() * t.element_size()) if t.is_meta else
                      (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
            sizes[key] = n, sizes.get(key, (0, False))[1] or isinstance(m, EngineExperts)
    return sum(n for n, _ in sizes.values()), sum(n for n, e in sizes.values() if e)


def check_weights_fit(model: nn.Module, device):
    """Refuse a model whose held tensors (on meta still: their shapes and dtypes are the holders') exceed the free
    memory of device (None: torch's default), naming the routed experts' share, which expert parallelism divides."""
    device = torch.device(device) if device is not None else torch.get_default_device()
    free = free_device_memory(device)
    if free is None:
        return
    need, experts = held_bytes(model)
    if need > free:
        gib = 2 ** -30
        ep = next((m.n_total // m.n_local for m in model.modules() if isinstance(m, EngineExperts)), 1)
        hint = ("split the routed experts over more ranks (rollout_server.py under torchrun with --ep, "
                "train_grpo.py's rollout.ep)" if need - experts <= free else
                "the rest alone exceeds it, and only the routed experts split over ranks: a GPU with more memory")
        raise ValueError(f"invalid engine arguments: the weights do not fit: this rank would hold {need * gib:.3g} GiB "
                         f"of them ({experts * gib:.3g} GiB the routed experts, split over ep={ep} rank(s); "
                         f"{(need - experts) * gib:.3g} GiB the rest) against the {free * gib:.3g} GiB free on "
                         f"{device}: {hint}")


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of model (its modules and settings) whose parameters and buffers are on meta: no storage."""
    memo = {}
    for t in [*model.parameters(), *model.buffers()]:
        m = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(m, t.requires_grad) if isinstance(t, nn.Parameter) else m
    return copy.deepcopy(model, memo)


FP8_SCALE = ".fp8_scale"  # suffix of the block scales that travel after an FP8-quantized tensor


def is_fp8_held(name: str) -> bool:
    """Whether the rollout holds this state_dict tensor in FP8 (the release's FP8 linears, the routed experts)."""
    return bool(FP8_LINEAR.search(name)) or bool(re.search(r"\.ffn\.experts\.w[123]$", name))


def _weight_index(model: Transformer):
    """(modules by name, state_dict) of an engine's model, built once: a weight sync resolves every tensor per
    bucket, and the engine's tensors keep their storage."""
    index = model.__dict__.get("_weight_index")
    if index is None:
        index = model.__dict__["_weight_index"] = (dict(model.named_modules()), model.state_dict())
    return index


def weight_target(model: Transformer, name: str, t: torch.Tensor):
    """Where a received tensor (named like the training model's state_dict) goes: (dst, src) when it is copied
    as it is (src sliced to this rank's experts under rollout expert parallelism), or (None, load) where load()
    converts it (re-quantizes into an FP8 holder, or casts)."""
    mods, state = _weight_index(model)
    scale = name.endswith(FP8_SCALE)
    base = name[: -len(FP8_SCALE)] if scale else name
    mod_name, _, leaf = base.rpartition(".")
    mod = mods.get(mod_name)
    def same_shape(want):  # (copy_ would broadcast a smaller tensor over the model's)
        if tuple(t.shape) != tuple(want):
            raise ValueError(f"update_weights: '{name}' has shape {tuple(t.shape)}, the rollout model's is "
                             f"{tuple(want)}")
    if isinstance(mod, EngineExperts):
        dst = mod.routed("s" + leaf[1] if scale else leaf)
        same_shape((mod.n_total, *dst.shape[1:]))  # the sender's stack: every rank's experts
        t = t[mod.expert_offset:mod.expert_offset + mod.n_local]
        if scale or (t.dtype == dst.dtype and mod.fp8 is not None):
            return dst, t
        return None, lambda: mod.load_(leaf, t)
    if isinstance(mod, FP8Linear) and leaf == "weight":
        dst = mod.scale if scale else mod.qweight
        same_shape(dst.shape)
        if scale or t.dtype == dst.dtype:
            return dst, t
        return None, lambda: mod.load_(t)
    if name in state:
        same_shape(state[name].shape)
        return state[name], t
    raise KeyError(f"update_weights: '{name}' is not a tensor of the rollout model")


@torch.no_grad()
def update_weights(model: Transformer, named_tensors):
    """Load (name, tensor) pairs named like the training model's state_dict, one at a time (the slow twin of
    `WeightApplier`). FP8 holders re-quantize in place, or, when the sender already quantized (an FP8 tensor
    followed by `<name>.fp8_scale`), copy the bytes as they are. Tensors keep their storage, so captured CUDA
    graphs stay valid. Under rollout expert parallelism only this rank's slice of each layer's experts is kept."""
    for name, t in named_tensors:
        dst, src = weight_target(model, name, t)
        if dst is None:
            src()
        else:
            dst.copy_(src.to(dst.device))


def checksum(t: torch.Tensor, chunk: int = 1 << 24) -> int:
    """Position-weighted byte sum of a tensor (for verifying a weight sync end to end); in chunks of `chunk` bytes,
    so a large tensor's int64 copy stays small."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    total = 0
    for o in range(0, b.numel(), chunk):
        part = b[o:o + chunk].to(torch.int64)
        w = torch.arange(o, o + part.numel(), device=b.device) % 251 + 1
        total += int((part * w).sum())
    return total


def held_tensors(model: Transformer, name: str) -> tuple[str, list[torch.Tensor], bool]:
    """What the rollout holds for a weight-sync tensor named as the sender names it: (key, tensors, fp8). key is
    the name, or under rollout expert parallelism 'name[a:b]' (this rank's experts); tensors are the FP8 bytes and
    their scales (fp8 True) or the one tensor in the rollout's dtype."""
    mods, state = _weight_index(model)
    mod_name, _, leaf = name.rpartition(".")
    mod = mods.get(mod_name)
    if isinstance(mod, EngineExperts):
        key = name if mod.group is None else f"{name}[{mod.expert_offset}:{mod.expert_offset + mod.n_local}]"
        if mod.fp8 is not None:
            return key, [mod.routed(leaf), mod.routed("s" + leaf[1])], True
        return key, [mod.routed(leaf)], False
    if isinstance(mod, FP8Linear) and leaf == "weight":
        return name, [mod.qweight, mod.scale], True
    if name in state:
        return name, [state[name]], False
    raise KeyError(f"weight sync: '{name}' is not a tensor of the rollout model")


def held_checksums(model: Transformer, spec: list) -> dict:
    """key -> checksum of every tensor a weight sync of `spec` ([name, dtype, shape] entries) leaves on this rank
    (keys as held_tensors names them): FP8 holders by their bytes and scales, the rest cast to the dtype they
    travelled in (the sender sums them as sent)."""
    out = {}
    for name, dt, _ in spec:
        if name.endswith(FP8_SCALE):
            continue
        key, tensors, fp8 = held_tensors(model, name)
        out[key] = sum(checksum(t if fp8 else t.to(_dtype(dt))) for t in tensors)
    return out


# ---------------------------------------------------------------------------------------------------------
# the math both engines share: the per-token layer stack, one sequence's attention over its state


class CompState:
    """A compressor's state for one sequence: partial window, previous window's overlap series, entries."""

    def __init__(self, buf_kv, buf_gate, prev, entries):
        self.buf_kv, self.buf_gate, self.prev, self.entries = buf_kv, buf_gate, prev, entries

    @classmethod
    def empty(cls, width: int, head_dim: int, device, entry_dtype=torch.float32):
        z = torch.zeros(0, width, device=device)
        return cls(z, z, None, torch.zeros(0, head_dim, device=device, dtype=entry_dtype))


class SeqState:
    """One sequence's attention state in one layer: the window's last keys, and the compressors' states."""

    def __init__(self, window, comp: CompState | None, index: CompState | None):
        self.window, self.comp, self.index = window, comp, index


def run_layers(model: Transformer, ids: torch.Tensor, pos: torch.Tensor, attention, last=None, fp8=None, side=None,
               pre=None):
    """Every per-token operation of the model over packed tokens ids/pos (N,); attention(li, attn, h (1, N, D),
    tables, hq) supplies the sequence-aware part. -> logits in the head's dtype (`sample` reads them as they are)
    of the tokens last (a list of indices; None: all N), routing (N, L, k) uint8. Each hc_post also gives the next
    mHC's mix partials (hc_post_mix). fp8: the FP8 engine's dtype: past GEMV_ROWS tokens (the GEMV kernels
    quantize their rows themselves) the mHC pre kernels also give their rows quantized, hq (or None), for the
    attention's FP8 input GEMM and the experts, instead of an act_quant launch each. side (a CUDA stream): each
    mHC pre makes its post and comb there, beside the sublayer; joined before its mHC post. pre: (RoPE tables,
    embedded streams) already made (the decode step's kernels.step.step_inputs)."""
    if pre is None:
        tables = {"main": model.rope_main(pos), "compress": model.rope_compress(pos)}
        x = model.embed(ids)[None].unsqueeze(2).expand(-1, -1, model.cfg.hc_mult, -1).contiguous()
    else:
        tables, x = pre
    fp8 = fp8 if ids.numel() > GEMV_ROWS else None

    def hc(blk, site, x, part):  # -> (h, post, comb, hq)
        out = blk.hc(site, x, part, fp8, side)
        return out if fp8 is not None else (*out, None)

    def post_mix(y, x, post, comb, fn):
        if side is not None:
            torch.cuda.current_stream(x.device).wait_stream(side)
        return hc_post_mix(y, x, post, comb, fn)
    if side is not None:  # the side stream joins the step first: a join before any work went there (the first mHC
        # pre runs on one stream) must not wait on work outside a graph being captured
        side.wait_stream(torch.cuda.current_stream(ids.device))
    part = None
    routing = torch.empty(ids.numel(), len(model.layers), model.cfg.num_experts_per_tok, dtype=torch.uint8,
                          device=ids.device)
    for li, blk in enumerate(model.layers):
        h, post, comb, hq = hc(blk, "attn", x, part)
        x, part = post_mix(attention(li, blk.attn, h, tables, hq), x, post, comb, blk.hc_ffn_fn)
        h, post, comb, hq = hc(blk, "ffn", x, part)
        # (post_mix joins side, sums the slot rows; the router writes the layer's routing rows)
        y, _ = blk.ffn(h, ids[None], xq=hq, summed=False, routing=routing[:, li])
        nxt = model.layers[li + 1].hc_attn_fn if li + 1 < len(model.layers) else model.hc_head_fn
        x, part = post_mix(y, x, post, comb, nxt)
    x = x[0]
    if last is not None:
        x, part = x[last], None if part is None else part[last]
    h = model.hc_head(x, part)
    # one row: the BF16 head through small_linear's GEMV kernel (under PDL its weights load beside the mHC
    # head; cuBLAS's kernel began ~5 us after the mHC head's end, behind a memset of its own). On an H200 (mini,
    # two runs each, tok/s): FP8 batch 1 1,189 / 1,189 -> 1,195 / 1,198, BF16 batch 1 950 / 948 -> 951 / 953; at
    # two rows the kernel was slower (FP8 batch 2 1,839 / 1,840 -> 1,780 / 1,782)
    if type(model.head) is Linear and h.shape[0] == 1:
        return small_linear(h, model.head.weight), routing
    return model.head(h), routing


def pool_windows(model: Transformer, comp, kv, gate, first: int, prev=None):
    """Compressor comp's entries of complete windows: kv, gate (B, c * ratio, width), the first window entry number
    first of its sequences; prev: the overlap series before it (Compressor.pool's). -> (entries (B, c, head_dim)
    fp32, the last window's series)."""
    B, n = kv.shape[:2]
    r = comp.ratio
    cos, sin = model.rope_compress((first + torch.arange(n // r, device=kv.device)) * r)
    return comp.pool(kv.reshape(B, n // r, r, -1), gate.reshape(B, n // r, r, -1), cos, sin, prev)


def compress(model: Transformer, comp, st: CompState, kv, gate) -> CompState:
    """Append projections (n, width) to a compressor's state; emit the entries of completed windows."""
    kv, gate = torch.cat([st.buf_kv, kv]), torch.cat([st.buf_gate, gate])
    r = comp.ratio
    c = kv.shape[0] // r
    entries, prev = st.entries, st.prev
    if c:
        p = None if prev is None else (prev[0][None], prev[1][None])
        new, last = pool_windows(model, comp, kv[None, : c * r], gate[None, : c * r], entries.shape[0], p)
        entries = torch.cat([entries, new[0].to(entries.dtype)])
        if last is not None:
            prev = (last[0][0], last[1][0])
    return CompState(kv[c * r:], gate[c * r:], prev, entries)


def comp_inputs(c, key: str, h, ins: dict):
    """Compressor c's kv and gate rows of h as its linears give them: from the layer's input GEMMs (ins, under
    key + "kv" / key + "gate") where they ran there."""
    kv = ins[key + "kv"] if key + "kv" in ins else c.wkv(h)
    return kv, (ins[key + "gate"] if key + "gate" in ins else c.wgate(h))


def projections(attn, h, pos, tables, hq=None):
    """The per-token projections one layer's attention needs, for packed tokens h (1, N, D) (prefill and the simple
    engine; the decode step orders its own across two streams). hq: h's rows quantized (run_layers'), for the FP8
    input GEMM; with it the q norm also quantizes its rows for wq_b and the indexer's."""
    cos, sin = tables[attn.rope_kind]
    ins = attn.input_gemms(h, hq) if hasattr(attn, "input_gemms") else {}
    q_res, qq = attn.q_lora(h, ins.get("wq_a"), None if hq is None else hq[0].dtype)
    q, kv = attn.q_and_kv(q_res, h, cos, sin, qq, ins.get("wkv"))
    pr = {"q": q, "kv": kv[0]}

    def comp(c, key):
        return c.biased(*comp_inputs(c, key, h, ins), pos)
    if attn.compressor is not None:
        pr["ckv"], pr["cgate"] = comp(attn.compressor, "c")
    if attn.indexer is not None:
        pr["iq"], pr["iw"] = attn.indexer.query(h, q_res, *tables["compress"], ins.get("iw"), qq=qq)
        pr["ikv"], pr["igate"] = comp(attn.indexer.compressor, "i")
    return pr


def index_record(entries: torch.Tensor, k: int) -> torch.Tensor:
    """entries (T, m) int, -1 = none -> (T, k) int32: each row's entries ascending, -1 past them (a position's
    chosen set in one layout whatever produced it: the full-sequence top-k, the decode kernel's)."""
    big = torch.iinfo(torch.int64).max
    rows = torch.where(entries < 0, big, entries.long()).sort(-1).values[:, :k]
    rows = torch.where(rows == big, -1, rows).to(torch.int32)
    return F.pad(rows, (0, k - rows.shape[1]), value=-1) if rows.shape[1] < k else rows


class IndexRecorder:
    """The indexer's chosen entries of one forward's tokens, CSA layer by layer (Output.index_entries): the
    attention of layer li asks for a list (seq) per sequence in the batch's order (prefill), or one for all rows
    (decode), and appends index_record rows of those tokens to it."""

    def __init__(self, k: int):
        self.k, self.layers = k, {}

    def seq(self, li: int, attn) -> list | None:
        if attn.indexer is None:
            return None
        rows = []
        self.layers.setdefault(li, []).append(rows)
        return rows

    def rows(self, n: int, device) -> torch.Tensor:
        """-> (n, CSA layers, k) int32 for the forward's n tokens."""
        if not self.layers:
            return torch.full((n, 0, self.k), -1, dtype=torch.int32, device=device)
        return torch.stack([torch.cat([r for seq in self.layers[li] for r in seq]) for li in sorted(self.layers)], 1)


def seq_attention(model: Transformer, attn, pr: dict, a: int, b: int, p: torch.Tensor, st: SeqState,
                  chunk: int = 512, chosen: list | None = None, kernel: bool = False, budget: int = 1 << 24):
    """Attention of one sequence's tokens pr[...][a:b] (positions p) over its state, which it advances.
    Queries go in chunks so a long prompt never materializes (tokens x keys) logits at once. -> (1, b - a, H, d).
    chosen: a list to append the indexer's chosen entries of these tokens to (index_record rows; CSA layers).
    kernel: the attention and the indexer's scores through their kernels where Triton runs (model.attend and
    prefill_index_ref otherwise); their chunks hold up to budget (query, entry) scores, at least chunk rows."""
    W = attn.window
    keys = torch.cat([st.window, pr["kv"][a:b]])
    k0 = int(p[-1]) + 1 - keys.shape[0]  # position of keys[0]
    st.window = keys[-(W - 1):] if W > 1 else keys[:0]
    comp = None
    if attn.compressor is not None:
        st.comp = compress(model, attn.compressor, st.comp, pr["ckv"][0, a:b], pr["cgate"][0, a:b])
        comp = st.comp.entries
        if attn.indexer is not None:
            st.index = compress(model, attn.indexer.compressor, st.index, pr["ikv"][0, a:b], pr["igate"][0, a:b])
    fast = kernel and use_triton(keys)
    if fast and comp is not None:
        chunk = max(chunk, budget // max(1, comp.shape[0]))
    outs = []
    for s in range(0, b - a, chunk):
        e = min(b - a, s + chunk)
        qp, sel, cmask = p[s:e], None, None
        if comp is not None:
            sel, rec, cmask = chunk_picks(attn, pr, torch.arange(a + s, a + e, device=p.device)[None],
                                          None if st.index is None else st.index.entries[None], comp.shape[0], qp,
                                          fast, chosen is not None)
            sel = None if sel is None else sel[0]
            if rec is not None:
                chosen.append(rec[0])
        if fast:  # keys[r] is position k0 + r; the entries from row 0
            z = torch.zeros_like(qp)
            outs.append(prefill_rows(attn, pr["q"][0, a + s:a + e], keys, z - k0, qp, comp, z, sel)[None])
            continue
        lo = max(0, int(qp[0]) - W + 1 - k0)
        kp = torch.arange(k0 + lo, k0 + e + keys.shape[0] - (b - a), device=p.device)
        allowed = (kp[None] <= qp[:, None]) & (kp[None] > qp[:, None] - W)
        outs.append(attend(pr["q"][:, a + s:a + e], keys[None, lo:lo + kp.shape[0]], allowed[None],
                           None if comp is None else comp[None], cmask, attn.attn_sink, attn.scale))
    return torch.cat(outs, 1)


def index_picks(attn, pr: dict, rows, keys, count, kernel: bool):
    """The indexer's top-k entries (-1: none) for the packed query rows rows (B, T) of pr's iq / iw, among keys
    (B, S, d), query t seeing count[t] of them: kernels.attention.prefill_index (kernel) or its torch twin."""
    f = prefill_index if kernel else prefill_index_ref
    return f(pr["iq"][0], pr["iw"][0], rows, keys, count, min(attn.indexer.topk, keys.shape[1]))


def entry_mask(sel, count, S: int):
    """model.attend's comp_allowed over S entries: the picks sel (..., k) (-1: none) where the indexer picked (CSA),
    else each query t's first count[t] (HCA) -> (..., S) / (T, S) bool."""
    if sel is None:
        return torch.arange(S, device=count.device)[None] < count[:, None]
    mask = torch.zeros(*sel.shape[:-1], S + 1, dtype=torch.bool, device=sel.device)
    return mask.scatter_(-1, torch.where(sel < 0, S, sel), True)[..., :S]


def chunk_picks(attn, pr: dict, rows, keys, S: int, qp, kernel: bool, record: bool):
    """A prefill chunk's compressed entries, for B sequences' packed query rows rows (B, n) at positions qp (n,)
    over S entries each (keys (B, S, d): the indexer's, CSA): -> (sel (B, n, k) the indexer's picks or None (HCA,
    or no entries yet); rec (B, n, topk) their index_record rows or None (not record, or no indexer); cmask
    model.attend's comp_allowed, (B, n, S), or None where the kernels run (kernel: index_picks' too))."""
    count = (qp + 1) // attn.compressor.ratio
    sel = rec = cmask = None
    B, n = rows.shape
    if attn.indexer is not None and S:
        sel = index_picks(attn, pr, rows, keys, count, kernel)
        if record:
            rec = index_record(sel.flatten(0, 1), attn.indexer.topk).view(B, n, -1)
    elif record and attn.indexer is not None:  # no entries yet
        rec = torch.full((B, n, attn.indexer.topk), -1, dtype=torch.int32, device=qp.device)
    if not kernel:
        cmask = entry_mask(sel, count, S).expand(B, n, S)
    return sel, rec, cmask


def prefill_rows(attn, q, keys, base, pos, comp, first, sel=None):
    """prefill_attention for attention layer attn's query rows q (N, H, d) at positions pos: the window's keys in
    keys (base: each row's row of position 0), compressed entries in comp (first: each row's entry 0; None or
    empty: none yet); sel (N, k) the indexer's picks (-1: none; padded to its top-k, so one kernel serves every
    entry count), else every entry up to the row's position (HCA)."""
    if comp is None or comp.shape[0] == 0:
        return prefill_attention(q, keys, base, pos, attn.attn_sink, attn.scale, attn.window)
    if attn.indexer is not None:
        sel = F.pad(sel, (0, attn.indexer.topk - sel.shape[1]), value=-1)
        return prefill_attention(q, keys, base, pos, attn.attn_sink, attn.scale, attn.window, comp, first, sel=sel)
    count = (pos + 1) // attn.compressor.ratio
    return prefill_attention(q, keys, base, pos, attn.attn_sink, attn.scale, attn.window, comp, first, count=count)


class FreshGroup:
    """Sequences a prefill chunk feeds from position 0 (an empty state: new prompts, preemptions recomputed),
    padded to one (B, T) layout so that each layer's attention, compressors and cache writes run once for all of
    them: seq_attention and its cache load and store are ~230 small launches a sequence a layer (on an H200 ~20
    ms a prompt in mini.yaml, most of a GRPO rollout of short prompts). rows (B, T): each (sequence, position)'s
    packed row; a pad repeats its sequence's last row (right padding: causal, so no real position reads it).
    index: the sequences' places in the chunk; n: their lengths; packed / valid: the real positions' packed rows
    and their flat (b * T + t) places in the padded layout."""

    def __init__(self, members: list[tuple[int, Sequence, int, int]], device):
        self.index = [i for i, _, _, _ in members]
        self.seqs = [s for _, s, _, _ in members]
        self.n = [n for _, _, n, _ in members]
        self.start = [r for _, _, _, r in members]
        self.T = T = max(self.n)
        self.device = device
        self.rows = torch.tensor([[r + min(t, n - 1) for t in range(T)] for r, n in zip(self.start, self.n)],
                                 device=device)
        self.packed = torch.tensor([r + t for r, n in zip(self.start, self.n) for t in range(n)], device=device)
        self.valid = torch.tensor([b * T + t for b, n in enumerate(self.n) for t in range(n)], device=device)
        self.memo = {}

    def window_index(self, W: int):
        """-> (slots, ring places, packed rows) of the window cache's rows: each sequence's last W - 1 keys."""
        if ("w", W) not in self.memo:
            ix = [(s.slot, t % W, r + t) for s, n, r in zip(self.seqs, self.n, self.start)
                  for t in range(max(0, n - (W - 1)), n)]
            self.memo["w", W] = self._tensors(ix, 3)
        return self.memo["w", W]

    def comp_index(self, r: int, kind: str, BE: int):
        """A compressor of ratio r whose entries go to the block pool kind (blocks of BE entries): -> (buffer slots,
        places, packed rows) of each sequence's partial window; (slots, (n, r) packed rows) of its last complete
        window, the overlap series' source; (blocks, places, flat b * (T // r) + e places) of its entries."""
        key = ("c", r, kind)
        if key not in self.memo:
            C = self.T // r
            buf = [(s.slot, j, st + n // r * r + j) for s, n, st in zip(self.seqs, self.n, self.start)
                   for j in range(n % r)]
            prev = [(s.slot, [st + (n // r - 1) * r + j for j in range(r)])
                    for s, n, st in zip(self.seqs, self.n, self.start) if n >= r]
            ent = [(s.blocks[kind][e // BE], e % BE, b * C + e) for b, (s, n) in enumerate(zip(self.seqs, self.n))
                   for e in range(n // r)]
            prev = self._tensors(prev, 2)
            self.memo[key] = (self._tensors(buf, 3), (prev[0], prev[1].view(-1, r)), self._tensors(ent, 3))
        return self.memo[key]

    def _tensors(self, items, k):
        return tuple(torch.tensor([it[j] for it in items], dtype=torch.int64, device=self.device) for j in range(k))


def fresh_groups(batch, bounds, device, slack: float = 1.5, extra: int = 256) -> list[FreshGroup]:
    """The chunk's sequences fed from position 0, longest first, in groups whose padded size B x T stays within
    slack x their tokens + extra."""
    fresh = sorted((i for i, (_, a, _) in enumerate(batch) if a == 0), key=lambda i: bounds[i] - bounds[i + 1])
    groups, cur = [], []
    for i in fresh:
        n = bounds[i + 1] - bounds[i]
        if cur and (len(cur) + 1) * cur[0][2] > slack * (sum(m[2] for m in cur) + n) + extra:
            groups.append(cur)
            cur = []
        cur.append((i, batch[i][0], n, bounds[i]))
    return [FreshGroup(g, device) for g in groups + ([cur] if cur else [])]


def fresh_compress(model: Transformer, comp, kv, gate, dtype) -> torch.Tensor:
    """compress from an empty state for a padded group: kv, gate (B, T, width) -> entries (B, T // ratio, head_dim)
    in dtype (the pool's, as compress rounds them). Entries past a sequence's own complete windows hold padding; its
    positions never see them."""
    B, T = kv.shape[:2]
    n = T // comp.ratio * comp.ratio
    if n == 0:
        return kv.new_zeros(B, 0, comp.head_dim, dtype=dtype)
    return pool_windows(model, comp, kv[:, :n], gate[:, :n], 0)[0].to(dtype)


def fresh_attention(model: Transformer, attn, pr: dict, g: FreshGroup, dtypes, chosen: list | None = None,
                    budget: int = 1 << 25, min_rows: int = 512, kernel: bool = False):
    """seq_attention for a FreshGroup's sequences at once: -> (B, T, H, d), and the entries of the compressor and
    the indexer's (B, T // ratio, ...) or None. dtypes: the entries' (the pools'). Queries go in chunks of at most
    budget (sequence, head, query, key) logits (with the kernels: (sequence, query, entry) scores), but of at least
    min_rows query rows (B x chunk; seq_attention's chunks are 512), each chunk's rows gathered as it goes. chosen: a
    list a sequence (the group's order) to append the indexer's chosen entries of its tokens to. kernel: the
    attention and the indexer's scores through prefill_attention and prefill_index where Triton runs (model.attend
    and prefill_index_ref otherwise), over the padded rows (a pad repeats its sequence's last query)."""
    W, B, T, H = attn.window, g.rows.shape[0], g.T, pr["q"].shape[2]
    kv = pr["kv"][g.rows]
    comp = index = None
    if attn.compressor is not None:
        comp = fresh_compress(model, attn.compressor, pr["ckv"][0][g.rows], pr["cgate"][0][g.rows], dtypes[0])
        if attn.indexer is not None:
            index = fresh_compress(model, attn.indexer.compressor, pr["ikv"][0][g.rows], pr["igate"][0][g.rows],
                                   dtypes[1])
    S = 0 if comp is None else comp.shape[1]
    fast = kernel and use_triton(kv)
    chunk = pow2(T)
    # (the kernels' chunk holds its (row, entry) scores; model.attend's its (row, head, key) logits)
    while chunk > pow2(-(-min_rows // B)) and B * chunk * (max(1, S) if fast else H * (chunk + W - 1 + S)) > budget:
        chunk //= 2
    p = torch.arange(T, device=kv.device)
    outs, rec = [], []
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        qp, sel, cmask = p[s:e], None, None
        if comp is not None:
            sel, picked, cmask = chunk_picks(attn, pr, g.rows[:, s:e], index, S, qp, fast, chosen is not None)
            if picked is not None:
                rec.append(picked)
        q = pr["q"][0][g.rows[:, s:e]]
        if fast:  # row (b, t): its keys from kv's row b * T on, its entries from comp's row b * S on
            who = torch.arange(B, device=kv.device).repeat_interleave(e - s)
            o = prefill_rows(attn, q.flatten(0, 1), kv.flatten(0, 1), who * T, qp.repeat(B),
                             None if comp is None else comp.flatten(0, 1), who * S,
                             None if sel is None else sel.flatten(0, 1))
            outs.append(o.view(q.shape))
            continue
        lo = max(0, s - W + 1)
        kp = p[lo:e]
        allowed = (kp[None] <= qp[:, None]) & (kp[None] > qp[:, None] - W)
        outs.append(attend(q, kv[:, lo:e], allowed[None], comp, cmask, attn.attn_sink, attn.scale))
    if chosen is not None and rec:
        rec = torch.cat(rec, 1)
        for b, (lst, n) in enumerate(zip(chosen, g.n)):
            lst.append(rec[b, :n])
    return torch.cat(outs, 1), comp, index


def stop_reason(tok: int, n_tokens: int, params: SamplingParams, eos: tuple = ()) -> str | None:
    """eos: the model's end-of-sequence ids (ModelConfig.eos_ids)."""
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    if tok in stops:
        return "stop"
    return "length" if n_tokens >= params.max_tokens else None


BLOCK_ENTRIES = 64  # entries a cache block holds (Engine's default block_entries)


def check_sizes(**sizes):
    """An engine's sizes: integers >= 1, a bad one named (before the model loads)."""
    bad = [f"{k}={v!r}" for k, v in sizes.items()
           if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1]
    if bad:
        raise ValueError(f"invalid engine arguments: {', '.join(bad)} (integers >= 1)")


def outside(ids, vocab: int) -> int | None:
    """The first of the token ids outside [0, vocab), or None."""
    return next((t for t in ids if not 0 <= t < vocab), None)


def either_params(params, sampling_params):
    """generate's sampling parameters given under either name (not both); neither: SamplingParams()."""
    if params is not None and sampling_params is not None:
        raise TypeError("generate: params and sampling_params are the same argument: give one")
    p = params if params is not None else sampling_params
    return SamplingParams() if p is None else p


def check_prompts(prompts, params, vocab: int, first_index=0) -> tuple[list[list[int]], list[SamplingParams]]:
    """generate's arguments checked, a bad one named: -> (the prompts as lists of Python ints, one SamplingParams
    a prompt). Prompts: a list (or 2-D tensor / array) of token id sequences."""
    if isinstance(first_index, bool) or not isinstance(first_index, numbers.Integral) or first_index < 0:
        raise TypeError(f"first_index={first_index!r}: an integer >= 0 (the index of the first prompt)")
    prompts = list(prompts)
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    elif isinstance(params, (list, tuple)):
        params = list(params)
    else:
        raise TypeError(f"sampling parameters: {params!r} is neither a SamplingParams nor a list of them")
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling parameter sets")
    for i, sp in enumerate(params):
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling parameters {i}: {sp!r} is not a SamplingParams")
        try:  # again: a field set after construction skipped the checks
            sp.__post_init__()
        except ValueError as e:
            raise ValueError(f"sampling parameters {i}: {e}") from None
        bad = outside(sp.stop_token_ids, vocab)
        if bad is not None:  # (it could never be sampled: a typo, or another model's vocabulary)
            raise ValueError(f"sampling parameters {i}: stop token id {bad} outside [0, {vocab})")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not isinstance(p, Iterable) or getattr(p, "ndim", 1) != 1:
            raise TypeError(f"prompt {i}: {p!r} is not a sequence of token ids (generate takes a list of prompts, "
                            f"each a list of token ids)")
        ids = []
        for j, t in enumerate(p):
            try:
                if isinstance(t, (bool, np.bool_)) or getattr(t, "dtype", None) == torch.bool:
                    raise TypeError
                ids.append(operator.index(t))  # Python / numpy / 0-d tensor integers
            except TypeError:
                raise TypeError(f"prompt {i}, position {j}: token id {t!r} is not an integer") from None
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        if outside(ids, vocab) is not None:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
        out.append(ids)
    return out, params


# ---------------------------------------------------------------------------------------------------------
# the simple engine (the slow twin)


class SimpleSeq:
    def __init__(self, idx: int, prompt: list[int], params: SamplingParams, model: Transformer, device, dtype):
        self.idx, self.prompt, self.params = idx, list(prompt), params
        self.seed = seq_seed(params.seed, idx)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.routing: list[torch.Tensor] = []
        self.index: list[torch.Tensor] = []  # (n, CSA layers, index_topk) pieces, with record_index
        self.pos = 0
        self.finish = None
        self.states = []
        for layer in model.layers:
            a = layer.attn
            c, i = a.compressor, a.indexer
            self.states.append(SeqState(
                torch.zeros(0, a.head_dim, device=device, dtype=dtype),
                CompState.empty(c.wkv.weight.shape[0], c.head_dim, device) if c is not None else None,
                CompState.empty(i.compressor.wkv.weight.shape[0], i.head_dim, device) if i is not None else None))

    def share_prefix(self, other: "SimpleSeq"):
        """Take over another sequence's state after the same prompt (state tensors are replaced, never written
        in place, so sharing them is safe)."""
        self.pos, self.routing, self.index = other.pos, list(other.routing), list(other.index)
        self.states = [copy.copy(st) for st in other.states]


class SimpleEngine:
    def __init__(self, model_or_path, fp8: bool = True, dtype: torch.dtype = torch.bfloat16, device=None,
                 fp8_scale_fmt: str | None = None, max_batch_tokens: int = 8192, progress: bool = False, ep=None,
                 record_index: bool = False, cfg: ModelConfig | None = None):
        """record_index: each Output also carries the indexer's chosen entries (Output.index_entries).
        cfg: a checkpoint directory's config, where the caller has read it already (None: read from its config.json)."""
        check_sizes(max_batch_tokens=max_batch_tokens)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = float_dtype(dtype, type(self).__name__)
        self.model = prepare_inference_model(model_or_path, fp8, dtype, device, fp8_scale_fmt, progress, ep, cfg=cfg)
        self.cfg, self.device, self.dtype = self.model.cfg, device, dtype
        self.max_batch_tokens = max_batch_tokens
        self.record_index = record_index

    def update_weights(self, named_tensors):
        update_weights(self.model, named_tensors)

    @torch.inference_mode()
    def _forward(self, seqs: list[SimpleSeq], chunks: list[list[int]]) -> torch.Tensor:
        """Feed chunks[i] for every sequence (positions seqs[i].pos ...); -> last-position logits (len(seqs), V)."""
        m, dev = self.model, self.device
        ids = torch.tensor([t for c in chunks for t in c], device=dev)
        pos = torch.cat([torch.arange(s.pos, s.pos + len(c), device=dev) for s, c in zip(seqs, chunks)])
        bounds = [0]
        for c in chunks:
            bounds.append(bounds[-1] + len(c))

        rec = IndexRecorder(self.cfg.index_topk) if self.record_index else None

        def attention(li, attn, h, tables, hq=None):
            pr = projections(attn, h, pos, tables, hq=hq)
            outs = [seq_attention(m, attn, pr, bounds[i], bounds[i + 1], pos[bounds[i]:bounds[i + 1]], s.states[li],
                                  chosen=None if rec is None else rec.seq(li, attn)) for i, s in enumerate(seqs)]
            return attn.project_out(torch.cat(outs, 1), *tables[attn.rope_kind])

        logits, routing = run_layers(m, ids, pos, attention, [b - 1 for b in bounds[1:]])
        routing = routing.cpu()
        index = None if rec is None else rec.rows(len(ids), dev).cpu()
        for i, s in enumerate(seqs):
            s.routing.append(routing[bounds[i]:bounds[i + 1]])
            if index is not None:
                s.index.append(index[bounds[i]:bounds[i + 1]])
            s.pos += len(chunks[i])
        return logits

    def _sample(self, seqs: list[SimpleSeq], logits, progress=None):
        tok, lp = sample(logits, [s.params for s in seqs], [s.seed for s in seqs], [len(s.tokens) for s in seqs])
        for s, t, l in zip(seqs, tok.tolist(), lp.tolist()):
            s.tokens.append(t)
            s.logprobs.append(l)
            s.finish = stop_reason(t, len(s.tokens), s.params, self.cfg.eos_ids)
            if s.finish is not None and progress is not None:
                progress(1)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 first_index: int = 0, *, sampling_params=None, progress=None) -> list[Output]:
        """first_index: the index of prompts[0] in a larger request (Engine.generate). As Engine.generate:
        sampling_params is params' other name, none is SamplingParams()'s defaults; progress(1) as each sequence
        ends."""
        prompts, params = check_prompts(prompts, either_params(params, sampling_params), self.cfg.vocab_size,
                                        first_index)
        seqs = [SimpleSeq(first_index + i, p, params[i], self.model, self.device, self.dtype)
                for i, p in enumerate(prompts)]
        same: dict[tuple, list[SimpleSeq]] = {}
        for s in seqs:  # a GRPO group shares its prompt: prefill once
            same.setdefault(tuple(s.prompt), []).append(s)
        leaders = [g[0] for g in same.values()]
        group, size = [], 0
        for s in leaders + [None]:
            if group and (s is None or size + len(s.prompt) > self.max_batch_tokens):
                logits = self._forward(group, [g.prompt for g in group])
                members, rows = [], []
                for g, row in zip(group, logits):
                    for member in same[tuple(g.prompt)]:
                        if member is not g:
                            member.share_prefix(g)
                        members.append(member)
                        rows.append(row)
                self._sample(members, torch.stack(rows), progress)
                group, size = [], 0
            if s is not None:
                group.append(s)
                size += len(s.prompt)
        active = [s for s in seqs if s.finish is None]
        while active:
            for start in range(0, len(active), self.max_batch_tokens):
                batch = active[start:start + self.max_batch_tokens]
                self._sample(batch, self._forward(batch, [[s.tokens[-1]] for s in batch]), progress)
            active = [s for s in seqs if s.finish is None]
        n = [len(s.prompt) + len(s.tokens) - 1 for s in seqs]
        return [Output(s.prompt, s.tokens, s.logprobs, torch.cat(s.routing)[:k], s.finish,
                       torch.cat(s.index)[:k] if self.record_index else None) for s, k in zip(seqs, n)]


# ---------------------------------------------------------------------------------------------------------
# the paged engine


class Sequence:
    """Host-side state of one request in the paged engine."""

    def __init__(self, idx: int, prompt: list[int], params: SamplingParams):
        self.idx, self.prompt, self.params = idx, list(prompt), params
        self.seed = seq_seed(params.seed, idx)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.routing: list[np.ndarray] = []  # (n, L, k) uint8 pieces: prefill chunks, one row per decode step
        self.index: list[np.ndarray] = []  # (n, CSA layers, index_topk) int32 pieces alike, with record_index
        self.finish = None
        self.slot = None
        self.blocks = {"csa": [], "hca": []}
        self.fed = 0                   # positions [0, fed) are in the cache
        self.feed = self.prompt        # what prefill feeds; after preemption: prompt + tokens[:-1]
        self.resume = False            # re-prefilling after preemption: do not sample at its end
        self.waited = False            # found a slot free but too few cache blocks to start (counted once)
        self.followers: list[Sequence] = []
        self.order = 0


class BlockAllocator:
    """Free list and reference counts of one block pool; block 0 is scratch and never handed out."""

    def __init__(self, n: int):
        self.free = deque(range(1, n))
        self.ref = [0] * n

    def alloc(self) -> int:
        b = self.free.popleft()
        self.ref[b] = 1
        return b

    def incref(self, b: int):
        self.ref[b] += 1

    def decref(self, b: int):
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free.append(b)


class PagedCache:
    """Every layer's attention state for up to n_slots sequences.

    slot pools (n_slots + 1 rows, the last is scratch for padded batch rows):
        win[l] (W, d) ring of the sliding window; buf_kv/buf_gate[l] (ratio, width) the compressor's partial
        window; prev_kv/prev_gate[l] (ratio, hd) the overlap series of the last completed window (CSA);
        the same with prefix i for the indexer's compressor.
    block pools (block 0 is scratch): entries[l] (n_blocks, BE, hd) compressed entries (CSA and HCA have their
        own pools and block tables, since they fill at different rates); ikeys[l] the indexer's keys (fp32).
    """

    POOLS = ("csa", "hca")  # the block pools (kinds), as num_blocks names them

    def __init__(self, model: Transformer, n_slots: int, n_blocks: dict, block_entries: int, max_len: int, device,
                 dtype):
        cfg = model.cfg
        self.model, self.n_slots, self.BE, self.device = model, n_slots, block_entries, device
        self.ratio = {"csa": cfg.csa_ratio, "hca": cfg.hca_ratio}
        self.max_blocks = cfg.seq_blocks(max_len, block_entries)
        self.trash = n_slots
        self.kind = self.layer_kinds(cfg)
        for name, per_layer in self.shapes(model, n_slots, n_blocks, block_entries, dtype).items():
            setattr(self, name, {li: torch.zeros(shape, dtype=dt, device=device) for li, (shape, dt) in
                                 per_layer.items()})
        # the kinds some layer keeps entries of: a pool no layer writes holds no bytes, and no sequence needs its blocks
        self.paged = {k: r for k, r in self.ratio.items() if k in self.kind.values()}
        self.alloc = {k: BlockAllocator(n) for k, n in n_blocks.items()}
        # blocks promised to the forks of admitted groups still prefilling (fork_need): not free to anyone else
        self.promised = {k: 0 for k in self.ratio}
        self.free_slots = deque(range(n_slots))
        # block tables by slot, on the device, so a decode step (and its CUDA graph) gathers them by slot id
        self.tables = {k: torch.zeros(n_slots + 1, self.max_blocks[k], dtype=torch.int64, device=device)
                       for k in self.ratio}

    @classmethod
    def too_few_blocks(cls, cfg, num_blocks: int, max_len: int, max_len_name: str) -> str | None:
        """Why num_blocks blocks a pool (a fixed num_blocks, of BLOCK_ENTRIES entries) cannot serve one sequence of
        max_len positions (its most in any pool a layer writes, and the scratch block), or None; max_len_name: the
        setting's name (the CLI's flag, a run's config key)."""
        most = cfg.seq_blocks(max_len, BLOCK_ENTRIES)
        least = 1 + max([most[k] for k in set(cls.layer_kinds(cfg).values())], default=0)
        return (f"blocks of {BLOCK_ENTRIES} entries cannot hold one sequence of {max_len_name} {max_len} ({least} "
                f"needed, one of them scratch") if num_blocks < least else None

    @staticmethod
    def layer_kinds(cfg: ModelConfig) -> dict:
        """{layer index: the pool its compressed entries go to} for the layers that compress: CSA (with an indexer)
        or HCA."""
        return {li: "csa" if t == CSA else "hca" for li, t in enumerate(cfg.layer_types) if t in (CSA, HCA)}

    # the per-layer tensors: a row a slot, and a block pool's
    SLOT_STATE = ("win", "buf_kv", "buf_gate", "prev_kv", "prev_gate", "ibuf_kv", "ibuf_gate", "iprev_kv",
                  "iprev_gate")
    BLOCK_STATE = ("entries", "ikeys")

    @classmethod
    def shapes(cls, model: Transformer, n_slots: int, n_blocks: dict, block_entries: int, dtype) -> dict:
        """{tensor name: {layer index: (shape, dtype)}} of everything the cache holds a layer (what __init__
        allocates, and what the engine's pool sizing counts)."""
        S, f32, kinds = n_slots + 1, torch.float32, cls.layer_kinds(model.cfg)
        out = {name: {} for name in cls.SLOT_STATE + cls.BLOCK_STATE}
        for li, blk in enumerate(model.layers):
            a = blk.attn
            out["win"][li] = (S, a.window, a.head_dim), dtype
            if a.compressor is None:
                continue
            c = a.compressor
            out["buf_kv"][li] = out["buf_gate"][li] = (S, c.ratio, c.wkv.weight.shape[0]), f32
            if c.overlap:
                out["prev_kv"][li] = out["prev_gate"][li] = (S, c.ratio, c.head_dim), f32
            out["entries"][li] = (n_blocks[kinds[li]], block_entries, c.head_dim), dtype
            if a.indexer is not None:
                ic = a.indexer.compressor
                out["ibuf_kv"][li] = out["ibuf_gate"][li] = (S, ic.ratio, ic.wkv.weight.shape[0]), f32
                out["iprev_kv"][li] = out["iprev_gate"][li] = (S, ic.ratio, ic.head_dim), f32
                out["ikeys"][li] = (n_blocks[kinds[li]], block_entries, ic.head_dim), f32
        return out

    @classmethod
    def nbytes(cls, model: Transformer, n_slots: int, n_blocks: dict, block_entries: int, dtype) -> int:
        """Bytes of the per-layer state a cache of these sizes allocates (its block tables, a few KB, aside)."""
        return sum(math.prod(shape) * dt.itemsize for d in cls.shapes(model, n_slots, n_blocks, block_entries,
                                                                      dtype).values() for shape, dt in d.values())

    # -- slots and blocks -------------------------------------------------------------------------------
    def slot_tensors(self):
        return [t for name in self.SLOT_STATE for t in getattr(self, name).values()]

    def block_tensors(self, kind):
        return [t for name in self.BLOCK_STATE for li, t in getattr(self, name).items() if self.kind[li] == kind]

    def usable_blocks(self) -> dict:
        """Each pool's blocks a sequence can be given (block 0 is scratch)."""
        return {k: len(a.ref) - 1 for k, a in self.alloc.items()}

    def blocks_for(self, upto: int) -> dict:
        """Blocks a sequence needs once positions [0, upto) are cached (kinds no layer has need none)."""
        return {k: -(-(upto // r) // self.BE) for k, r in self.paged.items()}

    def shortfall(self, seq: Sequence, upto: int) -> dict:
        need = self.blocks_for(upto)
        return {k: max(0, need[k] - len(seq.blocks[k])) for k in need}

    def step_need(self, seqs: list[Sequence], lags=None) -> tuple[dict, list]:
        """shortfall(s, s.fed + lag + 1) summed over seqs, and the (sequence, lag) pairs short of a block (one decode
        step; lag: steps of the sequence still in flight)."""
        need, short, BE = {k: 0 for k in self.paged}, [], self.BE
        for s, g in zip(seqs, lags or [0] * len(seqs)):
            u, lacks = s.fed + g + 1, False
            for k, r in self.paged.items():
                n = -(-(u // r) // BE) - len(s.blocks[k])
                if n > 0:
                    need[k] += n
                    lacks = True
            if lacks:
                short.append((s, g))
        return need, short

    def fits(self, need: dict) -> bool:
        return all(len(self.alloc[k].free) - self.promised[k] >= n for k, n in need.items())

    def fork_need(self, seq: Sequence) -> dict:
        """Blocks one fork of seq allocates once its prompt is cached: a copy of each partly filled last block."""
        n = len(seq.feed)
        return {k: int((n // r) % self.BE != 0) for k, r in self.paged.items()}

    def _sync_table(self, seq: Sequence, kind: str):
        row = self.tables[kind][seq.slot]
        row.zero_()
        if seq.blocks[kind]:
            row[:len(seq.blocks[kind])] = torch.tensor(seq.blocks[kind], dtype=torch.int64)

    def grow(self, seq: Sequence, upto: int):
        for k, n in self.shortfall(seq, upto).items():
            if n:
                seq.blocks[k] += [self.alloc[k].alloc() for _ in range(n)]
                self._sync_table(seq, k)

    def release(self, seq: Sequence):
        for k, bl in seq.blocks.items():
            for b in bl:
                self.alloc[k].decref(b)
            seq.blocks[k] = []
            if seq.slot is not None:
                self._sync_table(seq, k)
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None

    @torch.no_grad()
    def fork(self, groups: list[tuple[Sequence, list[Sequence]]]):
        """Each (src, dsts) of groups: dsts continue from src's cached prefix: slot state copied, full blocks
        shared, the partial last block copied for each (each will write into its own). One copy a tensor for all
        the groups of a prefill step (one at a time a fork was ~80 small launches; a group at a time, ~190 torch ops
        a group with mini.yaml's 12 layers: ~6,200 for a GRPO step's 32 prompts, ~45 ms of a 92 ms prefill step on
        an H200)."""
        pairs = [(s, d) for s, dsts in groups for d in dsts]
        if not pairs:
            return
        dev = self.device
        slots = torch.tensor([d.slot for _, d in pairs], device=dev)
        src = torch.tensor([s.slot for s, _ in pairs], device=dev)
        for t in self.slot_tensors() + list(self.tables.values()):  # (block tables: src's row, then own blocks)
            t[slots] = t[src]  # (advanced indexing copies first: no dst slot is a src slot)
        for k in self.paged:
            old, new, rows, cols = [], [], [], []
            for s, dsts in groups:
                bl = s.blocks[k]
                full = s.fed // self.ratio[k] // self.BE
                for b in bl[:full]:
                    for _ in dsts:
                        self.alloc[k].incref(b)
                self.promised[k] -= len(dsts) * len(bl[full:])  # generate promised them when it admitted the group
                for d in dsts:
                    own = [self.alloc[k].alloc() for _ in bl[full:]]
                    old += bl[full:]
                    new += own
                    rows += [d.slot] * len(own)
                    cols += range(full, full + len(own))
                    d.blocks[k] = list(bl[:full]) + own
            if new:
                new_t = torch.tensor(new, device=dev)
                old_t = torch.tensor(old, device=dev)
                for t in self.block_tensors(k):
                    t[new_t] = t[old_t]
                self.tables[k][torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = new_t

    # -- one sequence's state, for the prefill path ---------------------------------------------------------
    def _entries(self, pool, blocks, n):
        idx = torch.arange(n, device=self.device)
        bl = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        return pool[bl[idx // self.BE], idx % self.BE] if n else pool[0, :0]

    def _comp_state(self, li, seq, a, prefix, pool):
        bk, bg = getattr(self, prefix + "buf_kv")[li], getattr(self, prefix + "buf_gate")[li]
        r = bk.shape[1]
        pk = getattr(self, prefix + "prev_kv").get(li)
        prev = None if pk is None or a // r == 0 else (pk[seq.slot], getattr(self, prefix + "prev_gate")[li][seq.slot])
        return CompState(bk[seq.slot, :a % r], bg[seq.slot, :a % r], prev,
                         self._entries(pool, seq.blocks[self.kind[li]], a // r))

    def load(self, seq: Sequence, li: int, a: int) -> SeqState:
        W = self.win[li].shape[1]
        n = min(a, W - 1)
        window = self.win[li][seq.slot, torch.arange(a - n, a, device=self.device) % W]
        comp = index = None
        if li in self.kind:
            comp = self._comp_state(li, seq, a, "", self.entries[li])
            if li in self.ikeys:
                index = self._comp_state(li, seq, a, "i", self.ikeys[li])
        return SeqState(window, comp, index)

    def _store_comp(self, li, seq, st: CompState, a, b, prefix, pool):
        bk, bg = getattr(self, prefix + "buf_kv")[li], getattr(self, prefix + "buf_gate")[li]
        r = bk.shape[1]
        bk[seq.slot, :b % r], bg[seq.slot, :b % r] = st.buf_kv, st.buf_gate
        if st.prev is not None:
            getattr(self, prefix + "prev_kv")[li][seq.slot] = st.prev[0]
            getattr(self, prefix + "prev_gate")[li][seq.slot] = st.prev[1]
        lo, hi = a // r, b // r
        if hi > lo:
            idx = torch.arange(lo, hi, device=self.device)
            bl = torch.tensor(seq.blocks[self.kind[li]], dtype=torch.int64, device=self.device)
            pool[bl[idx // self.BE], idx % self.BE] = st.entries[lo:hi].to(pool.dtype)

    def store(self, seq: Sequence, li: int, st: SeqState, a: int, b: int):
        W = self.win[li].shape[1]
        n = st.window.shape[0]
        self.win[li][seq.slot, torch.arange(b - n, b, device=self.device) % W] = st.window
        if st.comp is not None:
            self._store_comp(li, seq, st.comp, a, b, "", self.entries[li])
        if st.index is not None:
            self._store_comp(li, seq, st.index, a, b, "i", self.ikeys[li])

    def store_fresh(self, g: FreshGroup, li: int, pr: dict, comp, index):
        """store for a FreshGroup's sequences at once: pr the chunk's projections, comp / index the group's entries
        (fresh_attention's)."""
        W = self.win[li].shape[1]
        slots, ring, rows = g.window_index(W)
        self.win[li][slots, ring] = pr["kv"][rows]
        if comp is not None:
            self._store_fresh_comp(g, li, "", pr["ckv"][0], pr["cgate"][0], comp, self.entries[li])
        if index is not None:
            self._store_fresh_comp(g, li, "i", pr["ikv"][0], pr["igate"][0], index, self.ikeys[li])

    def _store_fresh_comp(self, g, li, prefix, kv, gate, entries, pool):
        bk, bg = getattr(self, prefix + "buf_kv")[li], getattr(self, prefix + "buf_gate")[li]
        (bs, bj, br), (ps, prow), (eb, eo, ei) = g.comp_index(bk.shape[1], self.kind[li], self.BE)
        bk[bs, bj], bg[bs, bj] = kv[br], gate[br]
        pk = getattr(self, prefix + "prev_kv").get(li)
        if pk is not None:  # the overlap series: the last complete window's first head_dim columns
            hd = pk.shape[-1]
            pk[ps], getattr(self, prefix + "prev_gate")[li][ps] = kv[prow][..., :hd], gate[prow][..., :hd]
        pool[eb, eo] = entries.flatten(0, 1)[ei].to(pool.dtype)


def compress_step_ref(comp, kv, gate, pos, slots, table, bk, bg, pk, pg, pool, cos, sin):
    """kernels.compress.compress_decode's torch twin (same arguments, the compressor module in place of its
    position bias and norm): Compressor.project's fp32 conversion and bias, then the model's own
    Compressor.pool over each sequence's window, computed for every sequence and kept where a window completes
    (the others write block 0, the scratch block)."""
    r, BE = comp.ratio, pool.shape[1]
    kv, gate = comp.biased(kv, gate, pos)
    bk[slots, pos % r] = kv
    bg[slots, pos % r] = gate
    done = (pos + 1) % r == 0
    count = (pos + 1) // r
    prev = None
    if comp.overlap:
        pk_, pg_ = pk[slots], pg[slots]
        has_prev = (count >= 2)[:, None, None]
        prev = (pk_, torch.where(has_prev, pg_, torch.full_like(pg_, float("-inf"))))
    new, last = comp.pool(bk[slots][:, None], bg[slots][:, None], cos[:, None], sin[:, None], prev)
    e = (count - 1).clamp(min=0)
    blk = torch.where(done, table.gather(1, (e // BE)[:, None])[:, 0], torch.zeros_like(e))
    pool[blk, torch.where(done, e % BE, torch.zeros_like(e))] = new[:, 0].to(pool.dtype)
    if comp.overlap:
        d = done[:, None, None]
        pk[slots] = torch.where(d, last[0], pk_)
        pg[slots] = torch.where(d, last[1], pg_)
    return count


class Runner:
    """The model over the paged cache: eager prefill chunks, batched decode steps (CUDA graphs per bucket)."""

    BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    HOST_OUTPUTS = ("tok", "lp", "routing", "index")  # the step outputs zero_copy writes to the host

    def __init__(self, model: Transformer, cache: PagedCache, cuda_graphs: bool, record_index: bool = False):
        self.model, self.cache = model, cache
        self.record_index = record_index  # steps also give the indexer's chosen entries (Output.index_entries)
        # the FP8 engine's dtype (its linears'), for run_layers' quantized mHC outputs; None for BF16 weights
        self.fp8 = next((mod.fp8 for mod in model.modules() if isinstance(mod, FP8Linear)), None)
        self.graphs = {}
        self.use_graphs = cuda_graphs and cache.device.type == "cuda"
        # prefill's sequences from position 0 in padded groups (fresh_attention); ENGINE_BATCH_PREFILL=0: one at a
        # time (seq_attention), the slow twin
        self.batch_prefill = os.environ.get("ENGINE_BATCH_PREFILL", "1") != "0"
        # prefill's attention itself through kernels.attention.prefill_attention where Triton runs (the decode
        # kernel over the chunk's keys and entries, each query row its window and picks), and the indexer's scores
        # through prefill_index (summed over heads in-register); ENGINE_PREFILL_KERNEL=0: model.attend (torch,
        # every entry scored then masked) and prefill_index_ref ((rows, heads, entries) einsums), the slow twins
        self.prefill_kernel = os.environ.get("ENGINE_PREFILL_KERNEL", "1") != "0"
        cfg = model.cfg
        if self.use_graphs and not moe_kernels_take(torch.empty(0, device=cache.device), cfg.hidden_size,
                                                    cfg.moe_intermediate_size):
            warnings.warn(f"CUDA graphs off: the decode step's experts run on the torch fallback (hidden_size "
                          f"{cfg.hidden_size} and moe_intermediate_size {cfg.moe_intermediate_size} must be multiples "
                          f"of {BLOCK} for the grouped kernels, and Triton present), which reads on the host which "
                          f"experts a step hit")
            self.use_graphs = False
        # the decode step runs the compressors, the indexer and the mHC pre's post / comb on a second stream
        # (ENGINE_SIDE_STREAM=0: one stream)
        self.side = torch.cuda.Stream(cache.device) if (cache.device.type == "cuda" and
                                                        os.environ.get("ENGINE_SIDE_STREAM", "1") != "0") else None
        self.pool = None
        # its graphs are captured on a stream of their own: kernels.fp8_gemm.tickets keys its counters by the
        # capturing stream, and torch.cuda.graph's default capture stream is one for the whole process, so two
        # Runners' graphs replayed at once on two streams (two engines in one process) would share counters and
        # one's spin waits could miss their counts (a scratch run of two such graphs hung)
        self.capture_stream = torch.cuda.Stream(cache.device) if self.use_graphs else None
        self.staging, self.pinned = {}, {}
        self.parity = 0  # host buffers alternate between steps, so one step can be staged while one is in flight
        # the tokens each decode step samples, by row: the next step can take its inputs from them on the device
        self.tok = torch.zeros(pow2(cache.n_slots + 1), dtype=torch.int64, device=cache.device)
        # a graphed step writes its tokens, log-probs and per-position rows into pinned host memory itself
        # (kernels.sample.to_host, two rows it alternates by a device-side count of replays, self.ctr), so no
        # device-to-host copies follow the graph: on an H200 those took ~15 us between steps. On by default
        # where the graphs run on CUDA; ENGINE_ZERO_COPY=0 (or ROCm, unmeasured there) copies after the graph.
        self.zero_copy = self.use_graphs and use_triton(self.tok) and os.environ.get(
            "ENGINE_ZERO_COPY", "0" if torch.version.hip else "1") != "0"
        self.ctr = torch.zeros(2, dtype=torch.int32, device=cache.device) if self.zero_copy else None
        self.replays = 0  # graph replays so far: the row of this one's host outputs is replays % 2
        # step_inputs' RoPE offsets (1: the compress table at the positions; each compress ratio r: at each
        # window's first position, pos + 1 - r) and sliding windows
        attns = [blk.attn for blk in model.layers]
        comps = [a.compressor for a in attns if a.compressor is not None]
        comps += [a.indexer.compressor for a in attns if a.indexer is not None]
        self.offsets = tuple(sorted({1} | {cp.ratio for cp in comps}))
        self.windows = tuple(sorted({a.window for a in attns}))
        # the last position a decode step can take with no CSA layer holding more entries than its indexer's top-k
        # ((pos + 1) // ratio of them after the step's compress): up to there a step skips the indexer's query,
        # scores and top-k, which would pick every entry (_decode_attention's every). 2,050 in mini.yaml (top-k
        # 512, ratio 4), so the benchmark's 512 + 1,024 tokens never run them; its 16k context always does.
        self.every_upto = min(((a.indexer.topk + 1) * a.compressor.ratio - 2 for a in attns if a.indexer is not None),
                              default=-1)

    # -- prefill ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, batch: list[tuple[Sequence, int, int]]):
        """batch: (seq, a, b) = feed seq.feed[a:b] at positions a..b-1. -> last-position logits, routing (N, L, k),
        bounds, the indexer's chosen entries (N, CSA layers, index_topk) or None (record_index off)."""
        m, c, dev = self.model, self.cache, self.cache.device
        ids = torch.tensor([t for s, a, b in batch for t in s.feed[a:b]], device=dev)
        pos = torch.cat([torch.arange(a, b, device=dev) for _, a, b in batch])
        bounds = [0]
        for _, a, b in batch:
            bounds.append(bounds[-1] + b - a)

        rec = IndexRecorder(m.cfg.index_topk) if self.record_index else None
        # sequences fed from position 0 go in padded groups (fresh_attention); the others (a long prompt's later
        # chunks) one at a time (seq_attention: its slow twin, all of them with batch_prefill off)
        groups = fresh_groups(batch, bounds, dev) if self.batch_prefill else []
        grouped = {i for g in groups for i in g.index}

        def attention(li, attn, h, tables, hq=None):
            pr = projections(attn, h, pos, tables, hq=hq)
            chosen = [None if rec is None else rec.seq(li, attn) for _ in batch]  # (in the batch's order)
            out = torch.empty(pr["q"].shape, dtype=pr["q"].dtype, device=dev)
            for i, (s, a, b) in enumerate(batch):
                if i in grouped:
                    continue
                st = c.load(s, li, a)
                out[:, bounds[i]:bounds[i + 1]] = seq_attention(m, attn, pr, bounds[i], bounds[i + 1],
                                                                pos[bounds[i]:bounds[i + 1]], st, chosen=chosen[i],
                                                                kernel=self.prefill_kernel)
                c.store(s, li, st, a, b)
            dtypes = (c.entries[li].dtype, c.ikeys[li].dtype if li in c.ikeys else None) if li in c.kind else None
            for g in groups:
                o, comp, index = fresh_attention(m, attn, pr, g, dtypes, None if rec is None or attn.indexer is None
                                                 else [chosen[i] for i in g.index], kernel=self.prefill_kernel)
                out[0, g.packed] = o.flatten(0, 1)[g.valid]
                c.store_fresh(g, li, pr, comp, index)
            return attn.project_out(out, *tables[attn.rope_kind])

        logits, routing = run_layers(m, ids, pos, attention, [b - 1 for b in bounds[1:]], self.fp8)
        return logits, routing, bounds, None if rec is None else rec.rows(len(ids), dev)

    # -- decode -----------------------------------------------------------------------------------------
    def _compress_step(self, li, comp, prefix, kv, gate, pos, slots, table, pool, wrope):
        """Write each sequence's new projection row (kv, gate as the compressor's linears give them); pool the
        window for sequences that complete one.
        wrope: the compress RoPE tables at each window's first position, by ratio (made once a step)."""
        c = self.cache
        args = (kv, gate, pos, slots, table, getattr(c, prefix + "buf_kv")[li], getattr(c, prefix + "buf_gate")[li],
                getattr(c, prefix + "prev_kv").get(li), getattr(c, prefix + "prev_gate").get(li), pool)
        if use_triton(kv):
            return compress_decode(*args, comp.ape, comp.norm.weight, comp.norm.eps, *wrope[comp.ratio])
        return compress_step_ref(comp, *args, *wrope[comp.ratio])

    def _decode_attention(self, li, attn, h, tables, pos, slots, tabs, wrope, hq=None, rec=None, every=False):
        """wrope: the step's per-sequence tables every layer shares (window rows, compress RoPE by ratio). hq:
        h's rows quantized (run_layers'). rec: an IndexRecorder for the indexer's chosen entries. every: no row
        has more CSA entries than the indexer's top-k (Runner.every_upto), which would then pick them all: the
        attention reads every entry, as an HCA layer's does, and the indexer's query, scores and top-k do not
        run (its compressor still does)."""
        c = self.cache
        key = ("window", attn.window)  # (the window-cache row of each sequence's new key)
        # Two chains where there is a side stream (a compressed-attention layer on a GPU): there, the compressors'
        # steps (in the FP8 engine also their BF16 input GEMM, outside the FP8 group; the BF16 engine's one input
        # GEMM holds q's and kv's linears too and runs here first), then (after the q norm) the indexer's query,
        # scores and top-k; here, the FP8 input GEMM, q and kv. Joined before the attention reads the compressed
        # entries. One stream (CPU, ENGINE_SIDE_STREAM=0): the same kernels in that order, the same values.
        gemms = getattr(attn, "input_gemms", None)
        split = gemms is not None and self.fp8 is not None  # the FP8 engine: a BF16 and an FP8 GEMM group
        ins = gemms(h, hq) if gemms is not None and not split else {}
        side = self.side if attn.compressor is not None else None
        here = torch.cuda.current_stream(h.device) if side is not None else None
        if side is not None:
            side.wait_stream(here)
        with torch.cuda.stream(side):
            if split:
                ins = gemms(h, hq, fp8=False)
            if attn.compressor is not None:
                table = tabs[c.kind[li]]
                kv, gate = comp_inputs(attn.compressor, "c", h, ins)
                count = self._compress_step(li, attn.compressor, "", kv[0], gate[0], pos, slots, table, c.entries[li],
                                            wrope)
                if attn.indexer is not None:
                    kv, gate = comp_inputs(attn.indexer.compressor, "i", h, ins)
                    self._compress_step(li, attn.indexer.compressor, "i", kv[0], gate[0], pos, slots, table,
                                        c.ikeys[li], wrope)
        if split:
            ins.update(gemms(h, hq, fp8=True))
        cos, sin = tables[attn.rope_kind]
        # at one row the FP8 wq_b GEMVs (the layer's and the indexer's) take the q norm themselves (at two the
        # norm's own launch was faster: bench/RESULTS.md)
        q_res, qq = attn.q_lora(h, ins.get("wq_a"), None if hq is None else hq[0].dtype,
                                prenorm=self.fp8 is not None and h.shape[1] == 1 and use_triton(h))
        sel = None
        if attn.indexer is not None and not every:
            if side is not None:
                side.wait_stream(here)
            with torch.cuda.stream(side):
                iq, iw = attn.indexer.query(h, q_res, *tables["compress"], ins.get("iw"), raw=True, qq=qq)
                S = table.shape[1] * c.BE
                sc = index_scores(iq[0], iw[0], c.ikeys[li], table, count, S, attn.indexer.w_scale)
                sel = index_topk(sc, min(attn.indexer.topk, S), count)
                if rec is not None:
                    rec.seq(li, attn).append(index_record(sel, attn.indexer.topk))
        q = attn.q_and_kv(q_res, h, cos, sin, qq, ins.get("wkv"),
                          (c.win[li].view(-1, c.win[li].shape[-1]), wrope[key]))[0][0]
        if side is not None:
            here.wait_stream(side)
        # the kernel rotates its output back (project_out's inverse RoPE); with hq (the FP8 engine past GEMV_ROWS
        # rows) it also stores its output quantized, for wo_a's FP8 GEMM
        kw = dict(unrope=(cos, sin), fp8=None if hq is None else hq[0].dtype)
        if attn.compressor is None:
            out = decode_attention(q, c.win[li], slots, pos, attn.attn_sink, attn.scale, **kw)
        else:  # (top-k lists a row's valid entries first; without sel, entries [0, count))
            out = decode_attention(q, c.win[li], slots, pos, attn.attn_sink, attn.scale, c.entries[li], table,
                                   sel=sel, count=count, **kw)
        out, oq = out if hq is not None else (out, None)
        return attn.project_out(out[None], None, None, oq)

    def _decode_eager(self, inp, feed: bool = True, every: bool = False, filtered: bool = False,
                      candidates: int | None = None):
        """inp (9, n) int64 rows: token ids, positions, slots, sampling seeds, sampling steps, temperatures (as
        float64 bits), the row of the previous step whose sampled token is this row's id (-1: the id row), top-k
        (0: off) and top-p (as float64 bits). -> logits (n, V) in the head's dtype (the sampler reads them as they
        are, no fp32 copy), routing (n, L, k) uint8, tok (n,) and lp (n,): rollout_server.sample's tokens and
        log-probs (kernels.sample on GPUs, sample_plain elsewhere; filtered: some rows have top-k / top-p, and
        every row goes through sample_filtered, candidates its filter_candidates for the torch twin).
        feed=False: the sampled tokens are not kept in self.tok for the next step to feed (a capture's warm-up
        step, which may run while a step is in flight whose tokens the next one feeds from there). every: no
        position past every_upto (_decode_attention)."""
        n, m, c = inp.shape[1], self.model, self.cache
        pos, slots = inp[1], inp[2]
        # the step's ids, embedded streams, RoPE rows (at the positions; at each compress window's first position,
        # by ratio), window-cache rows and block-table rows: one launch on GPUs
        ids, x, ropes, wrows, tabs = step_inputs(inp[:7], self.tok, m.embed.weight, m.cfg.hc_mult, m.rope_main.table,
                                                 m.rope_compress.table, self.offsets, self.windows,
                                                 list(c.tables.values()))
        tabs = dict(zip(c.tables, tabs))
        wrope = {("window", w): wrows[j] for j, w in enumerate(self.windows)}
        wrope.update({r: (ropes[1 + j, 0], ropes[1 + j, 1]) for j, r in enumerate(self.offsets)})
        tables = {"main": (ropes[0, 0], ropes[0, 1]), "compress": wrope[1]}

        rec = IndexRecorder(self.model.cfg.index_topk) if self.record_index else None

        def attention(li, attn, h, tables, hq=None):
            return self._decode_attention(li, attn, h, tables, pos, slots, tabs, wrope, hq, rec, every)
        logits, routing = run_layers(m, ids, pos, attention, fp8=self.fp8, side=self.side, pre=(tables, x))
        out = {"logits": logits, "routing": routing}
        if rec is not None:
            out["index"] = rec.rows(n, ids.device)
        temps = inp[5].view(torch.float64)  # (the kernel rounds them to fp32 itself)
        if filtered:  # (rounded to fp32 as SamplingParams' floats are in `sample`)
            out["tok"], out["lp"] = sample_filtered(out["logits"], temps.float(), inp[7], inp[8].view(torch.float64)
                                                    .float(), inp[3], inp[4], candidates,
                                                    also=self.tok if feed else None)
        elif use_triton(out["logits"]):  # (the kernel also writes the tokens the next step feeds)
            out["tok"], out["lp"] = gumbel_sample(out["logits"], temps, inp[3], inp[4],
                                                  also=self.tok if feed else None)
        else:
            out["tok"], out["lp"] = sample_plain(out["logits"], temps.float(), inp[3], inp[4])
            if feed:
                self.tok[:n].copy_(out["tok"])
        return out

    def _stage(self, seqs: list[Sequence], lags=None, src=None) -> torch.Tensor:
        """The step's inputs (see _decode_eager) in one host buffer (pinned on GPUs: one asynchronous copy),
        padded to a power of two with rows that write to the scratch slot. lags[i]: steps of sequence i still
        in flight (0 or 1: its position and sampling step move on by that many); src[i]: the in-flight step's
        row whose token sequence i feeds (-1: its last host token)."""
        B = len(seqs)
        n = pow2(B)
        self.parity ^= 1
        h = self.staging.get((n, self.parity))
        if h is None:
            h = self.staging[n, self.parity] = torch.empty(9, n, dtype=torch.int64,
                                                           pin_memory=self.cache.device.type == "cuda")
        a = h.numpy()
        a[:, B:] = 0
        a[2, B:] = self.cache.trash
        a[6] = -1
        a[8, B:].view(np.float64)[:] = 1.0  # (padding rows: no top-p, nothing to search)
        lags = lags or [0] * B
        a[0, :B] = [s.tokens[-1] for s in seqs]
        a[1, :B] = [s.fed + g for s, g in zip(seqs, lags)]
        a[2, :B] = [s.slot for s in seqs]
        a[3, :B] = [s.seed for s in seqs]
        a[4, :B] = [len(s.tokens) + g for s, g in zip(seqs, lags)]
        a[5, :B].view(np.float64)[:] = [s.params.temperature for s in seqs]
        a[7, :B] = [s.params.top_k for s in seqs]
        a[8, :B].view(np.float64)[:] = [s.params.top_p for s in seqs]
        if src is not None:
            a[6, :B] = src
        return h

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], lags=None, src=None) -> dict:
        """Feed every sequence's last sampled token (see _stage for lags and src). -> device tensors of the B rows
        (see _decode_eager); nothing waits for the device. A graphed step with zero_copy also gives "host": its
        HOST_OUTPUTS as the step itself writes them into pinned host memory (read them after an event recorded
        behind it, and before the step two after it writes them again)."""
        B = len(seqs)
        h = self._stage(seqs, lags, src)
        every = not self.record_index and int(h.numpy()[1, :B].max()) <= self.every_upto
        # top-k / top-p rows: drawn inside the step (graphs of their own), from no host value: still pipelined
        filtered = any(s.params.filtered for s in seqs)
        bucket = next((b for b in self.BUCKETS if b >= B), None) if self.use_graphs else None
        host = {}
        if bucket is None:
            inp = h[:, :B].to(self.cache.device, non_blocking=True)
            out = self._decode_eager(inp, every=every, filtered=filtered,
                                     candidates=filter_candidates([s.params for s in seqs]))
        else:
            g = self.graphs.get((bucket, every, filtered)) or self._capture(bucket, every, filtered)
            inp = g["inp"]
            inp.copy_(h[:, :bucket], non_blocking=True)
            g["graph"].replay()
            p, self.replays = self.replays % 2, self.replays + 1
            out = g["out"]
            host = {k: host_rows(t, p, out[k])[:B] for k, t in g["host"].items()}
        res = {k: v[:B] for k, v in out.items()}
        return {**res, "host": host} if host else res

    def fetch_start(self, *ts: torch.Tensor):
        """Start copying device tensors to the host (pinned buffers of this step's parity, one event). -> a handle
        for fetch_wait."""
        if self.cache.device.type != "cuda":
            return [t.cpu().numpy() for t in ts], None
        hs = []
        for i, t in enumerate(ts):
            if t.device.type == "cpu":  # already on the host (a graphed step's own outputs: Runner.decode's "host")
                hs.append(t)
                continue
            key = (i, t.dtype, tuple(t.shape[1:]), self.parity)
            h = self.pinned.get(key)
            if h is None or h.shape[0] < t.shape[0]:
                h = self.pinned[key] = torch.empty(max(t.shape[0], self.cache.n_slots), *t.shape[1:], dtype=t.dtype,
                                                   pin_memory=True)
            hs.append(h[:t.shape[0]])
            hs[-1].copy_(t, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.cache.device))
        return hs, ev

    @staticmethod
    def fetch_wait(handle) -> list[np.ndarray]:
        hs, ev = handle
        if ev is None:
            return hs
        ev.synchronize()
        return [h.numpy().copy() for h in hs]

    def fetch(self, *ts: torch.Tensor) -> list[np.ndarray]:
        """Device tensors -> host arrays: copies into pinned buffers and one synchronization."""
        return self.fetch_wait(self.fetch_start(*ts))

    def _capture(self, bucket: int, every: bool, filtered: bool = False):
        c, dev = self.cache, self.cache.device
        inp = torch.zeros(9, bucket, dtype=torch.int64, device=dev)
        inp[2], inp[6] = c.trash, -1
        inp[8].view(torch.float64).fill_(1.0)
        # compiles the Triton kernels and warms the allocator outside the capture; feed=False: a bucket's first step
        # may come while the step before it is in flight, whose tokens it feeds from self.tok (before, the warm-up
        # wrote its own there: graphs and eager parted where a batch first shrank into a new bucket)
        warm = self._decode_eager(inp, feed=False, every=every, filtered=filtered)
        names = [k for k in self.HOST_OUTPUTS if k in warm] if self.zero_copy else []
        host = {k: torch.empty(2, warm[k].nbytes, dtype=torch.uint8, pin_memory=True) for k in names}
        if host:  # (compiles to_host, on a count of its own)
            to_host(torch.zeros_like(self.ctr), [warm[k] for k in names], [host[k] for k in names])
        # the capture stream's split-K / overlap ticket counters (kernels.fp8_gemm.tickets, keyed by stream), as many
        # as the warm-up's stream holds after this step's kernels took theirs, made before the capture: inside it
        # their zero fill would be a node of the graph, run by every replay (one launch on the step's path)
        n = tickets(dev, 1).numel()
        with torch.cuda.stream(self.capture_stream):
            tickets(dev, n)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
            out = self._decode_eager(inp, every=every, filtered=filtered)
            if host:
                to_host(self.ctr, [out[k] for k in names], [host[k] for k in names])
        self.pool = graph.pool()
        self.graphs[bucket, every, filtered] = g = {"inp": inp, "graph": graph, "out": out, "host": host}
        return g


class Engine:
    """The paged FP8 engine (see the module docstring). Pools are sized from the memory left after the weights
    (mem_fraction of it) unless num_blocks is given (one count for both pools, or {"csa": n, "hca": m}, where a
    pool no layer of the model writes may be left out); max_model_len bounds prompt + completion."""

    def __init__(self, model_or_path, fp8: bool = True, dtype: torch.dtype = torch.bfloat16, device=None,
                 fp8_scale_fmt: str | None = None, max_seqs: int = 256, max_model_len: int = 4096,
                 block_entries: int = BLOCK_ENTRIES, mem_fraction: float = 0.85, num_blocks: int | dict | None = None,
                 max_batch_tokens: int = 8192, cuda_graphs: bool = True, progress: bool = False, ep=None,
                 pipeline: bool = True, record_index: bool = False, cfg: ModelConfig | None = None):
        """ep: (process group, size, rank) of rollout expert parallelism: the group's ranks run identical steps
        on identical requests, each holding 1/size of the routed experts (from a checkpoint directory it reads
        only those).
        pipeline: launch each decode step before reading the last one's tokens (they feed it on the device), so
        the host's bookkeeping overlaps the device's work; False: one step at a time (the twin).
        record_index: each Output also carries the indexer's chosen entries (Output.index_entries), for indexer
        replay in training.
        fp8_scale_fmt: the FP8 block scales, "fp32" or "ue8m0" (powers of two); None: a checkpoint directory's
        own (an FP8 checkpoint's weights keep their bits), else fp32.
        cfg: a checkpoint directory's config, where the caller has read it already (None: read from its
        config.json, once, for the pools' check and the load)."""
        pools = ({f"num_blocks[{k!r}]": n for k, n in num_blocks.items()} if isinstance(num_blocks, dict) else
                 {} if num_blocks is None else {"num_blocks": num_blocks})
        check_sizes(max_seqs=max_seqs, max_model_len=max_model_len, block_entries=block_entries,
                    max_batch_tokens=max_batch_tokens, **pools)
        if isinstance(num_blocks, dict) and not set(num_blocks) <= set(PagedCache.POOLS):
            raise ValueError(f"invalid engine arguments: num_blocks={num_blocks!r} (an integer, or one a pool: keys "
                             f"{', '.join(map(repr, PagedCache.POOLS))})")
        if not (isinstance(mem_fraction, numbers.Real) and 0 < mem_fraction <= 1):
            raise ValueError(f"invalid engine arguments: mem_fraction={mem_fraction!r} (in (0, 1])")
        if isinstance(num_blocks, dict):  # before the weights load, which takes minutes for a release checkpoint
            if isinstance(model_or_path, Transformer):
                cfg = model_or_path.cfg
            elif cfg is None and isinstance(model_or_path, (str, Path)) and Path(model_or_path).is_dir():
                cfg = load_hf_config(model_or_path)  # (handed to the load: not read again)
            lack = [] if cfg is None else sorted(set(PagedCache.layer_kinds(cfg).values()) - set(num_blocks))
            if lack:
                raise ValueError(f"invalid engine arguments: num_blocks={num_blocks!r} has no {lack[0]!r} pool, which "
                                 f"this model's {lack[0].upper()} layers need")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = float_dtype(dtype, type(self).__name__)
        self.model = prepare_inference_model(model_or_path, fp8, dtype, device, fp8_scale_fmt, progress, ep, cfg=cfg)
        for rope in (self.model.rope_main, self.model.rope_compress):  # positions stay below max_model_len
            rope.precompute(max_model_len + 1)
        self.cfg, self.device, self.dtype = self.model.cfg, device, dtype
        self.max_seqs, self.max_model_len, self.max_batch_tokens = max_seqs, max_model_len, max_batch_tokens
        self.warned_context = False  # generate's warning of positions past max_position_embeddings, given once
        n_blocks = self._size_pools(num_blocks, block_entries, mem_fraction)
        if ep is not None:  # identical schedules need identical pools: take the group's smallest
            t = torch.tensor([n_blocks["csa"], n_blocks["hca"]], device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ep[0])
            n_blocks = {"csa": int(t[0]), "hca": int(t[1])}
        self.cache = PagedCache(self.model, max_seqs, n_blocks, block_entries, max_model_len, device, dtype)
        self.runner = Runner(self.model, self.cache, cuda_graphs, record_index)
        self.records = ("routing", "index") if record_index else ("routing",)  # a step's per-position outputs
        # cache_waits: sequences that found a slot free but too few cache blocks to start (each counted once)
        self.stats = {"preemptions": 0, "cache_waits": 0, "prefill_tokens": 0, "decode_steps": 0, "decode_tokens": 0,
                      "prefill_s": 0.0, "decode_s": 0.0}
        self.pipeline = pipeline
        self.ahead = None  # the decode step in flight: (its sequences, fetch handle)
        self.progress = None  # generate's progress callback, while it runs

    def _size_pools(self, num_blocks, BE, mem_fraction) -> dict:
        most = self.cfg.seq_blocks(self.max_model_len, BE)
        full = {k: self.max_seqs * n + 1 for k, n in most.items()}  # (+ 1: block 0 is scratch)
        size = functools.partial(PagedCache.nbytes, self.model, self.max_seqs, block_entries=BE, dtype=self.dtype)
        if num_blocks is not None:  # fixed (a dict may leave out a pool no layer writes: no bytes; checked above)
            fixed = ({**full, **{k: int(n) for k, n in num_blocks.items()}} if isinstance(num_blocks, dict) else
                     {k: int(num_blocks) for k in full})
            free = free_device_memory(self.device)  # (a GPU's: checked before the pools are made)
            if free is not None and (need := size(fixed)) > free:
                gib = 2 ** -30
                raise ValueError(f"invalid engine arguments: the cache does not fit: num_blocks={num_blocks!r} for "
                                 f"max_seqs={self.max_seqs} sequences take {need * gib:.2f} GiB against the "
                                 f"{free * gib:.2f} GiB free after the weights: fewer blocks or sequences")
            return fixed
        if self.device.type != "cuda":
            return full
        zero = dict.fromkeys(full, 0)
        fixed = size(zero)  # the slots' rows: window rings and compressor state
        per_block = {k: size({**zero, k: 1}) - fixed for k in full}
        need = {k: n + 1 for k, n in most.items()}  # the least that serves: one sequence of max_model_len
        least = fixed + sum(per_block[k] * need[k] for k in full)
        free = free_device_memory(self.device)  # (what loading and quantizing freed counted as free)
        budget = mem_fraction * free
        if least > budget:
            gib = 2 ** -30
            raise ValueError(f"invalid engine arguments: the cache does not fit: {fixed * gib:.2f} GiB for the state "
                             f"of max_seqs={self.max_seqs} sequences and {(least - fixed) * gib:.2f} GiB of blocks for "
                             f"one of max_model_len={self.max_model_len}, against mem_fraction={mem_fraction} of the "
                             f"{free * gib:.2f} GiB free after the weights ({budget * gib:.2f} GiB): lower max_seqs "
                             f"or max_model_len, or raise mem_fraction")
        scale = min(1.0, (budget - least) / max(sum(per_block[k] * (full[k] - need[k]) for k in full), 1))
        return {k: need[k] + int((full[k] - need[k]) * scale) for k in full}

    def footprint(self) -> dict:
        """What the engine holds: bytes of its weights ("weights"; "fp8": whether its FP8 set is FP8) and of its
        cache's state ("cache"), and how many sequences of max_model_len, none sharing a prompt, the cache's blocks
        hold at once ("room"; at most max_seqs, the slots)."""
        c = self.cache
        state = [*c.slot_tensors(), *(t for k in c.paged for t in c.block_tensors(k))]
        pool = c.usable_blocks()
        room = min([self.max_seqs, *(pool[k] // n for k, n in c.blocks_for(self.max_model_len).items() if n)])
        return {"weights": held_bytes(self.model)[0], "fp8": self.runner.fp8 is not None,
                "cache": sum(t.nbytes for t in state), "room": room}

    def footprint_note(self, max_model_len: str = "max_model_len", max_seqs: str = "max_seqs") -> str:
        """footprint() in words; the names are those of the settings that sized the cache (the CLI's flags, a
        run's config keys)."""
        fp = self.footprint()
        return (f"weights {size_text(fp['weights'])} ({'FP8' if fp['fp8'] else 'BF16'}) and a cache of "
                f"{size_text(fp['cache'])}, whose blocks hold {fp['room']} sequence(s) of {max_model_len} "
                f"{self.max_model_len} at once ({max_seqs} {self.max_seqs})")

    def update_weights(self, named_tensors):
        update_weights(self.model, named_tensors)

    # -- scheduling -------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 first_index: int = 0, *, sampling_params=None, progress=None) -> list[Output]:
        """params: one SamplingParams for every prompt or one a prompt (sampling_params, vLLM's name for it, works
        too; neither: SamplingParams()'s defaults). first_index: the index of prompts[0] in a larger request sent in
        pieces (the CLI's chunks). Sequence i samples with (its seed, first_index + i), so the pieces give what one
        call would. progress: called with 1 as each sequence ends (a progress bar's update)."""
        prompts, params = check_prompts(prompts, either_params(params, sampling_params), self.cfg.vocab_size,
                                        first_index)
        pool = self.cache.usable_blocks()
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if len(p) + sp.max_tokens > self.max_model_len:
                raise ValueError(f"prompt {first_index + i}: {len(p)} tokens + max_tokens {sp.max_tokens} exceed "
                                 f"max_model_len {self.max_model_len}")
            over = {k: n for k, n in self.cache.blocks_for(len(p) + sp.max_tokens).items() if n > pool[k]}
            if over:  # it would run until its cache outgrows the whole pool
                raise ValueError(f"prompt {first_index + i}: {len(p)} tokens + max_tokens {sp.max_tokens} need "
                                 f"{over} cache blocks, the pools hold {pool}: raise num_blocks or mem_fraction")
        long = None if self.warned_context else next(  # (once an engine: a run's every call would repeat it)
            (i for i, (p, sp) in enumerate(zip(prompts, params)) if len(p) + sp.max_tokens >
             self.cfg.max_position_embeddings), None)
        if long is not None:
            self.warned_context = True
            warnings.warn(f"prompt {first_index + long}: {len(prompts[long])} tokens + max_tokens "
                          f"{params[long].max_tokens} reach past the model's max_position_embeddings "
                          f"{self.cfg.max_position_embeddings}: positions beyond its trained context", stacklevel=2)
        seqs = [Sequence(first_index + i, p, params[i]) for i, p in enumerate(prompts)]
        leaders: dict[tuple, Sequence] = {}
        for s in seqs:  # a GRPO group shares its prompt: one prefill, blocks shared
            lead = leaders.setdefault(tuple(s.prompt), s)
            if lead is not s:
                lead.followers.append(s)
        waiting = deque(leaders.values())
        prefilling: list[Sequence] = []
        running: list[Sequence] = []
        order = 0
        c = self.cache
        self.progress = progress
        try:
            while waiting or prefilling or running:
                while waiting:  # admit whole groups while slots and blocks last
                    s = waiting[0]
                    group = [s] + s.followers
                    forks, fits = self._group_fits(s, len(s.followers))
                    if not fits:
                        if prefilling or running or not s.followers:
                            if len(c.free_slots) > len(s.followers):  # the blocks, not the slots, hold it back
                                self.stats["cache_waits"] += sum(not g.waited for g in group)
                                for g in group:
                                    g.waited = True
                            break
                        # nothing runs, so nothing frees slots or blocks: the group is larger than the cache. Admit
                        # as much of it as fits; the rest becomes a group of its own (its prompt prefilled again)
                        keep = next((n for n in range(len(s.followers) - 1, -1, -1) if self._group_fits(s, n)[1]),
                                    None)
                        if keep is None:
                            break
                        rest, s.followers = s.followers[keep:], s.followers[:keep]
                        rest[0].followers = rest[1:]
                        waiting.insert(1, rest[0])
                        continue
                    waiting.popleft()
                    for k, n in forks.items():  # held until the forks take them
                        c.promised[k] += n
                    for g in group:
                        g.slot = c.free_slots.popleft()
                        g.order = order = order + 1
                    c.grow(s, len(s.feed))
                    prefilling.append(s)
                if not (prefilling or running):
                    raise RuntimeError("the cache cannot hold a single sequence: raise num_blocks or mem_fraction")
                t0 = time.perf_counter()
                if prefilling:  # every step ends in a host read of its samples, so the wall time is the step's
                    self._prefill_step(prefilling, running)
                    self.stats["prefill_s"] += time.perf_counter() - t0
                else:
                    self.stats["decode_tokens"] += len(running)
                    self._decode_step(running, waiting)
                    self.stats["decode_s"] += time.perf_counter() - t0
            self._drain(running)
        except BaseException:  # (KeyboardInterrupt too) the next call finds the cache as a fresh engine would
            self._abandon(seqs)
            raise
        finally:
            self.progress = None

        def rows(pieces, s):  # one row a fed position
            return torch.from_numpy(np.concatenate(pieces)[: len(s.prompt) + len(s.tokens) - 1])
        return [Output(s.prompt, s.tokens, s.logprobs, rows(s.routing, s), s.finish,
                       rows(s.index, s) if self.runner.record_index else None) for s in seqs]

    def _prefill_step(self, prefilling: list[Sequence], running: list[Sequence]):
        budget, batch = self.max_batch_tokens, []
        for s in prefilling:
            n = min(len(s.feed) - s.fed, budget)
            if n <= 0:
                break
            batch.append((s, s.fed, s.fed + n))
            budget -= n
        logits, routing, bounds, index = self.runner.prefill(batch)
        routing = routing.cpu().numpy()
        index = None if index is None else index.cpu().numpy()
        self.stats["prefill_tokens"] += bounds[-1]
        done, rows, forks = [], [], []
        for i, (s, a, b) in enumerate(batch):
            s.fed = b
            if not s.resume:
                s.routing.append(routing[bounds[i]:bounds[i + 1]])
                if index is not None:
                    s.index.append(index[bounds[i]:bounds[i + 1]])
            if s.fed == len(s.feed):
                prefilling.remove(s)
                if s.resume:
                    s.resume = False
                    running.append(s)
                    continue
                forks.append((s, s.followers))
                for f in s.followers:
                    f.fed, f.routing, f.index = s.fed, list(s.routing), list(s.index)
                members = [s] + s.followers
                s.followers = []
                done += members
                rows += [logits[i]] * len(members)
        self.cache.fork(forks)  # (before sampling, which frees the blocks of sequences it ends)
        if done:
            self._sample(done, torch.stack(rows), running)

    def _decode_step(self, running: list[Sequence], waiting: deque):
        """One decode step's tokens. Pipelined: the step after it goes to the device first (every sequence that
        may continue, at one position further, fed its token on the device), then this one's tokens are read.
        A step whose blocks would need a preemption waits for the step in flight and runs alone."""
        if not self.pipeline:
            self._drain(running)
            if running:
                self._decode_alone(running, waiting)
            return
        if self.ahead is None:  # nothing in flight: this step alone may preempt
            self._reserve(running, waiting)
            self.ahead = self._launch(list(running), [0] * len(running), None)
        rows = {id(s): i for i, s in enumerate(self.ahead[0])}
        # the next step: sequences the step in flight cannot end by length, a position further; new ones as they are
        nxt = [s for s in running if id(s) not in rows or len(s.tokens) + 1 < s.params.max_tokens]
        lags = [int(id(s) in rows) for s in nxt]
        need, short = self.cache.step_need(nxt, lags)
        launch = nxt and self.cache.fits(need)
        if launch:
            for s, g in short:
                self.cache.grow(s, s.fed + g + 1)
        handle = self._launch(nxt, lags, [rows.get(id(s), -1) for s in nxt]) if launch else None
        self._collect(self.ahead, running)
        self.ahead = handle

    def _launch(self, seqs: list[Sequence], lags: list[int], src):
        out = self.runner.decode(seqs, lags, src)
        self.stats["decode_steps"] += 1
        return seqs, self.runner.fetch_start(*self._outputs(out, ("tok", "lp", *self.records)))

    @staticmethod
    def _outputs(out: dict, names) -> list[torch.Tensor]:
        """A decode step's outputs `names`: where the step wrote them to the host itself, those."""
        host = out.get("host", {})
        return [host.get(k, out[k]) for k in names]

    def _collect(self, step, running: list[Sequence]):
        """Read a launched step's tokens into its sequences that are still running (one may have ended on the
        step before it, which was read after this one launched)."""
        seqs, handle = step
        self._advance(seqs, running, *self.runner.fetch_wait(handle))

    def _advance(self, seqs: list[Sequence], running: list[Sequence], tok, lp, *records):
        """One step's tokens, log-probs and per-position rows (host arrays by row: routing, [index], as
        self.records names them) into its sequences still running."""
        live = [i for i, s in enumerate(seqs) if s.finish is None]
        for i in live:
            for name, rows in zip(self.records, records):
                getattr(seqs[i], name).append(rows[i:i + 1])
            seqs[i].fed += 1
        self._take([seqs[i] for i in live], tok[live].tolist(), lp[live].tolist(), running, decoding=True)

    def _abandon(self, seqs: list[Sequence]):
        """After a generate call raised: wait for its step in flight and drop it, give back every slot and block
        its sequences hold, and clear its groups' promised blocks."""
        step, self.ahead = self.ahead, None
        if step is not None:
            try:
                self.runner.fetch_wait(step[1])
            except Exception:  # the device error the call raised on: nothing left to wait for
                pass
        for s in seqs:
            self.cache.release(s)
        self.cache.promised = dict.fromkeys(self.cache.promised, 0)

    def _drain(self, running: list[Sequence]):
        if self.ahead is not None:
            step, self.ahead = self.ahead, None
            self._collect(step, running)

    def _group_fits(self, s: Sequence, followers: int) -> tuple[dict, bool]:
        """(blocks the forks of `followers` followers of leader s take, per kind; whether the free slots and
        blocks hold s, its first decode step and those forks)."""
        c = self.cache
        forks = {k: n * followers for k, n in c.fork_need(s).items()}
        need = {k: n + forks[k] for k, n in c.shortfall(s, len(s.feed) + 1).items()}
        return forks, len(c.free_slots) > followers and c.fits(need)

    def _reserve(self, running: list[Sequence], waiting: deque):
        """Blocks for the positions the next step writes; the newest sequences are preempted while short."""
        c = self.cache
        while True:  # blocks for the entries this step completes; preempt the newest sequences if short
            need, short = c.step_need(running)
            if c.fits(need):
                break
            victim = max(running, key=lambda s: s.order)
            if len(running) == 1:
                raise RuntimeError("the block pool cannot hold one sequence: raise num_blocks or mem_fraction")
            running.remove(victim)
            c.release(victim)
            victim.feed, victim.fed, victim.resume = victim.prompt + victim.tokens[:-1], 0, True
            waiting.appendleft(victim)
            self.stats["preemptions"] += 1
        for s, _ in short:
            c.grow(s, s.fed + 1)

    def _decode_alone(self, running: list[Sequence], waiting: deque):
        self._reserve(running, waiting)
        seqs = list(running)
        out = self.runner.decode(seqs)
        self.stats["decode_steps"] += 1
        tok, lp, *records = self.runner.fetch(*self._outputs(out, ("tok", "lp", *self.records)))
        self._advance(seqs, running, tok, lp, *records)

    def _draw(self, seqs: list[Sequence], logits):
        return sample(logits, [s.params for s in seqs], [s.seed for s in seqs], [len(s.tokens) for s in seqs])

    def _sample(self, seqs: list[Sequence], logits, running: list[Sequence]):
        tok, lp = self._draw(seqs, logits)
        self._take(seqs, tok.tolist(), lp.tolist(), running)

    def _take(self, seqs: list[Sequence], toks: list[int], lps: list[float], running: list[Sequence],
              decoding: bool = False):
        """Append the sampled tokens; finished sequences leave `running` and free their cache, new ones join
        (decoding: every sequence is already running)."""
        for s, t, l in zip(seqs, toks, lps):
            s.tokens.append(t)
            s.logprobs.append(l)
            s.finish = stop_reason(t, len(s.tokens), s.params, self.cfg.eos_ids)
            if s.finish is not None:
                if s in running:
                    running.remove(s)
                self.cache.release(s)
                if self.progress is not None:
                    self.progress(1)
            elif not decoding and s not in running:
                running.append(s)


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in message")
    return dt


# ---------------------------------------------------------------------------------------------------------
# failure handling: every blocking wait of the trainer and the rollout ranks runs inside a named phase; the
# watchdog ends a rank that makes no progress in one phase for deploy.timeout_s, naming the rank, the phase and
# the peers it waits on, instead of hanging until a backend timeout (or forever). Fault injection (GRPO_FAULT)
# lets the recovery tests kill or freeze a rank at a chosen point.


class Watchdog:
    def __init__(self):
        self.rank, self.timeout = None, None
        self.name, self.peer, self.since, self.patience = "start-up", "", time.monotonic(), 1.0
        self.trace = os.environ.get("GRPO_PHASE_DIR")  # the recovery harness reads where a rank was when killed
        self.raised_in = None  # where() of the innermost phase an exception left (the phases unwind before a report)
        self.progress = 0      # phases entered and left on this rank
        self.beat = None       # (store, key, is the driver): the driver's progress, shared (share())
        self.beat_seen = None  # the driver's progress as this rank last read it (the driver: as it last added it)
        self.beat_lock = threading.Lock()  # held by a tick's store call; unshare() waits for it

    def start(self, rank: int, timeout_s: float):
        self.rank, self.timeout, self.since = rank, timeout_s, time.monotonic()
        threading.Thread(target=self._run, daemon=True, name="watchdog").start()

    def share(self, driver: bool, key: str = "grpo-watchdog/driver-progress"):
        """After the rendezvous (torchrun's MASTER_ADDR / MASTER_PORT store): the driver's watchdog adds its
        progress to a store counter every tick; on the other ranks an idle phase (work that waits on the driver)
        counts a change of that counter as progress of its own. A long run of healthy driver phases (many
        rollout rounds, an evaluation) then never reads as a stuck driver; a driver that stops (frozen, or stuck
        in one phase, which it reports itself first) still does. A store connection of its own, with a short
        timeout: a frozen store host blocks no tick for long. Without a store nothing is shared."""
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            return
        try:
            import torch.distributed as dist
            store = dist.TCPStore(addr, int(port), is_master=False,
                                  timeout=timedelta(seconds=max(1.0, min(10.0, self.timeout / 4))))
            key = f"{key}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            self.beat_seen = store.add(key, 0) if not driver else 0
            self.beat = (store, key, driver)
        except Exception:  # (a launcher without a reachable store: idle phases keep their own clocks)
            self.beat = None

    def unshare(self):
        """Stop sharing and close the store connection (its last reference dropped here, before the process ends:
        a connection torn down by the interpreter's exit while the watchdog thread used it aborted the process)."""
        with self.beat_lock:
            self.beat = None

    def _share_beat(self):
        with self.beat_lock:
            if self.beat is not None:
                self._beat_tick(*self.beat)

    def _beat_tick(self, store, key, driver):
        try:
            if driver:
                if self.progress != self.beat_seen:
                    n = self.progress
                    store.add(key, n - self.beat_seen)
                    self.beat_seen = n
            elif self.patience > 1.0:  # an idle phase: the driver's progress is ours
                v = store.add(key, 0)
                if v != self.beat_seen:
                    self.beat_seen, self.since = v, time.monotonic()
        except Exception:  # the store unreachable (the run ending, its host frozen): no progress
            pass

    @contextmanager
    def phase(self, name: str, peer: str = "", idle: bool = False):
        """idle: waiting for work from a peer that may itself be waiting (a follower for the driver, a rollout
        rank for a request), or on a driver that waits on a third rank (a follower in the weight sync): twice the
        patience, so the rank whose peer is actually stuck speaks first; progress of the driver counts (share)."""
        prev = self.name, self.peer, self.patience
        self.name, self.peer, self.since, self.patience = name, peer, time.monotonic(), 2.0 if idle else 1.0
        self.raised_in = None  # (an exception an earlier phase left was handled: work goes on)
        self.progress += 1
        self._trace()
        try:
            yield
        except BaseException:
            self.raised_in = self.raised_in or self.where()
            raise
        finally:  # back in the enclosing phase, which has just made progress
            (self.name, self.peer, self.patience), self.since = prev, time.monotonic()
            self.progress += 1
            self._trace()

    def _trace(self):
        if self.trace:
            name = f"rank{os.environ.get('RANK', '0')}.phase"
            with open(os.path.join(self.trace, "." + name), "w") as f:
                f.write(self.name)
            os.replace(os.path.join(self.trace, "." + name), os.path.join(self.trace, name))

    def where(self) -> str:
        return f"rank {self.rank}: during {self.name}" + (f" (waiting on {self.peer})" if self.peer else "")

    def _run(self):
        while True:
            time.sleep(min(1.0, self.timeout / 10))
            self._share_beat()
            idle = time.monotonic() - self.since
            if idle > self.timeout * self.patience:
                sys.stdout.flush()
                sys.stderr.write(f"{self.where()}: no progress for {idle:.0f} s (deploy.timeout_s={self.timeout:g}): "
                                 f"a peer died or stopped answering; exiting\n")
                sys.stderr.flush()
                os._exit(124)


WATCHDOG = Watchdog()
phase = WATCHDOG.phase
_fault_hits: dict[str, int] = {}


def fault_point(name: str) -> bool:
    """Fault injection for the recovery tests. GRPO_FAULT="RANK:POINT:N[:ACTION][,...]": the N-th time rank RANK
    passes fault point POINT it kills itself (ACTION kill, the default: SIGKILL), freezes (hang: SIGSTOP), or
    gets True back (nan: the caller poisons its loss, at update a weight, at sync a rollout rank's received
    weights). Only on a run's first attempt, so a torchrun restart resumes cleanly. Points: generate, sync (rollout
    and driver, mid weight sync), train (mid step), ckpt (shard written, checkpoint not yet complete), loss, update
    (after an optimizer step)."""
    spec = os.environ.get("GRPO_FAULT", "")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    rank = int(os.environ.get("RANK", "-1"))
    _fault_hits[name] = hits = _fault_hits.get(name, 0) + 1
    for one in spec.split(","):
        parts = one.split(":")
        if len(parts) not in (3, 4) or not parts[0].isdigit() or not parts[2].isdigit() or \
                (len(parts) == 4 and parts[3] not in ("kill", "hang", "nan")):
            raise ValueError(f"GRPO_FAULT: {one!r} is not RANK:POINT:N[:kill|hang|nan]")
        if int(parts[0]) != rank or parts[1] != name or int(parts[2]) != hits:
            continue
        action = parts[3] if len(parts) == 4 else "kill"
        if action == "nan":
            return True
        print(f"GRPO_FAULT: rank {rank} {action} at {name} #{hits}", flush=True)
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGSTOP)
    return False


# ---------------------------------------------------------------------------------------------------------
# messages between the driver and the rollout ranks


def _bytes(t: torch.Tensor, device) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).to(device)


_in_flight: list = []  # (work, buffers) of messages not yet received on the other side


def send_msg(meta: dict, tensors: dict[str, torch.Tensor], dst: int, device, group=None):
    """Non-blocking: both sides may be sending to each other (a rollout returning results while the driver
    announces a weight sync), so sends are posted and their buffers kept until they complete."""
    global _in_flight
    _in_flight = [(w, b) for w, b in _in_flight if not w.is_completed()]
    spec = [[k, str(t.dtype), list(t.shape)] for k, t in tensors.items()]
    header = json.dumps({"meta": meta, "tensors": spec}).encode()
    bufs = [torch.tensor([len(header)], dtype=torch.int64, device=device),
            torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)]
    bufs += [_bytes(t, device) for t in tensors.values() if t.numel()]
    for b in bufs:
        _in_flight.append((dist.isend(b, dst, group=group), b))


def flush_sends():
    """Wait until every message this rank posted has been received."""
    global _in_flight
    for w, _ in _in_flight:
        w.wait()
    _in_flight = []


def recv_msg(src: int, device, group=None) -> tuple[dict, dict[str, torch.Tensor]]:
    n = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(n, src, group=group)
    buf = torch.zeros(int(n), dtype=torch.uint8, device=device)
    dist.recv(buf, src, group=group)
    header = json.loads(buf.cpu().numpy().tobytes().decode())
    out = {}
    for name, dt, shape in header["tensors"]:
        dt = _dtype(dt)
        numel = math.prod(shape)
        b = torch.zeros(numel * torch.empty(0, dtype=dt).element_size(), dtype=torch.uint8, device=device)
        if numel:
            dist.recv(b, src, group=group)
        out[name] = b.view(dt).reshape(shape)
    return header["meta"], out


def _itemsize(dtype_name: str) -> int:
    return torch.empty(0, dtype=_dtype(dtype_name)).element_size()


ALIGN = 16  # bytes: every tensor in a sync bucket starts on such a boundary


def bucket_plan(spec: list, bucket_bytes: int) -> list[list[int]]:
    """Indices of `spec` ([name, dtype, shape] entries) grouped into buckets of at most bucket_bytes (a tensor
    larger than a bucket travels alone). Sender and receivers derive the same plan."""
    plans, cur, size = [], [], 0
    for i, (_, dt, shape) in enumerate(spec):
        nb = -(-math.prod(shape) * _itemsize(dt) // ALIGN) * ALIGN  # as laid out by bucket_layout
        if cur and size + nb > bucket_bytes:
            plans.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nb
    if cur:
        plans.append(cur)
    return plans


def bucket_layout(spec: list, idx: list[int]) -> tuple[list[int], list[int], int]:
    """Byte offsets and sizes of the tensors spec[idx] in one bucket, each starting on a 16-byte boundary (so the
    receiver views them in place), and the bucket's size."""
    offs, sizes, o = [], [], 0
    for i in idx:
        nb = math.prod(spec[i][2]) * _itemsize(spec[i][1])
        offs.append(o)
        sizes.append(nb)
        o += -(-nb // ALIGN) * ALIGN
    return offs, sizes, o


# ---------------------------------------------------------------------------------------------------------
# the rollout ranks' serve loop and the trainer's client


def _pack_outputs(outs: list[Output]) -> tuple[dict, dict]:
    meta = {"finish": [o.finish_reason for o in outs], "lengths": [len(o.token_ids) for o in outs],
            "routing_lengths": [o.routed_experts.shape[0] for o in outs]}
    tensors = {"tokens": torch.tensor([t for o in outs for t in o.token_ids], dtype=torch.int64),
               "logprobs": torch.tensor([x for o in outs for x in o.logprobs], dtype=torch.float32),
               "routing": torch.cat([o.routed_experts for o in outs])}
    return meta, tensors


CACHE_COUNTS = ("preemptions", "cache_waits")  # what a cache too small for the requests costs (Engine.stats)


def cache_counts(engine) -> dict:
    """The engine's CACHE_COUNTS so far (the simple engine has no cache to run short of: zeros)."""
    stats = getattr(engine, "stats", {})
    return {k: stats.get(k, 0) for k in CACHE_COUNTS}


def serve(engine, driver: int, sync_group, device, reply: bool = True):
    """Answer the driver (actor rank 0) until it says stop: generate, or receive new weights. reply=False on the
    non-leading ranks of a rollout expert-parallel group: they run the same steps and stay silent."""
    while True:
        with phase("waiting for a request", f"rank {driver}, the driver", idle=True):
            meta, t = recv_msg(driver, device)
        cmd = meta["cmd"]
        if cmd == "stop":
            with phase("stopping", f"rank {driver}, the driver"):
                flush_sends()
            return
        if cmd == "generate":
            flat, lengths = t["tokens"].cpu().tolist(), meta["prompt_lengths"]
            prompts, o = [], 0
            for n in lengths:
                prompts.append(flat[o:o + n])
                o += n
            params = [SamplingParams(**p) for p in meta["params"]]
            fault_point("generate")
            with phase(f"generation ({len(prompts)} prompts)"):
                t0 = time.perf_counter()
                before = cache_counts(engine)
                # sequence i of the whole request samples with (seed, i) whichever group generates it
                outs = engine.generate(prompts, params, first_index=meta.get("first_index", 0))
                gen_s = time.perf_counter() - t0
            if reply:
                m, ts = _pack_outputs(outs)
                m["gen_s"] = gen_s
                m.update({k: n - before[k] for k, n in cache_counts(engine).items()})
                send_msg(m, ts, driver, device)
        elif cmd == "sync":
            with phase("weight sync", f"rank {driver}, the driver"):
                _receive_weights(engine, meta, driver, sync_group, device)
        else:
            raise ValueError(f"rollout: unknown command {cmd!r}")


def _receive_weights(engine, meta: dict, driver: int, sync_group, device):
    """One weight sync on a rollout rank: the buckets the driver broadcasts, copied into the engine's weights
    through the `WeightApplier` planned for this layout (kept for the next sync)."""
    spec, bucket_bytes = meta["spec"], meta["bucket_bytes"]
    ap = getattr(engine, "_sync_applier", None)
    if ap is None or not ap.matches(spec, bucket_bytes):
        engine._sync_applier = None  # the old plan's buffers go before the new ones are allocated
        ap = engine._sync_applier = WeightApplier(engine.model, spec, bucket_bytes, device)
    # double-buffered: bucket k + 1 is arriving while bucket k is copied into the weights (the broadcast into a
    # buffer is ordered after the copies out of it that were queued before it)
    pending, corrupt = None, False
    for k in range(len(ap.plans) + 1):
        nxt = None
        if k < len(ap.plans):
            nxt = dist.broadcast(ap.bucket(k), driver, group=sync_group, async_op=True)
        if pending is not None:
            pending.wait()
            ap.apply(k - 1)
            if k == 1:
                corrupt = fault_point("sync")
        pending = nxt
    if corrupt:  # the recovery tests' damaged sync: one byte of the first tensor and of the first FP8-held one
        fp8 = next((n for n, _, _ in spec if not n.endswith(FP8_SCALE) and held_tensors(engine.model, n)[2]), None)
        for name in dict.fromkeys(n for n in (spec[0][0], fp8) if n is not None):
            with torch.no_grad():
                held_tensors(engine.model, name)[1][0].view(-1).view(torch.uint8)[:1].bitwise_xor_(1)
    if meta.get("verify"):
        send_msg({"checksums": held_checksums(engine.model, spec)}, {}, driver, device)


def bucket_slots(spec: list, idx: list[int], buf: torch.Tensor) -> dict[int, torch.Tensor]:
    """spec index -> its tensor's place in the bucket `buf` (laid out by bucket_layout)."""
    offs, sizes, _ = bucket_layout(spec, idx)
    return {i: buf[o:o + nb].view(_dtype(spec[i][1])).view(spec[i][2]) for i, o, nb in zip(idx, offs, sizes)}


class BucketBuffers:
    """One weight-sync layout (spec, bucket size) and two persistent bucket buffers: bucket k lives in
    bufs[k % 2]. The sender's GraphPacker and the receiver's WeightApplier each keep one per layout."""

    def __init__(self, spec: list, bucket_bytes: int, device):
        self.spec, self.bucket_bytes = spec, bucket_bytes
        self.plans = bucket_plan(spec, bucket_bytes)
        layouts = [bucket_layout(spec, idx) for idx in self.plans]
        self.sizes = [lay[2] for lay in layouts]
        self.payload = sum(sum(lay[1]) for lay in layouts)  # without the alignment padding
        self.bufs = [torch.empty(max(self.sizes), dtype=torch.uint8, device=device)
                     for _ in range(min(2, len(self.plans)))]

    def matches(self, spec: list, bucket_bytes: int) -> bool:
        return bucket_bytes == self.bucket_bytes and spec == self.spec

    def bucket(self, k: int) -> torch.Tensor:
        return self.bufs[k % 2][:self.sizes[k]]

    def slots(self, k: int) -> dict[int, torch.Tensor]:
        return bucket_slots(self.spec, self.plans[k], self.bucket(k))


def pack_bucket(spec: list, idx: list[int], buf: torch.Tensor, it, views: dict):
    """Fill one sync bucket from the producer iterator `it`: views (the dst of the producer) is set to the bucket's
    slots first, so a producer that writes in place costs no copy here."""
    views.clear()
    views.update(bucket_slots(spec, idx, buf))
    for i in idx:
        t = next(it)
        if list(t.shape) != spec[i][2] or str(t.dtype) != spec[i][1]:
            raise ValueError(f"sync_weights: {spec[i][0]} is {t.dtype} {list(t.shape)}, spec says "
                             f"{spec[i][1]} {spec[i][2]}")
        if t.data_ptr() != views[i].data_ptr():  # not written in place by the producer
            views[i].copy_(t)


_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _word_views(dst: torch.Tensor, src: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Two contiguous tensors of equal size as the widest integer words their size and both addresses allow
    (the copy kernels then move 8 bytes per element rather than 1)."""
    nb = dst.numel() * dst.element_size()
    w = next(w for w in (8, 4, 2, 1) if nb % w == 0 and dst.data_ptr() % w == 0 and src.data_ptr() % w == 0)
    return w, dst.reshape(-1).view(torch.uint8).view(_INT[w]), src.reshape(-1).view(torch.uint8).view(_INT[w])


class WeightApplier(BucketBuffers):
    """The receiver's side of one weight-sync layout (spec, bucket size), planned once per engine: two persistent
    bucket buffers (bucket k arrives in buffer k % 2) and, per bucket, the byte copies from the buffer into the
    engine's tensors grouped into one `torch._foreach_copy_` per element width. Tensors that must be converted on
    arrival (BF16 sent into FP8 holders) go through `weight_target`'s load, as `update_weights` does.

    Same result as `update_weights` on the bucket's views (tests/test_paged_engine.py compares them)."""

    def __init__(self, model: Transformer, spec: list, bucket_bytes: int, device):
        super().__init__(spec, bucket_bytes, device)
        self.steps = []
        for k in range(len(self.plans)):
            copies, convert = {}, []
            for i, view in self.slots(k).items():
                dst, src = weight_target(model, spec[i][0], view)
                if dst is None:
                    convert.append(src)
                elif dst.dtype == src.dtype and dst.shape == src.shape and dst.is_contiguous() \
                        and src.is_contiguous() and dst.device == src.device:
                    w, d, s = _word_views(dst, src)
                    pair = copies.setdefault(w, ([], []))
                    pair[0].append(d)
                    pair[1].append(s)
                else:
                    convert.append(lambda dst=dst, src=src: dst.copy_(src.to(dst.device)))
            self.steps.append((list(copies.values()), convert))

    @torch.no_grad()
    def apply(self, k: int):
        """Bucket k has arrived in bufs[k % 2]: copy it into the engine's tensors."""
        copies, convert = self.steps[k]
        for dsts, srcs in copies:
            torch._foreach_copy_(dsts, srcs)
        for f in convert:
            f()


class GraphPacker(BucketBuffers):
    """The sender's side of one weight-sync layout as CUDA graphs: two persistent bucket buffers and, per bucket,
    a graph of the producer's kernels (cast, quantize, copy) writing into buffer k % 2. Captured from one pass of
    the producer (tensors(dst, None)), which must run no collectives and read the same storage on every replay
    (the actor's parameters, updated in place). The eager path of `RolloutClient.sync_weights` is its slow twin
    (tests/test_gpu.py compares their bytes)."""

    def __init__(self, spec: list, bucket_bytes: int, tensors, device):
        super().__init__(spec, bucket_bytes, device)
        self.graphs, views = [], {}
        pool = torch.cuda.graph_pool_handle()  # shared: a tensor split across two buckets is made in one graph
        it = iter(tensors(views.get, None))   # and read by the next, which replays right after it
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for k, idx in enumerate(self.plans):
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")  # NCCL's watchdog polls
                try:
                    pack_bucket(spec, idx, self.bucket(k), it, views)
                finally:
                    graph.capture_end()
                self.graphs.append(graph)
        torch.cuda.current_stream(device).wait_stream(stream)
        if next(it, None) is not None:
            raise ValueError("sync_weights: the producer yields more tensors than the spec names")

    def pack(self, k: int) -> torch.Tensor:
        """Replay bucket k's graph; its bytes (for tests)."""
        self.graphs[k].replay()
        return self.bucket(k)


class RolloutClient:
    """The driver's handle on the rollout ranks: requests travel point to point, weights by broadcast.

    A rollout rank answers in the order it was asked, so every request that expects a reply takes a ticket in
    that rank's queue, and collecting a reply first drains (and keeps) the replies queued before it: a
    generation can stay outstanding while the driver trains, syncs weights or evaluates."""

    def __init__(self, rollout_ranks: list[int], sync_group, device, ep: int = 1):
        """ep > 1: consecutive groups of ep rollout ranks serve together (expert parallel); requests go to every
        rank of a group and the first one answers."""
        self.ranks, self.sync_group, self.device = rollout_ranks, sync_group, device
        self.groups = [rollout_ranks[i:i + ep] for i in range(0, len(rollout_ranks), ep)]
        self.queue = {r: [] for r in rollout_ranks}   # tickets in reply order
        self.replies: dict[int, tuple] = {}
        self.next_ticket = 0
        self.packers: dict = {}  # graphs key -> GraphPacker
        self.last_gen_s = 0.0
        self.last_cache = dict.fromkeys(CACHE_COUNTS, 0)

    def _expect(self, rank: int) -> int:
        self.next_ticket += 1
        self.queue[rank].append(self.next_ticket)
        return self.next_ticket

    def _reply(self, rank: int, ticket: int):
        while ticket not in self.replies:
            with phase("a rollout request", f"rollout rank {rank}"):
                self.replies[self.queue[rank].pop(0)] = recv_msg(rank, self.device)
        return self.replies.pop(ticket)

    def submit(self, prompts: list[list[int]], params: list[SamplingParams], group_size: int = 1):
        """Send prompts (whole groups of `group_size` kept together) to the rollout groups, each its share with
        that share's index in the request (first_index), so the completions do not depend on how many rollout
        groups there are; returns a handle."""
        n_groups = len(prompts) // group_size
        per = -(-n_groups // len(self.groups))
        handle = []
        for j, ranks in enumerate(self.groups):
            a, b = j * per * group_size, min(len(prompts), (j + 1) * per * group_size)
            if a >= b:
                continue
            meta = {"cmd": "generate", "prompt_lengths": [len(p) for p in prompts[a:b]],
                    "params": [asdict(p) for p in params[a:b]], "first_index": a}
            tokens = torch.tensor([t for p in prompts[a:b] for t in p], dtype=torch.int64)
            for r in ranks:
                send_msg(meta, {"tokens": tokens}, r, self.device)
            handle.append((ranks[0], self._expect(ranks[0]), prompts[a:b]))
        return handle

    def collect(self, handle) -> list[Output]:
        """The outputs of a submitted request, in prompt order. self.last_gen_s: the longest time one rollout
        group spent generating its share (the groups generate at the same time); self.last_cache: the groups'
        engines' cache_counts over the request, summed (sequences preempted and recomputed, and sequences that
        waited for cache blocks: their cache pools full)."""
        outs, self.last_gen_s, self.last_cache = [], 0.0, dict.fromkeys(CACHE_COUNTS, 0)
        for r, ticket, prompts in handle:
            meta, t = self._reply(r, ticket)
            self.last_gen_s = max(self.last_gen_s, meta.get("gen_s", 0.0))
            for k in CACHE_COUNTS:
                self.last_cache[k] += meta.get(k, 0)
            tok, lp, rt = t["tokens"].cpu().tolist(), t["logprobs"].cpu().tolist(), t["routing"].cpu()
            o = ro = 0
            for p, n, nr, fin in zip(prompts, meta["lengths"], meta["routing_lengths"], meta["finish"]):
                outs.append(Output(p, tok[o:o + n], lp[o:o + n], rt[ro:ro + nr], fin))
                o, ro = o + n, ro + nr
        return outs

    def generate(self, prompts, params, group_size: int = 1) -> list[Output]:
        return self.collect(self.submit(prompts, params, group_size))

    def sync_weights(self, spec: list, tensors, bucket_bytes: int, verify: bool = False, graphs=None) -> int:
        """Broadcast the weights to every rollout rank in buckets of at most bucket_bytes; returns the bytes each
        receiver got. tensors(dst, checksums) yields them in `spec` order ([name, dtype, shape] entries); its
        producer writes tensor j straight into dst(j) when dst is given and dst(j) is not None (a view into the
        bucket being filled), and, when checksums is a dict, fills it with {key: checksum} of every weight the
        rollout should hold afterwards (keys and sums as `held_checksums` gives them). Double-buffered: the next
        bucket is packed while the previous one is on the wire. verify: compare those checksums with the rollout
        ranks'; a mismatch, or a key no rank reports, raises.

        graphs: a key naming a producer that runs no collectives and reads the same storage on every call (an
        actor on one rank). On CUDA, the first sync under that key runs eagerly and then captures each bucket's
        packing as a CUDA graph; later syncs replay them (a few microseconds of CPU per bucket instead of a
        Python step and a kernel launch or two per tensor). With verify, the checksums then come from a separate
        pass of the producer after the replayed sync, so they check the graphs' bytes."""
        tickets = {}
        for r in self.ranks:
            send_msg({"cmd": "sync", "spec": spec, "bucket_bytes": bucket_bytes, "verify": verify}, {},
                     r, self.device)
            if verify:
                tickets[r] = self._expect(r)
        sums = {} if verify else None
        packer = self.packers.get(graphs) if graphs is not None else None
        if packer is not None and not packer.matches(spec, bucket_bytes):
            del self.packers[graphs]  # its buffers go before new ones are allocated
            packer = None
        if packer is not None:
            total = self._send_graphs(packer)
            if verify:
                for _ in tensors(None, sums):
                    pass
        else:
            total = self._send_eager(spec, tensors, sums, bucket_bytes)
        if graphs is not None and packer is None and self.device.type == "cuda":
            self.packers[graphs] = GraphPacker(spec, bucket_bytes, tensors, self.device)
        if verify:
            seen = set()
            for r in self.ranks:
                got = self._reply(r, tickets[r])[0]["checksums"]
                bad = [n for n, c in got.items() if sums.get(n) != c]
                if bad:
                    raise RuntimeError(f"weight sync verification: rollout rank {r} holds different weights for "
                                       f"{len(bad)} of {len(got)} tensors, first {bad[:3]}")
                seen.update(got)
            unchecked = [n for n in sums if n not in seen]  # (under rollout EP each rank holds a slice of them)
            if unchecked:
                raise RuntimeError(f"weight sync verification: no rollout rank holds {len(unchecked)} of the "
                                   f"{len(sums)} tensors sent, first {unchecked[:3]}")
        return total

    def _send_eager(self, spec: list, tensors, sums, bucket_bytes: int) -> int:
        views: dict[int, torch.Tensor] = {}  # spec index -> its place in the bucket being filled
        total, inflight = 0, []
        it = iter(tensors(views.get, sums))
        for idx in bucket_plan(spec, bucket_bytes):
            offs, sizes, size = bucket_layout(spec, idx)
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)  # padding bytes travel unread
            pack_bucket(spec, idx, buf, it, views)
            inflight.append(dist.broadcast(buf, dist.get_rank(), group=self.sync_group, async_op=True))
            total += sum(sizes)  # payload, without the alignment padding
            if len(inflight) == 2:  # two buffers: wait for the older before packing a third
                with phase("weight sync", f"rollout ranks {self.ranks}"):
                    inflight.pop(0).wait()
                fault_point("sync")
        with phase("weight sync", f"rollout ranks {self.ranks}"):
            for work in inflight:
                work.wait()
        return total

    def _send_graphs(self, packer: "GraphPacker") -> int:
        inflight = []
        for k, graph in enumerate(packer.graphs):
            if len(inflight) == 2:  # bucket k - 2 has left buffer k % 2 (a wait on the stream, not the host)
                with phase("weight sync", f"rollout ranks {self.ranks}"):
                    inflight.pop(0).wait()
                fault_point("sync")
            graph.replay()
            inflight.append(dist.broadcast(packer.bucket(k), dist.get_rank(), group=self.sync_group, async_op=True))
        with phase("weight sync", f"rollout ranks {self.ranks}"):
            for work in inflight:
                work.wait()
        return packer.payload

    def stop(self):
        for r in self.ranks:
            send_msg({"cmd": "stop"}, {}, r, self.device)
        with phase("stopping the rollout ranks", f"rollout ranks {self.ranks}"):
            flush_sends()


# ---------------------------------------------------------------------------------------------------------
# command line


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# a prompt line's sampling fields: (the JSON they take, its check)
_LINE_FIELDS = {
    "max_tokens": ("an integer", _is_int),
    "top_k": ("an integer", _is_int),
    "seed": ("an integer or null", lambda v: v is None or _is_int(v)),
    "temperature": ("a number", lambda v: _is_int(v) or isinstance(v, float)),
    "top_p": ("a number", lambda v: _is_int(v) or isinstance(v, float)),
    "ignore_eos": ("true or false", lambda v: isinstance(v, bool)),
    "stop_token_ids": ("a list of token ids", lambda v: isinstance(v, list) and all(map(_is_int, v))),
}


MAX_MODEL_LEN = 8192  # the CLI's largest default --max-model-len


def read_prompts(path: Path, tokenizer, vocab: int, base: SamplingParams, data: bytes | None = None,
                 keys: tuple[str, str] = ("prompt", "answer")
                 ) -> list[tuple[list[int], SamplingParams, int, str | None]]:
    """JSONL, a line a prompt: a list of token ids, or {"prompt_token_ids": [...]} or {"prompt": "text"} (needs
    --tokenizer), the object optionally with SamplingParams fields for that prompt (_LINE_FIELDS) over base's, and
    an "answer" (a training JSONL's: its final answer, as math_reward compares it). data: the file's bytes, if
    already read. keys: the text prompt's and the answer's keys (a dataset's own, GSM8K's question, say).
    -> (token ids, sampling parameters, line number, final answer or None) a prompt."""
    pk, ak = keys
    out = []
    from model.tasks import gold_answer, json_line, jsonl_lines
    try:
        lines = jsonl_lines(path, data)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json_line(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}:{n}: not JSON ({e})")
        except ValueError as e:
            raise SystemExit(f"{path}:{n}: {e}")
        sp, gold = base, None
        if isinstance(d, dict):
            over = {k: v for k, v in d.items() if k not in ("prompt_token_ids", pk, ak)}
            bad = sorted(over.keys() - _LINE_FIELDS.keys())
            if bad:
                raise SystemExit(f"{path}:{n}: unknown key {bad[0]!r} (a prompt line takes prompt_token_ids or "
                                 f"{pk}, {ak}, and {', '.join(sorted(_LINE_FIELDS))}"
                                 + ("; --prompt-key and --answer-key name a dataset's own)" if keys == (
                                     "prompt", "answer") else ")"))
            if ak in d:
                try:
                    gold = gold_answer(d[ak])
                except ValueError as e:
                    raise SystemExit(f"{path}:{n}: {e}") from None
            for k, v in over.items():
                if not _LINE_FIELDS[k][1](v):
                    raise SystemExit(f"{path}:{n}: {k} = {json.dumps(v)} is not {_LINE_FIELDS[k][0]}")
            try:
                sp = replace(base, **over) if over else base
            except ValueError as e:
                raise SystemExit(f"{path}:{n}: bad sampling parameters ({e})")
            if "prompt_token_ids" in d and pk in d:
                raise SystemExit(f"{path}:{n}: prompt_token_ids or {pk}, not both")
            if "prompt_token_ids" in d:
                d = d["prompt_token_ids"]
            elif pk in d:
                if not isinstance(d[pk], str) or not d[pk]:
                    raise SystemExit(f"{path}:{n}: {pk} = {json.dumps(d[pk])} is not a non-empty string")
                if tokenizer is None:
                    raise SystemExit(f"{path}:{n}: a text prompt needs --tokenizer")
                try:
                    text, d = d[pk], tokenizer.apply_chat(d[pk])
                except ValueError as e:
                    raise SystemExit(f"{path}:{n}: {pk}: {e}") from None
                if not d:
                    raise SystemExit(f"{path}:{n}: {pk} = {json.dumps(text)} encodes to no tokens (through the chat "
                                     f"template, with no --bos-token)")
        if not isinstance(d, list) or not d or not all(map(_is_int, d)):
            raise SystemExit(f"{path}:{n}: expected a non-empty list of token ids, prompt_token_ids or {pk}")
        for what, ids in (("token id", d), ("stop token id", sp.stop_token_ids)):
            bad = outside(ids, vocab)
            if bad is not None:
                raise SystemExit(f"{path}:{n}: {what} {bad} outside the model's vocabulary [0, {vocab})")
        out.append((d, sp, n, gold))
    if not out:
        raise SystemExit(f"{path}: no prompts")
    return out


# the arguments that decide what a --prompts/--out run writes: a resumed run must be given the same ones
_RUN_ARGS = ("model", "tokenizer", "chat_template", "bos_token", "eos_token", "bf16", "fp8_scale_fmt", "engine",
             "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "n", "chunk", "index_entries",
             "no_routed_experts", "prompt_key", "answer_key")


def run_settings(args, prompts: bytes) -> dict:
    """What a run's output depends on (and --resume checks): those arguments, and the prompts file's bytes (the
    ones read_prompts parsed: read once)."""
    import hashlib
    s = {k: getattr(args, k) for k in _RUN_ARGS}
    s["model"] = str(Path(args.model).resolve())
    s["prompts_sha256"] = hashlib.sha256(prompts).hexdigest()
    return s


def resume_point(partial: Path, meta: Path, settings: dict, requests: list[tuple[int, int, list[int]]],
                 chunk: int) -> tuple[int, list]:
    """How many of the requests (index, sample, prompt token ids) an interrupted run's <out>.partial holds whole:
    its complete records up to the last whole chunk (the file cut there), and those records' rewards (None where
    a record has none). Another run's file, or one written with other arguments or prompts (meta: that run's
    run_settings), is an error that says which."""
    if not meta.is_file():
        raise SystemExit(f"--resume: {meta} is missing, so {partial} cannot be checked against this request: "
                         f"remove {partial}, or run without --resume")
    try:
        old = json.loads(meta.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--resume: {meta}: unreadable ({e})") from None
    if not isinstance(old, dict):
        raise SystemExit(f"--resume: {meta}: not a run's settings")
    for k in settings:
        if old.get(k) != settings[k]:
            what = ("the prompts file has changed since" if k == "prompts_sha256" else
                    f"--{k.replace('_', '-')} was {old.get(k)!r}, now {settings[k]!r}")
            raise SystemExit(f"--resume: {partial} was written by another request ({what}): give the same arguments "
                             f"and prompts, or run without --resume")
    data = partial.read_bytes()
    whole, end, ends, rewards = 0, 0, [0], []
    for n, raw in enumerate(data.split(b"\n")[:-1], 1):  # (the piece after the last newline is torn)
        end += len(raw) + 1
        try:
            rec = json.loads(raw)
            key = (rec["index"], rec["sample"], rec["prompt_token_ids"])
            rewards.append(rec.get("reward"))
        except (ValueError, KeyError, TypeError):
            break  # a record cut short by the interruption: the run's chunk from here on is done again
        if whole >= len(requests) or key != requests[whole]:
            raise SystemExit(f"--resume: {partial}:{n} is not the completion of request {whole} of this run "
                             f"(prompts line order or --n differ)")
        whole += 1
        ends.append(end)
    keep = whole if whole == len(requests) else whole // chunk * chunk
    with open(partial, "r+b") as f:
        f.truncate(ends[keep])
    return keep, rewards[:keep]


@dataclass
class CliRanks:
    """Where the CLI runs: one process, or torchrun's ranks in groups of ep_size consecutive ranks. A group is one
    engine whose ranks share out each layer's routed experts (expert parallelism: a node's GPUs serving a model
    none of them holds alone, DeepSeek-V4-Flash's ~284 GB of FP8 weights over 8) and run the same requests; the
    groups take turns at the chunks (data parallelism). Rank 0 prints and writes, the groups' first ranks send it
    their chunks' records."""
    device: torch.device
    rank: int = 0
    world: int = 1
    ep_size: int = 1
    ep: tuple | None = None  # Engine's ep: (this rank's group, ep_size, its rank in the group); None: ep_size 1
    gather: object = None  # a gloo group of every rank, through which the records reach rank 0 (more than 1 group)

    @property
    def group(self) -> int:
        return self.rank // self.ep_size

    @property
    def groups(self) -> int:
        return self.world // self.ep_size

    def __str__(self):
        return str(self.device) if self.world == 1 else (f"{self.device}, one of {self.groups} group(s) of "
                                                         f"{self.ep_size} rank(s)")


def cli_cache_counts(engine, ranks: CliRanks, since: dict | None = None) -> dict:
    """The groups' engines' cache_counts since `since`, summed on rank 0 (each group's once: its ranks run one
    schedule); zeros on the other ranks. Every rank must call it."""
    mine = {k: n - (since or {}).get(k, 0) if ranks.rank % ranks.ep_size == 0 else 0
            for k, n in cache_counts(engine).items()}
    if ranks.groups > 1:
        got = [None] * ranks.world if ranks.rank == 0 else None
        dist.gather_object(mine, got, dst=0, group=ranks.gather)
        mine = {k: sum(g[k] for g in got) for k in mine} if ranks.rank == 0 else mine
    return mine if ranks.rank == 0 else dict.fromkeys(mine, 0)


def cache_note(counts: dict, fixed: bool, names=("--num-blocks", "--mem-fraction", "--max-seqs")) -> str:
    """The CLI's last line's ending: what a cache too small for the requests cost (a silent slowdown otherwise),
    and the settings that give the pools more blocks: names, those of num_blocks (fixed: it set them), mem_fraction
    and max_seqs (the CLI's flags; a run's config keys)."""
    cost = [f"{counts['cache_waits']} sequence(s) waited for cache blocks with a slot free"] \
        if counts["cache_waits"] else []
    cost += [f"{counts['preemptions']} sequence(s) preempted and recomputed"] if counts["preemptions"] else []
    if not cost:
        return " (none waited for cache blocks or was preempted)"
    more = (f"a larger {names[0]}" if fixed else
            f"a larger {names[1]}, or a smaller {names[2]} whose slots take a share,")
    return f" ({'; '.join(cost)}: {more} gives the cache pools more blocks)"


def score_note(rewards: list, n: int) -> str:
    """The CLI's evaluation line: rewards of a run's completions in request order (a prompt's n samples follow each
    other; None for a prompt with no answer), their mean, and with n > 1 pass@k for k = 2, 4, ... below n (the
    unbiased estimate from n samples: 1 - C(n - c, k) / C(n, k) a prompt with c correct, averaged) and k = n (the
    share of prompts with a correct one)."""
    got = [(j, r) for j, r in enumerate(rewards) if r is not None]
    right = sum(r == 1.0 for _, r in got)
    line = (f"scored {len(got) // n} prompt(s) x {n} sample(s) against their answers: mean reward "
            f"{sum(r for _, r in got) / len(got):.4f} ({right} of {len(got)} completions correct)")
    if n > 1:
        correct = {}
        for j, r in got:
            correct[j // n] = correct.get(j // n, 0) + (r == 1.0)
        for k in [2 ** i for i in range(1, n.bit_length()) if 2 ** i < n]:
            est = sum(1 - math.comb(n - c, k) / math.comb(n, k) for c in correct.values()) / len(correct)
            line += f", pass@{k} {est:.4f}"
        hit = sum(c > 0 for c in correct.values())
        line += f", pass@{n} {hit / len(correct):.4f} ({hit} of {len(correct)} prompts)"
    return line


def cli_ranks(n_experts: int, ep_size: int | None, ap) -> CliRanks:
    """The CLI's ranks (WORLD_SIZE > 1: under torchrun) in groups of ep_size (None: all of them, one group)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if world == 1:
        if ep_size not in (None, 1):
            ap.error(f"--ep {ep_size} splits the experts over torchrun's ranks: run under torchrun with a multiple "
                     f"of {ep_size} ranks")
        return CliRanks(torch.device("cuda" if cuda else "cpu"))
    size = world if ep_size is None else ep_size
    if world % size:
        ap.error(f"--ep {size}: torchrun's {world} ranks do not split into groups of {size}")
    if n_experts % size:
        ap.error(f"--ep {size}: the model's {n_experts} routed experts do not split evenly over {size} ranks "
                 f"(each group of --ep ranks shares them out; --ep defaults to all of torchrun's ranks)")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    atexit.register(close_process_groups)  # (not destroy_process_group alone: its docstring says why)
    rank = dist.get_rank()
    groups = [dist.new_group(list(range(r, r + size))) for r in range(0, world, size)] if size > 1 else []
    gather = dist.new_group(backend="gloo") if world > size else None
    return CliRanks(device, rank, world, size, (groups[rank // size], size, rank % size) if size > 1 else None,
                    gather)


def token_ids_arg(s: str) -> list[int]:
    """--stop-token-ids' value: token ids (integers >= 0) separated by commas."""
    try:
        ids = [int(x) for x in s.split(",")]
    except ValueError:
        ids = None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"{s!r}: token ids (integers >= 0) separated by commas, e.g. 7,42")
    return ids


def main(argv=None):
    ap = argparse.ArgumentParser(description="Generate with the FP8 DeepSeek-V4 engine, or measure its throughput. "
                                 "Under torchrun the ranks form groups of --ep (default: all of them) that share out "
                                 "the routed experts (expert parallelism) and take turns at the chunks; every rank "
                                 "reads --model and --prompts.")
    ap.add_argument("--model", required=True, help="checkpoint directory, or a YAML config (random weights)")
    ap.add_argument("--prompts", type=Path, help="JSONL prompts")
    ap.add_argument("--out", type=Path, help="JSONL outputs")
    ap.add_argument("--tokenizer", help="tokenizer.json, or a directory holding one, such as the checkpoint's (for "
                                        "text prompts, decoded outputs, and prompt lines' answers scored)")
    ap.add_argument("--prompt-key", help="the key of a prompt line's text prompt: a dataset's own, such as GSM8K's "
                    "question (train_grpo's task.prompt_key; default: prompt)")
    ap.add_argument("--answer-key", help="the key of a prompt line's answer, which is scored (train_grpo's "
                    "task.answer_key; default: answer)")
    ap.add_argument("--chat-template", default="{prompt}",
                    help="a text prompt's format, around its one {prompt} (train_grpo's task.chat_template; "
                         "default: the prompt alone)")
    ap.add_argument("--bos-token", help="a token of --tokenizer put before each text prompt (train_grpo's "
                    "task.bos_token)")
    ap.add_argument("--eos-token", help="a token of --tokenizer that ends a completion, in place of the "
                    "checkpoint's eos_token_id unless among its ids (train_grpo's task.eos_token)")
    ap.add_argument("--bf16", action="store_true", help="keep weights in BF16 instead of FP8")
    ap.add_argument("--fp8-scale-fmt", choices=["fp32", "ue8m0"],
                    help="FP8 block scales (default: an FP8 checkpoint's own, its weights keeping their bits; "
                         "else fp32)")
    ap.add_argument("--engine", choices=["paged", "simple"], default="paged",
                    help="paged: the paged cache, continuous batching and CUDA graphs; simple: its unpaged "
                         "reference twin (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=256, help="new tokens a completion may reach (default: "
                    "%(default)s; a prompt line's max_tokens overrides it)")
    ap.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default: %(default)s)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's mass, in (0, 1] (default: "
                    "%(default)s, off)")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default: "
                    "%(default)s, off)")
    ap.add_argument("--seed", type=int, default=0, help="the sampling seed: request i draws with (seed, i), the "
                    "same tokens in any batch or chunk (default: %(default)s)")
    ap.add_argument("--stop-token-ids", type=token_ids_arg, metavar="IDS",
                    help="token ids, separated by commas, that end a completion besides the end-of-sequence "
                         "token (a prompt line's own stop_token_ids replace them)")
    ap.add_argument("--n", "--samples", type=int, default=1,
                    help="samples per prompt (under torchrun --samples: torchrun takes --n as its own --nnodes ...)")
    ap.add_argument("--max-seqs", type=int, default=256, help="sequences decoded together at most (paged "
                    "engine; default: %(default)s)")
    ap.add_argument("--max-model-len", type=int, help="positions a sequence may reach (default: what the longest "
                    "request needs, at least the model's max_position_embeddings, at most 8192)")
    ap.add_argument("--mem-fraction", type=float, default=0.85,
                    help="of the GPU memory free after the weights, for the cache pools (paged engine; default: "
                    "%(default)s)")
    ap.add_argument("--num-blocks", type=int, help="blocks of %d entries in each cache pool, instead of as many as "
                    "--mem-fraction leaves room for (paged engine)" % BLOCK_ENTRIES)
    ap.add_argument("--chunk", type=int, default=256, help="requests (prompts x --n) an engine call; a chunk's "
                    "completions are on disk before the next one starts (default: %(default)s)")
    ap.add_argument("--resume", action="store_true",
                    help="continue an interrupted run (same arguments and prompts) from <out>.partial, keeping "
                         "its whole chunks (each generated as one batch, as an uninterrupted run would)")
    ap.add_argument("--bench", action="store_true", help="random prompts: print throughput")
    ap.add_argument("--batch", type=int, default=64, help="--bench: prompts (default: %(default)s)")
    ap.add_argument("--prompt-len", type=int, default=512, help="--bench: tokens a prompt (default: %(default)s)")
    ap.add_argument("--no-graphs", action="store_true", help="decode eagerly, without CUDA graphs (paged engine)")
    ap.add_argument("--ep", type=int, help="under torchrun: ranks a group, which share out the routed experts "
                    "(default: all ranks; 1: each rank a whole model, the ranks splitting the chunks)")
    ap.add_argument("--index-entries", action="store_true",
                    help="also write each position's indexer choices per CSA layer (index_entries; large)")
    ap.add_argument("--no-routed-experts", action="store_true",
                    help="leave out each position's routed expert ids per MoE layer (routed_experts: what routing "
                         "replay needs, about 3 bytes a token a layer and expert in the JSON)")
    args = ap.parse_args(argv)
    from tqdm import tqdm
    from model import build_model
    from model.config import ConfigError, load_yaml, write_denied
    from model.tasks import completion_text, math_reward
    from model.tokenizer import tokenizer_file
    from model.weights import WeightError
    # every check that needs no weights before they load (a large checkpoint takes minutes)
    for name in ("max_tokens", "n", "max_seqs", "max_model_len", "chunk", "batch", "prompt_len", "ep", "num_blocks"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.mem_fraction <= 1:
        ap.error(f"--mem-fraction must be in (0, 1], got {args.mem_fraction}")
    if args.num_blocks is not None and args.engine != "paged":
        ap.error("--num-blocks sizes the paged engine's cache pools: not with --engine simple")
    for flag in ("bos_token", "eos_token"):
        if getattr(args, flag) is not None and not args.tokenizer:
            ap.error(f"--{flag.replace('_', '-')} names a token of the tokenizer's: give --tokenizer too")
    keys = (args.prompt_key or "prompt", args.answer_key or "answer")
    for flag, k in zip(("--prompt-key", "--answer-key"), keys):
        if not k or k == "prompt_token_ids" or k in _LINE_FIELDS:
            ap.error(f"{flag} {k!r}: a key of its own (not empty, prompt_token_ids or a sampling field: "
                     f"{', '.join(sorted(_LINE_FIELDS))})")
    if keys[0] == keys[1]:
        ap.error(f"--prompt-key and --answer-key are both {keys[0]!r}: a line's prompt and answer need keys apart")
    if args.bench and args.stop_token_ids:
        ap.error("--stop-token-ids: --bench generates --max-tokens for every prompt")
    if not args.bench:
        if args.prompts is None or args.out is None:
            ap.error("--prompts and --out are required (or --bench)")
        if not args.prompts.is_file():
            ap.error(f"--prompts {args.prompts}: " + ("a directory, not a file" if args.prompts.is_dir() else
                                                      "no such file"))
        if not args.out.resolve().parent.is_dir():
            ap.error(f"--out {args.out}: no directory {args.out.resolve().parent}")
        if args.out.is_dir():
            ap.error(f"--out {args.out}: a directory, not a file")
        if args.out.resolve() == args.prompts.resolve():
            ap.error(f"--out {args.out}: the prompts file itself")
        denied = write_denied(args.out.resolve().parent)  # before the weights load (minutes for a large checkpoint)
        if denied:
            ap.error(f"--out {args.out}: {denied}")
    elif args.resume:
        ap.error("--resume continues a --prompts/--out run, not --bench")
    elif args.engine == "paged" and args.prompt_len + args.max_tokens > (args.max_model_len or MAX_MODEL_LEN):
        ap.error(f"--prompt-len {args.prompt_len} + --max-tokens {args.max_tokens} exceed --max-model-len "
                 f"{args.max_model_len or MAX_MODEL_LEN}")
    if args.tokenizer and not tokenizer_file(args.tokenizer).is_file():
        ap.error(f"--tokenizer {args.tokenizer}: " + ("no tokenizer.json in this directory"
                                                      if Path(args.tokenizer).is_dir() else "no such file"))
    yaml_model = args.model.endswith((".yaml", ".yml"))
    if not yaml_model and not Path(args.model).is_dir():
        ap.error(f"--model {args.model}: neither a checkpoint directory nor a .yaml config")
    try:
        if yaml_model:
            d = load_yaml(args.model)
            if "model" not in d:
                raise ConfigError(f"{args.model}: no model: section")
            cfg = ModelConfig.from_dict(d["model"], f"{args.model}: model")
        else:
            cfg = load_hf_config(args.model)
    except (OSError, ConfigError, WeightError) as e:
        ap.error(f"--model: {e}")
    bad = outside(args.stop_token_ids or [], cfg.vocab_size)
    if bad is not None:
        ap.error(f"--stop-token-ids: token id {bad} outside the model's vocabulary [0, {cfg.vocab_size})")
    ranks = cli_ranks(cfg.n_routed_experts, args.ep, ap)
    device, ep, lead = ranks.device, ranks.ep, ranks.rank == 0  # (rank 0 prints and writes)
    try:
        sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.bench,
                            stop_token_ids=args.stop_token_ids or [])
    except ValueError as e:
        ap.error(str(e))
    tok = None
    if args.tokenizer:
        from model.tokenizer import HFTokenizer
        try:
            tok = HFTokenizer(args.tokenizer, args.chat_template, args.bos_token or None, args.eos_token or None)
        except (OSError, ValueError, ImportError) as e:
            ap.error(f"--tokenizer / --chat-template / --bos-token / --eos-token: {e}")
        for flag, i in (("--bos-token", tok.bos_id), ("--eos-token", tok.eos_id)):
            if i is not None and i >= cfg.vocab_size:
                ap.error(f"{flag}: token id {i} outside the model's vocabulary [0, {cfg.vocab_size})")
    start = 0
    if not args.bench:
        try:
            raw = args.prompts.read_bytes()
        except OSError as e:
            ap.error(f"--prompts {args.prompts}: {e}")
        lines = [r for r in read_prompts(args.prompts, tok, cfg.vocab_size, sp, raw, keys) for _ in range(args.n)]
        greedy = sum(q.temperature == 0 for _, q, *_ in lines[::args.n])
        if args.n > 1 and greedy and lead:  # (pass@n of alike samples is pass@1)
            print(f"note: {greedy} prompt(s) decode greedily (temperature 0), so each one's --n {args.n} samples are "
                  f"alike", file=sys.stderr)
        # a chunk's completions are on disk before the next chunk starts, under <out>.partial until the last one
        # (beside it <out>.partial.json, the run's settings): an interrupted run leaves no file that looks
        # complete, an earlier --out stays as it was, and --resume goes on from the last whole chunk
        partial = args.out.with_name(args.out.name + ".partial")
        meta = args.out.with_name(args.out.name + ".partial.json")
        settings = run_settings(args, raw)
        stop, rewards = None, []  # (rewards: the completions', in request order, None for a prompt with no answer)
        if lead:  # (rank 0 reads and cuts the partial file, and tells the other ranks where it ends)
            try:
                if args.resume and partial.exists():
                    start, rewards = resume_point(partial, meta, settings, [(i // args.n, i % args.n, p) for i, (
                        p, *_) in enumerate(lines)], args.chunk)
                    print(f"resuming: {start} of {len(lines)} completions kept from {partial}")
                elif args.resume and args.out.exists():  # most likely the finished run's: not generated again
                    raise SystemExit(f"--resume: there is no {partial} to continue, and {args.out} exists (a "
                                     f"finished run's output?): run without --resume to generate it again")
                elif args.resume:
                    print(f"--resume: no {partial}, so starting from the first prompt")
                elif partial.exists():
                    print(f"{partial} (an interrupted run) is started over: --resume would continue it",
                          file=sys.stderr)
            except SystemExit as e:
                stop = str(e)
        if ranks.world > 1:
            box = [start, stop]
            dist.broadcast_object_list(box, src=0)
            start, stop = box
        if stop is not None:
            raise SystemExit(stop if lead else 1)
    if args.max_model_len is None:  # no warning of positions past the model's context unless a request needs them
        need = args.prompt_len + args.max_tokens if args.bench else max(len(p) + q.max_tokens for p, q, *_ in lines)
        args.max_model_len = min(MAX_MODEL_LEN, max(cfg.max_position_embeddings, need))
    short = args.num_blocks and PagedCache.too_few_blocks(cfg, args.num_blocks, args.max_model_len, "--max-model-len")
    if short:
        ap.error(f"--num-blocks {args.num_blocks}: {short})")
    if not args.bench:
        for p, q, n, _ in lines:  # the engine's own check names no line
            if args.engine == "paged" and len(p) + q.max_tokens > args.max_model_len:
                raise SystemExit(f"{args.prompts}:{n}: {len(p)} prompt tokens + max_tokens {q.max_tokens} exceed "
                                 f"--max-model-len {args.max_model_len}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # random weights are drawn tensor by tensor into the engine (build_model's values for the seed, cast as
    # set_dtype casts them): no whole BF16 model on the device beside the engine's
    model = build_model(cfg, "meta", torch.float32, seed=None) if yaml_model else args.model
    kw = dict(fp8=not args.bf16, dtype=dtype, device=device, record_index=args.index_entries,
              fp8_scale_fmt=args.fp8_scale_fmt, ep=ep, cfg=None if yaml_model else cfg)
    if args.engine == "paged":
        kw.update(max_seqs=args.max_seqs, max_model_len=args.max_model_len, cuda_graphs=not args.no_graphs,
                  mem_fraction=args.mem_fraction, num_blocks=args.num_blocks)
    try:
        engine = (Engine if args.engine == "paged" else SimpleEngine)(model, progress=lead, **kw)
    except (OSError, ConfigError, WeightError) as e:  # the checkpoint's tensors (the config read fine above)
        raise SystemExit(f"error: --model {args.model}: {e}") from None
    except ValueError as e:  # what only the loaded model and the device tell: the cache does not fit
        if not str(e).startswith("invalid engine arguments"):
            raise
        raise SystemExit(f"error: {e}") from None
    if tok is not None:  # (--eos-token)
        engine.cfg.end_with(tok.eos_id)
    if ep is not None and lead:
        ex = next(m for m in engine.model.modules() if isinstance(m, EngineExperts))
        print(f"expert parallel: each of {ep[1]} ranks holds {ex.n_local} of the {ex.n_total} routed experts a layer")
    if args.engine == "paged" and lead:
        print(f"engine on {ranks}: {'rank 0 holds ' if ranks.world > 1 else ''}"
              f"{engine.footprint_note('--max-model-len', '--max-seqs')}", flush=True)
    if yaml_model:
        engine.update_weights((n, Transformer.held_as(n, t, dtype)) for n, t in model.random_state(args.seed,
                                                                                                   device=device))
    if args.bench:
        g = torch.Generator().manual_seed(args.seed)
        prompts, warm = torch.randint(0, engine.cfg.vocab_size, (2, args.batch, args.prompt_len), generator=g).tolist()
        # the same batch and lengths with other tokens first (no prefix shared with the timed prompts): the kernels
        # for these sizes compile and the batch's CUDA graph is captured before the clock starts
        engine.generate(warm, SamplingParams(max_tokens=2, ignore_eos=True))
        before = cache_counts(engine)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = engine.generate(prompts, sp)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        gen = sum(len(o.token_ids) for o in outs)
        counts = cli_cache_counts(engine, ranks, since=before)
        if lead:  # (each group ran the batch: rank 0's timed)
            print(f"{args.batch} x ({args.prompt_len} prompt + {args.max_tokens} generated) on {ranks}: {dt:.2f} s, "
                  f"{gen / dt:.0f} generated tokens/s, {(gen + args.batch * args.prompt_len) / dt:.0f} tokens/s "
                  f"overall{cache_note(counts, bool(args.num_blocks))}")
        return
    prompts, params, answers = ([x[k] for x in lines] for k in (0, 1, 3))
    if tok is None and any(a is not None for a in answers) and lead:
        print(f"note: {sum(a is not None for a in answers[::args.n])} prompt(s) have an answer, not scored: scoring "
              f"decodes the completions, which needs --tokenizer", file=sys.stderr)
    scored = tok is not None and any(a is not None for a in answers)

    def records(first: int, outs: list[Output]) -> tuple[str, list]:
        """A chunk's output lines (with --n a prompt's lines follow each other), and their rewards (None for a
        prompt with no answer): math_reward of the completion's text against the line's answer."""
        text, scores = [], []
        for i, o in enumerate(outs, first):
            # strict JSON: a NaN / Inf log-prob (json.dumps would write NaN, which JSON parsers refuse) is null
            logprobs = [v if math.isfinite(v) else None for v in o.logprobs]
            if None in logprobs:
                print(f"warning: prompt {i // args.n} sample {i % args.n}: {logprobs.count(None)} of "
                      f"{len(logprobs)} log-probs are NaN / Inf (written as null)", file=sys.stderr)
            rec = {"index": i // args.n, "sample": i % args.n, "prompt_token_ids": o.prompt_token_ids,
                   "token_ids": o.token_ids, "logprobs": logprobs, "finish_reason": o.finish_reason}
            if tok is not None:
                rec["text"] = tok.decode(o.token_ids)
            scores.append(math_reward(completion_text(tok, o), answers[i]) if scored and answers[i] is not None
                          else None)
            if answers[i] is not None:  # (the final answer the reward compares against)
                rec["answer"] = answers[i]
            if scores[-1] is not None:
                rec["reward"] = scores[-1]
            if not args.no_routed_experts:
                rec["routed_experts"] = o.routed_experts.tolist()
            if o.index_entries is not None:
                rec["index_entries"] = o.index_entries.tolist()
            text.append(json.dumps(rec, allow_nan=False) + "\n")
        return "".join(text), scores
    if lead and not start:
        tmp = meta.with_name(meta.name + ".tmp")
        tmp.write_text(json.dumps(settings))
        os.replace(tmp, meta)
    todo = range(start, len(prompts), args.chunk)  # the chunks' first requests; in a round group g takes the g-th
    G = ranks.groups
    with open(partial, "a" if start else "w") if lead else nullcontext() as f, \
            tqdm(desc="generating", unit="completion", initial=start, total=len(prompts), disable=not lead) as bar:
        for k in range(0, len(todo), G):
            text = None
            if k + ranks.group < len(todo):
                first = todo[k + ranks.group]
                outs = engine.generate(prompts[first:first + args.chunk], params[first:first + args.chunk],
                                       first_index=first, progress=bar.update if lead else None)
                text = records(first, outs) if ranks.rank % ranks.ep_size == 0 else None
            texts = [text]
            if G > 1:  # every group's first rank sends its chunk's lines; rank 0 writes them in chunk order
                got = [None] * ranks.world if lead else None
                dist.gather_object(text, got, dst=0, group=ranks.gather)
                texts = got[::ranks.ep_size] if lead else []
            if lead:
                for g, t in enumerate(texts):
                    if t is not None:  # (None: a group past the last chunk)
                        f.write(t[0])
                        rewards += t[1]
                        if g:  # (the other groups' completions; rank 0's own counted as they ended)
                            bar.update(len(t[1]))
                f.flush()
        if lead:
            os.fsync(f.fileno())
    counts = cli_cache_counts(engine, ranks)
    if not lead:
        return
    os.replace(partial, args.out)
    meta.unlink(missing_ok=True)
    print(f"wrote {len(prompts)} completions to {args.out}{cache_note(counts, bool(args.num_blocks))}")
    if scored:
        print(score_note(rewards, args.n))


if __name__ == "__main__":
    main()
