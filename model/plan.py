"""Memory plan of a run config: per-rank bytes on the actor and rollout sides, and whether it fits.

    python -m model.plan --config configs/dsv4.yaml [dotted.key=value ...]

Actor rank: fp32 master parameters, fp32 gradients and AdamW moments (8 bytes per parameter; in host memory with
train.optimizer_offload), all sharded over the actor ranks (experts over their expert-parallel slice, then
FSDP); the working copies FSDP gathers in the compute dtype (one layer and the next plus the root's embedding and
head; every layer's with train.reshard_after_forward false); activations of one micro-batch of
rollout.max_model_len tokens a sequence, what bf16 training through the GPU kernels saves (with activation
checkpointing: every layer's input streams plus one layer's recomputation).
Rollout rank: FP8 dense linears and experts (the experts split over rollout.ep ranks) with their block scales,
the BF16/fp32 rest, the cache pools for rollout.max_seqs sequences of rollout.max_model_len tokens, and the
decode step's working set.
"""
from __future__ import annotations

import argparse
import sys

from .config import CSA, HCA, ConfigError, ModelConfig
from .model import query_block

GB = 1e9


def param_split(cfg: ModelConfig) -> dict:
    """Parameter counts: routed experts, dense (everything else), root (embedding, head, final norm / hc head),
    one layer's dense parameters at most, FP8-held linears, their 128x128 blocks."""
    D, H, hd, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    I, E, L = cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_hidden_layers
    blocks = lambda r, c: -(-r // 128) * -(-c // 128)  # noqa: E731
    fp8 = fp8_blocks = 0
    layer_dense, comp_bf16 = [], 0
    hc = 2 * ((2 + n) * n * n * D + (2 + n) * n + 3)
    fp32_kept = cfg.num_hidden_layers * (hc + 2 * D + cfg.q_lora_rank + hd + H) + n * n * D + n + 1 + D
    for i in range(L):
        lin = [(cfg.q_lora_rank, D), (H * hd, cfg.q_lora_rank), (hd, D), (cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups),
               (D, cfg.o_groups * cfg.o_lora_rank)]
        lin += [(cfg.shared_intermediate_size, D), (D, cfg.shared_intermediate_size), (cfg.shared_intermediate_size, D)] \
            if cfg.n_shared_experts else []
        other = E * D + 2 * ((2 + n) * n * n * D + (2 + n) * n + 3) + 2 * D + cfg.q_lora_rank + hd + H
        t = cfg.layer_type(i)
        if t == CSA:
            ih = cfg.index_head_dim
            lin.append((cfg.index_n_heads * ih, cfg.q_lora_rank))
            bf = 2 * D * 2 * hd + 2 * D * 2 * ih + D * cfg.index_n_heads
            other += bf + cfg.csa_ratio * 2 * (hd + ih) + hd + ih
            comp_bf16 += bf
            fp32_kept += cfg.csa_ratio * 2 * (hd + ih) + hd + ih
        elif t == HCA:
            bf = 2 * D * hd
            other += bf + cfg.hca_ratio * hd + hd
            comp_bf16 += bf
            fp32_kept += cfg.hca_ratio * hd + hd
        fp8 += sum(r * c for r, c in lin)
        fp8_blocks += sum(blocks(r, c) for r, c in lin)
        layer_dense.append(sum(r * c for r, c in lin) + other)
    root = cfg.vocab_size * D * (1 if cfg.tie_word_embeddings else 2) + D + n * n * D + n + 1
    experts = L * E * 3 * D * I
    return {"experts": experts, "dense": sum(layer_dense) + root, "root": root, "layer_dense_max": max(layer_dense),
            "layer_experts": E * 3 * D * I, "fp8_dense": fp8, "fp8_dense_blocks": fp8_blocks,
            "expert_blocks": L * E * (2 * blocks(I, D) + blocks(D, I)), "total": sum(layer_dense) + root + experts,
            "fp32_kept": fp32_kept}


def activation_bytes_per_token(cfg: ModelConfig, esize: int, kernels: bool, seq: int) -> dict:
    """Bytes autograd keeps per token of sequences of seq tokens, by part: "layers" = each layer's saved tensors,
    "stream" = a layer's input streams (what activation checkpointing keeps), "head" = the final collapse, norm and
    the head's logits of every scored position (the chunked head keeps them for the backward); and "position" =
    bytes a position rather than a token (the RoPE tables, shared by the micro-batch's sequences).
    kernels: bf16 training on GPUs (the Triton kernels forward and backward: each mHC keeps its bf16 input streams
    and a few fp32 numbers a token, RMSNorm its input), fitted to the saved tensors on an H200 (mini.yaml's dims and
    a narrower variant, 1-4k tokens a sequence; tests/test_gpu.py keeps the plan within 1.0-1.1x of them). Else the
    torch twins (CPU: mHC keeps fp32 stream copies and the Sinkhorn iterates), fitted at 128 tokens with no term
    for seq (tests/test_plan.py: within 1.0-1.5x). Either way attention keeps only each query chunk's inputs (its
    logits are recomputed in backward)."""
    D, H, hd, n, k = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult, cfg.num_experts_per_tok
    I, Is, E, q, W = cfg.moe_intermediate_size, cfg.shared_intermediate_size, cfg.n_routed_experts, cfg.q_lora_rank, \
        cfg.sliding_window
    og, ol = cfg.o_groups, cfg.o_lora_rank
    out = {"stream": esize * n * D, "head": 4 * (2 * n * D + 3 * D) + esize * D + esize * cfg.vocab_size,
           "position": 8 * cfg.qk_rope_head_dim}  # cos and sin, fp32, of the main and compressed RoPE
    if not kernels:
        hc_site = 4 * (3 * n * D + (2 + n) * n * 4 + 2 * cfg.hc_sinkhorn_iters * (n * n + n)) + esize * n * D
        attn = esize * (4 * D + 2 * q + 5 * H * hd + 6 * hd + 2 * og * ol) + 4 * H * hd
        moe = 4 * (D + 3 * E) + esize * (2 * k * D + 4 * k * I + 4 * Is + 2 * D)
        return {**out, "layers": [2 * hc_site + attn + moe + 4 * n * D * 2] * cfg.num_hidden_layers}
    # each mHC site: its input streams, the collapsed row (the norm's input) and the sublayer's output, and fp32
    # mix pre-activations, sum of squares, pre, post and comb
    hc = 2 * (esize * (n * D + 2 * D) + 4 * ((2 + n) * n + n * n + 2 * n + 1))
    # attention pads the sequence to whole query blocks (pad: padded / real tokens); the checkpointed chunks keep
    # the padded q heads, each block's bq + W keys and its (bq, bq + W) mask
    bq = query_block(W, seq)
    pad = -(-seq // bq) * bq / seq
    attn = esize * (D + 2 * q + 2 * H * hd + H * hd * pad + hd + hd * pad * (bq + W) / bq + og * ol) \
        + (bq + W) * pad + 8 * H + 16
    moe = 4 * (D + 4 * E) + 16 * k + esize * (2 * k * D + 3 * k * I) + (esize * (D + 3 * Is) if cfg.n_shared_experts
                                                                       else 0)
    layers = []
    for i in range(cfg.num_hidden_layers):
        t, extra = cfg.layer_type(i), 0.0
        if t in (CSA, HCA):  # the (seq, seq / r) mask of the entries a query sees, the entries, the compressor's
            # fp32 kv and gate series (two with CSA's overlap)
            r = cfg.csa_ratio if t == CSA else cfg.hca_ratio
            extra = pad * seq / r + esize * hd / r + 8 * hd * (2 if t == CSA else 1) + 4 * hd / r + 128
        layers.append(hc + attn + moe + extra)
    return {**out, "layers": layers}


def activations(cfg: ModelConfig, tokens: int, esize: int, checkpointing: bool, kernels: bool = True,
                seq: int | None = None) -> dict:
    """Saved activation bytes of a micro-batch of `tokens` tokens in sequences of `seq` (default: one sequence):
    kept through the forward, and the transient recompute peak. kernels: as in activation_bytes_per_token."""
    seq = seq or tokens
    a = activation_bytes_per_token(cfg, esize, kernels, seq)
    per_seq = seq * a["position"]
    if checkpointing:
        return {"kept": tokens * (cfg.num_hidden_layers * a["stream"] + a["head"]) + per_seq,
                "recompute": tokens * max(a["layers"])}
    return {"kept": tokens * (sum(a["layers"]) + a["stream"] + a["head"]) + per_seq, "recompute": 0.0}


def attention_chunk_bytes(cfg: ModelConfig, seq: int, chunk: int = 512) -> float:
    """Transient peak of one attention query chunk in backward: fp32 logits, probabilities and their gradient
    over the window, the chunk and every compressed entry."""
    keys = min(seq, chunk) + cfg.sliding_window + seq // cfg.csa_ratio
    return 4 * 4 * cfg.num_attention_heads * min(seq, chunk) * keys


def plan(run) -> dict:
    """run: train_grpo.RunConfig. -> {"actor": {...}, "rollout": {...}, "host": {...}, "fits": bool, ...}."""
    cfg, dep, tr, ro = run.model, run.deploy, run.train, run.rollout
    if not dep.world_size:
        raise ConfigError("deploy.world_size: the plan needs the world size (0 means any world to the trainer)")
    run.validate_world(dep.world_size)  # the trainer's rank checks: ep, rollout ranks, the batch split
    ps = param_split(cfg)
    n_actor = dep.world_size - dep.rollout_ranks
    # a micro-batch as the trainer cuts one: train.micro_batch (0: all) of a rank's share of a mini-batch
    share = tr.prompts_per_step * tr.group_size // (tr.minibatches * n_actor)
    micro = min(tr.micro_batch, share) if tr.micro_batch else share
    esize = 2 if tr.dtype == "bf16" else 4
    per_param = ps["total"] / n_actor
    a = {"params (fp32 master)": 4 * per_param, "grads (fp32)": 4 * per_param,
         "optimizer (AdamW moments)": 0.0 if tr.optimizer_offload else 8 * per_param}
    local_experts_layer = ps["layer_experts"] / tr.ep
    gathered = 2 * (ps["layer_dense_max"] + local_experts_layer) + ps["root"] if tr.reshard_after_forward \
        else ps["dense"] + cfg.num_hidden_layers * local_experts_layer  # every block's copy, forward to backward
    a["FSDP working copies"] = esize * gathered \
        + 4 * (ps["layer_dense_max"] + local_experts_layer)  # one layer's unsharded fp32 gradient for reduce
    tokens = micro * ro.max_model_len
    act = activations(cfg, tokens, esize, tr.activation_checkpointing, seq=ro.max_model_len)
    a["activations"] = act["kept"]
    a["one layer recomputed (transient)"] = act["recompute"]
    a["attention chunk (transient)"] = micro * attention_chunk_bytes(cfg, ro.max_model_len)
    a["logits (chunked head)"] = 3 * 4 * min(tokens, 1024) * cfg.vocab_size
    sync = 2 * ro.sync_bucket_mb * 2 ** 20  # two persistent buckets each side (GraphPacker / WeightApplier)
    a["weight-sync buckets (rank 0)"] = sync
    # rollout
    E = cfg.n_routed_experts
    rs = 2 if ro.dtype == "bf16" else 4
    fp8 = 1 if ro.fp8 else rs
    buffers = 4 * E * (cfg.num_hidden_layers - cfg.num_hash_layers) + 8 * cfg.vocab_size * cfg.num_experts_per_tok * cfg.num_hash_layers
    r = {"dense FP8 linears": fp8 * ps["fp8_dense"] + (4 * ps["fp8_dense_blocks"] if ro.fp8 else 0),
         "other weights (BF16/fp32)": rs * (ps["dense"] - ps["fp8_dense"] - ps["fp32_kept"]) + 4 * ps["fp32_kept"]
         + buffers,
         "routed experts": (fp8 * ps["experts"] + (4 * ps["expert_blocks"] if ro.fp8 else 0)) / ro.ep}
    r["cache pools"] = cache_bytes(cfg, ro.max_seqs, ro.max_model_len, rs, num_blocks=ro.num_blocks)
    r["weight-sync buckets"] = sync
    S = ro.max_model_len // cfg.csa_ratio
    r["decode working set"] = ro.max_seqs * (4 * (cfg.vocab_size * 3 + S * 2) + rs * 64 * cfg.hidden_size) \
        + ro.max_seqs * cfg.num_experts_per_tok * rs * cfg.moe_intermediate_size * 4
    gpu = dep.gpu_memory_gb * GB
    usable = 0.95 * gpu
    per_node_actor = min(dep.gpus_per_node, n_actor)
    host = {"actor node: AdamW moments": (8 * per_param * per_node_actor) if tr.optimizer_offload else 0.0}
    fits_actor = sum(a.values()) <= usable
    fits_rollout = sum(r.values()) <= usable
    fits_host = sum(host.values()) <= 0.9 * dep.host_memory_gb * GB
    return {"actor": a, "rollout": r, "host": host, "params": ps, "n_actor": n_actor, "gpu_bytes": gpu,
            "fits_actor": fits_actor, "fits_rollout": fits_rollout, "fits_host": fits_host,
            "fits": fits_actor and fits_rollout and fits_host}


def cache_bytes(cfg: ModelConfig, max_seqs: int, max_len: int, esize: int, block_entries: int = 64,
                num_blocks: int = 0) -> float:
    """The paged engine's pools (rollout_server.PagedCache) at full capacity: max_seqs + 1 slots (window ring,
    compressor buffers and overlap series) and max_seqs x max_blocks + 1 blocks of compressed entries (and fp32
    indexer keys for CSA); num_blocks > 0: that many blocks a pool (rollout.num_blocks)."""
    slot, block = 0, {"csa": 0, "hca": 0}
    for i in range(cfg.num_hidden_layers):
        slot += cfg.sliding_window * cfg.head_dim * esize
        t = cfg.layer_type(i)
        if t == CSA:
            r, hd, ih = cfg.csa_ratio, cfg.head_dim, cfg.index_head_dim
            slot += 4 * r * (2 * 2 * hd + 2 * hd) + 4 * r * (2 * 2 * ih + 2 * ih)
            block["csa"] += block_entries * (hd * esize + ih * 4)
        elif t == HCA:
            slot += 4 * cfg.hca_ratio * 2 * cfg.head_dim
            block["hca"] += block_entries * cfg.head_dim * esize
    blocks = {k: num_blocks or max_seqs * n + 1 for k, n in cfg.seq_blocks(max_len, block_entries).items()}
    return (max_seqs + 1) * slot + sum(blocks[k] * block[k] for k in block)


def report(run, p: dict) -> str:
    lines = [f"model: {p['params']['total'] / 1e9:.2f}B parameters ({p['params']['experts'] / 1e9:.2f}B in routed "
             f"experts); {p['n_actor']} actor ranks (ep={run.train.ep}), {run.deploy.rollout_ranks} rollout ranks "
             f"(ep={run.rollout.ep}); {run.deploy.gpu_memory_gb:g} GB per GPU, {run.deploy.host_memory_gb:g} GB host "
             f"memory per node of {run.deploy.gpus_per_node} GPUs"]
    for role, key in (("actor rank", "actor"), ("rollout rank", "rollout"), ("host", "host")):
        lines.append(f"{role}:")
        for k, v in p[key].items():
            lines.append(f"  {k:<32} {v / GB:10.2f} GB")
        cap = (0.95 * p["gpu_bytes"] if key != "host" else 0.9 * run.deploy.host_memory_gb * GB) / GB
        lines.append(f"  {'total':<32} {sum(p[key].values()) / GB:10.2f} GB of {cap:.1f} GB usable")
    verdict = "fits" if p["fits"] else "does not fit"
    why = [k for k in ("actor", "rollout", "host") if not p[f"fits_{k}"]]
    lines.append(verdict + ("" if p["fits"] else f" ({', '.join(why)} over)"))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Per-rank memory plan of a run config.")
    ap.add_argument("--config", required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    sys.path.insert(0, ".")
    from train_grpo import RunConfig
    try:
        run = RunConfig.load(args.config, args.overrides)
        p = plan(run)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    print(report(run, p))
    return p


if __name__ == "__main__":
    main()
