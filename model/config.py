"""DeepSeek-V4 model configuration.

One dataclass, `ModelConfig`, read from three places:
  * a YAML `model:` section (our configs/),
  * a release `config.json` (official naming: `compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`,
    `rope_scaling`, `quantization_config`, ...),
  * a `transformers` `config.json` (`layer_types`, `compress_rates`, `mlp_layer_types`,
    `partial_rotary_factor`, nested `rope_parameters`).
Validation names the offending key and, for a misspelled one, the closest known key.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import numbers
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


class ConfigError(ValueError):
    """A configuration value is missing, misspelled, of the wrong type or out of range."""


def closest(name: str, options) -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _default_yarn() -> dict:
    return {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
            "beta_fast": 32, "beta_slow": 1}


def _token_id(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _flash_compress_ratios() -> list[int]:
    return [0, 0] + [4, 128] * 20 + [4]


@dataclass
class ModelConfig:
    """Architecture of a DeepSeek-V4 model. Defaults are DeepSeek-V4-Flash."""
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512                  # shared K == V head (MQA, one KV head)
    qk_rope_head_dim: int = 64           # RoPE on the last qk_rope_head_dim dims of every head
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    # per layer: 0 = sliding window only; csa_ratio = CSA (+ indexer); hca_ratio = HCA
    compress_ratios: list = field(default_factory=_flash_compress_ratios)
    csa_ratio: int = 4
    hca_ratio: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    num_hash_layers: int = 3             # the first layers route by tid2eid[token_id]
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True          # a YAML switch only: config.json's is not read (see from_hf_config)
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = field(default=10.0, metadata={"inf": "no clamp"})
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0          # sliding-only layers: plain RoPE
    compress_rope_theta: float = 160000.0  # CSA/HCA layers and their compressors: this theta + rope_scaling
    rope_scaling: dict | None = field(default_factory=_default_yarn)
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    # one id, or a list of ids that each end a sequence (a config.json may give several)
    eos_token_id: int | list | None = field(default=1, metadata={"ids": "a list of token ids"})
    num_nextn_predict_layers: int = 1    # MTP layers in the release; not instantiated here

    def __post_init__(self):
        self.validate()

    # ---- derived -------------------------------------------------------------------------------------
    def layer_type(self, i: int) -> str:
        r = self.compress_ratios[i]
        return SLIDING if r == 0 else CSA if r == self.csa_ratio else HCA

    @property
    def layer_types(self) -> list[str]:
        return [self.layer_type(i) for i in range(self.num_hidden_layers)]

    def is_hash_layer(self, i: int) -> bool:
        return i < self.num_hash_layers

    @property
    def eos_ids(self) -> tuple:
        """The token ids that end a sequence (eos_token_id as a tuple; empty where it is null)."""
        eos = self.eos_token_id
        return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)

    def end_with(self, eos_id: int | None):
        """A tokenizer's end token (train_grpo's task.eos_token, the CLI's --eos-token) as the one that ends a
        sequence, in place of eos_token_id unless its ids hold it already; None changes nothing."""
        if eos_id is not None and eos_id not in self.eos_ids:
            self.eos_token_id = eos_id

    def seq_blocks(self, max_len: int, block_entries: int) -> dict:
        """{"csa": n, "hca": n}: the most blocks of block_entries compressed entries one sequence of max_len positions
        takes in each of the paged engine's pools (its block table's width; at least 1)."""
        return {k: max(1, -(-(max_len // r) // block_entries)) for k, r in (("csa", self.csa_ratio),
                                                                             ("hca", self.hca_ratio))}

    @property
    def shared_intermediate_size(self) -> int:
        return self.n_shared_experts * self.moe_intermediate_size

    # ---- validation ----------------------------------------------------------------------------------
    def validate(self):
        """Raise ConfigError('key: problem') for the first bad field; normalizes numbers and lists in place."""
        def fail(key, msg):
            raise ConfigError(f"{key}: {msg}")

        ints = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "csa_ratio",
                "hca_ratio", "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok",
                "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings"]
        for k in ints:
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                fail(k, f"must be a positive integer, got {v!r}")
        for k in ["n_shared_experts", "num_hash_layers", "num_nextn_predict_layers"]:
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                fail(k, f"must be a non-negative integer, got {v!r}")
        for k in ["routed_scaling_factor", "swiglu_limit", "hc_eps", "rms_norm_eps", "rope_theta",
                  "compress_rope_theta"]:
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                fail(k, f"must be a positive number, got {v!r}")
            setattr(self, k, float(v))
        eos = self.eos_token_id
        ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        if eos is not None and not (ids and all(_token_id(i) for i in ids)):
            fail("eos_token_id", f"must be a token id (an integer >= 0), a non-empty list of them or null, "
                                 f"got {eos!r}")
        if isinstance(eos, (list, tuple)):  # one id as itself, several as a list
            self.eos_token_id = ids[0] if len(ids) == 1 else ids
        if self.qk_rope_head_dim > self.head_dim or self.qk_rope_head_dim % 2:
            fail("qk_rope_head_dim", f"must be even and <= head_dim ({self.head_dim}), got {self.qk_rope_head_dim}")
        if self.qk_rope_head_dim > self.index_head_dim:
            fail("qk_rope_head_dim", f"must be <= index_head_dim ({self.index_head_dim})")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            fail("o_groups", f"must divide num_attention_heads * head_dim = {self.num_attention_heads * self.head_dim}")
        if self.num_experts_per_tok > self.n_routed_experts:
            fail("num_experts_per_tok", f"{self.num_experts_per_tok} > n_routed_experts ({self.n_routed_experts})")
        if self.n_routed_experts > 256:
            fail("n_routed_experts", "routed expert ids travel as uint8, so at most 256 experts")
        if self.num_hash_layers > self.num_hidden_layers:
            fail("num_hash_layers", f"{self.num_hash_layers} > num_hidden_layers ({self.num_hidden_layers})")
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            fail("scoring_func", f"must be sqrtsoftplus, sigmoid or softmax, got {self.scoring_func!r}")
        if self.csa_ratio == self.hca_ratio:
            fail("csa_ratio", "must differ from hca_ratio (the ratio tells the layer type)")
        if not isinstance(self.compress_ratios, (list, tuple)):
            fail("compress_ratios", f"must be a list of per-layer ratios, got {self.compress_ratios!r}")
        for i, r in enumerate(self.compress_ratios):
            if isinstance(r, bool) or not isinstance(r, numbers.Integral):
                fail(f"compress_ratios[{i}]", f"must be an integer, got {r!r}")
        # (a release's extra entries for its MTP layers are cut by from_hf_config)
        self.compress_ratios = [int(r) for r in self.compress_ratios]
        if len(self.compress_ratios) != self.num_hidden_layers:
            fail("compress_ratios", f"has {len(self.compress_ratios)} entries, need num_hidden_layers = "
                                    f"{self.num_hidden_layers}")
        for i, r in enumerate(self.compress_ratios):
            if r not in (0, self.csa_ratio, self.hca_ratio):
                fail(f"compress_ratios[{i}]", f"{r} is none of 0 (sliding), csa_ratio={self.csa_ratio}, "
                                             f"hca_ratio={self.hca_ratio}")
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, dict):
                fail("rope_scaling", f"must be a mapping or null, got {self.rope_scaling!r}")
            keys = ("type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
            for k in self.rope_scaling:
                if k not in keys:
                    fail(f"rope_scaling.{k}", f"unknown key{closest(str(k), keys)}")
            kind = self.rope_scaling.get("type", self.rope_scaling.get("rope_type", "yarn"))
            if kind not in ("yarn", "default"):
                fail("rope_scaling.type", f"only 'yarn' is supported, got {kind!r}")
            if kind == "default":
                self.rope_scaling = None
            else:
                for k in ("factor", "original_max_position_embeddings"):
                    if k not in self.rope_scaling:
                        fail(f"rope_scaling.{k}", "is required for yarn")
                for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
                    v = self.rope_scaling.get(k)
                    if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real)
                                          or not 0 < v < math.inf):
                        fail(f"rope_scaling.{k}", f"must be a positive finite number, got {v!r}")

    # ---- construction --------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, where: str = "model") -> "ModelConfig":
        """Strict: every key must be a field (the YAML path)."""
        return build_section(cls, d, where)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_hf_config(cls, d: dict, where: str = "config.json") -> "ModelConfig":
        """Lenient: reads the official release naming or the transformers naming, ignores the keys that do not
        change the model. Keys that would (another activation, RoPE type or YaRN attention factor) are errors."""
        def bad(key, rule, v):
            raise ConfigError(f"{where}: {key}: {rule}, got {v!r}")

        def whole(key, v):
            if isinstance(v, bool) or not isinstance(v, int):
                bad(key, "must be an integer", v)
            return v

        def listed(key):
            v = g.get(key)
            if v is not None and not isinstance(v, list):
                bad(key, "must be a list", v)
            return v

        if not isinstance(d, dict):
            bad("top level", "must be a JSON object", type(d).__name__)
        g = d["text_config"] if d.get("text_config") is not None else d
        if not isinstance(g, dict):
            bad("text_config", "must be a JSON object", g)
        g = dict(g)
        out: dict[str, Any] = {}
        direct = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                  "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim",
                  "index_topk", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                  "moe_intermediate_size", "scoring_func", "routed_scaling_factor",
                  "swiglu_limit", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps", "rope_theta",
                  "compress_rope_theta", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                  "eos_token_id", "num_nextn_predict_layers", "qk_rope_head_dim", "num_hash_layers"]
        for k in direct:
            if g.get(k) is not None:
                out[k] = g[k]
        absent = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                              "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size") if k not in out]
        if absent:  # (transformers does the same, silently: a config.json of another model would build a V4-Flash)
            warnings.warn(f"{where}: no {', '.join(absent)}: DeepSeek-V4-Flash's value{'s' if len(absent) > 1 else ''}"
                          f" taken", stacklevel=3)
        # norm_topk_prob is not read: DeepSeek-V4 divides the top-k weights by their sum whatever it says
        # (transformers' DeepseekV4 routers ignore it; the YAML key stays a research switch)
        if g.get("hidden_act", "silu") != "silu":  # transformers applies it in every expert; ours are SwiGLU
            bad("hidden_act", "only 'silu' (DeepSeek-V4's SwiGLU experts)", g["hidden_act"])
        if out.get("eos_token_id") == []:
            out["eos_token_id"] = None
        n = whole("num_hidden_layers", out.get("num_hidden_layers", cls.num_hidden_layers))
        head_dim = whole("head_dim", out.get("head_dim", cls.head_dim))
        if "qk_rope_head_dim" not in out:  # transformers: head_dim x partial_rotary_factor (default 64 / 512)
            prf = g.get("partial_rotary_factor")
            prf = 64 / 512 if prf is None else prf
            if isinstance(prf, bool) or not isinstance(prf, (int, float)) or not 0 < prf <= 1:
                bad("partial_rotary_factor", "must be a number in (0, 1]", prf)
            out["qk_rope_head_dim"] = int(head_dim * prf)

        # attention layer schedule
        rates = g.get("compress_rates") or {}
        if not isinstance(rates, dict):
            bad("compress_rates", "must be an object {layer type: ratio}", rates)
        csa = whole(f"compress_rates.{CSA}", rates.get(CSA, g.get("compress_rate_csa", 4)))
        hca = whole(f"compress_rates.{HCA}", rates.get(HCA, g.get("compress_rate_hca", 128)))
        if listed("layer_types") is not None:
            lt = g["layer_types"][:n]
            unknown = [t for t in lt if t not in (SLIDING, CSA, HCA)]
            if unknown:
                raise ConfigError(f"{where}: layer_types has unknown entries {unknown}")
            out["compress_ratios"] = [0 if t == SLIDING else csa if t == CSA else hca for t in lt]
        elif listed("compress_ratios") is not None:
            ratios = [whole(f"compress_ratios[{i}]", r) for i, r in enumerate(g["compress_ratios"][:n])]
            ratios = [0 if r in (0, 1) else r for r in ratios]
            distinct = sorted({r for r in ratios if r})
            if len(distinct) == 2:
                csa, hca = distinct
            elif len(distinct) == 1 and distinct[0] not in (csa, hca):
                raise ConfigError(f"{where}: compress_ratios uses only ratio {distinct[0]}, which is neither the "
                                  f"CSA ratio ({csa}) nor the HCA ratio ({hca}); give layer_types + compress_rates")
            elif len(distinct) > 2:
                raise ConfigError(f"{where}: compress_ratios has more than two non-zero ratios: {distinct}")
            out["compress_ratios"] = ratios
        out["csa_ratio"], out["hca_ratio"] = csa, hca

        # MoE schedule
        if listed("mlp_layer_types") is not None:
            mt = list(g["mlp_layer_types"][:n])
            n_hash = sum(1 for t in mt if t == "hash_moe")
            if mt[:n_hash] != ["hash_moe"] * n_hash:
                raise ConfigError(f"{where}: mlp_layer_types must put every hash_moe layer first, got {mt}")
            out["num_hash_layers"] = n_hash

        # RoPE: official `rope_scaling` or transformers' nested `rope_parameters`. DeepSeek-V4: plain RoPE on the
        # sliding layers (main), YaRN or plain on the compressed ones (compress), cos / sin never scaled
        def yarn_of(rs, key):  # -> our rope_scaling (None: plain)
            if not isinstance(rs, dict):
                bad(key, "must be an object", rs)
            kind = rs.get("rope_type", rs.get("type", "default"))
            if kind in ("default", None):
                return None
            if kind != "yarn":
                bad(f"{key}.rope_type", "only 'yarn' or 'default' (DeepSeek-V4's RoPE)", kind)
            if rs.get("attention_factor") not in (None, 1, 1.0):
                bad(f"{key}.attention_factor", "DeepSeek-V4 does not scale cos / sin: 1.0 or absent",
                    rs["attention_factor"])
            # (transformers reads YaRN's `truncate` from the top of rope_parameters, never the nested compress
            # entry, so it always takes whole correction dims, as DeepSeek's reference does, and as we do)
            y = {k: rs[k] for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
                 if k in rs}
            return {**y, "type": "yarn"}
        rp = g.get("rope_parameters")
        if isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
            comp, main = rp["compress"], rp.get("main", {})
            if yarn_of(main, "rope_parameters.main") is not None:
                bad("rope_parameters.main.rope_type", "'default': DeepSeek-V4's sliding layers take plain RoPE",
                    main.get("rope_type", main.get("type")))
            if "rope_theta" in main:
                out["rope_theta"] = main["rope_theta"]
            if "rope_theta" in comp:
                out["compress_rope_theta"] = comp["rope_theta"]
            out["rope_scaling"] = yarn_of(comp, "rope_parameters.compress")
        else:
            key = "rope_scaling" if g.get("rope_scaling") is not None else "rope_parameters"
            rs = g.get("rope_scaling", rp if isinstance(rp, dict) and rp else None)
            # (a flat dict's own rope_theta is not read: transformers gives the sliding layers rope_theta and the
            # compressed ones compress_rope_theta whatever it says)
            out["rope_scaling"] = None if rs is None else yarn_of(rs, key)
        return cls.from_dict(out, where)

    def to_hf_config(self, quantization: dict | None = None, dtype: str = "bfloat16") -> dict:
        """config.json in the official release naming (which `transformers` also reads)."""
        if not self.norm_topk_prob:
            warnings.warn("norm_topk_prob=false has no config.json form: load_pretrained and transformers divide "
                          "the top-k weights by their sum whatever the key says", stacklevel=2)
        d = {
            "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1, "head_dim": self.head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
            "q_lora_rank": self.q_lora_rank, "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.sliding_window, "compress_ratios": list(self.compress_ratios),
            "layer_types": self.layer_types,
            "compress_rates": {CSA: self.csa_ratio, HCA: self.hca_ratio},
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk, "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok, "n_shared_experts": self.n_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size, "num_hash_layers": self.num_hash_layers,
            "scoring_func": self.scoring_func, "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor, "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult, "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id, "num_nextn_predict_layers": 0,
            "hidden_act": "silu", "torch_dtype": dtype,
        }
        if self.rope_scaling is not None:
            d["rope_scaling"] = dict(self.rope_scaling)
        if quantization is not None:
            d["quantization_config"] = quantization
        return d

    # ---- sizes ---------------------------------------------------------------------------------------
    def param_counts(self) -> dict:
        """Parameter counts: total, routed experts, and active per token (embeddings excluded from active)."""
        D, H, hd, n = self.hidden_size, self.num_attention_heads, self.head_dim, self.hc_mult
        attn = D * self.q_lora_rank + self.q_lora_rank * H * hd + D * hd + (H * hd) * self.o_lora_rank \
            + self.o_groups * self.o_lora_rank * D + self.q_lora_rank + hd + H
        hc = 2 * ((2 + n) * n * n * D + (2 + n) * n + 3)
        expert = 3 * D * self.moe_intermediate_size
        per_layer_dense = attn + hc + 2 * D + self.n_routed_experts * D + 3 * D * self.shared_intermediate_size
        comp = 0
        for i in range(self.num_hidden_layers):
            t = self.layer_type(i)
            if t == CSA:
                comp += 2 * (D * 2 * hd) + self.csa_ratio * 2 * hd + hd  # compressor
                ih = self.index_head_dim
                comp += 2 * (D * 2 * ih) + self.csa_ratio * 2 * ih + ih + self.q_lora_rank * self.index_n_heads * ih \
                    + D * self.index_n_heads
            elif t == HCA:
                comp += 2 * (D * hd) + self.hca_ratio * hd + hd
        L = self.num_hidden_layers
        emb = self.vocab_size * D * (1 if self.tie_word_embeddings else 2)
        routed = L * self.n_routed_experts * expert
        total = emb + L * per_layer_dense + comp + routed + n * n * D + n + 1 + D
        active = L * per_layer_dense + comp + L * self.num_experts_per_tok * expert + self.vocab_size * D
        return {"total": total, "routed_experts": routed, "active": active}


def _unique_keys(pairs) -> dict:
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"key {k!r} given twice")
        d[k] = v
    return d


def strict_json(text: str):
    """json.loads, but an object giving a key twice is a ValueError naming the key (json.loads keeps the last
    silently); bad syntax is json.JSONDecodeError (a ValueError) as before."""
    return json.loads(text, object_pairs_hook=_unique_keys)


def load_hf_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    f = path / "config.json" if path.is_dir() else path
    if not f.exists():
        if (f.parent / "meta.json").exists() and any(f.parent.glob("actor-rank*.safetensors")):
            raise FileNotFoundError(f"{f.parent}: a training checkpoint (meta.json and actor shards), not a model "
                                    f"directory; python -m model.export {f.parent} OUT writes it as one")
        raise FileNotFoundError(f"{path}: no such directory" if not path.exists() else f"{f}: no config.json")
    try:
        d = strict_json(f.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f}: not valid JSON ({e})") from None
    except ValueError as e:  # a key given twice: which one was meant is unknowable
        raise ConfigError(f"{f}: {e}") from None
    except (OSError, UnicodeDecodeError) as e:  # a directory, unreadable, not text
        raise ConfigError(f"{f}: cannot read ({type(e).__name__}: {e})") from None
    cfg = ModelConfig.from_hf_config(d, where=str(f))
    if path.is_dir():  # the shared experts as the checkpoint holds them (transformers writes one of any count)
        from .weights import shared_experts_held
        cfg = shared_experts_held(path, cfg)
    return cfg


# ---------------------------------------------------------------------------------------------------------
# YAML files with dotted command-line overrides; strict dataclass sections


_BOOL_WORDS = {"yes": True, "on": True, "y": True, "no": False, "off": False, "n": False}


@functools.lru_cache(maxsize=None)
def _yaml_loader():
    """yaml.SafeLoader with only true / false as booleans (YAML 1.2): YAML 1.1's on / off / yes / no stay words, so
    `train.routing_replay=off` is the string its field takes (build_section still reads them for bool fields)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass
    Loader.yaml_implicit_resolvers = {k: [r for r in v if r[0] != "tag:yaml.org,2002:bool"]
                                      for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                 list("tTfF"))

    def mapping(loader, node, deep=False):  # a key given twice is an error (PyYAML keeps the last one silently)
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` (its keys may be given again after it)
                continue
            key = loader.construct_object(key_node, deep=deep)
            try:
                dup = key in seen
            except TypeError:  # an unhashable key: SafeLoader says so below
                continue
            if dup:
                raise yaml.constructor.ConstructorError("while reading a mapping", node.start_mark,
                                                        f"key {key!r} given twice", key_node.start_mark)
            seen.add(key)
        return yaml.SafeLoader.construct_mapping(loader, node, deep)
    Loader.construct_mapping = mapping
    return Loader


def _yaml(text: str):
    import yaml
    return yaml.load(text, Loader=_yaml_loader())


def parse_override(item: str):
    """'train.lr=3e-4' -> (['train', 'lr'], 3e-4); the value is read as YAML (numbers, bools, lists)."""
    import yaml

    if "=" not in item:
        raise ConfigError(f"override '{item}': expected dotted.key=value")
    key, _, raw = item.partition("=")
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override '{item}': empty key")
    try:
        value = _yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


CONFIGS = Path(__file__).resolve().parents[1] / "configs"  # the repo's configs/ (a checkout or an editable install)


def resolve_config(path: str | Path) -> Path:
    """path as given where it exists; a bare file name that does not (`--config dsv4.yaml`) is looked up in the
    repo's configs/."""
    path = Path(path)
    if not path.exists() and path.name == str(path) and (CONFIGS / path).is_file():
        return CONFIGS / path
    return path


def write_denied(path: Path, probe: bool = True) -> str | None:
    """Why no file can be made in folder `path` (a run's out_dir, the rollout CLI's --out folder, an export's
    directory), or None. A path not made yet is judged by the nearest folder above it that exists, where making it
    starts; that must be a folder. probe: a file is then made and removed there, the one test that holds for every
    cause (permissions, a read-only or special file system)."""
    folder = Path(path)
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} exists and is not a directory"
    if not probe:
        return None
    try:
        tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check.").close()
    except OSError as e:
        return f"cannot write in {folder} ({type(e).__name__}: {e})"
    return None


def load_yaml(path: str | Path, overrides: list[str] | tuple = ()) -> dict:
    """Read a YAML mapping (resolve_config's path) and apply dotted overrides (which may only set keys, never
    invent sections)."""
    import yaml

    path = resolve_config(path)
    if not path.exists():
        bare = path.name == str(path)
        raise ConfigError(f"{path}: config file not found" + (f" (nor in {CONFIGS})" if bare else ""))
    try:
        d = _yaml(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:  # a directory, unreadable, not text
        raise ConfigError(f"{path}: cannot read the config file ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    for item in overrides:
        keys, value = parse_override(item)
        node = d
        for i, k in enumerate(keys[:-1]):
            nxt = node.get(k)
            if nxt is None:
                nxt = node[k] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override '{item}': '{'.'.join(keys[:i + 1])}' is not a section")
            node = nxt
        node[keys[-1]] = value
    return d


def load_model_config(path: str | Path, overrides: list[str] | tuple = ()) -> ModelConfig:
    """A YAML config's model section with dotted model.* overrides (the benchmarks, which build the model alone):
    any other key, and every bad key or value, is a ConfigError naming the file and the overrides."""
    bad = [o for o in overrides if not o.startswith("model.")]
    if bad:
        raise ConfigError(f"{' '.join(bad)}: only model.* overrides here (the model section is all that is read)")
    where = " ".join([str(path), *overrides])
    return ModelConfig.from_dict(load_yaml(path, overrides).get("model"), f"{where}: model")


def _at(where: str, key: str) -> str:
    return f"{where}: {key}" if where.endswith((".json", ".yaml", ".yml")) else f"{where}.{key}"


def build_section(cls, d: dict | None, where: str):
    """Strict dataclass from a mapping: unknown keys are errors with a suggestion; simple types are checked."""
    d = {} if d is None else d
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in d:
        if k not in fields:
            raise ConfigError(f"{_at(where, k)}: unknown key{closest(k, fields)}")
    kwargs = {}
    for k, v in d.items():
        default = fields[k].default
        if v is None and default is not dataclasses.MISSING and default is not None \
                and "None" not in str(fields[k].type):  # null where the field takes no None
            raise ConfigError(f"{_at(where, k)}: expected {type(default).__name__}, got null")
        if default is not dataclasses.MISSING and default is not None and v is not None:
            want = type(default)
            if want is float and isinstance(v, str):
                try:  # YAML 1.1 reads 1e-5 (no dot) as a string
                    v = float(v)
                except ValueError:
                    pass
            if want is bool and isinstance(v, str) and v.lower() in _BOOL_WORDS:
                v = _BOOL_WORDS[v.lower()]
            if want is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            elif "ids" in fields[k].metadata and isinstance(v, list):
                pass  # (validate checks the ids)
            elif want is bool and not isinstance(v, bool) or want in (int, str) and type(v) is not want:
                raise ConfigError(f"{_at(where, k)}: expected {want.__name__}, got {v!r}")
            elif want is float and not isinstance(v, float):
                raise ConfigError(f"{_at(where, k)}: expected a number, got {v!r}")
            elif want is float and not math.isfinite(v) and not (v == math.inf and "inf" in fields[k].metadata):
                raise ConfigError(f"{_at(where, k)}: expected a finite number, got {v!r}")  # (inf: where it means
                # off: the field's metadata says what)
        kwargs[k] = v
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(_at(where, str(e))) from None
