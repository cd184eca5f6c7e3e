"""Config parsing: release naming, transformers naming, YAML validation with messages that name the key."""
import json
import math
import re

import pytest

from model.config import CONFIGS, CSA, HCA, SLIDING, ConfigError, ModelConfig, load_hf_config, load_yaml

# DeepSeek-V4-Flash's release config.json (the keys our loader reads, and some it must ignore)
FLASH_RELEASE = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "expert_dtype": "fp4",
    "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_act": "silu",
    "hidden_size": 4096, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512,
    "max_position_embeddings": 1048576, "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 6,
    "num_hidden_layers": 43, "num_hash_layers": 3, "num_key_value_heads": 1, "num_nextn_predict_layers": 1,
    "o_groups": 8, "o_lora_rank": 1024, "q_lora_rank": 1024, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
    "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "vocab_size": 129280, "compress_rope_theta": 160000, "bos_token_id": 0, "eos_token_id": 1,
    # 44 entries: the last one is the MTP layer's
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}


def test_release_config_equals_dsv4_yaml(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(FLASH_RELEASE))
    rel = load_hf_config(tmp_path)
    yml = ModelConfig.from_dict(load_yaml("configs/dsv4.yaml")["model"])
    assert rel == yml
    assert rel.layer_types[:4] == [SLIDING, SLIDING, CSA, HCA] and len(rel.compress_ratios) == 43
    counts = rel.param_counts()
    assert 283e9 < counts["total"] < 285e9 and 13e9 < counts["active"] < 13.5e9  # 284B total, 13B active


def test_transformers_config_naming():
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV4Config(
        num_hidden_layers=5, hidden_size=64, layer_types=[SLIDING, CSA, HCA, CSA, HCA],
        compress_rates={CSA: 2, HCA: 16}, mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 3,
        partial_rotary_factor=0.25, head_dim=64, index_head_dim=32,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128})
    c = ModelConfig.from_hf_config(hf.to_dict())
    assert c.compress_ratios == [0, 2, 16, 2, 16] and (c.csa_ratio, c.hca_ratio) == (2, 16)
    assert c.num_hash_layers == 2 and c.qk_rope_head_dim == 16
    assert c.rope_scaling["factor"] == 8.0 and c.compress_rope_theta == 160000.0 and c.rope_theta == 10000.0
    # and back: our config.json is read by transformers into the same architecture
    back = transformers.DeepseekV4Config(**c.to_hf_config())
    assert back.layer_types == hf.layer_types and back.mlp_layer_types == hf.mlp_layer_types
    assert back.compress_rates == hf.compress_rates and back.qk_rope_head_dim == 16


# configs that leave out shape keys on purpose (test_config_json_without_its_shape_keys_warns checks the warning)
FLASH_SHAPES_TAKEN = pytest.mark.filterwarnings("ignore:.*DeepSeek-V4-Flash's values taken:UserWarning")


@FLASH_SHAPES_TAKEN
def test_ambiguous_compress_ratios_need_layer_types():
    with pytest.raises(ConfigError, match="compress_ratios uses only ratio 8"):
        ModelConfig.from_hf_config({"num_hidden_layers": 2, "compress_ratios": [0, 8]})
    c = ModelConfig.from_hf_config({"num_hidden_layers": 3, "compress_ratios": [1, 8, 2]})  # 1 = no compression
    assert c.compress_ratios == [0, 8, 2] and (c.csa_ratio, c.hca_ratio) == (2, 8)


@pytest.mark.parametrize("override, message", [
    ("model.hiden_size=64", r"model\.hiden_size: unknown key \(did you mean 'hidden_size'\?\)"),
    ("model.hidden_size=sixty", r"model\.hidden_size: expected int"),
    ("model.num_experts_per_tok=9", r"model\.num_experts_per_tok: 9 > n_routed_experts"),
    ("model.compress_ratios=[0,4,5,4]", r"model\.compress_ratios\[2\]: 5 is none of"),
    ("model.compress_ratios=[0,4]", r"model\.compress_ratios: has 2 entries"),
    ("model.qk_rope_head_dim=15", r"model\.qk_rope_head_dim: must be even"),
    ("model.n_routed_experts=300", r"model\.n_routed_experts: .*uint8"),
    ("model.rope_scaling={type: linear}", r"model\.rope_scaling\.type: only 'yarn'"),
    # each of these was taken, then failed on every rank with a raw traceback, or ran with what was cut off
    ("model.compress_ratios=[0,4,16,null]", r"model\.compress_ratios\[3\]: must be an integer, got None"),
    ("model.compress_ratios=[0,4,16,4.5]", r"model\.compress_ratios\[3\]: must be an integer, got 4\.5"),
    ("model.compress_ratios=[0,4,16,4,16]", r"model\.compress_ratios: has 5 entries, need num_hidden_layers = 4"),
    ("model.rope_scaling.factor=abc", r"model\.rope_scaling\.factor: must be a positive finite number, got 'abc'"),
    ("model.qk_rope_head_dim=0", r"model\.qk_rope_head_dim: must be a positive integer, got 0"),
])
def test_yaml_validation_names_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(load_yaml("configs/tiny.yaml", [override])["model"])


def test_overrides_and_file_errors(tmp_path):
    c = ModelConfig.from_dict(load_yaml("configs/tiny.yaml", ["model.hidden_size=96", "model.hc_eps=1e-5"])["model"])
    assert c.hidden_size == 96 and c.hc_eps == 1e-5
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_yaml("configs/tiny.yaml", ["model.hidden_size"])
    with pytest.raises(ConfigError, match="not a section"):
        load_yaml("configs/tiny.yaml", ["model.hidden_size.x=1"])
    with pytest.raises(ConfigError, match="nope.yaml: config file not found$"):
        load_yaml(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="nope.yaml: config file not found .nor in .*configs"):
        load_yaml("nope.yaml")
    with pytest.raises(ConfigError, match="cannot read the config file .IsADirectoryError"):
        load_yaml(tmp_path)
    (tmp_path / "bad.yaml").write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml: invalid YAML"):
        load_yaml(tmp_path / "bad.yaml")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 64, "num_hidden_layers": 2, "hidden_size": 32}')
    with pytest.raises(ConfigError, match="config.json: key 'hidden_size' given twice"):
        load_hf_config(tmp_path)


def test_yaml_words_off_and_yes():
    """YAML 1.1 reads off / yes as booleans: the README's `train.routing_replay=off` failed ("expected str, got
    False"). Only true / false are booleans now; a bool field still takes yes / no / on / off."""
    from train_grpo import RunConfig
    c = RunConfig.load("configs/tiny.yaml", ["train.routing_replay=off", "train.compile=yes",
                                             "model.tie_word_embeddings=on", "rollout.cuda_graphs=false"])
    assert (c.train.routing_replay, c.train.compile, c.model.tie_word_embeddings, c.rollout.cuda_graphs) == \
        ("off", True, True, False)
    with pytest.raises(ConfigError, match="train.compile: expected bool, got 'maybe'"):
        RunConfig.load("configs/tiny.yaml", ["train.compile=maybe"])


@pytest.mark.parametrize("name", ["tiny", "mini", "dsv4"])
def test_shipped_configs_load(name):
    c = ModelConfig.from_dict(load_yaml(f"configs/{name}.yaml")["model"])
    assert {SLIDING, CSA, HCA} <= set(c.layer_types) and 0 < c.num_hash_layers < c.num_hidden_layers
    if name == "mini":
        assert 2e9 < c.param_counts()["total"] < 5e9


def test_bare_config_name_found_in_configs(tmp_path, monkeypatch):
    """`--config dsv4.yaml` (the design card's form) from anywhere: a bare name that is not a file here is the repo's
    configs/<name>; a file of that name in the working directory comes first."""
    from train_grpo import RunConfig
    monkeypatch.chdir(tmp_path)
    assert RunConfig.load("tiny.yaml", ["train.steps=3"]).train.steps == 3
    assert load_yaml("dsv4.yaml")["model"]["num_hidden_layers"] == load_yaml(CONFIGS / "dsv4.yaml")["model"][
        "num_hidden_layers"]
    (tmp_path / "tiny.yaml").write_text("model: {hidden_size: 1}\n")
    assert load_yaml("tiny.yaml") == {"model": {"hidden_size": 1}}
    with pytest.raises(ConfigError, match="sub/tiny.yaml: config file not found$"):
        load_yaml("sub/tiny.yaml")


@FLASH_SHAPES_TAKEN
def test_malformed_config_json_is_named(tmp_path):
    """config.json shapes that raised AttributeError / TypeError deep in from_hf_config name the file and key."""
    for body, match in [("[]", "top level: must be a JSON object"),
                        ('{"text_config": 3}', "text_config: must be a JSON object"),
                        ('{"num_hidden_layers": "3"}', "num_hidden_layers: must be an integer, got '3'"),
                        ('{"compress_rates": [2, 8]}', r"compress_rates: must be an object"),
                        ('{"compress_rates": {"compressed_sparse_attention": "x"}}', "compress_rates.compressed_sparse"),
                        ('{"compress_ratios": [0, "4"]}', r"compress_ratios\[1\]: must be an integer"),
                        ('{"layer_types": "sliding_attention"}', "layer_types: must be a list"),
                        ('{"partial_rotary_factor": 2}', r"partial_rotary_factor: must be a number in \(0, 1\]"),
                        ('{"rope_scaling": {"type": "dynamic", "factor": 2}}', "rope_scaling.rope_type: only 'yarn'"),
                        ('{"rope_parameters": {"main": {"rope_type": "yarn", "factor": 2}, "compress": {}}}',
                         "rope_parameters.main.rope_type: 'default'")]:
        (tmp_path / "config.json").write_text(body)
        with pytest.raises(ConfigError, match="config.json: " + match):
            load_hf_config(tmp_path / "config.json")
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match="config.json: cannot read .IsADirectoryError"):
        load_hf_config(tmp_path)
    # text_config null is no text_config (as transformers reads it)
    assert ModelConfig.from_hf_config({"text_config": None, "num_hidden_layers": 2, "num_hash_layers": 0,
                                       "compress_ratios": [0, 4]}).num_hidden_layers == 2


def test_duplicate_keys_typos_and_conflicts_are_named(tmp_path):
    """A key given twice in the YAML (PyYAML kept the last silently: a second `train:` section dropped the first),
    a typo inside model.rope_scaling, a non-finite number (inf only where the field says it switches something
    off), a seed outside [0, 2**32) (past 2**64 every rank died in torch.manual_seed), and a model.* override that
    init_from would have dropped: each an error naming the key (and, for a duplicate, the line)."""
    from model import build_model, save_pretrained
    from train_grpo import RunConfig
    text = (CONFIGS / "tiny.yaml").read_text()
    (tmp_path / "sec.yaml").write_text(text + "\ntrain:\n  steps: 7\n")
    (tmp_path / "leaf.yaml").write_text(text.replace("\nseed: 0\n", "\nseed: 0\nseed: 1\n"))
    assert "\nseed: 0\n" in text
    for name, key in (("sec.yaml", "train"), ("leaf.yaml", "seed")):
        with pytest.raises(ConfigError, match=rf"{name}: invalid YAML(.|\n)*key '{key}' given twice(.|\n)*line \d+"):
            RunConfig.load(tmp_path / name)
    (tmp_path / "merge.yaml").write_text("base: &b {lr: 1, x: 2}\ntrain:\n  <<: *b\n  lr: 3\n")
    assert load_yaml(tmp_path / "merge.yaml")["train"] == {"lr": 3, "x": 2}  # a merge's key may be given again
    for item, match in [("model.rope_scaling.fator=8", r"model\.rope_scaling\.fator: unknown key \(did you mean "
                                                       r"'factor'\?\)"),
                        ("model.rope_scaling.factor=.inf", r"rope_scaling\.factor: must be a positive finite number"),
                        ("train.lr=.inf", r"train\.lr: expected a finite number, got inf"),
                        ("rollout.temperature=.nan", r"rollout\.temperature: expected a finite number, got nan"),
                        ("seed=99999999999999999999", r"seed: expected an integer in \[0, 2\*\*32\)"),
                        ("seed=-1", r"seed: expected an integer in \[0, 2\*\*32\)"),
                        ("train.grad_clip=-.inf", r"train\.grad_clip: expected a finite number, got -inf")]:
        with pytest.raises(ConfigError, match=match):
            RunConfig.load("configs/tiny.yaml", [item])
    run = RunConfig.load("configs/tiny.yaml", ["train.grad_clip=.inf", "train.tis_cap=.inf", "model.swiglu_limit=.inf"])
    assert (run.train.grad_clip, run.train.tis_cap, run.model.swiglu_limit) == (math.inf,) * 3  # inf: off
    (tmp_path / "unhashable.yaml").write_text("model:\n  [a]: 1\n")
    with pytest.raises(ConfigError, match="unhashable.yaml: invalid YAML"):  # as SafeLoader says it
        load_yaml(tmp_path / "unhashable.yaml")
    cfg = ModelConfig.from_dict(load_yaml("configs/tiny.yaml")["model"])
    save_pretrained(build_model(cfg, seed=0), tmp_path / "ckpt")
    run = RunConfig.load("configs/tiny.yaml", [f"init_from={tmp_path / 'ckpt'}", "model.hidden_size=64",
                                               f"model.rope_scaling.factor={cfg.rope_scaling['factor']}"])
    assert run.model.hidden_size == cfg.hidden_size == 64  # overrides that agree with the checkpoint are fine
    with pytest.raises(ConfigError, match=r"model\.hidden_size: the override asks 96, but init_from .*ckpt takes "
                                          r"the model from its config.json \(64\)"):
        RunConfig.load("configs/tiny.yaml", [f"init_from={tmp_path / 'ckpt'}", "model.hidden_size=96"])
    (tmp_path / "run").mkdir()  # a training checkpoint's files, not a model directory
    (tmp_path / "run" / "meta.json").write_text("{}")
    (tmp_path / "run" / "actor-rank0.safetensors").write_bytes(b"")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{")
    for d, why in (("missing", "missing: no such directory"),
                   ("run", "run: a training checkpoint (meta.json and actor shards), not a model directory"),
                   ("bad", "bad/config.json: not valid JSON")):  # (the first was a FileNotFoundError traceback)
        with pytest.raises(ConfigError, match=re.escape(f"configs/tiny.yaml: init_from: {tmp_path / why}")):
            RunConfig.load("configs/tiny.yaml", [f"init_from={tmp_path / d}"])


def test_null_and_infinite_values_are_named():
    """`key=null` where the field takes no None raised TypeError in __post_init__ on every rank; an infinite
    timeout or sync bucket passed validation and raised OverflowError at start-up (after the actor was built)."""
    from train_grpo import RunConfig
    for item, match in [("ckpt.every=null", "ckpt.every: expected int, got null"),
                        ("train.steps=null", "train.steps: expected int, got null"),
                        ("rollout.sync_verify=null", "rollout.sync_verify: expected bool, got null"),
                        ("deploy.timeout_s=.inf", "deploy.timeout_s: expected a finite number, got inf"),
                        ("rollout.sync_bucket_mb=inf", "rollout.sync_bucket_mb: expected a finite number, got inf")]:
        with pytest.raises(ConfigError, match=match):
            RunConfig.load("configs/tiny.yaml", [item])
    assert RunConfig.load("configs/tiny.yaml", ["model.eos_token_id=null"]).model.eos_token_id is None


def test_config_json_without_its_shape_keys_warns():
    """A config.json without the keys that size the model builds DeepSeek-V4-Flash's shapes (as transformers does):
    it says which it took; our own config.json (to_hf_config) has them all."""
    import warnings
    with pytest.warns(UserWarning, match=r"m/config\.json: no hidden_size, n_routed_experts: DeepSeek-V4-Flash's "
                                         r"values taken"):
        c = ModelConfig.from_hf_config({"vocab_size": 300, "num_hidden_layers": 2, "num_attention_heads": 4,
                                        "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                        "compress_ratios": [0, 0], "num_hash_layers": 1}, where="m/config.json")
    assert c.hidden_size == ModelConfig.hidden_size and c.n_routed_experts == ModelConfig.n_routed_experts
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ModelConfig.from_hf_config(c.to_hf_config()).hidden_size == c.hidden_size
