"""DeepSeek-V4 in plain PyTorch: module and parameter names are the release's tensor names.

    embed -> [Block x L] -> hc_head collapse -> norm -> head
    Block:  mHC pre (Sinkhorn mix) -> attn_norm -> Attention -> mHC post
            mHC pre                -> ffn_norm  -> MoE       -> mHC post
    Attention: shared-KV MQA (one K == V head), partial interleaved RoPE on the last dims, sinks,
               a sliding window of `sliding_window` tokens, plus per layer type
               CSA: entries compressed every `csa_ratio` tokens (two overlapping series) and picked
                    per query by the Lightning Indexer (top-k), or
               HCA: entries compressed every `hca_ratio` tokens, attended densely;
               grouped low-rank output projection.
    MoE: sqrt(softplus) scores; top-k (bias for selection only) or a frozen tid2eid hash table;
         normalized weights x routed_scaling_factor; clamped SwiGLU experts + a shared expert.

Routing: `forward(..., return_routing=True)` also returns the expert ids every layer used,
(B, T, L, top_k); `replay_experts=` of that shape makes the top-k layers use the given ids
instead of their own top-k (gate weights still come from the layer's own scores, so the router
is trained). Hash layers always use their table.

Shape comments use B batch, T tokens, D hidden, H heads, n hc streams, E experts, k top-k.
The math follows `transformers`' DeepseekV4ForCausalLM (the test oracle); mixing, pooling, router
logits and softmaxes run in fp32 as in DeepSeek's own inference code.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kernels import fused, mhc
from kernels.attention import block_softmax, topk_first
from kernels.logprob import head_logprob
from kernels.moe import SlotRows, combine_rows
from kernels.fp8_gemm import Prenorm, use_triton
from kernels.fused import fused_ok

from .config import CSA, HCA, SLIDING, ModelConfig

# the compute dtypes a config or command line names (train.dtype, rollout.dtype, model.score --dtype)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# ---------------------------------------------------------------------------------------------------------
# small pieces


class RMSNorm(nn.Module):
    """Weighted RMSNorm; the weight stays fp32 and the product is taken in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x):
        if use_triton(x):
            return fused.rms_norm(x, self.weight, self.eps)
        return IMPL["rms"](x, self.weight, self.eps)


def _rms(x, weight, eps: float):
    xf = x.float()
    return (weight.float() * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps))).to(x.dtype)


def _rms_unweighted(x, eps: float):
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rms_unweighted(x, eps: float):
    if use_triton(x):
        return fused.rms_norm(x, None, eps)
    return IMPL["rms_unweighted"](x, eps)


class Rope(nn.Module):
    """Interleaved RoPE tables: (cos, sin) of shape (..., rope_dim/2) for integer positions."""

    def __init__(self, rope_dim: int, theta: float, yarn: dict | None):
        super().__init__()
        self.rope_dim, self.theta, self.yarn = rope_dim, theta, yarn
        # on meta only the shape (Transformer.reset_buffers fills it after to_empty; computing it here would go
        # through torch._refs, whose first use imports torch._dynamo: seconds per process)
        meta = torch.empty(0).is_meta
        self.register_buffer("inv_freq", torch.empty(rope_dim // 2) if meta else self.compute_inv_freq(),
                             persistent=False)
        self.table = None  # (2, n, rope_dim/2) cos / sin of positions [0, n) once `precompute` ran

    def compute_inv_freq(self, device=None):
        d, base = self.rope_dim, self.theta
        inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
        if self.yarn is None:
            return inv
        factor = float(self.yarn["factor"])
        orig = float(self.yarn["original_max_position_embeddings"])
        beta_fast, beta_slow = self.yarn.get("beta_fast") or 32, self.yarn.get("beta_slow") or 1

        def corr_dim(rot):
            return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low, high = max(math.floor(corr_dim(beta_fast)), 0), min(math.ceil(corr_dim(beta_slow)), d - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return (inv / factor) * (1 - extrapolation) + inv * extrapolation

    def reset(self):
        self.inv_freq = self.compute_inv_freq(self.inv_freq.device)
        if self.table is not None:
            self.precompute(self.table.shape[1])

    def precompute(self, n: int):
        """From now on forward gathers rows of a table of positions [0, n) instead of computing them: the same
        values in one kernel (the rollout engine; its positions stay below its max_model_len). A table of the
        same size is refilled in place: CUDA graphs captured over it read that memory."""
        t = torch.stack(self._angles(torch.arange(n, device=self.inv_freq.device)))
        if self.table is not None and self.table.shape == t.shape:
            self.table.copy_(t)
        else:
            self.table = t

    def _angles(self, pos):
        freqs = pos.float()[..., None] * self.inv_freq
        return freqs.cos(), freqs.sin()

    def forward(self, pos: torch.Tensor):
        if self.table is not None:
            t = self.table[:, pos]
            return t[0], t[1]
        return self._angles(pos)


def apply_rope(x, cos, sin, inverse: bool = False):
    """Rotate the last 2*cos.shape[-1] dims of x in interleaved pairs (fp32 math).

    x: (..., T, [heads,] dim); cos/sin broadcastable to (..., T, [1,] rd/2): pass them already shaped.
    """
    if use_triton(x):
        y = fused.rope(x, cos, sin, inverse)
        if y is not None:
            return y
    return IMPL["rope"](x, cos, -sin if inverse else sin)


def _rope(x, cos, sin):
    rd = cos.shape[-1] * 2
    nope, rope = x[..., :-rd], x[..., -rd:].float()
    x0, x1 = rope[..., 0::2], rope[..., 1::2]
    y = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2)
    return torch.cat([nope, y.to(x.dtype)], dim=-1)


class Linear(nn.Linear):
    """nn.Linear without bias. A separate class so FP8 swapping in the rollout engine finds its targets."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x, xq=None):
        """xq: x's rows already quantized per 1x128 tile, where the caller has them: the rollout engine's FP8
        holders take them instead of quantizing x; a plain weight reads x. A Prenorm: x is to be normed first."""
        return super().forward(xq.norm(x) if isinstance(xq, Prenorm) else x)

    def reset_parameters(self):
        if not self.weight.is_meta:  # nothing to fill on meta (and the fill would import torch._dynamo: seconds)
            super().reset_parameters()


class Embedding(nn.Embedding):
    def reset_parameters(self):
        if not self.weight.is_meta:
            super().reset_parameters()


# ---------------------------------------------------------------------------------------------------------
# compressor + indexer


class Compressor(nn.Module):
    """Pools every `ratio` tokens into one KV entry: softmax(gate + ape)-weighted sum per channel.

    With `overlap` (CSA), wkv/wgate produce two series per token: Ca = [:head_dim] feeds the *next*
    window's entry, Cb = [head_dim:] the current one, so entry w pools window w-1's Ca with window w's
    Cb (2*ratio slots). The entry is RMS-normed and rotated at position w * ratio.
    """

    def __init__(self, cfg: ModelConfig, ratio: int, head_dim: int, overlap: bool):
        super().__init__()
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, overlap
        width = head_dim * (2 if overlap else 1)
        self.wkv = Linear(cfg.hidden_size, width)
        self.wgate = Linear(cfg.hidden_size, width)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, cfg.rms_norm_eps)

    def project(self, x, pos):
        """x (B, T, D), pos (B, T) or (T,) absolute positions -> kv, gate (B, T, width) fp32, gate incl. ape."""
        return self.biased(self.wkv(x), self.wgate(x), pos)

    def biased(self, kv, gate, pos):
        """The linears' outputs -> fp32, the gate plus its position bias (the decode kernel does this itself)."""
        return kv.float(), gate.float() + self.ape[pos % self.ratio]

    def pool(self, kv, gate, cos, sin, prev=None):
        """kv, gate: (B, n, ratio, width) complete windows. prev: (kv, gate) (B, ratio, head_dim) = Ca of
        the window before window 0, or None (zero weight). cos/sin: (B or 1, n, rd/2) at each window's
        first position. -> entries (B, n, head_dim) fp32, and this call's last Ca (for the next call)."""
        hd, r = self.head_dim, self.ratio
        last = None
        if self.overlap:
            B, n = kv.shape[:2]
            kv2 = kv.new_zeros(B, n, 2 * r, hd)
            g2 = gate.new_full((B, n, 2 * r, hd), float("-inf"))
            kv2[:, :, r:], g2[:, :, r:] = kv[..., hd:], gate[..., hd:]
            kv2[:, 1:, :r], g2[:, 1:, :r] = kv[:, :-1, :, :hd], gate[:, :-1, :, :hd]
            if prev is not None:
                kv2[:, 0, :r], g2[:, 0, :r] = prev[0], prev[1]
            last = (kv[:, -1, :, :hd], gate[:, -1, :, :hd])
            kv, gate = kv2, g2
        pooled = (kv * gate.softmax(dim=2)).sum(dim=2)
        return apply_rope(self.norm(pooled), cos, sin), last

    def forward(self, x, rope_tables):
        """Full-sequence path from position 0: entries for every complete window. x (B, T, D)."""
        B, T, _ = x.shape
        n = T // self.ratio
        if n == 0:
            return x.new_zeros(B, 0, self.head_dim, dtype=torch.float32)
        pos = torch.arange(n * self.ratio, device=x.device)
        kv, gate = self.project(x[:, : n * self.ratio], pos)
        cos, sin = rope_tables
        wpos = torch.arange(n, device=x.device) * self.ratio
        entries, _ = self.pool(kv.view(B, n, self.ratio, -1), gate.view(B, n, self.ratio, -1),
                               cos[wpos], sin[wpos])
        return entries


class Indexer(nn.Module):
    """Lightning Indexer: score(t, s) = sum_h w_{t,h} * relu(q_{t,h} . k_s), top-k causal entries per query."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.ratio = cfg.csa_ratio
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads)
        self.compressor = Compressor(cfg, cfg.csa_ratio, cfg.index_head_dim, overlap=True)

    def query(self, x, q_res, cos, sin, w=None, raw: bool = False, qq=None):
        """-> q (B, T, h, d) fp32 with RoPE, head weights (B, T, h) fp32. w: weights_proj(x) where the caller
        has it. raw: q and w in the linears' dtype and w not yet scaled by w_scale (the rollout engine's
        index_scores kernel converts and scales them as it reads them). qq: q_res quantized (q_lora's), for
        the FP8 engine's wq_b."""
        B, T, _ = x.shape
        q = self.wq_b(q_res, qq).view(B, T, self.n_heads, self.head_dim)
        q = apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
        w = self.weights_proj(x) if w is None else w
        return (q, w) if raw else (q.float(), w.float() * self.w_scale)

    @property
    def w_scale(self) -> float:
        return self.n_heads ** -0.5

    def scores(self, q, w, keys):
        """q (B, T, h, d), w (B, T, h), keys (B, S, d) -> (B, T, S) fp32."""
        s = torch.einsum("bthd,bsd->bths", q, keys.float()).relu_() * self.head_dim ** -0.5
        return torch.einsum("bths,bth->bts", s, w)

    @torch.no_grad()
    def select(self, x, q_res, pos, comp_rope, q_rope, n_entries: int, chunk: int = 1024):
        """Full-sequence path. -> mask (B, T, n_entries) bool: entries each query attends to.
        The indexer gets no gradient through top-k (as in the release's RL setup)."""
        B, T, _ = x.shape
        keys = self.compressor(x, comp_rope)  # (B, S, d)
        mask = torch.zeros(B, T, n_entries, dtype=torch.bool, device=x.device)
        if n_entries == 0:
            return mask
        k = min(self.topk, n_entries)
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            q, w = self.query(x[:, s:e], q_res[:, s:e], q_rope[0][s:e], q_rope[1][s:e])
            sc = self.scores(q, w, keys)
            allowed = torch.arange(n_entries, device=x.device) < ((pos[s:e] + 1) // self.ratio)[:, None]
            sc = sc.masked_fill(~allowed, float("-inf"))
            idx = topk_first(sc, k)  # ties: the lower entry, as the engine's paths pick
            picked = torch.zeros_like(sc, dtype=torch.bool).scatter_(-1, idx, True)
            mask[:, s:e] = picked & allowed
        return mask


# ---------------------------------------------------------------------------------------------------------
# attention


def attend(*args):
    return IMPL["attend"](*args)


def _attend(q, window_kv, window_allowed, comp_kv, comp_allowed, sink, scale):
    """One softmax over [window keys, compressed entries, sink].

    q (B, T, H, d); window_kv (B, Kw, d); window_allowed (B or 1, T, Kw) bool;
    comp_kv (B, S, d) or None; comp_allowed (B or 1, T, S) bool; sink (H,) -> (B, T, H, d) in q's dtype.
    """
    B, T, H, d = q.shape
    qh = q.transpose(1, 2)  # (B, H, T, d)
    logits = [torch.matmul(qh, window_kv.unsqueeze(1).transpose(-1, -2)).float() * scale]
    masks = [window_allowed.unsqueeze(1).expand(B, 1, T, -1)]
    if comp_kv is not None and comp_kv.shape[1] > 0:
        logits.append(torch.matmul(qh, comp_kv.to(q.dtype).unsqueeze(1).transpose(-1, -2)).float() * scale)
        masks.append(comp_allowed.unsqueeze(1).expand(B, 1, T, -1))
    lg = torch.cat(logits, -1).masked_fill(~torch.cat(masks, -1), float("-inf"))
    lg = torch.cat([lg, sink.float().view(1, H, 1, 1).expand(B, H, T, 1)], -1)
    p = lg.softmax(-1)[..., :-1].to(q.dtype)
    kw = window_kv.shape[1]
    out = torch.matmul(p[..., :kw], window_kv.unsqueeze(1))
    if len(logits) > 1:
        out = out + torch.matmul(p[..., kw:], comp_kv.to(q.dtype).unsqueeze(1))
    return out.transpose(1, 2)


def attend_blocks(q, *args):
    if use_triton(q):
        return _attend_blocks_fused(q, *args)
    return IMPL["attend_blocks"](q, *args)


def _attend_blocks_fused(q, keys, allowed, comp_kv, comp_allowed, sink, scale):
    """_attend_blocks with its masked softmax in one Triton kernel each way (the GEMMs stay cuBLAS)."""
    B, C, H, d = q.shape
    nb, bq, K = allowed.shape
    lw = torch.matmul(q.reshape(B, nb, bq * H, d), keys.transpose(-1, -2))
    S = 0 if comp_kv is None else comp_kv.shape[1]
    lc = torch.matmul(q.reshape(B, C * H, d), comp_kv.transpose(-1, -2)) if S else None
    pw, pc = block_softmax(lw, lc, allowed, comp_allowed if S else None, sink, scale, H)
    out = torch.matmul(pw, keys).view(B, C * H, d)
    if S:  # the compressed entries' part added in the GEMM's epilogue
        out = torch.baddbmm(out, pc, comp_kv)
    return out.view(B, C, H, d)


def _attend_blocks(q, keys, allowed, comp_kv, comp_allowed, sink, scale):
    """The full-sequence form of `_attend`: the same softmax over [window keys, compressed entries, sink],
    queries in nb blocks of bq tokens, each block with its own window keys.

    q (B, nb * bq, H, d); keys (B, nb, K, d); allowed (nb, bq, K) bool; comp_kv (B, S, d) in q's dtype or None;
    comp_allowed (B or 1, nb * bq, S) bool -> (B, nb * bq, H, d). Heads fold into the GEMMs' rows."""
    B, C, H, d = q.shape
    nb, bq, K = allowed.shape
    lw = torch.matmul(q.reshape(B, nb, bq * H, d), keys.transpose(-1, -2)).float().view(B, nb, bq, H, K) * scale
    parts = [lw.masked_fill(~allowed[None, :, :, None], float("-inf")).view(B, C, H, K)]
    S = 0 if comp_kv is None else comp_kv.shape[1]
    if S:
        lc = torch.matmul(q.reshape(B, C * H, d), comp_kv.transpose(-1, -2)).float().view(B, C, H, S) * scale
        parts.append(lc.masked_fill(~comp_allowed[:, :, None], float("-inf")))
    parts.append(sink.float().view(1, 1, H, 1).expand(B, C, H, 1))
    p = torch.cat(parts, -1).softmax(-1).to(q.dtype)
    out = torch.matmul(p[..., :K].reshape(B, nb, bq * H, K), keys).view(B, C, H, d)
    if S:
        out = out + torch.matmul(p[..., K:K + S].reshape(B, C * H, S), comp_kv).view(B, C, H, d)
    return out


def grouped_linear(x, w):
    """x (..., G, i), w (G, R, i) -> (..., G, R): group g's rows times w[g]^T (the grouped output projection)."""
    if x.is_cuda:
        return _GroupedLinear.apply(x, w)
    return _grouped_linear(x, w)


def _grouped_linear(x, w):
    return torch.einsum("...gi,gri->...gr", x, w)


class _GroupedLinear(torch.autograd.Function):
    """_grouped_linear as batched GEMMs over strided views: cuBLAS reads and writes the (N, G, .) layouts with a
    leading dimension of G * width, so neither direction copies x, the output or their gradients into (G, N, .)
    order (einsum does, four copies of the attention output's size per layer)."""

    @staticmethod
    def forward(ctx, x, w):
        G, R, i = w.shape
        xf = x.reshape(-1, G, i)
        y = torch.empty(xf.shape[0], G, R, dtype=x.dtype, device=x.device)
        torch.bmm(xf.transpose(0, 1), w.transpose(1, 2), out=y.transpose(0, 1))
        ctx.save_for_backward(xf, w)
        ctx.shape = x.shape
        return y.view(*x.shape[:-1], R)

    @staticmethod
    def backward(ctx, gy):
        xf, w = ctx.saved_tensors
        G, R, i = w.shape
        gt = gy.reshape(-1, G, R).transpose(0, 1)  # (G, N, R)
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = torch.empty_like(xf)
            torch.bmm(gt, w, out=gx.transpose(0, 1))
            gx = gx.view(ctx.shape)
        if ctx.needs_input_grad[1]:
            gw = torch.bmm(gt.transpose(1, 2), xf.transpose(0, 1))
        return gx, gw


def query_block(window: int, T: int) -> int:
    """Queries a block of the full-sequence attention: 128 (fewer for short sequences: no padding to 128), at least
    the window. A block's logits are over its bq + window keys; T is padded to whole blocks."""
    return max(window, min(128, T))


class Attention(nn.Module):
    LOGITS_BUDGET = 1 << 28  # elements of one checkpointed chunk's logits (window + compressed entries)

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.cfg = cfg
        self.layer_type = cfg.layer_type(layer_id)
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.window = cfg.sliding_window
        self.scale = cfg.head_dim ** -0.5
        self.rope_kind = "main" if self.layer_type == SLIDING else "compress"
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, cfg.num_attention_heads * cfg.head_dim)
        self.wkv = Linear(cfg.hidden_size, cfg.head_dim)
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.o_groups = cfg.o_groups
        self.wo_a = Linear(cfg.num_attention_heads * cfg.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.attn_sink = nn.Parameter(torch.zeros(cfg.num_attention_heads, dtype=torch.float32))
        self.compressor = self.indexer = None
        if self.layer_type == CSA:
            self.compressor = Compressor(cfg, cfg.csa_ratio, cfg.head_dim, overlap=True)
            self.indexer = Indexer(cfg)
        elif self.layer_type == HCA:
            self.compressor = Compressor(cfg, cfg.hca_ratio, cfg.head_dim, overlap=False)

    # pieces shared with the rollout engine's incremental path
    def project_q(self, x, cos, sin):
        """x (B, T, D) -> q (B, T, H, d) roped, q_res (B, T, q_lora) (the indexer reads it too)."""
        q_res = self.q_lora(x)[0]
        return self.q_heads(q_res, cos, sin), q_res

    def q_lora(self, x, a=None, fp8=None, prenorm: bool = False):
        """x (B, T, D) -> q_res (B, T, q_lora) normed, and its rows quantized per 1x128 tile (q, scales) or None.
        a: wq_a(x) where the caller has it (the rollout engine's one GEMM over every linear reading x). fp8 (the
        FP8 engine's dtype, its wq_b an FP8 holder): the norm's kernel also quantizes the rows, for wq_b and the
        indexer's (no act_quant launch; None where the kernel does not run). prenorm: q_res not yet normed, with
        Prenorm(q_norm) for wq_b and the indexer's to apply (the FP8 engine's GEMVs at one row: no norm launch)."""
        a = self.wq_a(x) if a is None else a
        if prenorm:
            return a, Prenorm(self.q_norm)
        if fp8 is not None and fused_ok(a):
            return fused.rms_norm_quant(a, self.q_norm.weight, self.q_norm.eps, fp8)
        return self.q_norm(a), None

    def q_heads(self, q_res, cos, sin, qq=None):
        """q_res (B, T, q_lora) -> q (B, T, H, d): wq_b (qq: q_res quantized, q_lora's), the per-head norm, RoPE."""
        return self._q_rope(self._q_proj(q_res, qq), cos, sin)

    def q_and_kv(self, q_res, x, cos, sin, qq=None, kv=None, store=None):
        """(q_heads(q_res, cos, sin, qq), project_kv(x, cos, sin, kv, store)); in inference both norms and
        rotations run in one kernel."""
        q = self._q_proj(q_res, qq)
        kv = self.wkv(x) if kv is None else kv
        if fused_ok(kv):
            ys = fused.norm_rope(kv, self.norm.weight, self.norm.eps, cos, sin, store,
                                 first=(q, None, self.cfg.rms_norm_eps, cos.unsqueeze(-2), sin.unsqueeze(-2)))
            if ys is not None:
                return ys
        return self._q_rope(q, cos, sin), self.project_kv(x, cos, sin, kv, store)

    def _q_proj(self, q_res, qq=None):
        B, T, _ = q_res.shape
        return self.wq_b(q_res, qq).view(B, T, self.n_heads, self.head_dim)

    def _q_rope(self, q, cos, sin):
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        # inference: the per-head norm and the rotation in one kernel (None where it declines the broadcast)
        y = fused.norm_rope(q, None, self.cfg.rms_norm_eps, cos, sin) if fused_ok(q) else None
        if y is None:
            y = apply_rope(rms_unweighted(q, self.cfg.rms_norm_eps), cos, sin)
        return y

    def project_kv(self, x, cos, sin, kv=None, store=None):
        """x (B, T, D) -> kv (B, T, d) roped: the one shared K == V head. kv: wkv(x) where the caller has it.
        store: (buf (R, d), rows (B * T,)): also buf[rows] = the result (the rollout engine's window cache)."""
        kv = self.wkv(x) if kv is None else kv
        if fused_ok(kv):  # inference: norm, rotation and the store in one kernel
            y = fused.norm_rope(kv, self.norm.weight, self.norm.eps, cos, sin, store)
            if y is not None:
                return y
        y = apply_rope(self.norm(kv), cos, sin)
        if store is not None:
            store[0][store[1]] = y.reshape(-1, y.shape[-1]).to(store[0].dtype)
        return y

    def project_out(self, o, cos, sin, oq=None):
        """o (B, T, H, d) attention output -> (B, T, D). Inverse RoPE undoes V's rotation at the query position
        (cos None: o has it already, as the rollout engine's decode attention kernel gives it). oq: o's rows
        quantized per 1x128 tile (that kernel's, for the FP8 engine's wo_a), or None."""
        B, T = o.shape[:2]
        if cos is not None:
            o = apply_rope(o, cos.unsqueeze(-2), sin.unsqueeze(-2), inverse=True)
        g = o.reshape(B, T, self.o_groups, -1)
        if hasattr(self.wo_a, "grouped"):  # the rollout engine's FP8 holder: one FP8 GEMM per group
            return self.wo_b(self.wo_a.grouped(g, oq).flatten(2))
        wa = self.wo_a.weight.view(self.o_groups, -1, g.shape[-1])  # (G, R, H*d/G)
        return self.wo_b(grouped_linear(g, wa).flatten(2))

    def forward(self, x, ctx, chunk: int | None = None):
        """Full-sequence path from position 0. x (B, T, D) -> (B, T, D).

        Queries go in blocks of `bq` tokens; a block's window keys are the `bq + window` positions before and in
        it, so its logits are one GEMM with the heads folded into the rows (all heads share the one KV head).
        Chunks of blocks are checkpointed: only their inputs are kept, their logits are recomputed in backward.
        chunk (tokens): by default as many as keep a chunk's logits under LOGITS_BUDGET elements (one chunk for
        the whole sequence at mini's 8 x 2048: the window GEMM then folds batch and blocks without a copy)."""
        B, T, _ = x.shape
        pos = ctx["pos"]
        cos, sin = ctx[self.rope_kind]
        q, q_res = self.project_q(x, cos, sin)
        kv = self.project_kv(x, cos, sin)
        comp, comp_mask, S = None, None, 0
        if self.compressor is not None:
            comp = self.compressor(x, ctx["compress"])
            S = comp.shape[1]
            if self.indexer is not None:
                comp_mask = self.indexer.select(x, q_res, pos, ctx["compress"], ctx["compress"], S)
            else:
                comp_mask = (torch.arange(S, device=x.device) < ((pos + 1) // self.compressor.ratio)[:, None])[None]
            comp = comp.to(q.dtype)
        W = self.window
        bq = query_block(W, T)
        if chunk is None:
            chunk = self.LOGITS_BUDGET // max(1, B * self.n_heads * (bq + W + S))
        chunk = bq * max(1, chunk // bq)
        Tp = -(-T // bq) * bq
        if Tp > T:  # pad the queries to whole blocks (their rows are dropped below)
            q = F.pad(q, (0, 0, 0, 0, 0, Tp - T))
            if comp_mask is not None:
                comp_mask = F.pad(comp_mask, (0, 0, 0, Tp - T))
        kvp = F.pad(kv, (0, 0, W, Tp - T))  # kvp[:, i] = key at position i - W (zeros outside [0, T))
        t = torch.arange(bq, device=x.device)[:, None]
        c = torch.arange(bq + W, device=x.device)
        local = (c > t) & (c <= t + W)  # (bq, bq + W): query offset t sees key offset c
        outs = []
        # split, not sliced per chunk: the backward is one concatenation, not a zero-filled copy of q per chunk
        for i, qc in enumerate(q.split(chunk, dim=1)):
            s = i * chunk
            e = s + qc.shape[1]
            nb = (e - s) // bq
            # (B, nb, bq + W, d), copied once here (the two GEMMs would each copy the unfolded view)
            keys = kvp[:, s:e + W].unfold(1, bq + W, bq).transpose(-1, -2).contiguous()
            starts = s - W + bq * torch.arange(nb, device=x.device)
            allowed = local & (starts[:, None, None] + c >= 0)  # (nb, bq, bq + W)
            args = (qc, keys, allowed, comp, None if comp_mask is None else comp_mask[:, s:e],
                    self.attn_sink, self.scale)
            if torch.is_grad_enabled():  # keep the chunk's inputs only; its logits are recomputed in backward
                outs.append(checkpoint(attend_blocks, *args, use_reentrant=False))
            else:
                outs.append(attend_blocks(*args))
        return self.project_out(torch.cat(outs, 1)[:, :T], cos, sin)


# ---------------------------------------------------------------------------------------------------------
# MoE


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.topk, self.n_experts = cfg.num_experts_per_tok, cfg.n_routed_experts
        self.score_func, self.route_scale, self.norm_topk = cfg.scoring_func, cfg.routed_scaling_factor, cfg.norm_topk_prob
        self.hash = cfg.is_hash_layer(layer_id)
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if self.hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long))
        else:  # aux-loss-free balancing bias: used to pick experts, never to weight them
            self.register_buffer("bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def scores(self, x):
        """x (N, D) -> (N, E) fp32 scores."""
        logits = F.linear(x.float(), self.weight.float())
        if self.score_func == "softmax":
            return logits.softmax(-1)
        if self.score_func == "sigmoid":
            return logits.sigmoid()
        return F.softplus(logits).sqrt()

    def forward(self, x, input_ids=None, replay=None, token_mask=None, rows=None):
        """x (N, D), input_ids (N,), replay (N, k) or None -> weights (N, k) fp32, ids (N, k) long. rows: an (N, k)
        uint8 tensor the ids are also written into (the rollout engine's routing rows; by the kernel on a GPU).

        With replay, `replay_stats` accumulates (tokens whose own top-k set differs from the replayed one,
        tokens) over the real tokens (token_mask), for the actor's routing-mismatch metric."""
        if replay is None and fused_ok(x):  # inference on a GPU: two kernels (fused.route); the code below its twin
            return fused.route(x, self.weight, None if self.hash else self.bias, self.topk, self.score_func,
                               self.norm_topk, self.route_scale, *((self.tid2eid, input_ids) if self.hash else
                                                                   (None, None)), rows=rows)
        s = self.scores(x)
        if self.hash:
            idx = self.tid2eid[input_ids].long()
        elif replay is not None:
            idx = replay.long()
            with torch.no_grad():
                own = (s + self.bias).topk(self.topk, dim=-1).indices.sort(-1).values
                diff = (own != idx.sort(-1).values).any(-1)
                if token_mask is not None:
                    diff = diff & token_mask
                n = token_mask.sum() if token_mask is not None else torch.tensor(diff.numel(), device=diff.device)
                st = torch.stack([diff.sum(), n]).float()
                self.replay_stats = st if getattr(self, "replay_stats", None) is None else self.replay_stats + st
        else:  # selection needs no gradient; the gathered weights carry it
            idx = (s.detach() + self.bias).topk(self.topk, dim=-1, sorted=False).indices
        w = s.gather(1, idx)
        if self.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        if rows is not None:
            rows.copy_(idx)
        return w * self.route_scale, idx


def swiglu(gate, up, limit: float):
    if use_triton(gate):
        return fused.swiglu(gate, up, limit)
    return IMPL["swiglu"](gate, up, limit)


def _swiglu(gate, up, limit: float):
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class Experts(nn.Module):
    """Routed experts stacked per projection: w1/w3 (E, I, D), w2 (E, D, I).

    The release stores experts.{e}.w{1,2,3}.weight; the loader writes them into slice e.
    `expert_offset` is the first global expert id held here (expert parallelism).
    """

    def __init__(self, cfg: ModelConfig, n_local: int | None = None, expert_offset: int = 0):
        super().__init__()
        E = cfg.n_routed_experts if n_local is None else n_local
        self.n_local, self.expert_offset, self.limit = E, expert_offset, cfg.swiglu_limit
        I, D = cfg.moe_intermediate_size, cfg.hidden_size
        self.w1 = nn.Parameter(torch.empty(E, I, D))
        self.w2 = nn.Parameter(torch.empty(E, D, I))
        self.w3 = nn.Parameter(torch.empty(E, I, D))

    def expert(self, e: int):
        """(w1, w2, w3) of local expert e."""
        return self.w1[e], self.w2[e], self.w3[e]

    grouped = True  # torch._grouped_mm where it runs; False = the per-expert loop (the slow twin)

    def forward_sorted(self, xs, counts):
        """xs (M, D) rows grouped by local expert, counts (E,) -> (M, D)."""
        if xs.shape[0] == 0:  # no rows: keep the weights in the graph (FSDP reduce-scatters every gradient)
            return xs + 0.0 * (self.w1[:1].sum() + self.w2[:1].sum() + self.w3[:1].sum())
        if self.grouped and grouped_mm_takes(xs, self.w1):
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h = swiglu(torch._grouped_mm(xs, self.w1.transpose(-2, -1), offs=offs),
                       torch._grouped_mm(xs, self.w3.transpose(-2, -1), offs=offs), self.limit)
            return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)
        out = torch.empty_like(xs)
        start = 0
        for e, c in enumerate(counts.tolist()):
            if c:
                w1, w2, w3 = self.expert(e)
                x = xs[start:start + c]
                out[start:start + c] = swiglu(x @ w1.T, x @ w3.T, self.limit) @ w2.T
                start += c
        return out

    def forward(self, x, idx, w):
        """x (N, D), idx (N, k) local expert ids, w (N, k) -> (N, D) = sum_k w * expert_k(x)."""
        N, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = expert_counts(flat, self.n_local)
        inv = inverse(order)
        return combine(self.forward_sorted(dispatch(x, order, k, inv), counts), order, w, inv)


def grouped_mm_takes(xs, w1):
    """Whether torch._grouped_mm runs these experts: it exists, the dtype is one it has a kernel for on the device
    (BF16 on a GPU), and every row stride (D and I elements) is a multiple of 16 bytes, as it requires."""
    es = xs.element_size()
    return (hasattr(torch, "_grouped_mm") and (xs.dtype == torch.bfloat16 or not xs.is_cuda)
            and w1.shape[-1] * es % 16 == 0 and w1.shape[-2] * es % 16 == 0)


def expert_counts(ids, n: int):
    """Rows per expert id in [0, n) (bincount without its host sync: it reads the largest id first)."""
    return ids.new_zeros(n).scatter_add_(0, ids, torch.ones_like(ids))


def inverse(perm):
    """The inverse permutation: inverse(p)[p[i]] = i."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


class _Rows(torch.autograd.Function):
    """y = x[rows], where rows is a permutation (k = 1) or visits every row of x k times (the slots of a k-way
    dispatch); back is the inverse permutation of the slots. The backward is a gather (and a k-sum), not
    index_put's scatter-add."""

    @staticmethod
    def forward(ctx, x, rows, back, k: int):
        ctx.save_for_backward(back)
        ctx.k, ctx.n = k, x.shape[0]
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, g):
        (back,) = ctx.saved_tensors
        gx = g.index_select(0, back)
        return (gx.view(ctx.n, ctx.k, -1).sum(1) if ctx.k > 1 else gx), None, None, None


def dispatch(x, order, k: int, inv=None):
    """x (N, D) -> x[order // k]: each token once per slot, the N * k slots in `order` (inv: inverse(order))."""
    return _Rows.apply(x, order // k, inverse(order) if inv is None else inv, k)


def permute(x, perm, inv=None):
    """x[perm] for a permutation of x's rows (inv: inverse(perm), if the caller has it)."""
    return _Rows.apply(x, perm, inverse(perm) if inv is None else inv, 1)


def combine(ys, order, w, inv=None):
    """ys (N * k, D): the experts' outputs of the token slots in `order` (a permutation of the N * k slots), w
    (N, k) -> (N, D) = sum_k w * y. A gather back to slot order, then a weighted sum over k (no atomics).
    inv: inverse(order), if the caller has it."""
    inv = inverse(order) if inv is None else inv
    if use_triton(ys):
        return combine_rows(ys, inv, w)
    return _combine(ys, order, w, inv)


def _combine(ys, order, w, inv=None):
    N, k = w.shape
    inv = inverse(order) if inv is None else inv
    ys = permute(ys, inv, order).view(N, k, ys.shape[-1])
    return (ys * w[..., None].to(ys.dtype)).sum(1)


class MLP(nn.Module):
    """Shared expert (SwiGLU, clamped like the routed ones)."""

    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(dim, inter), Linear(inter, dim), Linear(dim, inter)
        self.limit = limit

    def forward(self, x):
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.gate = Gate(cfg, layer_id)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.shared_intermediate_size, cfg.swiglu_limit) \
            if cfg.n_shared_experts else None
        self.shared_in_experts = False  # the rollout engine's grouped kernel runs the shared expert too

    def forward(self, x, input_ids, replay=None, token_mask=None, xq=None, summed=True, routing=None):
        """x (B, T, D), input_ids (B, T), replay (B, T, k) or None -> y (B, T, D), ids (B, T, k). xq: x's rows
        quantized per 1x128 tile, (q, scales), where the caller has them (the FP8 rollout engine's experts).
        routing: a (B * T, k) uint8 tensor the gate also writes the ids into (the rollout engine's routing rows).
        summed=False (the rollout engine's, for hc_post_mix): y may be the experts' slot rows unsummed
        (kernels.moe.SlotRows, flat over B * T), where the experts give them and nothing is added to them; experts
        that can run the shared expert's part beside the router (early_rows: their buffers, made before the gate
        launches) then do."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        early = getattr(self.experts, "early_rows", None) if not summed else None
        rows = early(flat, self.gate.topk) if early is not None else None
        w, idx = self.gate(flat, input_ids.reshape(-1), None if replay is None else replay.reshape(-1, replay.shape[-1]),
                           None if token_mask is None else token_mask.reshape(-1), routing)
        shared = self.shared_experts is not None and not self.shared_in_experts
        kw = {} if xq is None else {"xq": xq}
        if not (summed or shared) and getattr(self.experts, "gives_slot_rows", False):  # (the rollout engine's)
            kw["summed"] = False
        if rows is not None:
            kw["rows"] = rows
        y = self.experts(flat, idx, w, **kw)
        if shared:
            y = y + self.shared_experts(flat)
        return y if isinstance(y, SlotRows) else y.view(shape), idx.view(*shape[:-1], -1)


# ---------------------------------------------------------------------------------------------------------
# manifold-constrained hyper-connections


def hc_pre(x, fn, base, scale, iters: int, eps: float, norm_eps: float, norm: RMSNorm | None = None, part=None,
           fp8: torch.dtype | None = None, side=None):
    """x (B, T, n, D) streams -> collapsed block input (B, T, D), post (B, T, n), comb (B, T, n, n).

    comb is projected onto doubly-stochastic matrices by Sinkhorn-Knopp (column first, then row/column).
    norm: the RMSNorm applied to the collapsed input (inside the inference kernel). part: hc_post_mix's
    partials of this mHC's mix over x (the inference kernel's input; None: computed here). fp8 (an FP8 dtype):
    a fourth output, the input's rows quantized per 1x128 tile (q, scales) by the inference kernel, or None. side:
    a CUDA stream for the inference kernel's post and comb, as in kernels.fused.hc_pre."""
    if fused_ok(x):  # inference: the decode-tuned forward
        return fused.hc_pre(x, fn, base, scale, iters, eps, norm_eps, None if norm is None else (norm.weight, norm.eps),
                            part, fp8, side)
    if use_triton(x):  # training and scoring: forward and backward kernels
        h, post, comb = mhc.hc_pre(x, fn, base, scale, iters, eps, norm_eps)
    else:
        h, post, comb = IMPL["hc_pre"](x, fn, base, scale, iters, eps, norm_eps)
    out = (h if norm is None else norm(h), post, comb)
    return out if fp8 is None else (*out, None)


def _hc_pre(x, fn, base, scale, iters: int, eps: float, norm_eps: float):
    n = x.shape[-2]
    flat = rms_unweighted(x.flatten(-2).float(), norm_eps)
    mix = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    base = base.float()
    pre = torch.sigmoid(pre_w * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + base[n:2 * n])
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * scale[2] + base[2 * n:].view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * x).sum(-2).to(x.dtype)
    return collapsed, post, comb


def hc_post(out, x, post, comb):
    """out (B, T, D) block output, x (B, T, n, D) streams -> new streams: post * out + comb^T @ x."""
    if fused_ok(x):
        return fused.hc_post(out, x, post, comb)
    if use_triton(x):
        return mhc.hc_post(out, x, post, comb)
    return IMPL["hc_post"](out, x, post, comb)


def hc_post_mix(out, x, post, comb, fn):
    """hc_post, and for inference on a GPU the partials of the next mHC's mix (weights fn) over the new streams,
    from the same kernel: -> (streams, part for that hc_pre / hc_head; None elsewhere). out may be an MoE's slot
    rows unsummed (SlotRows: MoE.forward's summed=False), which that kernel sums."""
    if fused_ok(x):
        return fused.hc_post(out, x, post, comb, fn)
    if isinstance(out, SlotRows):
        out = out.summed().view(*x.shape[:-2], -1)
    return hc_post(out, x, post, comb), None


def _hc_post(out, x, post, comb):
    mixed = torch.matmul(comb.transpose(-1, -2), x.float())
    return (post.unsqueeze(-1) * out.float().unsqueeze(-2) + mixed).to(x.dtype)


# The torch twins of the training path's fused ops: eager here, compiled by compile_fusions(). Where Triton runs
# (GPUs) the model calls the kernels in kernels/ instead (forward and backward), so this matters on CPU.
IMPL = {"rms": _rms, "rms_unweighted": _rms_unweighted, "rope": _rope, "attend": _attend,
        "attend_blocks": _attend_blocks, "swiglu": _swiglu,
        "hc_pre": _hc_pre, "hc_post": _hc_post}
EAGER = dict(IMPL)


def compile_fusions(enable: bool = True):
    """torch.compile the elementwise chains of the training path (mHC, RoPE, norms, masked softmax, SwiGLU):
    each becomes a few fused kernels forward and backward instead of dozens of passes over fp32 copies."""
    for k, f in EAGER.items():
        IMPL[k] = torch.compile(f, dynamic=True) if enable else f


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        n, D = cfg.hc_mult, cfg.hidden_size
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_id)
        self.ffn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.ffn = MoE(cfg, layer_id)
        mix = (2 + n) * n
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.empty(mix, n * D, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(mix, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))

    def hc(self, site, x, part=None, fp8=None, side=None):
        """The site's mHC pre, its collapsed input normed by the site's norm -> (normed, post, comb[, quantized]).
        part, fp8, side: as in hc_pre."""
        c = self.cfg
        return hc_pre(x, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                      getattr(self, f"hc_{site}_scale"), c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps,
                      getattr(self, f"{site}_norm"), part, fp8, side)

    def forward(self, x, input_ids, ctx, replay=None):
        """x (B, T, n, D) -> (B, T, n, D), expert ids (B, T, k)."""
        h, post, comb = self.hc("attn", x)
        x = hc_post(self.attn(h, ctx), x, post, comb)
        h, post, comb = self.hc("ffn", x)
        y, idx = self.ffn(h, input_ids, replay, ctx.get("token_mask"))
        return hc_post(y, x, post, comb), idx


# ---------------------------------------------------------------------------------------------------------
# the model


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        D, n = cfg.hidden_size, cfg.hc_mult
        self.embed = Embedding(cfg.vocab_size, D)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.head = Linear(D, cfg.vocab_size)
        self.tie_weights()
        self.hc_head_fn = nn.Parameter(torch.empty(n, n * D, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.rope_main = Rope(cfg.qk_rope_head_dim, cfg.rope_theta, None)
        self.rope_compress = Rope(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling)
        self.activation_checkpointing = False

    # -- init -------------------------------------------------------------------------------------------
    @staticmethod
    def keeps_fp32(name: str) -> bool:
        """Norms, sinks, mHC, compressor position biases and the gate bias stay fp32 in every mode."""
        leaf = name.rsplit(".", 1)[-1]
        return leaf.startswith("hc_") or leaf in ("attn_sink", "ape", "bias") or name.endswith("norm.weight")

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02):
        """Random init for training from scratch (and for tests): random_state's values, drawn on the parameters'
        device (so the same seed gives different weights on CPU and GPU)."""
        state = self.state_dict(keep_vars=True)
        for name, t in self.random_state(seed, std):
            state[name].copy_(t)
        self.reset_buffers()
        return self

    @torch.no_grad()
    def random_state(self, seed: int = 0, std: float = 0.02, device=None):
        """init_weights' values one state_dict tensor at a time, as (name, tensor on `device`; default: the
        parameters'), each in its parameter's dtype: a model too large for one device, built on meta, is
        initialized tensor by tensor into its shards (the same seed and device give init_weights' values). Hash
        tables get k distinct experts per token. A tied weight comes under each of its names."""
        dev = torch.device(device) if device is not None else next(self.parameters()).device
        g = torch.Generator(dev).manual_seed(seed)
        names = {}
        for name, t in self.state_dict(keep_vars=True).items():
            names.setdefault(id(t), []).append(name)
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            t = torch.empty(p.shape, dtype=p.dtype, device=dev)
            if leaf.endswith("_base") or leaf in ("attn_sink", "ape"):
                t.zero_()
            elif leaf.endswith("_scale") or (leaf == "weight" and p.ndim == 1):
                t.fill_(1.0)
            else:
                t.normal_(0.0, std, generator=g)
            for alias in names[id(p)]:
                yield alias, t
        for i, layer in enumerate(self.layers):
            gate = layer.ffn.gate
            if gate.hash:
                V, k, E = gate.tid2eid.shape[0], gate.topk, gate.n_experts
                yield f"layers.{i}.ffn.gate.tid2eid", torch.rand(V, E, generator=g, device=dev).argsort(-1)[:, :k]
            else:
                yield f"layers.{i}.ffn.gate.bias", torch.zeros(gate.bias.shape, dtype=gate.bias.dtype, device=dev)

    def tie_weights(self):
        """With tie_word_embeddings the head's weight is the embedding's Parameter. Again after `to_empty`, which
        gives each module a new Parameter when it leaves `meta` (the tie would break: the head stays unfilled)."""
        if self.cfg.tie_word_embeddings:
            self.head.weight = self.embed.weight
        return self

    def stored_state(self) -> dict:
        """state_dict() with each tensor once: without the aliases of tied weights (the head's, with
        tie_word_embeddings), which a safetensors checkpoint cannot hold twice."""
        seen, out = set(), {}
        for name, t in self.state_dict(keep_vars=True).items():
            if id(t) not in seen:
                seen.add(id(t))
                out[name] = t.detach()
        return out

    def reset_buffers(self):
        """Recompute non-persistent buffers (after building on `meta` and `to_empty`)."""
        self.rope_main.reset()
        self.rope_compress.reset()

    @classmethod
    def held_as(cls, name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """State tensor `name` as a model in `dtype` holds it: floats in `dtype` or fp32 (keeps_fp32), integers as
        they are."""
        return t.to(torch.float32 if cls.keeps_fp32(name) else dtype) if t.is_floating_point() else t

    def set_dtype(self, dtype: torch.dtype):
        """Cast to `dtype`, keeping norms, sinks, mHC, ape and the gate bias in fp32."""
        for name, p in self.named_parameters():
            p.data = self.held_as(name, p.data, dtype)
        return self

    # -- forward ----------------------------------------------------------------------------------------
    def rope_ctx(self, T: int, device):
        pos = torch.arange(T, device=device)
        return {"pos": pos, "main": self.rope_main(pos), "compress": self.rope_compress(pos)}

    def hc_head(self, x, part=None):
        """Final streams (B, T, n, D) -> the head's input (B, T, D): their pre-weighted collapse, normed (one
        kernel in inference, fused.hc_head; part as in hc_pre)."""
        c = self.cfg
        if fused_ok(x):
            return fused.hc_head(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.hc_eps, c.rms_norm_eps,
                                 (self.norm.weight, self.norm.eps), part)
        flat = rms_unweighted(x.flatten(-2).float(), c.rms_norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_head_fn.float()) * self.hc_head_scale.float()
                            + self.hc_head_base.float()) + c.hc_eps
        return self.norm((pre.unsqueeze(-1) * x).sum(-2).to(x.dtype))

    def forward(self, input_ids, attention_mask=None, replay_experts=None, return_routing: bool = False,
                return_hidden: bool = False, targets_mask=None, temperature: float = 1.0):
        """input_ids (B, T) integers -> logits (B, T, V) [, routing (B, T, L, k) long].

        attention_mask (B, T): 1 for real tokens, right padding only. Causality already keeps every real
        token from seeing the padding after it, so the mask is only checked here (and used for statistics).
        replay_experts (B, T, L, k): expert ids to use in the top-k layers instead of their own choice.
        return_hidden: return the final normed hidden states (B, T, D) instead of logits.
        targets_mask (B, T - 1): return instead (logp (B, T - 1) fp32 of input_ids[:, 1:] under
        logits / temperature, zero where the mask is 0; the entropy summed over the masked positions) with the
        head applied only at masked positions, in chunks, so a 129k vocabulary never makes (B, T, V) logits.
        """
        if (not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.is_floating_point()
                or input_ids.is_complex() or input_ids.dtype == torch.bool):
            raise ValueError(f"input_ids must be an integer tensor (B, T), got "
                             f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)}"
                             f"{' ' + str(input_ids.dtype) if isinstance(input_ids, torch.Tensor) else ''}")
        B, T = input_ids.shape
        if not B or not T:
            raise ValueError(f"input_ids (B, T) = {(B, T)}: at least one row of at least one token")
        if input_ids.dtype not in (torch.int64, torch.int32):
            input_ids = input_ids.long()
        if input_ids.device.type == "cpu":  # (on a GPU an id out of range is the embedding's device-side assert)
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.cfg.vocab_size:
                raise ValueError(f"input_ids: token id {lo if lo < 0 else hi} outside the vocabulary "
                                 f"[0, {self.cfg.vocab_size})")
        if attention_mask is not None:
            m = attention_mask.to(torch.int64)
            if (m[:, 1:] > m[:, :-1]).any():
                raise ValueError("attention_mask must be right-padded (ones then zeros in every row)")
        if replay_experts is not None and replay_experts.shape[:3] != (B, T, len(self.layers)):
            raise ValueError(f"replay_experts must be (B, T, L, k) = ({B}, {T}, {len(self.layers)}, k), "
                             f"got {tuple(replay_experts.shape)}")
        ctx = self.rope_ctx(T, input_ids.device)
        if attention_mask is not None:
            ctx["token_mask"] = attention_mask.bool()
        h = self.embed(input_ids)
        x = h.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()
        routing = []
        for i, layer in enumerate(self.layers):
            replay = None if replay_experts is None else replay_experts[:, :, i]
            if self.activation_checkpointing and torch.is_grad_enabled():
                # the recomputation must route exactly as the forward did: it replays the forward's choice
                seen = {}

                def run(x_, replay_, layer=layer, seen=seen):
                    first = "idx" not in seen  # the recomputation records no routing statistics
                    c = ctx if first else {k: v for k, v in ctx.items() if k != "token_mask"}
                    out, idx = layer(x_, input_ids, c, replay_ if replay_ is not None else seen.get("idx"))
                    seen.setdefault("idx", idx.detach())
                    return out, idx
                x, idx = checkpoint(run, x, replay, use_reentrant=False)
            else:
                x, idx = layer(x, input_ids, ctx, replay)
            routing.append(idx)
        h = self.hc_head(x)
        if targets_mask is not None:
            out = self.token_logprobs(h, input_ids, targets_mask, temperature)
        else:
            out = h if return_hidden else self.head(h)
        if return_routing:
            return out, torch.stack(routing, dim=2)
        return out

    def token_logprobs(self, h, ids, mask, temperature: float, chunk: int = 1024):
        """h (B, T, D), ids (B, T), mask (B, T - 1) -> (log-probs of ids[:, 1:] (B, T - 1) fp32, zero where the mask
        is 0; the entropy summed over the masked positions). The head runs on the masked positions only."""
        b, t = mask.nonzero(as_tuple=True)  # one host sync: how many positions are scored
        hs, tgt = h[b, t], ids[b, t + 1]
        if use_triton(hs) and isinstance(self.head, nn.Linear):  # one pass per chunk each way, no fp32 copies
            lp, ent = head_logprob(hs, self.head.weight, tgt, temperature, chunk)
            ent = ent.sum()
        else:
            lps, ent = [], hs.new_zeros((), dtype=torch.float32)
            for s in range(0, hs.shape[0], chunk):
                lp, e = _chunk_logprobs(self.head(hs[s:s + chunk]), tgt[s:s + chunk], temperature)
                lps.append(lp)
                ent = ent + e
            lp = torch.cat(lps) if lps else hs.new_zeros(0, dtype=torch.float32)
        return torch.zeros(mask.shape, dtype=torch.float32, device=h.device).index_put((b, t), lp), ent


def _chunk_logprobs(logits, targets, temperature: float):
    """logits (n, V), targets (n,) -> log-probs (n,) fp32 of the targets under softmax(logits / temperature), and
    that distribution's entropy summed over the rows (a statistic: no gradient). The twin of head_logprob."""
    lp = (logits.float() / temperature).log_softmax(-1)
    with torch.no_grad():
        ent = -(lp.exp() * lp).sum()
    return lp.gather(-1, targets[:, None])[:, 0], ent


def build_model(cfg: ModelConfig, device="cpu", dtype=torch.float32, seed: int | None = 0) -> Transformer:
    """Random-init model on `device` in `dtype` (fp32-kept tensors stay fp32)."""
    with torch.device(device):
        m = Transformer(cfg)
    if seed is not None:
        m.init_weights(seed)
    return m.set_dtype(dtype)
