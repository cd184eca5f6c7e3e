"""Weight I/O in the DeepSeek-V4 release layout: safetensors + JSON only (no pickle anywhere).

Reading (`load_pretrained`): `config.json` + `*.safetensors` (sharded through `model.safetensors.index.json` or
not), official names or `transformers` names, with or without the `model.` prefix. FP8 e4m3 weights carry 128x128
block scales as `<name>.scale` (E8M0) or `<name>.weight_scale_inv` (fp32); MXFP4 experts are int8-packed e2m1
pairs with one E8M0 scale per 32 values. The model is built on `meta`, allocated once on the target device,
and filled one tensor at a time from memory-mapped shards, so a checkpoint is never held twice.

Writing (`save_pretrained`): official names, BF16 (fp32 for the tensors the model keeps in fp32), or FP8 with
E8M0 block scales for the dense and expert linears; shards of at most `max_shard_bytes` plus an index.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from kernels.quant import BLOCK, dequant_fp8_block, dequant_mxfp4, quant_fp8_block

from .config import ModelConfig, load_hf_config, strict_json
from .model import Experts, Transformer

FLOAT8 = {torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2}
FLOATS = {torch.float32, torch.bfloat16, torch.float16, torch.float64}
INTS = {torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8}
FP4 = {torch.int8, torch.uint8} | ({torch.float4_e2m1fn_x2} if hasattr(torch, "float4_e2m1fn_x2") else set())

# transformers' module names -> release names (applied in order, after stripping a leading "model.")
_HF_TO_OFFICIAL = [(re.compile(a), b) for a, b in [
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.kv_norm\.", ".norm."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.sinks$", ".attn_sink"),
    (r"\.position_bias$", ".ape"),
    (r"\.e_score_correction_bias$", ".bias"),
]]
_EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
_FUSED = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(gate_up_proj|down_proj)$")
# linears stored FP8 in the release (compressor/indexer-key projections, router, embed and head stay BF16)
FP8_LINEAR = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|indexer\.wq_b|shared_experts\.w[123])\.weight$")
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")


class WeightError(ValueError):
    """A checkpoint tensor is missing, unexpected, misshapen or of an unknown dtype (the message names it)."""


def official_name(key: str) -> str:
    name = key[len("model."):] if key.startswith("model.") else key
    for pat, rep in _HF_TO_OFFICIAL:
        name = pat.sub(rep, name)
    return name


def _open(f: Path):
    """A safetensors file's handle (memory-mapped), or a WeightError naming the file (safetensors raises its own
    error types for truncated or corrupt files)."""
    try:
        return safe_open(f, framework="pt")
    except Exception as e:
        raise WeightError(f"{f}: cannot read safetensors file ({e})") from None


def _checkpoint_files(path: Path) -> tuple[list[Path], dict[str, str]]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            wm = strict_json(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError, OSError) as e:  # (JSON syntax, a key given twice, not text)
            raise WeightError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        if not isinstance(wm, dict) or not all(isinstance(f, str) and f for f in wm.values()):
            raise WeightError(f"{index}: weight_map must map tensor names to shard file names")
        files = sorted({path / f for f in wm.values()})
        for f in files:
            if not f.exists():
                raise WeightError(f"{index}: lists shard {f.name}, which does not exist")
        return files, wm
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightError(f"{path}: no *.safetensors files and no model.safetensors.index.json")
    wm = {}
    for f in files:
        with _open(f) as h:
            for k in h.keys():
                if k in wm:
                    raise WeightError(f"{path}: tensor '{k}' is in both {wm[k]} and {f.name} (and no "
                                      f"model.safetensors.index.json says which to read)")
                wm[k] = f.name
    return files, wm


class _Shards:
    """Lazily opened, memory-mapped shard handles."""

    def __init__(self, root: Path, weight_map: dict[str, str]):
        self.root, self.wm, self.handles = root, weight_map, {}
        self.unused_scales: dict[str, str] = {}  # a BF16 / FP16 / FP32 tensor's key -> the block scale beside it

    def get(self, key: str) -> torch.Tensor:
        fname = self.wm[key]
        if fname not in self.handles:
            self.handles[fname] = _open(self.root / fname)
        try:
            return self.handles[fname].get_tensor(key)
        except Exception as e:
            raise WeightError(f"{self.root / fname}: cannot read tensor '{key}' ({e})") from None

    def is_scale(self, key: str) -> bool:
        """`<m>.scale` / `<m>.weight_scale_inv` next to a `<m>.weight` (not e.g. transformers' `attn_hc.scale`), or
        `<t>_scale_inv` next to a `<t>` (transformers' FP8 fused experts: `experts.gate_up_proj_scale_inv`)."""
        for suf in _SCALE_SUFFIXES:
            if key.endswith(suf) and key[: -len(suf)] + ".weight" in self.wm:
                return True
        return key.endswith("_scale_inv") and key[: -len("_scale_inv")] in self.wm

    @staticmethod
    def scale_names(key: str) -> list[str]:
        if key.endswith(".weight"):
            return [key[: -len(".weight")] + suf for suf in _SCALE_SUFFIXES]
        return [key + "_scale_inv"]

    def scale_for(self, key: str) -> str | None:
        return next((k for k in self.scale_names(key) if k in self.wm), None)


def _decode(key: str, t: torch.Tensor, shards: _Shards, device, halves: int = 1, rows: slice | None = None
            ) -> torch.Tensor:
    """Raw checkpoint tensor -> a floating (or integer) tensor on `device`, dequantized if it has a scale.
    halves 2 (a fused gate_up_proj): FP8 block scales may cover the gate and up halves apart (transformers gives
    each half its own rows of blocks where the half is not a whole number of 128-row blocks). rows: the dim-0
    slice (of a stacked expert tensor) wanted, taken before the copy and the dequantization."""
    scale_key = shards.scale_for(key)
    if t.dtype in FLOAT8 and scale_key is None:
        raise WeightError(f"tensor '{key}' is {t.dtype} but has no block scale "
                          f"({' or '.join(repr(k) for k in shards.scale_names(key))})")
    full = tuple(t.shape)
    if rows is not None:
        t = t[rows]
    if t.dtype in FLOAT8 or (t.dtype in FP4 and scale_key is not None):
        s = shards.get(scale_key)
        if s.ndim != len(full) or tuple(s.shape[:-2]) != full[:-2]:
            raise WeightError(f"tensor '{key}' {full}: its scale '{scale_key}' has shape {tuple(s.shape)}")
        s, t = (s if rows is None else s[rows]).to(device), t.to(device)
        try:
            if t.dtype in FP4:
                return dequant_mxfp4(t, s, torch.float32)
            n = t.shape[-2] // halves
            if halves > 1 and n % BLOCK and s.shape[-2] == halves * -(-n // BLOCK):  # each half its own block rows
                r = s.shape[-2] // halves
                return torch.cat([dequant_fp8_block(t[..., h * n:(h + 1) * n, :], s[..., h * r:(h + 1) * r, :],
                                                    torch.float32, BLOCK) for h in range(halves)], -2)
            return dequant_fp8_block(t, s, torch.float32, BLOCK)
        except ValueError as e:
            raise WeightError(f"tensor '{key}' with scale '{scale_key}': {e}") from None
    if t.dtype in FLOATS or t.dtype in INTS:
        if scale_key is not None and t.dtype in FLOATS:
            shards.unused_scales.setdefault(key, scale_key)
        return t.to(device)
    raise WeightError(f"tensor '{key}' has unsupported dtype {t.dtype}")


def _rows(t: torch.Tensor) -> tuple[int, int]:
    """(first global row, rows) held here: all of a plain tensor, this rank's dim-0 shard of an FSDP2 DTensor."""
    from .parallel import shard_rows
    return shard_rows(t)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def load_state(model: Transformer, path: str | Path, device=None, progress: bool = True, sink=None) -> None:
    """Fill every parameter and persistent buffer of `model` (already allocated) from a checkpoint directory.

    Sharded models load only what this rank holds: the experts of its EP slice (others are never read) and the
    dim-0 rows of its FSDP shards.
    sink(target, tensor): each tensor goes there instead, one at a time, as `model` would hold it (its dtype, read
    and dequantized on `device`); `model` (on meta, say: nothing of it is written) then names, shapes and checks
    them. target: a state_dict name, or (name of an Experts stack, its local expert index) for one routed expert."""
    path = Path(path)
    files, wm = _checkpoint_files(path)
    shards = _Shards(path, wm)
    if device is None and sink is not None:
        raise ValueError("load_state: a sink needs the device to read onto")
    device = torch.device(device) if device is not None else _local(next(model.parameters())).device
    targets = dict(model.state_dict(keep_vars=True))
    tied = model.cfg.tie_word_embeddings
    filled: set = set()
    sources: dict = {}  # what each model tensor (or (experts leaf, expert)) is loaded from
    experts = {n: m for n, m in model.named_modules() if isinstance(m, Experts)}
    E = model.cfg.n_routed_experts

    def claim(target, key):
        """One checkpoint tensor per model tensor: two (e.g. `model.norm.weight` and `norm.weight`) are an error,
        not the later one winning."""
        if target in sources:
            what = target if isinstance(target, str) else f"{target[0]} of expert {target[1]}"
            raise WeightError(f"{path}: tensors '{sources[target]}' and '{key}' both load '{what}'")
        sources[target] = key

    def check_kind(label, src, dst):
        if src.is_floating_point() != dst.is_floating_point():
            raise WeightError(f"tensor '{label}': {src.dtype} in the checkpoint, the model holds {dst.dtype}"
                              + (" (packed FP4 needs its scale)" if src.dtype in FP4 else ""))

    nans: list[tuple[str, torch.Tensor]] = []  # (checkpoint key, whether its decoded values hold a NaN), read once

    def check_nan(label, t):  # (a NaN weight or scale would only show as NaN log-probs later; inf may be meant)
        if t.is_floating_point() and t.numel():  # amax propagates NaN (and not inf): one read, ~10x isnan().any()
            nans.append((label, t.amax().isnan()))

    def check_ids(label, name, t):  # hash layers' token -> expert tables must name experts of this config
        if name.endswith(".tid2eid") and t.numel() and (int(t.min()) < 0 or int(t.max()) >= E):
            raise WeightError(f"{path}: tensor '{label}' holds expert ids from {int(t.min())} to {int(t.max())}, but "
                              f"config.json has n_routed_experts = {E}")

    def put(name, dst, src, label):
        start, n = _rows(dst)
        full_shape = tuple(dst.shape)
        if full_shape != tuple(src.shape):
            raise WeightError(f"tensor '{label}': shape {tuple(src.shape)} in the checkpoint, the model "
                              f"(config.json) expects {full_shape}")
        check_kind(label, src, dst)
        check_ids(label, name, src)
        check_nan(label, src)
        with torch.no_grad():
            if sink is not None:
                sink(name, src[start:start + n].to(dst.dtype))
            else:
                _local(dst).copy_(src[start:start + n].to(_local(dst).dtype))
        filled.add(name)

    def put_expert(stack, param, e, t):  # routed expert e of this rank's (a local index) into Experts stack `stack`
        with torch.no_grad():
            if sink is not None:
                sink((stack, e), t.to(param.dtype))
            else:
                _local(param)[e].copy_(t)

    def own_experts(mod, leaf):
        """Local expert indices whose rows this rank holds."""
        start, n = _rows(getattr(mod, leaf))
        return range(start, start + n), start

    by_file: dict[str, list[str]] = {}
    for k, f in wm.items():
        by_file.setdefault(f, []).append(k)
    for f in tqdm(files, desc=f"loading {path.name}", unit="shard", disable=not progress):
        for key in sorted(by_file.get(f.name, [])):
            if shards.is_scale(key):
                continue
            name = official_name(key)
            if name.startswith("mtp."):
                continue  # multi-token-prediction layers: not part of the decoder we build
            m = _EXPERT.match(name) or _FUSED.match(name)
            if m is not None:
                mod = experts.get(m.group(1))
                if mod is None:
                    raise WeightError(f"tensor '{key}': no layer '{m.group(1)}' in this config")
                if m.re is _EXPERT:
                    g = int(m.group(2))
                    if g >= E:
                        raise WeightError(f"tensor '{key}': expert {g}, but config.json has n_routed_experts = {E}")
                    claim((f"{m.group(1)}.{m.group(3)}", g), key)
                    e = g - mod.expert_offset
                    rows, start = own_experts(mod, m.group(3))
                    if e in rows:
                        t = _decode(key, shards.get(key), shards, device)
                        param = getattr(mod, m.group(3))
                        if tuple(t.shape) != tuple(param.shape[1:]):
                            raise WeightError(f"tensor '{key}': shape {tuple(t.shape)} in the checkpoint, the model "
                                              f"(config.json) expects {tuple(param.shape[1:])}")
                        check_kind(key, t, param)
                        check_nan(key, t)
                        put_expert(f"{m.group(1)}.{m.group(3)}", param, e - start, t)
                        filled.add((f"{m.group(1)}.{m.group(3)}", e))
                    continue
                gate_up = m.group(2) == "gate_up_proj"
                leaves = ("w1", "w3") if gate_up else ("w2",)
                w = getattr(mod, leaves[0])
                want = (E, 2 * w.shape[1], w.shape[2]) if gate_up else (E, *w.shape[1:])
                raw = shards.get(key)
                rows, start = own_experts(mod, leaves[0])  # (w1, w3 and w2 hold the same experts)
                lo = mod.expert_offset
                held = slice(lo + rows.start, lo + rows.stop)  # this rank's experts only: decoded, copied
                if raw.ndim != 3 or raw.shape[0] != E:
                    raise WeightError(f"tensor '{key}': shape {tuple(raw.shape)} in the checkpoint, the model "
                                      f"(config.json) expects {want} (experts x rows x columns)")
                t = _decode(key, raw, shards, device, halves=2 if gate_up else 1, rows=held)
                if tuple(t.shape[1:]) != want[1:]:
                    raise WeightError(f"tensor '{key}': shape {(E, *t.shape[1:])} in the checkpoint (decoded), the "
                                      f"model (config.json) expects {want} (experts x rows x columns)")
                check_kind(key, t, w)
                check_nan(key, t)
                inter = want[1] // 2
                for leaf in leaves:
                    for g in range(E):
                        claim((f"{m.group(1)}.{leaf}", g), key)
                    part = t if leaf == "w2" else (t[:, :inter] if leaf == "w1" else t[:, inter:])
                    for e in rows:
                        put_expert(f"{m.group(1)}.{leaf}", getattr(mod, leaf), e - start, part[e - rows.start])
                        filled.add((f"{m.group(1)}.{leaf}", e))
                continue
            if name == "head.weight" and tied:
                continue
            if name not in targets:
                raise WeightError(f"{path / f.name}: tensor '{key}' (as '{name}') is not part of a DeepSeek-V4 "
                                  f"model with this config.json")
            claim(name, key)
            put(name, targets[name], _decode(key, shards.get(key), shards, device), key)

    if nans:
        flags = torch.stack([f for _, f in nans]).tolist()
        bad = [key for (key, _), f in zip(nans, flags) if f]
        if bad:
            raise WeightError(f"{path}: {len(bad)} tensor(s) hold NaN (after dequantization, if scaled), first: "
                              f"{bad[:5]}")
    missing, n_missing = [], 0
    for name in targets:
        mod_name, _, leaf = name.rpartition(".")
        if mod_name in experts:
            mod = experts[mod_name]
            rows, _ = own_experts(mod, leaf)
            lacking = [e for e in rows if (name, e) not in filled]
            if lacking:
                missing.append(f"{mod_name}.{lacking[0] + mod.expert_offset}.{leaf}.weight (and {len(lacking) - 1} "
                               f"more experts)")
                n_missing += len(lacking)
        elif name not in filled and not (tied and name == "head.weight"):
            missing.append(name)
            n_missing += 1
    if missing:
        raise WeightError(f"{path}: checkpoint lacks {n_missing} tensor(s), first: {missing[:5]}")
    if shards.unused_scales:  # which is meant cannot be told: say it, and read the values as stored
        key, scale = next(iter(shards.unused_scales.items()))
        warnings.warn(f"{path}: {len(shards.unused_scales)} tensor(s) stored in a float dtype have a block scale "
                      f"beside them, not applied (first: '{key}' with '{scale}'): right for a checkpoint upcast "
                      f"from FP8 that kept its scales; if the scales were meant, its values are off by them",
                      stacklevel=2)


_SHARED_W1 = re.compile(r"^layers\.\d+\.ffn\.shared_experts\.w1\.weight$")


def shared_experts_held(path: Path, cfg: ModelConfig) -> ModelConfig:
    """cfg with n_shared_experts as the checkpoint holds them: the rows of its first shared expert's w1 over
    moe_intermediate_size. transformers' DeepseekV4 writes one shared expert of moe_intermediate_size rows
    whatever its config's n_shared_experts says (0 and 2 included); DeepSeek's layout writes n_shared_experts x
    moe_intermediate_size rows. A directory without safetensors files, or a checkpoint without shared experts,
    keeps cfg (load_state then reports the missing tensors). load_hf_config calls it on checkpoint directories."""
    if not (path / "model.safetensors.index.json").exists() and not any(path.glob("*.safetensors")):
        return cfg
    _, wm = _checkpoint_files(path)
    key = next((k for k in sorted(wm) if _SHARED_W1.match(official_name(k))), None)
    if key is None:
        return cfg
    with _open(path / wm[key]) as h:
        rows = h.get_slice(key).get_shape()[0]
    if rows == cfg.shared_intermediate_size or rows % cfg.moe_intermediate_size:
        return cfg  # as configured, or a shape load_state reports
    return dataclasses.replace(cfg, n_shared_experts=rows // cfg.moe_intermediate_size)


def stored_scale_fmt(path: str | Path) -> str:
    """The block-scale format of a checkpoint's FP8 weights: "ue8m0" where its config.json's quantization_config
    says scale_fmt ue8m0 (the release's power-of-two scales, as save_pretrained(fp8=True) writes them), else
    "fp32". Quantized again in that format, the weights load_pretrained dequantized give back the stored bits."""
    try:
        q = json.loads((Path(path) / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):  # load_pretrained names what is wrong with the file
        return "fp32"
    return "ue8m0" if isinstance(q, dict) and q.get("scale_fmt") == "ue8m0" else "fp32"


def float_dtype(dtype, who: str) -> torch.dtype:
    """dtype as a torch float dtype of the weights: torch.float32 / bfloat16 / float16, or its name ("bfloat16",
    "torch.bfloat16", or the configs' short "bf16" / "fp32" / "fp16"); anything else is a ValueError naming `who`."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        named = getattr(torch, name, None)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(
            name, named if isinstance(named, torch.dtype) else dtype)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{who}: dtype {dtype!r}: torch.float32, torch.bfloat16 or torch.float16")
    return dtype


def load_pretrained(path: str | Path, device="cpu", dtype: torch.dtype = torch.float32, progress: bool = True,
                    cfg: ModelConfig | None = None, experts: tuple[int, int] | None = None) -> Transformer:
    """Read a DeepSeek-V4 checkpoint directory (config.json + safetensors) into a Transformer in eval mode.

    Tensors the model keeps in fp32 (norms, sinks, mHC, ape, gate bias) stay fp32; everything else is `dtype`
    (or its name). device None: torch's default device.
    experts (size, rank): each layer holds only routed experts [rank * E / size, (rank + 1) * E / size), an
    expert-parallel rank's share (Experts.expert_offset; the other experts' tensors are never read). Such a
    model is a holder of weights for the rollout engine, not one to call: its routing reaches all E experts.
    """
    if isinstance(device, torch.dtype):
        raise TypeError(f"load_pretrained: device {device!r} is a dtype (pass it as dtype=)")
    device = torch.get_default_device() if device is None else device
    model = pretrained_skeleton(path, dtype, cfg, experts)
    model.to_empty(device=device).tie_weights()
    load_state(model, path, device, progress)
    model.reset_buffers()
    return model.eval()


def pretrained_skeleton(path: str | Path, dtype: torch.dtype = torch.float32, cfg: ModelConfig | None = None,
                        experts: tuple[int, int] | None = None, who: str = "load_pretrained") -> Transformer:
    """The model a checkpoint directory holds (load_pretrained's arguments), on meta: its modules, tensor names,
    shapes and dtypes, no storage. load_state fills it, or streams the tensors elsewhere (its sink)."""
    dtype = float_dtype(dtype, who)
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a directory")
    cfg = cfg or load_hf_config(path)
    with torch.device("meta"):
        model = Transformer(cfg)
        if experts is not None:
            size, rank = experts
            E = cfg.n_routed_experts
            if not (0 <= rank < size and E % size == 0):
                raise ValueError(f"{who}: experts=(size {size}, rank {rank}): size must divide the "
                                 f"{E} routed experts and rank be in [0, size)")
            for mod in model.modules():
                if isinstance(getattr(mod, "experts", None), Experts):
                    mod.experts = Experts(cfg, E // size, rank * (E // size))
    return model.set_dtype(dtype)


# ---------------------------------------------------------------------------------------------------------
# writing


def release_tensors(named, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(state_dict name, full tensor) pairs -> (release name, tensor): stacked experts split per expert."""
    for name, t in named:
        m = re.match(r"^(layers\.\d+\.ffn\.experts)\.(w[123])$", name)
        if m is not None:
            for e in range(t.shape[0]):
                yield f"{m.group(1)}.{e}.{m.group(2)}.weight", t[e]
        elif name == "head.weight" and cfg.tie_word_embeddings:
            continue
        else:
            yield name, t


def export_tensors(model: Transformer) -> Iterator[tuple[str, torch.Tensor]]:
    """(release name, tensor) for every tensor of an unsharded model."""
    return release_tensors(model.state_dict().items(), model.cfg)


def process_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (/proc/self/status, 4.7+): setting it to
    read it back would give files another thread creates meanwhile the mode 0666."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o077)  # (the brief window then errs toward private files)
        os.umask(mask)
        return mask


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None):
    """safetensors' save_file, the file then given the mode open() gives new files (0666 less the umask): safetensors
    0.8 creates its files 0600 whatever the umask, so a checkpoint's weights were unreadable to other users
    (a serving process under another account) while its config.json beside them was readable."""
    save_file(tensors, str(path), metadata=metadata)
    try:
        os.chmod(path, 0o666 & ~process_umask())
    except OSError:  # a filesystem without modes (some network / FUSE mounts): the file is written, keep it as is
        pass


def save_pretrained(model: Transformer | None, path: str | Path, fp8: bool = False, dtype=torch.bfloat16,
                    max_shard_bytes: int = 5 * 2 ** 30, cfg: ModelConfig | None = None,
                    tensors: Iterable[tuple[str, torch.Tensor]] | None = None, progress: bool = False) -> Path:
    """Write config.json + sharded safetensors + index in the release layout.

    fp8=True stores the dense attention/shared-expert/expert linears as float8_e4m3fn with E8M0 128x128 block
    scales (`<name>.scale`). `tensors` (release name, full tensor) replaces `model` for sharded callers.
    Files are written under temporary names and renamed; the index is written last.
    """
    dtype = float_dtype(dtype, "save_pretrained")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = cfg or model.cfg
    tensors = tensors if tensors is not None else export_tensors(model)
    quant = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
             "weight_block_size": [BLOCK, BLOCK]} if fp8 else None

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    written: list[tuple[str, dict]] = []

    def flush():
        nonlocal size
        if shards[-1]:
            tmp = path / f".tmp-shard-{len(written)}.safetensors"
            save_tensors(shards[-1], tmp, metadata={"format": "pt"})
            written.append((tmp.name, {k: None for k in shards[-1]}))
            shards[-1] = {}
            size = 0

    total = 0
    for name, t in tqdm(tensors, desc="saving", unit="tensor", disable=not progress):
        t = t.detach()
        out: dict[str, torch.Tensor] = {}
        if fp8 and t.ndim == 2 and (FP8_LINEAR.search(name) or _EXPERT.match(name)):
            q, s = quant_fp8_block(t, torch.float8_e4m3fn, BLOCK, "ue8m0")
            out[name], out[name[: -len(".weight")] + ".scale"] = q, s
        else:
            out[name] = Transformer.held_as(name, t, dtype)
        for k, v in out.items():
            v = v.contiguous().cpu()
            nbytes = v.numel() * v.element_size()
            if size and size + nbytes > max_shard_bytes:
                flush()
            shards[-1][k] = v
            size += nbytes
            total += nbytes
    flush()

    n = len(written)
    weight_map = {}
    for i, (tmp, keys) in enumerate(written):
        final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(path / tmp, path / final)
        weight_map.update({k: final for k in keys})
    (path / "config.json").write_text(json.dumps(cfg.to_hf_config(quant, str(dtype).removeprefix("torch.")), indent=2))
    index_tmp = path / ".tmp-index.json"
    index_tmp.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    os.replace(index_tmp, path / "model.safetensors.index.json")
    return path


def transformers_deepseek_v4():
    """transformers' (DeepseekV4Config, DeepseekV4ForCausalLM): the oracle of the tests and the peer of
    bench/rollout.py, with the Hub's kernels off (USE_HUB_KERNELS=0: from_pretrained would otherwise kernelize the
    model from the Hub; they replace no DeepseekV4 layer). That transformers imports the Hub's `kernels` package
    where our kernels/ shadows it is kernels/__init__.py's part."""
    os.environ["USE_HUB_KERNELS"] = "0"
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    return DeepseekV4Config, DeepseekV4ForCausalLM
