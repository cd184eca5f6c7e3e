"""Release-layout I/O: round trips, FP8/MXFP4 checkpoints, sharding, prefixes, and errors that name the tensor."""
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kernels.quant import dequant_fp8_block, dequant_mxfp4, quant_fp8_block, quant_mxfp4, scale_to_float
from model import ModelConfig, build_model, load_pretrained, save_pretrained
from model.config import load_yaml
from model.weights import WeightError
from tests.conftest import all_tensors, rewrite_checkpoint


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.from_dict(load_yaml("configs/tiny.yaml")["model"])
    return build_model(cfg, seed=0)


def test_bf16_round_trip_is_exact(tiny, tmp_path):
    save_pretrained(tiny, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = load_pretrained(tmp_path, dtype="bfloat16", device=None, progress=False)  # (None: torch's default)
    from rollout_server import Engine
    assert Engine(tmp_path, fp8=False, dtype="torch.bfloat16", device="cpu", max_model_len=64).dtype == torch.bfloat16
    ref = {k: v.clone() for k, v in tiny.state_dict().items()}
    for k, v in back.state_dict().items():
        want = ref[k] if (tiny.keeps_fp32(k) or not v.is_floating_point()) else ref[k].to(torch.bfloat16)
        assert v.dtype == want.dtype and torch.equal(v, want), k
    ids = torch.randint(0, tiny.cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(back(ids), load_pretrained(tmp_path, dtype=torch.bfloat16, progress=False)(ids))


def test_fp32_round_trip_sharded_and_prefixed(tiny, tmp_path):
    save_pretrained(tiny, tmp_path / "a", dtype=torch.float32, max_shard_bytes=200_000)
    # config.json names the dtype the tensors have (it said bfloat16 for every export, and transformers loaded
    # an fp32 export in bf16)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["torch_dtype"] == "float32"
    with pytest.raises(ValueError, match="save_pretrained: dtype torch.int8"):
        save_pretrained(tiny, tmp_path / "c", dtype=torch.int8)
    files = sorted((tmp_path / "a").glob("*.safetensors"))
    assert len(files) > 2 and files[0].name.startswith("model-00001-of-")
    back = load_pretrained(tmp_path / "a", progress=False)
    for k, v in back.state_dict().items():
        assert torch.equal(v, tiny.state_dict()[k]), k
    # the same tensors under a "model." prefix, in one unindexed file
    (tmp_path / "b").mkdir()
    save_file({"model." + k: v for k, v in all_tensors(tmp_path / "a").items()},
              str(tmp_path / "b" / "weights.safetensors"))
    (tmp_path / "b" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    ids = torch.randint(0, tiny.cfg.vocab_size, (1, 70), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(load_pretrained(tmp_path / "b", progress=False)(ids), tiny(ids))


def test_fp8_checkpoint_within_format_error(tiny, tmp_path):
    save_pretrained(tiny, tmp_path, fp8=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["quantization_config"]["scale_fmt"] == "ue8m0"
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.get_slice("layers.0.attn.wq_a.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("layers.0.attn.wq_a.scale").get_dtype() == "F8_E8M0"
        assert f.get_slice("layers.1.ffn.experts.3.w2.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("layers.1.attn.compressor.wkv.weight").get_dtype() == "BF16"  # stays BF16
        assert f.get_slice("embed.weight").get_dtype() == "BF16"
    back = load_pretrained(tmp_path, progress=False)
    w, w8 = tiny.layers[0].attn.wq_a.weight, back.layers[0].attn.wq_a.weight
    _, s = quant_fp8_block(w, torch.float8_e4m3fn)
    step = scale_to_float(s).repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    assert ((w8 - w).abs() <= w.abs() * 2 ** -4 + step * 2 ** -10).all()
    assert not torch.equal(w8, w)
    ids = torch.randint(0, tiny.cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        d = (tiny(ids).log_softmax(-1) - back(ids).log_softmax(-1)).abs()
    assert d.mean() < 0.02 and d.max() < 0.25


def test_release_fp32_scales_and_mxfp4_experts(tiny, tmp_path):
    """DeepSeek-V3-style fp32 `weight_scale_inv` for dense layers, Flash-style MXFP4 routed experts."""
    save_pretrained(tiny, tmp_path, dtype=torch.float32)
    t = all_tensors(tmp_path)
    q, s = quant_fp8_block(t["layers.2.attn.wq_b.weight"], torch.float8_e4m3fn, scale_fmt="fp32")
    t["layers.2.attn.wq_b.weight"], t["layers.2.attn.wq_b.weight_scale_inv"] = q, s
    expected = {}
    for k in [k for k in t if ".ffn.experts." in k]:
        packed, scale = quant_mxfp4(t[k])
        t[k], t[k[: -len(".weight")] + ".scale"] = packed, scale
        expected[k] = dequant_mxfp4(packed, scale)
    rewrite_checkpoint(tmp_path, t)
    back = load_pretrained(tmp_path, progress=False)
    assert torch.equal(back.layers[2].attn.wq_b.weight, dequant_fp8_block(q, s))
    assert torch.equal(back.layers[1].ffn.experts.w3[5], expected["layers.1.ffn.experts.5.w3.weight"])
    assert torch.equal(back.layers[3].ffn.experts.w2[0], expected["layers.3.ffn.experts.0.w2.weight"])


def test_missing_tensor_is_named(tiny, tmp_path):
    save_pretrained(tiny, tmp_path)
    t = all_tensors(tmp_path)
    del t["layers.1.attn.indexer.weights_proj.weight"], t["layers.2.ffn.experts.6.w1.weight"]
    del t["layers.2.ffn.experts.7.w1.weight"]  # (two experts of one leaf: two tensors in the count)
    rewrite_checkpoint(tmp_path, t)
    with pytest.raises(WeightError, match=r"lacks 3 tensor\(s\).*layers\.1\.attn\.indexer\.weights_proj\.weight") as e:
        load_pretrained(tmp_path, progress=False)
    assert "layers.2.ffn.experts.6.w1.weight (and 1 more experts)" in str(e.value)


def test_shape_mismatch_is_named(tiny, tmp_path):
    save_pretrained(tiny, tmp_path)
    t = all_tensors(tmp_path)
    t["layers.0.attn.wkv.weight"] = torch.zeros(7, 64, dtype=torch.bfloat16)
    rewrite_checkpoint(tmp_path, t)
    with pytest.raises(WeightError, match=r"layers\.0\.attn\.wkv\.weight.*\(7, 64\).*\(32, 64\)"):
        load_pretrained(tmp_path, progress=False)


def test_unknown_dtype_unscaled_fp8_and_unexpected_tensor_are_named(tiny, tmp_path):
    save_pretrained(tiny, tmp_path)
    good = all_tensors(tmp_path)
    bad = dict(good, **{"layers.0.attn.wq_a.weight": torch.zeros(32, 64, dtype=torch.bool)})
    rewrite_checkpoint(tmp_path, bad)
    with pytest.raises(WeightError, match=r"layers\.0\.attn\.wq_a\.weight.*dtype"):
        load_pretrained(tmp_path, progress=False)
    bad = dict(good, **{"layers.0.attn.wq_a.weight": torch.zeros(32, 64, dtype=torch.float8_e4m3fn)})
    rewrite_checkpoint(tmp_path, bad)
    with pytest.raises(WeightError, match=r"layers\.0\.attn\.wq_a\.weight.*no block scale"):
        load_pretrained(tmp_path, progress=False)
    bad = dict(good, **{"layers.0.attn.wq_c.weight": torch.zeros(3, 3)})
    rewrite_checkpoint(tmp_path, bad)
    with pytest.raises(WeightError, match=r"layers\.0\.attn\.wq_c\.weight"):
        load_pretrained(tmp_path, progress=False)


def nan_at(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[t.numel() // 2] = float("nan")
    return t


def test_bad_tensors_are_refused_naming_them(tiny, tmp_path):
    """Checkpoint tensors that used to load silently (an expert past n_routed_experts skipped, an integer tensor
    cast into a float weight, two names for one tensor with the later one winning, expert ids a hash table cannot
    route to) or fail with torch's own error (a scale of the wrong shape) are WeightErrors naming the tensor."""
    save_pretrained(tiny, tmp_path, dtype=torch.float32)
    good = all_tensors(tmp_path)
    q, s = quant_fp8_block(good["layers.2.attn.wq_b.weight"], torch.float8_e4m3fn, scale_fmt="fp32")
    edits = [
        ({"layers.1.ffn.experts.8.w1.weight": good["layers.1.ffn.experts.0.w1.weight"].clone()},
         r"experts\.8\.w1\.weight': expert 8, but config.json has n_routed_experts = 8"),
        ({"layers.0.attn.wq_a.weight": good["layers.0.attn.wq_a.weight"].to(torch.int16)},
         r"layers\.0\.attn\.wq_a\.weight': torch.int16 in the checkpoint, the model holds torch.float32"),
        ({"model.norm.weight": good["norm.weight"] + 1}, r"'model.norm.weight' and 'norm.weight' both load"),
        ({"layers.0.ffn.gate.tid2eid": good["layers.0.ffn.gate.tid2eid"] + 8},
         r"layers\.0\.ffn\.gate\.tid2eid' holds expert ids from 8 to 15, but config.json has n_routed_experts"),
        ({"layers.2.attn.wq_b.weight": q, "layers.2.attn.wq_b.weight_scale_inv": s.repeat(2, 1)},
         r"layers\.2\.attn\.wq_b\.weight' with scale 'layers\.2\.attn\.wq_b\.weight_scale_inv': scale grid"),
        ({"layers.2.attn.wq_b.weight": q, "layers.2.attn.wq_b.weight_scale_inv": torch.ones(())},
         r"its scale 'layers\.2\.attn\.wq_b\.weight_scale_inv' has shape \(\)"),
        # NaN in a plain weight, an expert and an FP8 block scale (which generated NaN log-probs before)
        ({"norm.weight": nan_at(good["norm.weight"]), "layers.1.ffn.experts.3.w2.weight":
          nan_at(good["layers.1.ffn.experts.3.w2.weight"])},
         r"2 tensor\(s\) hold NaN .*\['layers\.1\.ffn\.experts\.3\.w2\.weight', 'norm\.weight'\]"),
        ({"layers.2.attn.wq_b.weight": q, "layers.2.attn.wq_b.weight_scale_inv": nan_at(s)},
         r"1 tensor\(s\) hold NaN .*\['layers\.2\.attn\.wq_b\.weight'\]"),
    ]
    for edit, match in edits:
        rewrite_checkpoint(tmp_path, dict(good, **edit))
        with pytest.raises(WeightError, match=match):
            load_pretrained(tmp_path, progress=False)
    # a float weight with a block scale beside it (a checkpoint upcast from FP8 that kept its scales, or one whose
    # scales were meant: which, cannot be told): read as stored, with a warning naming the first (it was silent)
    up = dequant_fp8_block(q, s, torch.float32)
    rewrite_checkpoint(tmp_path, dict(good, **{"layers.2.attn.wq_b.weight": up,
                                               "layers.2.attn.wq_b.weight_scale_inv": s}))
    with pytest.warns(UserWarning, match=r"1 tensor\(s\) stored in a float dtype have a block scale beside them, "
                                         r"not applied \(first: 'layers\.2\.attn\.wq_b\.weight' with "
                                         r"'layers\.2\.attn\.wq_b\.weight_scale_inv'\)"):
        m = load_pretrained(tmp_path, progress=False)
    assert torch.equal(m.state_dict()["layers.2.attn.wq_b.weight"], up)
    # the same tensor in two files and no index to say which one is read
    rewrite_checkpoint(tmp_path, good)
    (tmp_path / "model.safetensors.index.json").unlink()
    save_file({"norm.weight": good["norm.weight"]}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(WeightError, match="'norm.weight' is in both extra.safetensors and model.safetensors"):
        load_pretrained(tmp_path, progress=False)


def test_transformers_fused_experts_plain_and_fp8(tiny, tmp_path):
    """transformers' fused expert tensors (`experts.gate_up_proj` (E, 2I, D), `experts.down_proj` (E, D, I)): in
    BF16/FP32, and FP8 with `<tensor>_scale_inv` block scales, whole or with the gate and up halves scaled apart
    (transformers' layout where I is not a multiple of 128); a wrong expert count or shape is named."""
    save_pretrained(tiny, tmp_path, dtype=torch.float32)
    good = all_tensors(tmp_path)
    E = tiny.cfg.n_routed_experts

    def fused(t, layer, fp8=None):
        out = {k: v for k, v in t.items() if not k.startswith(f"layers.{layer}.ffn.experts.")}
        w = {n: torch.stack([t[f"layers.{layer}.ffn.experts.{e}.{n}.weight"] for e in range(E)]) for n in ("w1", "w2", "w3")}
        key = f"model.layers.{layer}.mlp.experts."
        gate_up, down = torch.cat([w["w1"], w["w3"]], 1), w["w2"]
        if fp8 is None:
            return dict(out, **{key + "gate_up_proj": gate_up, key + "down_proj": down}), w
        if fp8 == "halves":
            (q1, s1), (q3, s3) = (quant_fp8_block(w[n], torch.float8_e4m3fn, scale_fmt="fp32") for n in ("w1", "w3"))
            qg, sg = torch.cat([q1, q3], 1), torch.cat([s1, s3], 1)
        else:
            qg, sg = quant_fp8_block(gate_up, torch.float8_e4m3fn, scale_fmt="fp32")
        qd, sd = quant_fp8_block(down, torch.float8_e4m3fn, scale_fmt="fp32")
        half = qg.shape[1] // 2
        ref = {"w1": dequant_fp8_block(qg[:, :half], sg[:, :sg.shape[1] // 2]) if fp8 == "halves" else
               dequant_fp8_block(qg, sg)[:, :half],
               "w3": dequant_fp8_block(qg[:, half:], sg[:, sg.shape[1] // 2:]) if fp8 == "halves" else
               dequant_fp8_block(qg, sg)[:, half:], "w2": dequant_fp8_block(qd, sd)}
        return dict(out, **{key + "gate_up_proj": qg, key + "gate_up_proj_scale_inv": sg, key + "down_proj": qd,
                            key + "down_proj_scale_inv": sd}), ref

    for fp8 in (None, "whole", "halves"):
        t, want = fused(good, 2, fp8)
        rewrite_checkpoint(tmp_path, t)
        back = load_pretrained(tmp_path, progress=False)
        for n in ("w1", "w2", "w3"):
            assert torch.equal(getattr(back.layers[2].ffn.experts, n), want[n]), (fp8, n)
    assert fp8 == "halves" and t["model.layers.2.mlp.experts.gate_up_proj_scale_inv"].shape[1] == 2
    t, _ = fused(good, 1)
    for bad in (t["model.layers.1.mlp.experts.gate_up_proj"][:E - 1], t["model.layers.1.mlp.experts.gate_up_proj"][..., :1]):
        rewrite_checkpoint(tmp_path, dict(t, **{"model.layers.1.mlp.experts.gate_up_proj": bad.contiguous()}))
        with pytest.raises(WeightError, match=rf"experts\.gate_up_proj': shape {tuple(bad.shape)}".replace("(", "\\(").replace(")", "\\)")):
            load_pretrained(tmp_path, progress=False)
    t, _ = fused(good, 1, "whole")  # a NaN in a fused FP8 stack's block scale
    rewrite_checkpoint(tmp_path, dict(t, **{"model.layers.1.mlp.experts.down_proj_scale_inv":
                                            nan_at(t["model.layers.1.mlp.experts.down_proj_scale_inv"])}))
    with pytest.raises(WeightError, match=r"1 tensor\(s\) hold NaN .*\['model\.layers\.1\.mlp\.experts\.down_proj'\]"):
        load_pretrained(tmp_path, progress=False)


def test_load_arguments_and_forward_inputs_are_checked(tiny, tmp_path):
    save_pretrained(tiny, tmp_path)
    with pytest.raises(ValueError, match="dtype torch.float64"):
        load_pretrained(tmp_path, dtype=torch.float64, progress=False)
    with pytest.raises(TypeError, match="is a dtype"):
        load_pretrained(tmp_path, torch.bfloat16, progress=False)
    for name, want in [("float16", torch.float16), ("fp16", torch.float16), ("bf16", torch.bfloat16)]:
        assert load_pretrained(tmp_path, dtype=name, progress=False).embed.weight.dtype == want
    with pytest.raises(ValueError, match="dtype 'bf32'"):
        load_pretrained(tmp_path, dtype="bf32", progress=False)
    m = load_pretrained(tmp_path, dtype="bfloat16", progress=False)
    assert m.embed.weight.dtype == torch.bfloat16
    V = tiny.cfg.vocab_size
    for ids, match in [(torch.tensor([[1, V]]), f"token id {V} outside the vocabulary \\[0, {V}\\)"),
                       (torch.tensor([[-1, 2]]), "token id -1 outside"), (torch.zeros(1, 0, dtype=torch.long), "at least one"),
                       (torch.tensor([1, 2]), "integer tensor \\(B, T\\)"), (torch.ones(1, 2), "integer tensor")]:
        with pytest.raises(ValueError, match=match), torch.no_grad():
            m(ids)
    with torch.no_grad():
        assert torch.equal(m(torch.tensor([[1, 2, 3]], dtype=torch.uint8)), m(torch.tensor([[1, 2, 3]])))


def test_corrupt_shard_and_missing_files(tiny, tmp_path):
    save_pretrained(tiny, tmp_path, max_shard_bytes=200_000)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(WeightError, match=shard.name):
        load_pretrained(tmp_path, progress=False)
    shard.unlink()
    with pytest.raises(WeightError, match=f"lists shard {shard.name}"):
        load_pretrained(tmp_path, progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path / "empty", progress=False)


def test_weight_io_never_pickles(tiny, tmp_path, monkeypatch):
    import pickle

    def refuse(*a, **k):
        raise AssertionError("pickle used in weight I/O")
    for name in ("load", "loads", "dump", "dumps", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    save_pretrained(tiny, tmp_path, fp8=True)
    load_pretrained(tmp_path, progress=False)


def test_malformed_index_is_named(tiny, tmp_path):
    save_pretrained(tiny, tmp_path, max_shard_bytes=200_000)
    index = tmp_path / "model.safetensors.index.json"
    shard = next(iter(json.loads(index.read_text())["weight_map"].values()))
    for body, why in (("[]", "not a safetensors index"), ('{"weight_map": ["a"]}', "weight_map must"),
                      ('{"weight_map": {"norm.weight": null}}', "weight_map must"),
                      (f'{{"weight_map": {{"norm.weight": "{shard}", "norm.weight": "{shard}"}}}}',
                       "not a safetensors index .ValueError: key 'norm.weight' given twice")):
        index.write_text(body)
        with pytest.raises(WeightError, match=f"model.safetensors.index.json: {why}"):
            load_pretrained(tmp_path, progress=False)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_saved_files_take_the_umask(tiny, tmp_path, umask):
    """Every file save_pretrained writes has the mode open() gives new files: safetensors 0.8 alone creates its
    files 0600, which left an exported model's weights unreadable to other users while config.json was not."""
    old = os.umask(umask)
    try:
        save_pretrained(tiny, tmp_path, max_shard_bytes=1 << 20)
    finally:
        os.umask(old)
    modes = {f.name: f.stat().st_mode & 0o777 for f in tmp_path.iterdir()}
    assert len([n for n in modes if n.endswith(".safetensors")]) > 1 and "config.json" in modes
    assert modes == dict.fromkeys(modes, 0o666 & ~umask), modes


def test_process_umask_reads_it_without_changing_it(monkeypatch):
    """process_umask reads /proc/self/status (no window in which another thread's new files get mode 0666); without
    it, it falls back to setting and restoring the umask. Both give the umask and leave it as it was."""
    from model import weights
    old = os.umask(0o027)
    try:
        assert weights.process_umask() == 0o027
        real_open = open

        def no_proc(path, *a, **k):
            if str(path).startswith("/proc"):
                raise FileNotFoundError(path)
            return real_open(path, *a, **k)
        monkeypatch.setattr("builtins.open", no_proc)
        assert weights.process_umask() == 0o027
        monkeypatch.undo()
        assert os.umask(0o027) == 0o027
    finally:
        os.umask(old)

