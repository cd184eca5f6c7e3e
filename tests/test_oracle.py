"""Our DeepSeek-V4 against transformers' DeepseekV4ForCausalLM: same weights, same logits (fp32, <= 1e-4)."""
import json

import pytest
import torch
from safetensors.torch import save_file

from model import load_pretrained, save_pretrained
from model.weights import transformers_deepseek_v4
from tests.oracle import CASES, make_hf, random_case

pytest.importorskip("transformers")
TOL = 1e-4


def _ids(case, B, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CASES[case]["vocab_size"], (B, T), generator=g)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    hf = make_hf(case)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, progress=False)
    # longer than several compress windows of every compressed layer, and than the sliding window
    ids = _ids(case, 2, 67)
    mask = torch.ones_like(ids)
    mask[1, 45:] = 0  # right padding on the second row
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).logits
        out = ours(ids, attention_mask=mask)
        alone = ours(ids[1:, :45])
    assert ref.abs().max() > 0.1, "oracle logits are degenerate"
    assert (out[0] - ref[0]).abs().max() <= TOL
    assert (out[1, :45] - ref[1, :45]).abs().max() <= TOL
    # padding changes nothing for real tokens
    assert (alone[0] - out[1, :45]).abs().max() <= TOL


@pytest.mark.parametrize("case", list(CASES))
def test_engine_on_a_transformers_checkpoint_decodes_as_transformers(case, tmp_path):
    """The paged engine (fp32, no FP8) on the directory transformers saved: its greedy completions are
    transformers' own argmax at every position of prompt + completion, its log-probs transformers' log-softmax
    (end to end: checkpoint reading, prefill, the paged decode steps across compress windows)."""
    from rollout_server import Engine, SamplingParams
    hf = make_hf(case)
    hf.save_pretrained(tmp_path)
    eng = Engine(tmp_path, fp8=False, dtype=torch.float32, device="cpu", max_model_len=128)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, CASES[case]["vocab_size"], (n,), generator=g).tolist() for n in (5, 40)]
    for p, o in zip(prompts, eng.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))):
        with torch.no_grad():
            lp = hf(torch.tensor([p + o.token_ids])).logits[0, len(p) - 1:-1].log_softmax(-1)
        assert lp.argmax(-1).tolist() == o.token_ids
        assert (lp.gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0] - torch.tensor(o.logprobs)).abs().max() <= TOL


@pytest.mark.parametrize("seed", [4, 11, 16, 28, 38])  # (together: every feature random_case varies)
def test_random_configs_match_transformers(seed, tmp_path):
    """Random tiny configs (random_case: layer types, widths, heads, RoPE, scoring, clamp, hc streams, tying):
    our logits are transformers' and the paged engine's greedy completions its argmax."""
    from rollout_server import Engine, SamplingParams
    case = random_case(seed)
    hf = make_hf("mixed", seed, **case)
    hf.save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, case["vocab_size"], (2, 50), generator=g)
    with torch.no_grad():
        ref, out = hf(ids).logits, load_pretrained(tmp_path, progress=False)(ids)
    assert ref.abs().max() > 0.1 and (out - ref).abs().max() <= TOL * max(1.0, ref.abs().max().item())
    eng = Engine(tmp_path, fp8=False, dtype=torch.float32, device="cpu", max_model_len=128, block_entries=4)
    prompts = [torch.randint(0, case["vocab_size"], (n,), generator=g).tolist() for n in (3, 37)]
    for p, o in zip(prompts, eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))):
        with torch.no_grad():
            lp = hf(torch.tensor([p + o.token_ids])).logits[0, len(p) - 1:-1].log_softmax(-1)
        assert lp.argmax(-1).tolist() == o.token_ids
        assert (lp.gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0] - torch.tensor(o.logprobs)).abs().max() <= TOL


def test_transformers_native_names_with_prefix(tmp_path):
    """A state dict in transformers' own module names (model.layers.N.self_attn.q_a_proj..., fused experts)."""
    hf = make_hf("mixed", seed=3)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any("self_attn.q_a_proj" in k for k in sd) and any("experts.gate_up_proj" in k for k in sd)
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    ours = load_pretrained(tmp_path, progress=False)
    ids = _ids("mixed", 1, 50, seed=4)
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() <= TOL


def test_transformers_reads_our_release_layout(tmp_path):
    """Our save_pretrained writes the release layout; transformers' loader maps it back to the same model."""
    DeepseekV4ForCausalLM = transformers_deepseek_v4()[1]

    hf = make_hf("wide_hc", seed=5)
    hf.save_pretrained(tmp_path / "a")
    ours = load_pretrained(tmp_path / "a", progress=False)
    save_pretrained(ours, tmp_path / "b", dtype=torch.float32)
    keys = json.loads((tmp_path / "b" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "embed.weight" in keys and "layers.0.ffn.experts.0.w1.weight" in keys and "hc_head_fn" in keys
    back = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.float32).eval()
    ids = _ids("wide_hc", 2, 40, seed=6)
    with torch.no_grad():
        assert (back(ids).logits - hf(ids).logits).abs().max() <= TOL


def test_config_json_forms_transformers_reads_alike(tmp_path):
    """config.json forms read as transformers reads them: YaRN's truncate false on the nested compress entry
    (which transformers never reads: whole correction dims whatever it says; a 64-wide RoPE, where fractional
    ones would differ), and no RoPE width at all (transformers' head_dim x 64 / 512). Forms we cannot build
    (another RoPE type or activation, a YaRN attention factor) are errors naming the key, not a model that
    differs silently."""
    DeepseekV4ForCausalLM = transformers_deepseek_v4()[1]

    from model.config import ConfigError
    wide = dict(head_dim=64, num_attention_heads=2, index_head_dim=64)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
            "beta_slow": 1}
    for name, kw, edit in [
            ("truncate", dict(partial_rotary_factor=1.0, rope_parameters={**yarn, "truncate": False}), None),
            ("no_rope_width", {}, ("partial_rotary_factor", "qk_rope_head_dim", "rope_parameters"))]:
        d = tmp_path / name
        make_hf("mixed", 7, **wide, **kw).save_pretrained(d)
        if edit:
            c = json.loads((d / "config.json").read_text())
            for k in edit:
                c.pop(k, None)
            (d / "config.json").write_text(json.dumps(c))
        hf = DeepseekV4ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        ours = load_pretrained(d, progress=False)
        ids = _ids("mixed", 2, 40, seed=8)
        with torch.no_grad():
            assert (ours(ids) - hf(ids).logits).abs().max() <= TOL, name
    assert load_pretrained(tmp_path / "no_rope_width", progress=False).cfg.qk_rope_head_dim == 8
    # a flat YaRN rope_parameters with its own rope_theta: transformers keeps rope_theta / compress_rope_theta
    d = tmp_path / "flat"
    make_hf("mixed", 0).save_pretrained(d)
    c = json.loads((d / "config.json").read_text())
    c["rope_parameters"] = {**yarn, "rope_theta": 123456.0}
    c.pop("rope_theta", None)
    (d / "config.json").write_text(json.dumps(c))
    hf_cfg = DeepseekV4ForCausalLM.from_pretrained(d, dtype=torch.float32).config
    ours = load_pretrained(d, progress=False).cfg
    assert (ours.rope_theta, ours.compress_rope_theta) == (hf_cfg.rope_parameters["main"]["rope_theta"],
                                                          hf_cfg.rope_parameters["compress"]["rope_theta"])
    for kw, key in [(dict(rope_parameters={"rope_type": "linear", "factor": 4.0}), "rope_type"),
                    (dict(rope_parameters={**yarn, "attention_factor": 1.5}), "attention_factor"),
                    (dict(hidden_act="gelu"), "hidden_act")]:
        d = tmp_path / key
        make_hf("mixed", 0, **kw).save_pretrained(d)
        with pytest.raises(ConfigError, match=f"config.json: .*{key}"):
            load_pretrained(d, progress=False)
