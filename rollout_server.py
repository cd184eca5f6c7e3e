"""The rollout side: an FP8 DeepSeek-V4 generation engine, the serve loop that answers the trainer, and the
trainer's client for it.

    Engine(model_or_path, fp8=True, dtype=torch.bfloat16, device=None)
    engine.generate(prompts: list[list[int]], SamplingParams(...)) -> [Output(token_ids, logprobs, routed_experts)]

This is the simple engine: per-sequence caches for every layer (the sliding window's last tokens; for CSA/HCA
the compressed entries, the compressor's partial window and, for CSA, the previous window's overlap series, and
the indexer's own compressed keys and state), tokens of all sequences packed into one batch for every
per-token operation, attention per sequence. FP8 weights are held as e4m3 with 128x128 block scales and
dequantized for each matmul. It is the slow, readable twin of the paged engine.

`routed_experts` has one row per token fed through the model (prompt + completion[:-1]): (n, layers, top_k) uint8.
Log-probs are of the sampled tokens under the temperature-scaled distribution (before top-p / top-k).
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kernels.quant import BLOCK, dequant_fp8_block, fp8_dtype, quant_fp8_block
from model.model import Experts, Linear, Transformer, apply_rope, attend, hc_post
from model.weights import FP8_LINEAR, load_pretrained


@dataclass
class SamplingParams:
    temperature: float = 1.0      # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                # 0 = off
    max_tokens: int = 16
    seed: int | None = None       # per request; sequence i samples from a generator seeded by (seed, i)
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.max_tokens < 1:
            raise ValueError(f"invalid sampling parameters {self}")


@dataclass
class Output:
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    routed_experts: torch.Tensor  # (len(prompt) + len(token_ids) - 1, layers, top_k) uint8
    finish_reason: str            # "stop" | "length"


# ---------------------------------------------------------------------------------------------------------
# FP8 weights (dequantize-then-matmul)


class FP8Linear(nn.Module):
    """e4m3 weight with 128x128 block scales; `.weight` dequantizes to the compute dtype."""

    def __init__(self, w: torch.Tensor, fp8: torch.dtype, scale_fmt: str, dtype: torch.dtype):
        super().__init__()
        self.fp8, self.scale_fmt, self.dtype = fp8, scale_fmt, dtype
        q, s = quant_fp8_block(w, fp8, BLOCK, scale_fmt)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", s.float())

    @property
    def weight(self):
        return dequant_fp8_block(self.qweight, self.scale, self.dtype)

    def forward(self, x):
        return F.linear(x, self.weight)

    @torch.no_grad()
    def load_(self, w: torch.Tensor):
        q, s = quant_fp8_block(w.to(self.qweight.device), self.fp8, BLOCK, self.scale_fmt)
        self.qweight.copy_(q)
        self.scale.copy_(s.float())


class FP8Experts(Experts):
    """Stacked experts in FP8: only the experts a batch routes to are dequantized."""

    def __init__(self, ex: Experts, fp8: torch.dtype, scale_fmt: str, dtype: torch.dtype):
        nn.Module.__init__(self)
        self.n_local, self.expert_offset, self.limit = ex.n_local, ex.expert_offset, ex.limit
        self.fp8, self.scale_fmt, self.dtype = fp8, scale_fmt, dtype
        for name in ("w1", "w2", "w3"):
            q, s = quant_fp8_block(getattr(ex, name).data, fp8, BLOCK, scale_fmt)
            self.register_buffer(f"{name}_q", q)
            self.register_buffer(f"{name}_s", s.float())

    def expert(self, e: int):
        return tuple(dequant_fp8_block(getattr(self, f"{n}_q")[e], getattr(self, f"{n}_s")[e], self.dtype)
                     for n in ("w1", "w2", "w3"))

    @torch.no_grad()
    def load_(self, name: str, w: torch.Tensor):
        q, s = quant_fp8_block(w.to(self.w1_q.device), self.fp8, BLOCK, self.scale_fmt)
        getattr(self, f"{name}_q").copy_(q)
        getattr(self, f"{name}_s").copy_(s.float())


def quantize_fp8_(model: Transformer, fp8: torch.dtype, scale_fmt: str, dtype: torch.dtype) -> Transformer:
    """Swap the release's FP8 linears and the routed experts for FP8 holders (router, norms, mHC, sinks,
    embeddings, head and the compressor/indexer-key projections stay in `dtype`/fp32)."""
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if type(child) is Linear and FP8_LINEAR.search(full + ".weight"):
                setattr(parent, name, FP8Linear(child.weight.data, fp8, scale_fmt, dtype))
            elif type(child) is Experts:
                setattr(parent, name, FP8Experts(child, fp8, scale_fmt, dtype))
    return model


# ---------------------------------------------------------------------------------------------------------
# per-sequence state


class CompState:
    """A compressor's incremental state: partial window, previous window's overlap series, emitted entries."""

    def __init__(self, width: int, head_dim: int, device):
        self.buf_kv = torch.zeros(0, width, device=device)
        self.buf_gate = torch.zeros(0, width, device=device)
        self.prev = None
        self.entries = torch.zeros(0, head_dim, device=device)


class Seq:
    def __init__(self, idx: int, prompt: list[int], params: SamplingParams, model: Transformer, device, dtype):
        self.idx, self.prompt, self.params = idx, list(prompt), params
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.routing: list[torch.Tensor] = []
        self.pos = 0
        self.finish = None
        self.gen = torch.Generator().manual_seed(_seq_seed(params.seed, idx)) if params.temperature > 0 else None
        self.window, self.comp, self.index = [], [], []
        for layer in model.layers:
            a = layer.attn
            self.window.append(torch.zeros(0, a.head_dim, device=device, dtype=dtype))
            c = a.compressor
            self.comp.append(CompState(c.wkv.weight.shape[0], c.head_dim, device) if c is not None else None)
            i = a.indexer
            self.index.append(CompState(i.compressor.wkv.weight.shape[0], i.head_dim, device) if i is not None else None)


    def share_prefix(self, other: "Seq"):
        """Take over another sequence's state after the same prompt. Cache tensors are replaced, never written
        in place, so sharing them is safe."""
        self.pos, self.routing = other.pos, list(other.routing)
        self.window = list(other.window)
        for mine, theirs in ((self.comp, other.comp), (self.index, other.index)):
            for i, st in enumerate(theirs):
                if st is not None:
                    mine[i] = copy.copy(st)


def _seq_seed(seed, idx: int) -> int:
    return ((0 if seed is None else int(seed)) * 1_000_003 + idx * 7919 + 17) % (2 ** 63)


# ---------------------------------------------------------------------------------------------------------
# the engine


class Engine:
    def __init__(self, model_or_path, fp8: bool = True, dtype: torch.dtype = torch.bfloat16, device=None,
                 fp8_scale_fmt: str = "fp32", max_batch_tokens: int = 8192, progress: bool = False):
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if isinstance(model_or_path, (str, Path)):
            model = load_pretrained(model_or_path, device, dtype, progress=progress)
        else:
            model = copy.deepcopy(model_or_path).to(device).set_dtype(dtype)
            model.reset_buffers()
        model.eval().requires_grad_(False)
        self.fp8 = fp8_dtype(device) if fp8 else None
        if fp8:
            quantize_fp8_(model, self.fp8, fp8_scale_fmt, dtype)
        self.model, self.cfg, self.device, self.dtype = model, model.cfg, device, dtype
        self.max_batch_tokens = max_batch_tokens

    # -- weights ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, named_tensors):
        """Load (name, tensor) pairs named like the training model's state_dict; FP8 holders re-quantize."""
        mods = dict(self.model.named_modules())
        state = self.model.state_dict()
        for name, t in named_tensors:
            mod_name, _, leaf = name.rpartition(".")
            mod = mods.get(mod_name)
            if isinstance(mod, FP8Linear) and leaf == "weight":
                mod.load_(t)
            elif isinstance(mod, FP8Experts):
                mod.load_(leaf, t)
            elif name in state:
                state[name].copy_(t.to(state[name].device))
            else:
                raise KeyError(f"update_weights: '{name}' is not a tensor of the rollout model")

    # -- forward over packed chunks ---------------------------------------------------------------------
    @torch.no_grad()
    def _forward(self, seqs: list[Seq], chunks: list[list[int]]) -> torch.Tensor:
        """Feed chunks[i] (tokens at positions seqs[i].pos ...) for every sequence; update caches.
        Returns the last-position logits of every chunk (len(seqs), vocab) fp32."""
        m, dev = self.model, self.device
        ids = torch.tensor([t for c in chunks for t in c], device=dev)
        pos = torch.cat([torch.arange(s.pos, s.pos + len(c), device=dev) for s, c in zip(seqs, chunks)])
        bounds = [0]
        for c in chunks:
            bounds.append(bounds[-1] + len(c))
        tables = {"main": m.rope_main(pos), "compress": m.rope_compress(pos)}
        x = m.embed(ids)[None].unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()  # (1, N, n, D)
        routing = []
        for li, blk in enumerate(m.layers):
            h, post, comb = blk.hc("attn", x)
            x = hc_post(self._attention(li, blk.attn, blk.attn_norm(h), pos, tables, seqs, bounds), x, post, comb)
            h, post, comb = blk.hc("ffn", x)
            y, idx = blk.ffn(blk.ffn_norm(h), ids[None])
            x = hc_post(y, x, post, comb)
            routing.append(idx[0])
        routing = torch.stack(routing, 1).to(torch.uint8).cpu()  # (N, L, k)
        for i, s in enumerate(seqs):
            s.routing.append(routing[bounds[i]:bounds[i + 1]])
            s.pos += len(chunks[i])
        last = torch.tensor([b - 1 for b in bounds[1:]], device=dev)
        h = m.norm(m.hc_head(x[0, last]))
        return m.head(h).float()

    def _compress(self, comp, st: CompState, kv, gate):
        """Append projections (n, width) to a compressor's state; emit entries for completed windows."""
        kv, gate = torch.cat([st.buf_kv, kv]), torch.cat([st.buf_gate, gate])
        r = comp.ratio
        c = kv.shape[0] // r
        if c:
            wpos = (st.entries.shape[0] + torch.arange(c, device=kv.device)) * r
            cos, sin = self.model.rope_compress(wpos)
            prev = None if st.prev is None else (st.prev[0][None], st.prev[1][None])
            new, last = comp.pool(kv[: c * r].view(1, c, r, -1), gate[: c * r].view(1, c, r, -1), cos, sin, prev)
            st.entries = torch.cat([st.entries, new[0]])
            if last is not None:
                st.prev = (last[0][0], last[1][0])
        st.buf_kv, st.buf_gate = kv[c * r:], gate[c * r:]
        return st.entries

    def _attention(self, li, attn, h, pos, tables, seqs, bounds):
        cos, sin = tables[attn.rope_kind]
        q, q_res = attn.project_q(h, cos, sin)        # (1, N, H, d)
        kv = attn.project_kv(h, cos, sin)[0]          # (N, d)
        if attn.compressor is not None:
            ckv, cgate = attn.compressor.project(h, pos)
        if attn.indexer is not None:
            iq, iw = attn.indexer.query(h, q_res, *tables["compress"])
            ikv, igate = attn.indexer.compressor.project(h, pos)
        W = attn.window
        outs = []
        for i, s in enumerate(seqs):
            a, b = bounds[i], bounds[i + 1]
            p = pos[a:b]
            keys = torch.cat([s.window[li], kv[a:b]])
            kpos = torch.arange(p[-1] + 1 - keys.shape[0], p[-1] + 1, device=p.device)
            allowed = (kpos[None] <= p[:, None]) & (kpos[None] > p[:, None] - W)
            s.window[li] = keys[-(W - 1):] if W > 1 else keys[:0]
            comp = cmask = None
            if attn.compressor is not None:
                comp = self._compress(attn.compressor, s.comp[li], ckv[0, a:b], cgate[0, a:b])
                causal = torch.arange(comp.shape[0], device=p.device)[None] < ((p + 1) // attn.compressor.ratio)[:, None]
                cmask = causal
                if attn.indexer is not None and comp.shape[0]:
                    keys_i = self._compress(attn.indexer.compressor, s.index[li], ikv[0, a:b], igate[0, a:b])
                    sc = attn.indexer.scores(iq[:, a:b], iw[:, a:b], keys_i[None])[0]
                    sc = sc.masked_fill(~causal, float("-inf"))
                    top = sc.topk(min(attn.indexer.topk, comp.shape[0]), dim=-1).indices
                    cmask = torch.zeros_like(causal).scatter_(-1, top, True) & causal
                elif attn.indexer is not None:
                    self._compress(attn.indexer.compressor, s.index[li], ikv[0, a:b], igate[0, a:b])
            outs.append(attend(q[:, a:b], keys[None], allowed[None], None if comp is None else comp[None],
                               None if cmask is None else cmask[None], attn.attn_sink, attn.scale))
        return attn.project_out(torch.cat(outs, 1), cos, sin)

    # -- sampling ---------------------------------------------------------------------------------------
    @staticmethod
    def _sample(logits: torch.Tensor, s: Seq) -> tuple[int, float]:
        p = s.params
        if p.temperature == 0:
            tok = int(logits.argmax())
            return tok, float(logits.log_softmax(-1)[tok])
        lp = (logits / p.temperature).log_softmax(-1)
        probs = lp.exp()
        if p.top_k > 0 and p.top_k < probs.shape[-1]:
            kth = probs.topk(p.top_k).values[-1]
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        if p.top_p < 1.0:
            sp, si = probs.sort(descending=True)
            keep = (sp.cumsum(-1) - sp) < p.top_p * sp.sum()
            probs = torch.zeros_like(probs).scatter_(-1, si[keep], sp[keep])
        tok = int(torch.multinomial((probs / probs.sum()).cpu(), 1, generator=s.gen))
        return tok, float(lp[tok])

    def _append(self, s: Seq, tok: int, lp: float):
        s.tokens.append(tok)
        s.logprobs.append(lp)
        p = s.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos or self.cfg.eos_token_id is None
                                          else {self.cfg.eos_token_id})
        if tok in stops:
            s.finish = "stop"
        elif len(s.tokens) >= p.max_tokens:
            s.finish = "length"

    # -- public -----------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Output]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling parameter sets")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if max(p) >= self.cfg.vocab_size or min(p) < 0:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.cfg.vocab_size})")
        seqs = [Seq(i, p, params[i], self.model, self.device, self.dtype) for i, p in enumerate(prompts)]
        # prefill once per distinct prompt (a GRPO group shares its prompt), in groups within the token budget
        same: dict[tuple, list[Seq]] = {}
        for s in seqs:
            same.setdefault(tuple(s.prompt), []).append(s)
        leaders = [g[0] for g in same.values()]
        group, size = [], 0
        for s in leaders + [None]:
            if s is None or (group and size + len(s.prompt) > self.max_batch_tokens):
                logits = self._forward(group, [g.prompt for g in group])
                for g, row in zip(group, logits):
                    for member in same[tuple(g.prompt)]:
                        if member is not g:
                            member.share_prefix(g)
                        self._append(member, *self._sample(row, member))
                group, size = [], 0
            if s is not None:
                group.append(s)
                size += len(s.prompt)
        # decode
        active = [s for s in seqs if s.finish is None]
        while active:
            for start in range(0, len(active), self.max_batch_tokens):
                batch = active[start:start + self.max_batch_tokens]
                logits = self._forward(batch, [[s.tokens[-1]] for s in batch])
                for s, row in zip(batch, logits):
                    self._append(s, *self._sample(row, s))
            active = [s for s in seqs if s.finish is None]
        return [Output(s.prompt, s.tokens, s.logprobs, torch.cat(s.routing)[: len(s.prompt) + len(s.tokens) - 1],
                       s.finish) for s in seqs]


# ---------------------------------------------------------------------------------------------------------
# messages between ranks: a JSON header and raw tensor bytes (no pickle)


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in message")
    return dt


def _bytes(t: torch.Tensor, device) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).to(device)


def send_msg(meta: dict, tensors: dict[str, torch.Tensor], dst: int, device, group=None):
    spec = [[k, str(t.dtype), list(t.shape)] for k, t in tensors.items()]
    header = json.dumps({"meta": meta, "tensors": spec}).encode()
    dist.send(torch.tensor([len(header)], dtype=torch.int64, device=device), dst, group=group)
    dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device), dst, group=group)
    for t in tensors.values():
        if t.numel():
            dist.send(_bytes(t, device), dst, group=group)


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


def bucket_plan(spec: list, bucket_bytes: int) -> list[list[int]]:
    """Indices of `spec` ([name, dtype, shape] entries) grouped into buckets of at most bucket_bytes (a tensor
    larger than a bucket travels alone). Sender and receivers derive the same plan."""
    plans, cur, size = [], [], 0
    for i, (_, dt, shape) in enumerate(spec):
        nb = math.prod(shape) * torch.empty(0, dtype=_dtype(dt)).element_size()
        if cur and size + nb > bucket_bytes:
            plans.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nb
    if cur:
        plans.append(cur)
    return plans


# ---------------------------------------------------------------------------------------------------------
# the rollout ranks' serve loop and the trainer's client


def _pack_outputs(outs: list[Output]) -> tuple[dict, dict]:
    meta = {"finish": [o.finish_reason for o in outs], "lengths": [len(o.token_ids) for o in outs],
            "routing_lengths": [o.routed_experts.shape[0] for o in outs]}
    tensors = {"tokens": torch.tensor([t for o in outs for t in o.token_ids], dtype=torch.int64),
               "logprobs": torch.tensor([x for o in outs for x in o.logprobs], dtype=torch.float32),
               "routing": torch.cat([o.routed_experts for o in outs])}
    return meta, tensors


def serve(engine: Engine, driver: int, sync_group, device):
    """Answer the driver (actor rank 0) until it says stop: generate, or receive new weights."""
    while True:
        meta, t = recv_msg(driver, device)
        cmd = meta["cmd"]
        if cmd == "stop":
            return
        if cmd == "generate":
            flat, lengths = t["tokens"].cpu().tolist(), meta["prompt_lengths"]
            prompts, o = [], 0
            for n in lengths:
                prompts.append(flat[o:o + n])
                o += n
            params = [SamplingParams(**p) for p in meta["params"]]
            outs = engine.generate(prompts, params)
            m, ts = _pack_outputs(outs)
            send_msg(m, ts, driver, device)
        elif cmd == "sync":
            spec = meta["spec"]
            for idx in bucket_plan(spec, meta["bucket_bytes"]):
                sizes = [math.prod(spec[i][2]) * torch.empty(0, dtype=_dtype(spec[i][1])).element_size() for i in idx]
                buf = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
                dist.broadcast(buf, driver, group=sync_group)
                o, named = 0, []
                for i, nb in zip(idx, sizes):
                    name, dt, shape = spec[i]
                    named.append((name, buf[o:o + nb].clone().view(_dtype(dt)).reshape(shape)))
                    o += nb
                engine.update_weights(named)
        else:
            raise ValueError(f"rollout: unknown command {cmd!r}")


class RolloutClient:
    """The driver's handle on the rollout ranks: requests travel point to point, weights by broadcast."""

    def __init__(self, rollout_ranks: list[int], sync_group, device):
        self.ranks, self.sync_group, self.device = rollout_ranks, sync_group, device

    def submit(self, prompts: list[list[int]], params: list[SamplingParams], group_size: int = 1):
        """Send prompts (whole groups of `group_size` kept together) to the rollout ranks; returns a handle."""
        n_groups = len(prompts) // group_size
        per = -(-n_groups // len(self.ranks))
        handle = []
        for j, r in enumerate(self.ranks):
            a, b = j * per * group_size, min(len(prompts), (j + 1) * per * group_size)
            if a >= b:
                continue
            meta = {"cmd": "generate", "prompt_lengths": [len(p) for p in prompts[a:b]],
                    "params": [asdict(p) for p in params[a:b]]}
            send_msg(meta, {"tokens": torch.tensor([t for p in prompts[a:b] for t in p], dtype=torch.int64)},
                     r, self.device)
            handle.append((r, prompts[a:b]))
        return handle

    def collect(self, handle) -> list[Output]:
        outs = []
        for r, prompts in handle:
            meta, t = recv_msg(r, self.device)
            tok, lp, rt = t["tokens"].cpu().tolist(), t["logprobs"].cpu().tolist(), t["routing"].cpu()
            o = ro = 0
            for p, n, nr, fin in zip(prompts, meta["lengths"], meta["routing_lengths"], meta["finish"]):
                outs.append(Output(p, tok[o:o + n], lp[o:o + n], rt[ro:ro + nr], fin))
                o, ro = o + n, ro + nr
        return outs

    def generate(self, prompts, params, group_size: int = 1) -> list[Output]:
        return self.collect(self.submit(prompts, params, group_size))

    def sync_weights(self, named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> int:
        """Broadcast (name, tensor) pairs to every rollout rank in buckets; returns bytes sent per receiver."""
        spec = [[n, str(t.dtype), list(t.shape)] for n, t in named]
        for r in self.ranks:
            send_msg({"cmd": "sync", "spec": spec, "bucket_bytes": bucket_bytes}, {}, r, self.device)
        total = 0
        for idx in bucket_plan(spec, bucket_bytes):
            buf = torch.cat([_bytes(named[i][1], self.device) for i in idx])
            dist.broadcast(buf, dist.get_rank(), group=self.sync_group)
            total += buf.numel()
        return total

    def stop(self):
        for r in self.ranks:
            send_msg({"cmd": "stop"}, {}, r, self.device)
