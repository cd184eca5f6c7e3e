"""The paged engine against its slow twin (SimpleEngine) and the model's full-sequence forward."""
import atexit
import dataclasses
import functools
import json
import os
import re
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model import ModelConfig, build_model
from model.config import load_yaml
from model.parallel import close_process_groups
from kernels.quant import fp8_dtype
from model.model import Transformer
from rollout_server import (FP8_SCALE, Engine, SamplingParams, SimpleEngine, WeightApplier, bucket_layout, bucket_plan,
                            is_fp8_held, prepare_inference_model, quantize, update_weights)
import rollout_server
from tests.conftest import all_tensors, input_dependent, rewrite_checkpoint, same_bytes

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.from_dict(load_yaml("configs/tiny.yaml", ["model.vocab_size=32"])["model"])
    return input_dependent(build_model(cfg, seed=0)).eval()


_GENERATE = Engine.generate  # (the engine's own, before a test patches it)


def stop_generate_at(monkeypatch, n: int) -> list:
    """Engine.generate raising KeyboardInterrupt at its n-th call (0: never), as an interrupted run; -> the calls'
    prompt counts."""
    calls = []

    def spy(self, prompts, *a, **kw):
        calls.append(len(prompts))
        if len(calls) == n:
            raise KeyboardInterrupt
        return _GENERATE(self, prompts, *a, **kw)
    monkeypatch.setattr(Engine, "generate", spy)
    return calls


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 32, (n,), generator=g).tolist() for n in lengths]


def _same(a, b):
    assert a.token_ids == b.token_ids
    assert torch.equal(a.routed_experts, b.routed_experts)
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert a.finish_reason == b.finish_reason
    assert (a.index_entries is None) == (b.index_entries is None)
    if a.index_entries is not None:
        assert torch.equal(a.index_entries, b.index_entries)


def _chosen(model, full):
    """The full-sequence forward's logits, routing and the indexer's chosen entries of every position (T, CSA
    layers, index_topk), in Output.index_entries' layout."""
    from rollout_server import index_record
    masks, indexers = [], [blk.attn.indexer for blk in model.layers if blk.attn.indexer is not None]
    for ix in indexers:
        ix.select = lambda *a, _f=ix.select, **k: masks.append(_f(*a, **k)) or masks[-1]
    try:
        with torch.no_grad():
            logits, routing = model(full, return_routing=True)
    finally:
        for ix in indexers:
            del ix.select
    k = model.cfg.index_topk
    rows = [index_record(torch.where(m[0], torch.arange(m.shape[-1]), -1), k) for m in masks]
    return logits, routing, torch.stack(rows, 1)


@pytest.mark.parametrize("kw", [
    dict(),                                                     # whole prompts in one prefill step
    dict(max_batch_tokens=16),                                  # chunked prefill across many steps
    dict(num_blocks=8, block_entries=4, max_seqs=4),            # block pool too small: preemption by recompute
    dict(max_seqs=2),                                           # sequences join as others leave
])
def test_greedy_equals_simple_engine_and_full_forward(model, kw):
    prompts = _prompts([1, 5, 17, 33, 50])
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 12, 40, 25, 31)]
    ref = SimpleEngine(model, fp8=False, dtype=torch.float32, device="cpu", record_index=True).generate(prompts, params)
    eng = Engine(model, fp8=False, dtype=torch.float32, device="cpu", max_model_len=128, record_index=True, **kw)
    out = eng.generate(prompts, params)
    for a, b in zip(ref, out):
        _same(a, b)
    for o in out:  # and the full-sequence forward, token for token: tokens, routing, the indexer's choices
        full = torch.tensor([o.prompt_token_ids + o.token_ids])
        logits, routing, chosen = _chosen(model, full)
        assert logits[0, len(o.prompt_token_ids) - 1:-1].argmax(-1).tolist() == o.token_ids
        assert torch.equal(routing[0, :-1].to(torch.uint8), o.routed_experts)
        assert o.index_entries.dtype == torch.int32 and torch.equal(chosen[:-1], o.index_entries)
    # past 5 compressed entries a CSA layer's indexer picks 4 of them: the check covers real choices
    assert (out[-1].index_entries[-1] >= 0).all() and int(out[-1].index_entries.max()) >= 4
    if "num_blocks" in kw:
        assert eng.stats["preemptions"] > 0
    if "max_batch_tokens" in kw:
        assert eng.stats["prefill_tokens"] == sum(map(len, prompts))


@pytest.mark.parametrize("ratios", [[0, 0, 0, 0], [0, 16, 0, 16], [4, 0, 4, 0]], ids=["sliding", "hca", "csa"])
def test_a_pool_no_layer_uses_neither_refuses_nor_preempts(ratios, tmp_path):
    """Each pool 3 usable blocks of 4 entries: the three requests below need 3 blocks each of a ratio-4 (CSA) pool and
    1 each of a ratio-16 (HCA) pool. A model without CSA layers must run them together with no preemption (a pool no
    layer writes must not throttle the schedule); one with CSA layers must preempt, or the pools were not small."""
    cfg = ModelConfig.from_dict(load_yaml("configs/tiny.yaml", ["model.vocab_size=32",
                                                                f"model.compress_ratios={ratios}"])["model"])
    model = input_dependent(build_model(cfg, seed=1), seed=1).eval()
    prompts = _prompts([9, 30, 21], seed=1)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 12, 20)]
    eng = Engine(model, fp8=False, dtype=torch.float32, device="cpu", max_model_len=64, num_blocks=4,
                 block_entries=4, max_seqs=3)
    out = eng.generate(prompts, params)
    for o in out:
        full = torch.tensor([o.prompt_token_ids + o.token_ids])
        with torch.no_grad():
            logits = model(full)
        assert logits[0, len(o.prompt_token_ids) - 1:-1].argmax(-1).tolist() == o.token_ids
    assert (eng.stats["preemptions"] > 0) == (4 in ratios)
    # num_blocks as a dict may leave out the pool no layer writes, not one a layer does
    used = {k for k, r in (("csa", 4), ("hca", 16)) if r in ratios}
    named = Engine(model, fp8=False, dtype=torch.float32, device="cpu", max_model_len=64,
                   num_blocks={k: 4 for k in used}, block_entries=4, max_seqs=3).generate(prompts, params)
    assert [o.token_ids for o in named] == [o.token_ids for o in out]
    # from a checkpoint directory: its config.json read once, for the pools' check and the load
    from model import load_hf_config, weights
    from model.weights import save_pretrained
    save_pretrained(model, tmp_path, dtype=torch.float32)
    reads = []
    with pytest.MonkeyPatch.context() as mp:
        for mod in (rollout_server, weights):
            mp.setattr(mod, "load_hf_config", lambda path: reads.append(path) or load_hf_config(path))
        loaded = Engine(tmp_path, fp8=False, dtype=torch.float32, device="cpu", max_model_len=64,
                        num_blocks={k: 4 for k in used}, block_entries=4, max_seqs=3).generate(prompts, params)
    assert [o.token_ids for o in loaded] == [o.token_ids for o in out] and len(reads) == 1, reads
    # its pools are checked from its config.json, before any weight is read (here none is)
    for f in tmp_path.glob("*.safetensors*"):
        f.unlink()
    for k in used:
        for src in (model, tmp_path, str(tmp_path)):
            with pytest.raises(ValueError, match=f"has no '{k}' pool, which this model's {k.upper()} layers need"):
                Engine(src, device="cpu", num_blocks={j: 4 for j in used - {k}})


def test_cli_reads_a_checkpoints_config_once(model, tmp_path):
    """rollout_server.py --model DIR reads DIR's config (load_hf_config) for its own checks and hands it to the engine,
    paged or simple: one read a run, and the completions of an engine made from the directory alone."""
    import json

    from model import load_hf_config, weights
    from model.weights import save_pretrained
    ckpt, src = tmp_path / "ckpt", tmp_path / "p.jsonl"
    save_pretrained(model, ckpt, dtype=torch.float32)
    prompts = _prompts([5, 12], seed=2)
    src.write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    for engine in ("paged", "simple"):
        out, reads = tmp_path / f"{engine}.jsonl", []
        with pytest.MonkeyPatch.context() as mp:
            for mod in (rollout_server, weights):
                mp.setattr(mod, "load_hf_config", lambda path: reads.append(path) or load_hf_config(path))
            rollout_server.main(["--model", str(ckpt), "--prompts", str(src), "--out", str(out), "--engine", engine,
                                 "--max-tokens", "5", "--temperature", "0", "--max-model-len", "64"])
        assert len(reads) == 1, reads
        want = (Engine if engine == "paged" else SimpleEngine)(ckpt, device="cpu", dtype=torch.float32).generate(
            prompts, SamplingParams(temperature=0, max_tokens=5))
        assert [json.loads(r)["token_ids"] for r in out.read_text().splitlines()] == [o.token_ids for o in want]


@pytest.mark.parametrize("tie", [False, True])
def test_engine_from_a_meta_model_holds_only_its_formats_until_the_weights_arrive(tie):
    """A rollout rank builds its model on meta (the BF16 DeepSeek-V4-Flash would not fit a GPU) and gets its weights
    by update_weights: device memory only for the held tensors (the same bytes as an engine made from the weights),
    the tied head tied again, and then the same outputs."""
    tied = f"model.tie_word_embeddings={str(tie).lower()}"
    cfg = ModelConfig.from_dict(load_yaml("configs/tiny.yaml", ["model.vocab_size=32", tied])["model"])
    real = input_dependent(build_model(cfg, seed=3), seed=3).eval()
    prompts = _prompts([9, 30], seed=3)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for fp8 in (True, False):
        for kind in (Engine, SimpleEngine):
            kw = dict(fp8=fp8, dtype=torch.float32, device="cpu", **(dict(max_model_len=64) if kind is Engine else {}))
            eng = kind(build_model(cfg, "meta", torch.bfloat16, seed=None), **kw)
            ref = kind(real, **kw)
            held = [{n: (t.shape, t.dtype) for n, t in e.model.state_dict().items()} for e in (eng, ref)]
            assert held[0] == held[1] and not any(t.is_meta for t in eng.model.state_dict().values())
            assert (eng.model.head.weight is eng.model.embed.weight) == tie
            eng.update_weights(real.stored_state().items())
            for a, b in zip(eng.generate(prompts, sp), ref.generate(prompts, sp)):
                _same(a, b)


@pytest.mark.parametrize("tie", [False, True])
def test_engine_streams_a_models_weights_as_a_whole_copy_holds_them(tie):
    """Engine(model) builds its own model on meta and streams the given one's weights in (update_weights, cast as
    set_dtype casts them): no second whole model on any device. It holds exactly what copying the model whole first
    holds (stream=False, the twin), FP8 bytes and scales included, in fp32 and bf16, under expert parallelism, tied
    head or not; the given model is left as it was."""
    tied = f"model.tie_word_embeddings={str(tie).lower()}"
    cfg = ModelConfig.from_dict(load_yaml("configs/tiny.yaml", ["model.vocab_size=32", tied])["model"])
    real = input_dependent(build_model(cfg, seed=3), seed=3)
    before = {k: v.clone() for k, v in real.state_dict().items()}
    for fp8 in (True, False):
        for dtype in (torch.float32, torch.bfloat16):
            for ep in (None, (None, 2, 1)):
                a, b = (prepare_inference_model(real, fp8, dtype, "cpu", ep=ep, stream=s) for s in (True, False))
                sa, sb = a.state_dict(), b.state_dict()
                assert sa.keys() == sb.keys()
                for k in sa:
                    assert same_bytes(sa[k], sb[k]), (fp8, dtype, ep, k)
                assert (a.head.weight is a.embed.weight) == tie
    assert all(torch.equal(v, before[k]) for k, v in real.state_dict().items())
    assert all(p.requires_grad for p in real.parameters())


@pytest.mark.parametrize("fp8_ckpt", [False, True], ids=["bf16-ckpt", "fp8-ckpt"])
def test_engine_from_a_checkpoint_under_ep_reads_only_its_experts(model, tmp_path, monkeypatch, fp8_ckpt):
    """Engine(directory, ep=...) on rank r of an expert-parallel group reads only its 1/size of each layer's routed
    experts from the checkpoint (DeepSeek-V4-Flash's experts are ~98% of its 569 GB; each of 8 ranks reading them
    all into host memory would need 4.5 TB), and holds what an engine made from the whole loaded model holds."""
    from model.weights import _Shards, load_pretrained, save_pretrained
    save_pretrained(model, tmp_path, fp8=fp8_ckpt, dtype=torch.float32)
    read = []
    get = _Shards.get
    monkeypatch.setattr(_Shards, "get", lambda self, key: read.append(key) or get(self, key))
    whole = load_pretrained(tmp_path, dtype=torch.float32, progress=False)
    E, size = model.cfg.n_routed_experts, 2
    expert = re.compile(r"\.ffn\.experts\.(\d+)\.w[123]\.weight$")
    for rank in range(size):
        read.clear()
        eng = prepare_inference_model(tmp_path, True, torch.float32, "cpu", ep=(None, size, rank))
        ids = {int(m.group(1)) for m in map(expert.search, read) if m}
        assert ids == set(range(rank * E // size, (rank + 1) * E // size))
        ref = prepare_inference_model(whole, True, torch.float32, "cpu", ep=(None, size, rank),
                                      scale_fmt="ue8m0" if fp8_ckpt else None)
        a, b = eng.state_dict(), ref.state_dict()
        assert a.keys() == b.keys() and all(same_bytes(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match=r"experts=\(size 3, rank 0\): size must divide the 8 routed experts"):
        load_pretrained(tmp_path, experts=(3, 0), progress=False)


@pytest.mark.parametrize("layout", ["bf16", "fp8", "fused", "mxfp4"])
def test_engine_streams_a_checkpoint_as_reading_it_whole_holds_it(tmp_path, monkeypatch, layout):
    """Engine(directory) builds its model on meta and streams the checkpoint in a tensor at a time, each read onto
    the device, cast and quantized there: load_pretrained, which reads the whole model into host memory first
    (569 GB in BF16 for DeepSeek-V4-Flash), is never called. It holds exactly what reading the checkpoint whole
    first holds (stream=False, the twin), FP8 bytes and scales included: from a BF16 and an FP8 (ue8m0) release
    checkpoint, from transformers' fused expert stacks and from MXFP4 experts beside fp32-scaled FP8 linears (the
    Flash release's and DeepSeek-V3's formats), for FP8 and BF16 engines (in bf16, and in fp32 from the FP8
    checkpoint), under expert parallelism or not, tied head or not. A bad checkpoint is refused as load_pretrained
    refuses it."""
    from kernels.quant import quant_mxfp4
    from model.weights import WeightError, save_pretrained
    whole = rollout_server.load_pretrained

    def refuse(*args, **kwargs):
        raise AssertionError("the streamed engine read the whole checkpoint")
    for tie in (False, True) if layout == "bf16" else (False,):
        tied = f"model.tie_word_embeddings={str(tie).lower()}"
        cfg = ModelConfig.from_dict(load_yaml("configs/tiny.yaml", ["model.vocab_size=32", tied])["model"])
        path = tmp_path / f"tie-{tie}"
        save_pretrained(input_dependent(build_model(cfg, seed=3), seed=3), path, fp8=layout == "fp8",
                        dtype=torch.float32)
        if layout == "fused":  # every layer's routed experts as transformers stacks them
            t = all_tensors(path)
            for li in range(cfg.num_hidden_layers):
                w = {n: torch.stack([t.pop(f"layers.{li}.ffn.experts.{e}.{n}.weight")
                                     for e in range(cfg.n_routed_experts)]) for n in ("w1", "w2", "w3")}
                key = f"model.layers.{li}.mlp.experts."
                t[key + "gate_up_proj"], t[key + "down_proj"] = torch.cat([w["w1"], w["w3"]], 1), w["w2"]
            rewrite_checkpoint(path, t)
        if layout == "mxfp4":  # routed experts in MXFP4, a dense linear FP8 with fp32 `weight_scale_inv`
            t = all_tensors(path)
            for k in [k for k in t if ".ffn.experts." in k]:
                t[k], t[k[: -len(".weight")] + ".scale"] = quant_mxfp4(t[k])
            k = "layers.2.attn.wq_b.weight"
            t[k], t[k + "_scale_inv"] = quantize(t[k], torch.float8_e4m3fn, "fp32")
            rewrite_checkpoint(path, t)
        for fp8 in (True, False):
            for dtype in (torch.float32, torch.bfloat16) if layout == "fp8" else (torch.bfloat16,):
                for ep in (None, (None, 2, 1)):
                    monkeypatch.setattr(rollout_server, "load_pretrained", whole)
                    b = prepare_inference_model(path, fp8, dtype, "cpu", ep=ep, stream=False)
                    monkeypatch.setattr(rollout_server, "load_pretrained", refuse)
                    a = prepare_inference_model(path, fp8, dtype, "cpu", ep=ep)
                    sa, sb = a.state_dict(), b.state_dict()
                    assert sa.keys() == sb.keys()
                    for k in sa:
                        assert same_bytes(sa[k], sb[k]), (layout, tie, fp8, dtype, ep, k)
                    assert (a.head.weight is a.embed.weight) == tie
    good = all_tensors(path)
    ids, D = good["layers.0.ffn.gate.tid2eid"] + cfg.n_routed_experts, cfg.hidden_size
    for edit, match in [({k: v for k, v in good.items() if k != "norm.weight"}, r"lacks 1 tensor\(s\), first: \['norm"),
                        (dict(good, **{"layers.0.ffn.gate.tid2eid": ids}),
                         rf"'layers.0.ffn.gate.tid2eid' holds expert ids from {int(ids.min())} to {int(ids.max())}"),
                        (dict(good, **{"norm.weight": good["norm.weight"][:-1].clone()}),
                         rf"'norm.weight': shape \({D - 1},\) in the checkpoint, the model \(config.json\) expects")]:
        rewrite_checkpoint(path, edit)
        with pytest.raises(WeightError, match=match):
            prepare_inference_model(path, True, torch.bfloat16, "cpu")


def test_pools_sized_from_free_memory_keep_to_the_fraction(model, monkeypatch):
    """On a GPU the pools take mem_fraction of the memory free after the weights: the slots' state first, then at
    least one sequence of max_model_len's blocks, then as many more blocks as fit (a device's free memory faked here,
    the byte count checked against what a cache of those sizes allocates). Too little memory for that least is a
    clear error, not a pool that refuses every request."""
    from rollout_server import PagedCache
    BE, seqs, mml, dt = 4, 4, 64, torch.bfloat16
    eng = Engine.__new__(Engine)
    eng.model, eng.cfg, eng.device, eng.dtype = model, model.cfg, torch.device("cuda"), dt
    eng.max_seqs, eng.max_model_len = seqs, mml
    free = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[-1], 2 * free[-1]))

    def allocated(n):
        cache = PagedCache(model, seqs, n, BE, mml, "cpu", dt)
        return sum(t.nbytes for t in cache.slot_tensors() + [t for k in n for t in cache.block_tensors(k)])
    full = {k: seqs * -(-(mml // r) // BE) + 1 for k, r in (("csa", model.cfg.csa_ratio), ("hca", model.cfg.hca_ratio))}
    need = {k: (n - 1) // seqs + 1 for k, n in full.items()}
    assert allocated(full) == PagedCache.nbytes(model, seqs, full, BE, dt)
    least, most = allocated(need), allocated(full)
    for frac in (0.5, 0.85, 1.0):
        for want in (least, (least + most) // 2, most, 3 * most):
            free.append(int(want / frac) + 1)
            n = eng._size_pools(None, BE, frac)
            assert all(need[k] <= n[k] <= full[k] for k in full), (n, need, full)
            got = allocated(n)
            block = sum(allocated({**n, k: n[k] + 1}) - got for k in n)
            assert got <= frac * free[-1] and (n == full or frac * free[-1] - got < block), (frac, want, n, got)
    free.append(int(least / 0.85) - 1)
    with pytest.raises(ValueError, match=r"the cache does not fit: .* GiB for the state of max_seqs=4 sequences and "
                       r".* of max_model_len=64, against mem_fraction=0.85 of the .* lower max_seqs or max_model_len"):
        eng._size_pools(None, BE, 0.85)
    # the least serves one sequence of max_model_len, whole
    free.append(int(least / 0.85) + 1)
    n = eng._size_pools(None, BE, 0.85)
    assert n == need
    # pools of a fixed size (num_blocks) are made only if they fit what is free, mem_fraction aside
    fixed = {"csa": 7, "hca": 5}
    free.append(allocated(fixed))
    assert eng._size_pools(fixed, BE, 0.5) == fixed and eng._size_pools(6, BE, 0.5) == {"csa": 6, "hca": 6}
    free.append(allocated(fixed) - 1)
    with pytest.raises(ValueError, match=r"the cache does not fit: num_blocks=\{'csa': 7, 'hca': 5\} for max_seqs=4 "
                       r"sequences take .* GiB against the .* GiB free after the weights: fewer blocks or sequences"):
        eng._size_pools(fixed, BE, 0.85)
    one = Engine(model, fp8=False, dtype=torch.float32, device="cpu", max_model_len=mml, num_blocks=n, block_entries=BE,
                 max_seqs=seqs).generate(_prompts([20]), SamplingParams(temperature=0, max_tokens=mml - 20,
                                                                        ignore_eos=True))
    assert len(one[0].token_ids) == mml - 20


@pytest.mark.parametrize("extra", [[], ["--bf16"], ["--engine", "simple"]])
def test_cli_random_weights_are_build_models(tmp_path, extra):
    """With a YAML config the CLI draws the random weights tensor by tensor into the engine (never the whole model on
    the device): the completions of an engine made from build_model(cfg, seed=--seed)."""
    import json
    from rollout_server import main
    prompts = [[5, 6, 7], [3, 4, 9, 10, 11], [8] * 9]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    main(["--model", "configs/tiny.yaml", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl"),
          "--max-tokens", "8", "--temperature", "0", "--max-seqs", "4", "--max-model-len", "64", "--seed", "3", *extra])
    got = [json.loads(x)["token_ids"] for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    cfg = ModelConfig.from_dict(load_yaml("configs/tiny.yaml")["model"])
    kind = SimpleEngine if "simple" in extra else Engine
    eng = kind(build_model(cfg, seed=3), fp8="--bf16" not in extra, dtype=torch.float32, device="cpu")
    assert got == [o.token_ids for o in eng.generate(prompts, SamplingParams(temperature=0, max_tokens=8))]
    assert got != [o.token_ids for o in kind(build_model(cfg, seed=4), fp8="--bf16" not in extra, dtype=torch.float32,
                                              device="cpu").generate(prompts, SamplingParams(temperature=0, max_tokens=8))]


def test_cli_writes_strict_json_when_log_probs_are_not_finite(tmp_path, monkeypatch, capsys):
    """A NaN / Inf log-prob (a model that overflows) is written as null with a warning naming the completion, not
    as json.dumps' NaN, which JSON parsers other than Python's refuse."""
    import json
    from rollout_server import main
    real = Engine.generate

    def broken(self, *a, **k):
        outs = real(self, *a, **k)
        outs[-1].logprobs[1:3] = [float("nan"), float("-inf")]
        return outs
    monkeypatch.setattr(Engine, "generate", broken)
    (tmp_path / "p.jsonl").write_text("[5, 6, 7]\n[3, 4]\n")
    main(["--model", "configs/tiny.yaml", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl"),
          "--max-tokens", "4", "--temperature", "0", "--max-seqs", "2", "--max-model-len", "32"])

    def refuse(c):
        raise ValueError(f"not JSON: {c}")
    rows = [json.loads(x, parse_constant=refuse) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [r["logprobs"].count(None) for r in rows] == [0, 2] and rows[1]["logprobs"][1:3] == [None, None]
    assert all(isinstance(v, float) for r in rows for v in r["logprobs"] if v is not None)
    assert "warning: prompt 1 sample 0: 2 of 4 log-probs are NaN / Inf (written as null)" in capsys.readouterr().err


def test_cli_says_when_the_cache_does_not_fit(monkeypatch):
    """The CLI stops with the engine's reason, not a traceback, when the device's free memory (faked: the sizing as
    on a GPU) cannot hold the cache --max-seqs and --max-model-len ask for."""
    real = Engine._size_pools

    def on_a_gpu(self, *a):
        self.device = torch.device("cuda")
        try:
            return real(self, *a)
        finally:
            self.device = torch.device("cpu")
    monkeypatch.setattr(Engine, "_size_pools", on_a_gpu)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 ** 20, 2 ** 30))
    with pytest.raises(SystemExit, match=r"^error: invalid engine arguments: the cache does not fit: .* "
                       r"max_seqs=64 .* max_model_len=512, against mem_fraction=0.5 of the 0.00 GiB free"):
        rollout_server.main(["--model", "configs/tiny.yaml", "--bench", "--batch", "2", "--prompt-len", "8",
                             "--max-tokens", "3", "--max-seqs", "64", "--max-model-len", "512", "--mem-fraction",
                             "0.5"])


@pytest.mark.parametrize("extra,attn_kw", [
    (256, {}),                           # a chunk's prompts in one padded group, its queries in one piece
    (0, {}),                             # in several groups
    (256, dict(budget=1, min_rows=16)),  # queries in pieces of 16 rows a group (windows reaching back into keys)
])
def test_batched_prefill_equals_one_sequence_at_a_time(model, monkeypatch, extra, attn_kw):
    """Prefill's sequences from position 0 in padded groups (fresh_attention, PagedCache.store_fresh) against its
    slow twin, seq_attention one sequence at a time (Runner.batch_prefill off): the same outputs and cache contents.
    Prompts shorter than a compress window, on window boundaries, past the sliding window (16) and the HCA ratio
    (16), one split over prefill chunks (its later chunk one at a time on both sides), a group sharing a prompt."""
    prompts = _prompts([1, 3, 4, 8, 16, 17, 31, 48, 70], 7) + _prompts([12], 8) * 3
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    monkeypatch.setattr(rollout_server, "fresh_groups", functools.partial(rollout_server.fresh_groups, extra=extra))
    n = {}
    for name in ("fresh", "seq"):  # count the calls of each path
        f = getattr(rollout_server, name + "_attention")
        f = functools.partial(f, **attn_kw) if name == "fresh" else f
        monkeypatch.setattr(rollout_server, name + "_attention",
                            lambda *a, _f=f, _k=name, **k: n.__setitem__(_k, n[_k] + 1) or _f(*a, **k))
    calls, outs, caches = [], [], []
    for batched in (True, False):
        eng = Engine(model, fp8=False, dtype=torch.float32, device="cpu", max_model_len=128, record_index=True,
                     max_batch_tokens=64)
        eng.runner.batch_prefill = batched
        n.update(fresh=0, seq=0)
        outs.append(eng.generate(prompts, sp))
        calls.append(dict(n))
        c = eng.cache
        caches.append(c.slot_tensors() + c.block_tensors("csa") + c.block_tensors("hca"))
    layers = model.cfg.num_hidden_layers
    # chunks of 64 tokens: [1, 3, 4, 8, 16, 17, 31's first 15], [31's last 16, 48], [70's first 64], [70's last 6,
    # 12]: one group each (the first chunk in two with no extra padding allowed), the later pieces one at a time
    assert calls[0] == {"fresh": layers * (4 if extra else 5), "seq": layers * 2}
    assert calls[1] == {"fresh": 0, "seq": layers * 12}
    for a, b in zip(*outs):
        _same(a, b)
    for a, b in zip(*caches):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fresh_groups_bound_their_padding():
    batch = [(None, 0, n) for n in (5, 100, 6, 90, 7)] + [(None, 3, 10)]  # the last one continues: not fresh
    bounds = [0]
    for _, a, b in batch:
        bounds.append(bounds[-1] + b - a)
    groups = rollout_server.fresh_groups(batch, bounds, "cpu", slack=1.5, extra=0)
    assert [g.index for g in groups] == [[1, 3], [4, 2, 0]]  # longest first; a group's B x T <= 1.5 x its tokens
    g = groups[0]
    assert g.T == 100 and g.rows.shape == (2, 100) and g.rows[1, 89:].eq(bounds[3] + 89).all()  # pads: last row
    assert torch.equal(g.packed, torch.cat([torch.arange(5, 105), torch.arange(111, 201)]))
    assert torch.equal(g.rows.flatten()[g.valid], g.packed)


@pytest.mark.parametrize("kw", [dict(), dict(max_seqs=2)])
def test_steps_whose_indexer_would_pick_every_entry_skip_it(model, kw, monkeypatch):
    """Decode steps whose positions all lie within Runner.every_upto (no CSA layer past the indexer's top-k of
    entries: 18 here, top-k 4 at ratio 4) read every entry and run no indexer query, scores or top-k; later
    steps run them. Against the engine that always runs them (record_index on) and the full forward: the same
    tokens and routing, log-probs within 1e-4."""
    prompts = _prompts([1, 3, 6, 14], 5)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 12, 25, 20)]
    ref = Engine(model, fp8=False, dtype=torch.float32, device="cpu", max_model_len=128, record_index=True,
                 **kw).generate(prompts, params)
    eng = Engine(model, fp8=False, dtype=torch.float32, device="cpu", max_model_len=128, **kw)
    assert eng.runner.every_upto == 18
    steps, scored = [], []
    step, scores = eng.runner._decode_eager, rollout_server.index_scores
    monkeypatch.setattr(eng.runner, "_decode_eager",
                        lambda inp, **k: steps.append((int(inp[1].max()), k["every"])) or step(inp, **k))
    monkeypatch.setattr(rollout_server, "index_scores", lambda *a, **k: scored.append(len(steps)) or scores(*a, **k))
    out = eng.generate(prompts, params)
    assert all(every == (p <= 18) for p, every in steps) and {e for _, e in steps} == {True, False}
    assert set(scored) == {i + 1 for i, (_, every) in enumerate(steps) if not every}  # the indexer ran there only
    for a, b in zip(ref, out):
        assert b.index_entries is None
        _same(a, dataclasses.replace(b, index_entries=a.index_entries))
        full = torch.tensor([b.prompt_token_ids + b.token_ids])
        with torch.no_grad():
            logits = model(full)
        assert logits[0, len(b.prompt_token_ids) - 1:-1].argmax(-1).tolist() == b.token_ids


def test_tied_index_scores_pick_the_same_entries_everywhere(model):
    """A position whose indexer scores tie exactly (entries 0 and 4 both 0.0: every head's ReLU is 0, here at
    position 19 of CSA layer 0): the decode step, the prefill and the full forward pick the same entries, so the
    log-probs agree with the forward's (they were 0.126 apart when the torch paths took torch.topk's order)."""
    prompt = _prompts([27, 3])[1]
    sp = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    outs = [e.generate([prompt], sp)[0] for e in (
        Engine(model, fp8=False, dtype=torch.float32, device="cpu", max_model_len=128, record_index=True),
        SimpleEngine(model, fp8=False, dtype=torch.float32, device="cpu", record_index=True))]
    full = torch.tensor([outs[0].prompt_token_ids + outs[0].token_ids])
    logits, _, chosen = _chosen(model, full)
    want = logits[0, len(prompt) - 1:-1].log_softmax(-1).gather(-1, torch.tensor(outs[0].token_ids)[:, None])[:, 0]
    for o in outs:
        assert torch.equal(chosen[:-1], o.index_entries)
        assert (torch.tensor(o.logprobs) - want).abs().max() < 1e-4

def test_sampling_and_shared_prefixes_match_the_simple_engine(model):
    prompts = [*_prompts([7], 1)] * 4 + [*_prompts([20], 2)] * 3 + _prompts([2], 3)
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=12, max_tokens=20, seed=5)
    a = SimpleEngine(model, fp8=False, dtype=torch.float32, device="cpu", record_index=True).generate(prompts, sp)
    eng = Engine(model, fp8=False, dtype=torch.float32, device="cpu", max_model_len=64, record_index=True)
    b = eng.generate(prompts, sp)
    for x, y in zip(a, b):
        _same(x, y)
    assert len({tuple(o.token_ids) for o in b[:4]}) > 1  # the samples of a group differ
    assert eng.stats["prefill_tokens"] == 7 + 20 + 2     # each distinct prompt prefilled once
    # a request's samples do not depend on the rest of the batch
    alone = eng.generate(prompts[0:1], sp)
    assert alone[0].token_ids == b[0].token_ids  # sequence index 0 of its own call, same prompt as b[0]
    # a request sent in pieces (first_index: where a piece starts) samples as the whole request does
    for e, whole in ((eng, b), (SimpleEngine(model, fp8=False, dtype=torch.float32, device="cpu"), a)):
        pieces = e.generate(prompts[:3], sp) + e.generate(prompts[3:], sp, first_index=3)
        assert [o.token_ids for o in pieces] == [o.token_ids for o in whole]
    assert eng.generate(prompts[3:4], sp)[0].token_ids != b[3].token_ids  # (index 0 instead of 3: other samples)


def test_groups_admitted_together_keep_the_blocks_their_forks_need(model):
    """Two groups admitted in one pass: each promises its followers' copies of the partial last blocks, so the
    second group cannot take them (the forks ran the pool dry: IndexError from the allocator). A group the idle
    cache cannot take whole is split (it never started: "the cache cannot hold a single sequence")."""
    prompts = [*_prompts([9], 4)] * 4 + [*_prompts([9], 5)] * 4
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = SimpleEngine(model, fp8=False, dtype=torch.float32, device="cpu").generate(prompts, sp)
    eng = Engine(model, fp8=False, dtype=torch.float32, device="cpu", max_model_len=64, num_blocks=6, block_entries=4,
                 max_seqs=8)
    for a, b in zip(ref, eng.generate(prompts, sp)):
        _same(a, b)
    assert not any(eng.cache.promised.values())
    assert all(len(a.free) == len(a.ref) - 1 for a in eng.cache.alloc.values())  # every block back
    # a group larger than the slots (or than the blocks its forks take) is admitted in parts: the same samples
    group = [*_prompts([13], 6)] * 8
    sp = SamplingParams(temperature=1.0, max_tokens=9, seed=3)
    ref = SimpleEngine(model, fp8=False, dtype=torch.float32, device="cpu").generate(group, sp)
    for kw in (dict(max_seqs=3), dict(num_blocks=4, block_entries=2, max_seqs=8)):
        eng = Engine(model, fp8=False, dtype=torch.float32, device="cpu", max_model_len=64, **kw)
        for a, b in zip(ref, eng.generate(group, sp)):
            _same(a, b)
        assert eng.stats["prefill_tokens"] > 13  # the prompt prefilled more than once



def _random_run(seed):
    """A random request mix (shared-prompt groups, greedy and sampled rows, top-k / top-p, stop ids, EOS on or
    off, 1-40 new tokens) and random engine sizes (slots, prefill chunk, small block pools): (prompts, params, kw)."""
    import random
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(rng.randint(1, 7)):
        p = torch.randint(3, 32, (rng.choice([1, 2, 4, 7, 15, 16, 17, 30, 33, 47, 64]),), generator=g).tolist()
        prompts += [p] * rng.choice([1, 1, 1, 2, 3])
    rng.shuffle(prompts)
    params = [SamplingParams(temperature=rng.choice([0, 0, 0.7, 1.0]), top_k=rng.choice([0, 0, 5]),
                             top_p=rng.choice([1.0, 1.0, 0.9]), max_tokens=rng.randint(1, 40), seed=rng.randint(0, 5),
                             stop_token_ids=rng.choice([[], [], [7], [3, 9]]), ignore_eos=rng.random() < 0.5)
              for _ in prompts]
    kw = dict(max_seqs=rng.choice([1, 2, 3, 8, 32]), pipeline=rng.random() < 0.6,
              max_batch_tokens=rng.choice([8, 16, 40, 8192]))
    if rng.random() < 0.5:
        kw.update(num_blocks=rng.choice([6, 8, 12, 20]), block_entries=rng.choice([2, 4, 8]))
    return prompts, params, kw


def test_random_request_mixes_match_the_simple_engine(model):
    """Random mixes of everything the scheduler juggles at once, against the simple engine. Offline (2026-12-04)
    1,000 seeds of _random_run: 3 parted, each at a near-tie of the reference model's own scores (two indexer
    scores 1.8e-7 apart at the top-k's edge twice, two router scores 7e-7 apart once: DESIGN's testing notes), the
    rest equal. These four cover preemption with shared groups (10, 12, 37), one slot with chunked prefill (2),
    pipelined and not, and sequences ending on stop ids."""
    preempted, stopped = 0, 0
    for seed in (2, 10, 12, 37):
        prompts, params, kw = _random_run(seed)
        ref = SimpleEngine(model, fp8=False, dtype=torch.float32, device="cpu", record_index=True).generate(prompts,
                                                                                                          params)
        eng = Engine(model, fp8=False, dtype=torch.float32, device="cpu", max_model_len=128, record_index=True, **kw)
        for a, b in zip(ref, eng.generate(prompts, params)):
            _same(a, b)  # tokens, log-probs, routing, the indexer's choices, finish reasons
        assert all(len(a.free) == len(a.ref) - 1 for a in eng.cache.alloc.values()), seed  # every block back
        preempted += eng.stats["preemptions"] > 0
        stopped += sum(o.finish_reason == "stop" for o in ref)
    assert preempted >= 3 and stopped >= 10, (preempted, stopped)


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_call_that_raises_gives_back_its_slots_and_blocks(model, monkeypatch, pipeline):
    """generate raising mid-run (here the third decode step; a KeyboardInterrupt or a device error alike) leaves the
    cache as it found it: the next call runs as on a fresh engine. Before, the failed call's sequences kept their
    slots and blocks for good ('the cache cannot hold a single sequence' from then on)."""
    prompts, sp = _prompts([9, 5]), SamplingParams(temperature=1.0, max_tokens=12, seed=2, ignore_eos=True)
    eng = Engine(model, fp8=False, dtype=torch.float32, device="cpu", max_model_len=64, max_seqs=2,
                 num_blocks=6, block_entries=4, pipeline=pipeline)
    c = eng.cache
    free = {k: len(a.free) for k, a in c.alloc.items()}
    want = eng.generate(prompts, sp)
    calls, decode = [0], eng.runner.decode

    def failing(*a, **k):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return decode(*a, **k)
    monkeypatch.setattr(eng.runner, "decode", failing)
    with pytest.raises(KeyboardInterrupt):
        eng.generate(prompts, sp)
    assert len(c.free_slots) == 2 and {k: len(a.free) for k, a in c.alloc.items()} == free
    assert eng.ahead is None and not any(c.promised.values())
    for a, b in zip(want, eng.generate(prompts, sp)):
        _same(a, b)

def test_cli_chunks_per_line_parameters_and_bad_lines(tmp_path, capsys):
    """rollout_server.py --prompts/--out: the completions do not depend on --chunk; a line's own sampling fields
    apply to it; a bad line stops the run naming file, line and what is wrong."""
    import dataclasses
    import json
    from rollout_server import _LINE_FIELDS, main
    assert set(_LINE_FIELDS) == {f.name for f in dataclasses.fields(SamplingParams)}  # every field a line may set
    lines = [[5, 6, 7], {"prompt_token_ids": [3, 4], "max_tokens": 2, "seed": 9}, [8] * 9,
             {"prompt_token_ids": [5, 6, 7], "temperature": 0}, {"prompt_token_ids": [9, 10], "answer": "7"}]
    src = tmp_path / "p.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    outs = {}
    for chunk in (2, 5):
        dst = tmp_path / f"o{chunk}.jsonl"
        main(["--model", "configs/tiny.yaml", "--prompts", str(src), "--out", str(dst), "--max-tokens", "6",
              "--chunk", str(chunk), "--max-seqs", "4", "--max-model-len", "64", "--n", "2",
              *(["--index-entries", "--no-routed-experts"] if chunk == 5 else [])])
        outs[chunk] = [json.loads(x) for x in dst.read_text().splitlines()]
    cfg = load_yaml("configs/tiny.yaml")["model"]
    for r in outs[2]:  # a row a fed position, the top-k routed experts of each MoE layer (the engine's uint8 ids)
        assert "index_entries" not in r and "routed_experts" not in outs[5][0]
        assert len(r["routed_experts"]) == len(r["prompt_token_ids"]) + len(r["token_ids"]) - 1
        assert {len(x) for x in r["routed_experts"]} == {cfg["num_hidden_layers"]}
        assert {len(y) for x in r["routed_experts"] for y in x} == {cfg["num_experts_per_tok"]}
        assert all(0 <= e < cfg["n_routed_experts"] for x in r["routed_experts"] for y in x for e in y)
    for r in outs[5]:  # a row a fed position, a list of index_topk entries a CSA layer
        assert len(r["index_entries"]) == len(r["prompt_token_ids"]) + len(r["token_ids"]) - 1
        assert {len(x) for x in r["index_entries"]} == {sum(c == cfg["csa_ratio"] for c in cfg["compress_ratios"])}
        assert {len(y) for x in r["index_entries"] for y in x} == {cfg["index_topk"]}
    assert [(o["index"], o["sample"]) for o in outs[2]] == [(i // 2, i % 2) for i in range(10)]  # (--n 2)
    for x, y in zip(outs[2], outs[5]):  # the same samples; log-probs to the last bits of other batch shapes
        assert (x["token_ids"], x["finish_reason"]) == (y["token_ids"], y["finish_reason"])
        assert max(abs(u - v) for u, v in zip(x["logprobs"], y["logprobs"])) < 1e-5
    assert "note: 1 prompt(s) decode greedily (temperature 0), so each one's --n 2 samples are alike" in \
        capsys.readouterr().err
    rows = outs[2]
    assert all(len(r["token_ids"]) <= 2 for r in rows[2:4]) and any(len(r["token_ids"]) > 2 for r in rows)
    assert rows[6]["token_ids"] == rows[7]["token_ids"]  # greedy: both samples alike
    assert rows[0]["token_ids"] != rows[1]["token_ids"] or rows[0]["logprobs"] != rows[1]["logprobs"]
    for bad, msg in (({"prompt_token_ids": [1], "max_token": 3}, "p.jsonl:2: unknown key 'max_token'"),
                     ([1, 99999], "p.jsonl:2: token id 99999 outside the model's vocabulary"),
                     ({"prompt_token_ids": [1], "stop_token_ids": [3, 99999]},
                      "p.jsonl:2: stop token id 99999 outside the model's vocabulary"),
                     ({"prompt_token_ids": [1], "top_p": 0}, "p.jsonl:2: bad sampling parameters"),
                     ({"prompt_token_ids": [1], "max_tokens": "5"}, 'p.jsonl:2: max_tokens = "5" is not an integer'),
                     ({"max_tokens": 5}, "p.jsonl:2: expected a non-empty list of token ids"),
                     ({"prompt": 5}, "p.jsonl:2: prompt = 5 is not a non-empty string"),  # (not: needs --tokenizer)
                     ({"prompt_token_ids": [1], "max_tokens": 9000},
                      "p.jsonl:2: 1 prompt tokens \\+ max_tokens 9000 exceed --max-model-len 8192")):
        src.write_text(json.dumps([3]) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(SystemExit, match=msg):
            main(["--model", "configs/tiny.yaml", "--prompts", str(src), "--out", str(tmp_path / "x.jsonl")])
    # a key given twice (json.loads would keep the last one silently)
    src.write_text(json.dumps([3]) + '\n{"prompt_token_ids": [1], "max_tokens": 2, "max_tokens": 5}\n')
    with pytest.raises(SystemExit, match="p.jsonl:2: key 'max_tokens' given twice"):
        main(["--model", "configs/tiny.yaml", "--prompts", str(src), "--out", str(tmp_path / "x.jsonl")])


@pytest.mark.parametrize("fp8", [True, False])
def test_weights_that_do_not_fit_the_device_are_refused_before_it_is_touched(model, monkeypatch, fp8):
    """On a GPU the engine counts what the rank will hold (the meta model's holders, before any memory is taken)
    against the device's free memory: exactly what it then holds, and more is refused naming the routed experts'
    share (which expert parallelism divides) and the rest. (The CPU has no budget: faked here.)"""
    import rollout_server

    def held(m):
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in [*m.parameters(), *m.buffers()]}.values())
    monkeypatch.setattr(rollout_server, "free_device_memory", lambda device: None)
    inference = rollout_server.prepare_inference_model(model, fp8, torch.bfloat16, torch.device("cpu"))
    need, experts = held(inference), 0
    for m in inference.modules():
        if type(m) is rollout_server.EngineExperts:  # (the routed experts' rows: not a folded shared expert's)
            experts += sum(m.routed(n).nbytes for n in ("w1", "w2", "w3", "s1", "s2", "s3")
                           if getattr(m, n) is not None)
    monkeypatch.setattr(rollout_server, "free_device_memory", lambda device: need)
    Engine(model, fp8=fp8, device="cpu", max_model_len=64, max_seqs=2)  # (exactly enough)
    gib = 2 ** -30
    for free, hint in ((need - 1, "split the routed experts over more ranks"),
                       (need - experts - 1, "the rest alone exceeds it")):
        monkeypatch.setattr(rollout_server, "free_device_memory", lambda device: free)
        # the engine (the model streamed into holders made on meta) and the twin that copies the model whole first
        for make in (lambda: Engine(model, fp8=fp8, device="cpu", max_model_len=64, max_seqs=2),
                     lambda: rollout_server.prepare_inference_model(model, fp8, torch.bfloat16, "cpu", stream=False)):
            with pytest.raises(ValueError) as e:
                make()
            assert str(e.value).startswith(
                f"invalid engine arguments: the weights do not fit: this rank would hold {need * gib:.3g} GiB of "
                f"them ({experts * gib:.3g} GiB the routed experts, split over ep=1 rank(s); "
                f"{(need - experts) * gib:.3g} GiB the rest) against the {free * gib:.3g} GiB free on cpu: {hint}")
    monkeypatch.setattr(rollout_server, "free_device_memory", lambda device: need)
    assert held(rollout_server.prepare_inference_model(model, fp8, torch.bfloat16, "cpu", stream=False)) == need


def test_cli_says_what_a_cache_too_small_for_the_batch_cost(tmp_path, capsys, monkeypatch):
    """The CLI's last line says what a cache too small for the requests cost (a silent slowdown otherwise): the
    sequences that found a slot free but too few blocks to start, and those preempted and recomputed, with what
    gives the pools more blocks; the completions are those of a run with room for all."""
    import json
    import rollout_server
    src = tmp_path / "p.jsonl"
    g = torch.Generator().manual_seed(3)  # (tiny.yaml's vocabulary: 14 tokens)
    src.write_text("\n".join(json.dumps({"prompt_token_ids": torch.randint(0, 14, (n,), generator=g).tolist(),
                                          "ignore_eos": True}) for n in (9, 4, 12, 7)))
    args = ["--model", "configs/tiny.yaml", "--prompts", str(src), "--max-tokens", "30", "--max-seqs", "4",
            "--max-model-len", "64", "--n", "2", "--temperature", "0.8"]
    engines, real = [], rollout_server.Engine.__init__
    monkeypatch.setattr(rollout_server.Engine, "__init__", lambda self, *a, **kw: real(self, *a, **kw)
                        or engines.append(self))
    rollout_server.main([*args, "--out", str(tmp_path / "ref.jsonl")])
    said = capsys.readouterr().out

    def says_its_footprint(eng, room):
        """The start's line: the weights held, the cache's bytes (counted from its shapes) and the sequences of
        --max-model-len its blocks hold at once (a sequence takes 64 / 4 CSA entries, 64 / 16 HCA, in blocks of BE)."""
        BE = eng.cache.BE
        n_blocks = {k: len(a.ref) for k, a in eng.cache.alloc.items()}
        assert room == min(4, (n_blocks["csa"] - 1) // -(-16 // BE), (n_blocks["hca"] - 1) // -(-4 // BE))
        cache = rollout_server.PagedCache.nbytes(eng.model, 4, n_blocks, BE, eng.dtype)
        weights = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                       for t in [*eng.model.parameters(), *eng.model.buffers()]}.values())
        return f"engine on cpu: weights {weights / 1024:.3g} KiB (FP8) and a cache of {cache / 1024:.3g} KiB, " \
            f"whose blocks hold {room} sequence(s) of --max-model-len 64 at once (--max-seqs 4)\n" in said
    assert says_its_footprint(engines[-1], 4)
    assert [rollout_server.size_text(n) for n in (100, 1536, 1023 << 10, 5 << 20, 3 << 30, 1300 << 30)] == \
        ["0.0977 KiB", "1.5 KiB", "1023 KiB", "5 MiB", "3 GiB", "1300 GiB"]
    assert f"wrote 8 completions to {tmp_path / 'ref.jsonl'} (none waited for cache blocks or was preempted)" in said
    for blocks in (8, 4):  # 7 usable blocks of 4 entries: all 4 sequences start, then preempt as they grow; 3: 3 start
        monkeypatch.setattr(rollout_server.Engine, "__init__",
                            lambda self, *a, **kw: real(self, *a, **{**kw, "num_blocks": blocks, "block_entries": 4})
                            or engines.append(self))
        out = tmp_path / f"o{blocks}.jsonl"
        rollout_server.main([*args, "--out", str(out)])
        said = capsys.readouterr().out
        assert says_its_footprint(engines[-1], 1 if blocks == 8 else 0)  # (4 CSA blocks a sequence of 64)
        waits, n = engines[-1].stats["cache_waits"], engines[-1].stats["preemptions"]
        assert n > 0 and (waits > 0 or blocks == 8)
        cost = f"{waits} sequence(s) waited for cache blocks with a slot free; " if waits else ""
        assert f"wrote 8 completions to {out} ({cost}{n} sequence(s) preempted and recomputed: a larger " \
            f"--mem-fraction, or a smaller --max-seqs whose slots take a share, gives the cache pools more blocks)" \
            in said
        want, got = ([json.loads(r) for r in f.read_text().splitlines()] for f in (tmp_path / "ref.jsonl", out))
        assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want]
    # --num-blocks (rollout.num_blocks's flag): 2 blocks of 64 entries a pool, one a scratch block, so one sequence
    # of 64 at a time; and the hint names the flag
    monkeypatch.setattr(rollout_server.Engine, "__init__", lambda self, *a, **kw: real(self, *a, **kw)
                        or engines.append(self))
    out = tmp_path / "flag.jsonl"
    rollout_server.main([*args, "--out", str(out), "--num-blocks", "2"])
    said = capsys.readouterr().out
    assert {k: len(a.ref) for k, a in engines[-1].cache.alloc.items()} == {"csa": 2, "hca": 2}
    assert says_its_footprint(engines[-1], 1)
    waits, n = engines[-1].stats["cache_waits"], engines[-1].stats["preemptions"]
    cost = "; ".join([f"{waits} sequence(s) waited for cache blocks with a slot free"] +
                     [f"{n} sequence(s) preempted and recomputed"] * (n > 0))
    assert waits > 0 and f"wrote 8 completions to {out} ({cost}: a larger --num-blocks gives the cache pools more " \
        f"blocks)" in said, said
    want, got = ([json.loads(r) for r in f.read_text().splitlines()] for f in (tmp_path / "ref.jsonl", out))
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want]
    for extra, msg in ((["--num-blocks", "1"], "--num-blocks 1: blocks of 64 entries cannot hold one sequence of "
                                               "--max-model-len 64 (2 needed, one of them scratch)"),
                       (["--num-blocks", "2", "--engine", "simple"],
                        "--num-blocks sizes the paged engine's cache pools: not with --engine simple"),
                       (["--num-blocks", "0"], "--num-blocks must be >= 1, got 0")):
        with pytest.raises(SystemExit):
            rollout_server.main([*args, "--out", str(out), *extra])
        assert msg in capsys.readouterr().err


def test_cli_resume_continues_an_interrupted_run(tmp_path, capsys, monkeypatch):
    """--resume after an interruption: the whole chunks in <out>.partial are kept (a torn record and the rest of its
    chunk are done again), only the chunks after them are generated, and the file is the uninterrupted run's, byte
    for byte. Other arguments or prompts, or no settings beside the file, are refused naming why; so is a finished
    run's --out (nothing to continue)."""
    import json
    src = tmp_path / "p.jsonl"
    src.write_text("\n".join(json.dumps([3 + i, 4, 5 + i % 3]) for i in range(7)) + "\n")
    args = ["--model", "configs/tiny.yaml", "--prompts", str(src), "--max-tokens", "5", "--n", "2", "--chunk", "4",
            "--max-model-len", "64", "--max-seqs", "4"]
    ref = tmp_path / "ref.jsonl"
    rollout_server.main([*args, "--out", str(ref)])
    out = tmp_path / "o.jsonl"
    partial, meta = tmp_path / "o.jsonl.partial", tmp_path / "o.jsonl.partial.json"
    stop_generate_at(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        rollout_server.main([*args, "--out", str(out)])
    assert not out.exists() and partial.read_text().splitlines() == ref.read_text().splitlines()[:8]
    with open(partial, "a") as f:  # the next chunk's first record, half written
        f.write(ref.read_text().splitlines()[8] + "\n" + ref.read_text().splitlines()[9][:30])
    for bad, why in ((["--temperature", "0.5"], "--temperature was 1.0, now 0.5"),
                     (["--n", "1"], "--n was 2, now 1"), (["--model", "configs/mini.yaml"], "--model was")):
        with pytest.raises(SystemExit, match=f"written by another request \\({why}"):
            rollout_server.main([*args, *bad, "--out", str(out), "--resume"])
    calls = stop_generate_at(monkeypatch, 0)
    rollout_server.main([*args, "--out", str(out), "--resume"])
    assert "resuming: 8 of 14 completions kept" in capsys.readouterr().out
    assert calls == [4, 2] and out.read_bytes() == ref.read_bytes() and not partial.exists() and not meta.exists()
    # prompts changed, settings lost, a record of another request: refused; no .partial: a fresh start
    stop_generate_at(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        rollout_server.main([*args, "--out", str(out)])
    src.write_text(src.read_text() + "[9, 9]\n")
    with pytest.raises(SystemExit, match="the prompts file has changed since"):
        rollout_server.main([*args, "--out", str(out), "--resume"])
    src.write_text("\n".join(src.read_text().splitlines()[:-1]) + "\n")
    lines = partial.read_text().splitlines()
    partial.write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    with pytest.raises(SystemExit, match="o.jsonl.partial:1 is not the completion of request 0"):
        rollout_server.main([*args, "--out", str(out), "--resume"])
    meta.unlink()
    with pytest.raises(SystemExit, match="o.jsonl.partial.json is missing"):
        rollout_server.main([*args, "--out", str(out), "--resume"])
    partial.unlink()
    out.unlink()
    calls = stop_generate_at(monkeypatch, 0)
    rollout_server.main([*args, "--out", str(out), "--resume"])
    assert "no " in capsys.readouterr().out and calls == [4, 4, 4, 2] and out.read_bytes() == ref.read_bytes()
    calls.clear()  # a finished run's --out and no .partial: refused, not generated again
    with pytest.raises(SystemExit, match="there is no .*o.jsonl.partial to continue, and .*o.jsonl exists"):
        rollout_server.main([*args, "--out", str(out), "--resume"])
    assert calls == [] and out.read_bytes() == ref.read_bytes()
    with pytest.raises(SystemExit):
        rollout_server.main(["--model", "configs/tiny.yaml", "--bench", "--resume"])
    assert "--resume continues a --prompts/--out run" in capsys.readouterr().err


def test_cli_under_torchrun_splits_the_experts_and_resumes(model, tmp_path, monkeypatch, capsys):
    """torchrun --nproc-per-node 2 rollout_server.py: the two ranks hold half the routed experts each (read from the
    checkpoint: nothing else of the other half) and generate what one process generates; rank 0 alone writes, and
    --resume keeps an interrupted one-process run's whole chunks. A resume rank 0 refuses stops both ranks with its
    message (the others are told, not left waiting). With --ep 1 each rank is a whole engine and the two take turns
    at the chunks: the one-process file's completions, in its order."""
    import json
    from model.weights import save_pretrained
    from tests.parallel_check import torchrun
    ckpt, src = tmp_path / "ckpt", tmp_path / "p.jsonl"
    save_pretrained(model, ckpt, dtype=torch.float32)
    src.write_text("\n".join(json.dumps(p) for p in _prompts([5, 17, 3, 30, 9], seed=4)) + "\n")
    args = ["--model", str(ckpt), "--prompts", str(src), "--max-tokens", "6", "--samples", "2", "--chunk", "4",
            "--max-model-len", "64", "--max-seqs", "4"]
    ref, out = tmp_path / "ref.jsonl", tmp_path / "o.jsonl"
    rollout_server.main([*args, "--out", str(ref)])
    calls = stop_generate_at(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        rollout_server.main([*args, "--out", str(out)])

    def same_as_ref():  # (log-probs to rounding: the ranks run on one thread, sum the experts' rows in other orders)
        want, got = ([json.loads(r) for r in f.read_text().splitlines()] for f in (ref, out))
        assert len(got) == len(want) == 10
        for a, b in zip(got, want):
            assert {k: v for k, v in a.items() if k != "logprobs"} == {k: v for k, v in b.items() if k != "logprobs"}
            assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) < 1e-4
        assert {r["token_ids"][0] for r in got} != {got[0]["token_ids"][0]}  # (not one token everywhere)
    p = torchrun("rollout_server.py", 2, *args, "--out", str(out), "--resume", timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    for line in ("expert parallel: each of 2 ranks holds 4 of the 8 routed experts a layer",
                 "resuming: 4 of 10 completions kept", "wrote 10 completions"):
        assert p.stdout.count(line) == 1, p.stdout
    same_as_ref()
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        rollout_server.main([*args, "--out", str(out)])
    (tmp_path / "o.jsonl.partial.json").unlink()
    p = torchrun("rollout_server.py", 2, *args, "--out", str(out), "--resume", timeout=300)
    assert p.returncode != 0 and "o.jsonl.partial.json is missing" in p.stderr, p.stderr[-3000:]
    p = torchrun("rollout_server.py", 2, *args, "--out", str(out), "--ep", "1", timeout=300)
    assert p.returncode == 0 and "expert parallel" not in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
    assert "10/10 [" in p.stderr  # (rank 0's bar: its own completions as they end, the other group's as they come)
    assert p.stdout.count("completions to") == p.stdout.count("(none waited for cache blocks or was preempted)") == 1
    same_as_ref()
    with pytest.raises(SystemExit):
        rollout_server.main([*args, "--out", str(out), "--ep", "2"])
    assert "--ep 2 splits the experts over torchrun's ranks: run under torchrun" in capsys.readouterr().err


def test_cli_bench_warms_up_the_timed_batch(capsys, monkeypatch):
    """--bench: a warm-up of the same batch and lengths with other tokens (kernels compiled, the batch's graph
    captured, no prefix shared) before the timed run, whose throughput it prints."""
    import rollout_server
    calls = []
    real = rollout_server.Engine.generate

    def spy(self, prompts, params, *a, **kw):
        calls.append((prompts, params))
        return real(self, prompts, params, *a, **kw)
    monkeypatch.setattr(rollout_server.Engine, "generate", spy)
    rollout_server.main(["--model", "configs/tiny.yaml", "--bench", "--batch", "3", "--prompt-len", "9",
                         "--max-tokens", "4", "--max-model-len", "64", "--max-seqs", "4"])
    (warm, wp), (timed, tp) = calls
    assert len(warm) == len(timed) == 3 and {len(p) for p in warm + timed} == {9}
    assert all(a != b for a in warm for b in timed) and wp.max_tokens == 2 and tp.max_tokens == 4
    out = capsys.readouterr().out
    assert "3 x (9 prompt + 4 generated) on cpu:" in out
    assert out.rstrip().endswith("(none waited for cache blocks or was preempted)")


def test_cli_default_max_model_len_fits_the_requests(tmp_path, monkeypatch):
    """Without --max-model-len the engine gets what the longest request needs, at least the model's
    max_position_embeddings (256 in tiny.yaml), at most 8192: no warning of positions past the model's context
    unless a request needs them."""
    import json
    import warnings
    import rollout_server
    seen, fractions = [], []

    class Spy(rollout_server.Engine):
        def __init__(self, *a, **kw):
            seen.append(kw["max_model_len"])
            fractions.append(kw["mem_fraction"])
            super().__init__(*a, **kw)
    monkeypatch.setattr(rollout_server, "Engine", Spy)
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps([3, 4, 5]) + "\n" + json.dumps({"prompt_token_ids": [6] * 230, "max_tokens": 20}) + "\n")
    argv = ["--model", "configs/tiny.yaml", "--prompts", str(src), "--out", str(tmp_path / "o.jsonl"),
            "--max-tokens", "3", "--max-seqs", "2"]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        rollout_server.main(argv)
        rollout_server.main(["--model", "configs/tiny.yaml", "--bench", "--batch", "2", "--prompt-len", "8",
                             "--max-tokens", "3", "--mem-fraction", "0.5"])
    assert fractions == [0.85, 0.5]  # (--mem-fraction: the pools' share of the GPU memory left)
    assert seen == [256, 256] and not [x for x in w if "max_position_embeddings" in str(x.message)]
    src.write_text(json.dumps([3, 4, 5]) + "\n")
    with pytest.warns(UserWarning, match="prompt 0: 3 tokens \\+ max_tokens 300 reach past the model's "
                      "max_position_embeddings 256"):
        rollout_server.main(argv[:-4] + ["--max-tokens", "300", "--max-seqs", "1"])
    assert seen[-1] == 303


def test_cli_rejects_bad_arguments_before_loading_the_model(tmp_path, capsys, monkeypatch, locked_dir):
    """Every check that needs no weights runs before they load (a large checkpoint takes minutes): each bad
    argument or prompt line stops the run naming the flag, file or line, and no model is built."""
    import json
    import model as model_pkg
    import rollout_server

    def built(*a, **k):
        raise AssertionError("a model was built before the arguments were checked")
    monkeypatch.setattr(model_pkg, "build_model", built)
    monkeypatch.setattr(rollout_server, "Engine", built)
    src, nomodel = tmp_path / "p.jsonl", tmp_path / "nomodel.yaml"
    src.write_text(json.dumps([1, 2]) + "\n")
    locked = locked_dir
    nomodel.write_text("seed: 1\n")
    ok = ["--prompts", str(src), "--out", str(tmp_path / "o.jsonl")]
    tiny = ["--model", "configs/tiny.yaml", *ok]
    for argv, msg in ((["--model", str(tmp_path / "nothing"), *ok], "neither a checkpoint directory nor"),
                      (["--model", str(tmp_path), *ok], "no config.json"),
                      (["--model", str(nomodel), *ok], "no model: section"),
                      (["--model", "configs/tiny.yaml", "--prompts", str(tmp_path / "x.jsonl"), "--out", "o.jsonl"],
                       "x.jsonl: no such file"),
                      (["--model", "configs/tiny.yaml", "--prompts", str(tmp_path), "--out", "o.jsonl"],
                       f"--prompts {tmp_path}: a directory, not a file"),
                      ([*tiny, "--tokenizer", str(tmp_path)],
                       f"--tokenizer {tmp_path}: no tokenizer.json in this directory"),
                      (["--model", "configs/tiny.yaml", "--prompts", str(src), "--out", str(tmp_path / "d" / "o")],
                       "no directory"),
                      ([*tiny, "--n", "0"], "--n must be >= 1, got 0"),
                      ([*tiny, "--chunk", "0"], "--chunk must be >= 1"),
                      ([*tiny, "--mem-fraction", "1.5"], "--mem-fraction must be in (0, 1]"),
                      ([*tiny, "--temperature", "-1"], "temperature=-1.0"),
                      (["--model", "configs/tiny.yaml", "--out", "o.jsonl"], "--prompts and --out are required"),
                      # these three loaded the weights first, then failed
                      (["--model", "configs/tiny.yaml", "--prompts", str(src), "--out", str(tmp_path)],
                       "a directory, not a file"),
                      (["--model", "configs/tiny.yaml", "--prompts", str(src), "--out", str(src)],
                       "the prompts file itself"),
                      (["--model", "configs/tiny.yaml", "--prompts", str(src), "--out", str(locked / "o.jsonl")],
                       f"--out {locked / 'o.jsonl'}: cannot write in {locked} ("),
                      (["--model", "configs/tiny.yaml", "--bench", "--prompt-len", "100", "--max-model-len", "64"],
                       "--prompt-len 100 + --max-tokens 256 exceed --max-model-len 64"),
                      # not a tokenizer.json: a raw Exception from the tokenizers package before
                      ([*tiny, "--tokenizer", str(src)],
                       "--tokenizer / --chat-template / --bos-token / --eos-token: "),
                      ([*tiny, "--eos-token", "</s>"],
                       "--eos-token names a token of the tokenizer's: give --tokenizer too"),
                      ([*tiny, "--bos-token", "<s>"],
                       "--bos-token names a token of the tokenizer's: give --tokenizer too"),
                      ([*tiny, "--stop-token-ids", "2,x"],
                       "argument --stop-token-ids: '2,x': token ids (integers >= 0) separated by commas"),
                      ([*tiny, "--stop-token-ids", "-1"],
                       "argument --stop-token-ids: '-1': token ids"),
                      ([*tiny, "--stop-token-ids", "2,14"],
                       "--stop-token-ids: token id 14 outside the model's vocabulary [0, 14)"),
                      ([*tiny, "--prompt-key", "max_tokens"],
                       "--prompt-key 'max_tokens': a key of its own (not empty, prompt_token_ids or a sampling field"),
                      ([*tiny, "--answer-key", "prompt_token_ids"],
                       "--answer-key 'prompt_token_ids': a key of its own"),
                      ([*tiny, "--answer-key", "prompt"],
                       "--prompt-key and --answer-key are both 'prompt'"),
                      (["--model", "configs/tiny.yaml", "--bench", "--stop-token-ids", "2"],
                       "--stop-token-ids: --bench generates --max-tokens for every prompt")):
        with pytest.raises(SystemExit):
            rollout_server.main(argv)
        assert msg in capsys.readouterr().err, argv
    src.write_bytes(b"[1, 2]\n\xff\xfe\n")
    with pytest.raises(SystemExit, match="p.jsonl: not UTF-8 text"):
        rollout_server.main(tiny)
    src.write_text(json.dumps([1, 99999]) + "\n")
    with pytest.raises(SystemExit, match="p.jsonl:1: token id 99999 outside the model's vocabulary"):
        rollout_server.main(tiny)


def test_cli_names_a_broken_checkpoint_without_a_traceback(model, tmp_path, capsys):
    """A checkpoint whose config reads but whose tensors do not (a shard the index lists is missing; a tensor of
    another shape than config.json's) stops the CLI with the loader's message, no traceback, and no --out."""
    import json
    import rollout_server
    from model import save_pretrained
    src, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    src.write_text(json.dumps([3, 4, 5]) + "\n")
    argv = ["--prompts", str(src), "--out", str(out), "--max-model-len", "64", "--max-tokens", "4"]
    missing, shape = tmp_path / "missing", tmp_path / "shape"
    for d in (missing, shape):
        save_pretrained(model, d, dtype=torch.float32, max_shard_bytes=1 << 16) if d is missing else \
            save_pretrained(model, d, dtype=torch.float32)
    next(missing.glob("*.safetensors")).unlink()
    c = json.loads((shape / "config.json").read_text())
    c["vocab_size"] += 8
    (shape / "config.json").write_text(json.dumps(c))
    for d, msg in ((missing, "does not exist"), (shape, "tensor 'embed.weight'")):
        with pytest.raises(SystemExit) as e:
            rollout_server.main(["--model", str(d), *argv])
        err = f"{e.value.code} {capsys.readouterr().err}"
        assert e.value.code != 0 and "--model" in err and msg in err and "Traceback" not in err, err
        assert not out.exists()


def test_cli_text_prompts_and_an_interrupted_run(tmp_path, bpe, capsys, monkeypatch):
    """Text prompts (--tokenizer): a line whose text holds U+2028 (str.splitlines split it: 'not JSON'), a non-string
    or empty prompt, or both prompt keys are refused naming the line (null was tokenized as the text 'None'); a
    template with another placeholder is refused naming the flag (a raw KeyError before). An interrupted run leaves
    <out>.partial, not a file that looks complete, and an earlier --out as it was (it was truncated at the start)."""
    import json
    import rollout_server
    bpe_tok = bpe(["a b c", "one two three", "x y"], vocab_size=60)
    cfg = tmp_path / "m.yaml"
    cfg.write_text(open("configs/tiny.yaml").read().replace("vocab_size: 14 ", "vocab_size: 64 "))
    src, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    base = ["--model", str(cfg), "--tokenizer", str(tmp_path), "--prompts", str(src), "--out",  # (its directory)
            str(out), "--max-tokens", "3", "--max-model-len", "64", "--chunk", "1"]
    lines = [{"prompt": "a b\u2028c"}, {"prompt": "one two"}, [5, 6]]
    src.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
    rollout_server.main([*base, "--bos-token", "<s>"])  # as train_grpo's task.bos_token puts it
    rows = [json.loads(x) for x in out.read_text().split("\n") if x]
    assert [r["index"] for r in rows] == [0, 1, 2] and [r["prompt_token_ids"][0] for r in rows[:2]] == [1, 1]
    for bad, msg in (({"prompt": None}, "p.jsonl:2: prompt = null is not a non-empty string"),
                     ({"prompt": ""}, "p.jsonl:2: prompt = \"\" is not a non-empty string"),
                     ({"prompt": "a", "prompt_token_ids": [1]}, "p.jsonl:2: prompt_token_ids or prompt, not both"),
                     # whitespace only: no tokens (no --bos-token here); it was "expected a non-empty list of ids"
                     ({"prompt": " \t "}, re.escape('p.jsonl:2: prompt = " \\t " encodes to no tokens'))):
        src.write_text(json.dumps(lines[1]) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(SystemExit, match=msg):
            rollout_server.main(base)
    with pytest.raises(SystemExit):
        rollout_server.main([*base, "--chat-template", "{system} {prompt}"])
    assert "--eos-token: chat template '{system} {prompt}': KeyError" in capsys.readouterr().err
    tiny = [*base[2:], "--model", "configs/tiny.yaml"]  # (14 token ids: fewer than the tokenizer's)
    for argv, msg in (([*base, "--eos-token", "<x>"], "eos token '<x>' is not in the vocabulary"),
                      ([*tiny, "--bos-token", "<s>", "--eos-token", bpe_tok.id_to_token(20)],
                       "--eos-token: token id 20 outside the model's vocabulary [0, 14)"),
                      ([*tiny, "--bos-token", bpe_tok.id_to_token(14)],
                       "--bos-token: token id 14 outside the model's vocabulary [0, 14)")):
        with pytest.raises(SystemExit):
            rollout_server.main(argv)
        assert msg in capsys.readouterr().err, argv
    src.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
    out.write_text("an earlier run's output\n")
    stop_generate_at(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        rollout_server.main(base)
    assert out.read_text() == "an earlier run's output\n"
    assert [json.loads(x)["index"] for x in (tmp_path / "o.jsonl.partial").read_text().split("\n") if x] == [0]


def test_cli_stop_token_ids_and_eos_token(tmp_path, bpe):
    """--stop-token-ids ends every completion at those ids (a prompt line's own stop_token_ids replace them);
    --eos-token ends them at a tokenizer's token in place of the checkpoint's eos_token_id, unless among its
    ids (train_grpo's task.eos_token: a line's ignore_eos passes it). Greedy, so each run's completions are the
    first run's cut."""
    import json
    import rollout_server
    words = [f"w{i}" for i in range(80)]
    tok = bpe([" ".join(words[i:i + 3]) for i in range(0, 80, 2)], vocab_size=60)
    assert tok.get_vocab_size() == 60
    cfg, src, out = tmp_path / "m.yaml", tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    yaml = open("configs/tiny.yaml").read().replace("vocab_size: 14 ", "vocab_size: 64 ")
    assert yaml.count("eos_token_id: 2") == 1
    base = ["--model", str(cfg), "--prompts", str(src), "--out", str(out), "--temperature", "0", "--max-tokens",
            "16", "--max-model-len", "64"]

    def run(*extra, eos="null", lines=([3, 4, 5], [9, 8])):
        cfg.write_text(yaml.replace("eos_token_id: 2", f"eos_token_id: {eos}"))
        src.write_text("".join(json.dumps(x) + "\n" for x in lines))
        rollout_server.main([*base, *extra])
        return [(r["token_ids"], r["finish_reason"]) for r in map(json.loads, out.read_text().splitlines())]
    full = run()
    assert [f for _, f in full] == ["length", "length"]
    ids = full[0][0]
    k = next(i for i, t in enumerate(ids) if 0 < i and t < 60 and t not in ids[:i])  # a token first seen at k
    t, cut = ids[k], (ids[:k + 1], "stop")
    other = next(i for i in range(3, 60) if i not in full[0][0] + full[1][0])  # in neither completion
    stopped = run("--stop-token-ids", f"{other},{t}")
    assert stopped[0] == cut and stopped[1] == (full[1][0][:full[1][0].index(t) + 1] if t in full[1][0] else
                                                full[1][0], "stop" if t in full[1][0] else "length")
    own = run("--stop-token-ids", str(t), lines=([3, 4, 5], {"prompt_token_ids": [3, 4, 5], "stop_token_ids": []}))
    assert own == [cut, full[0]]
    name = tok.id_to_token(t)
    tk = ["--tokenizer", str(tmp_path)]
    assert run(*tk, "--eos-token", name)[0] == cut  # (the config's eos null)
    # the checkpoint's own eos (here the token at k) is replaced by --eos-token's
    assert run(eos=t)[0] == cut and run(*tk, "--eos-token", tok.id_to_token(other), eos=t)[0] == full[0]
    assert run(*tk, "--eos-token", tok.id_to_token(other), eos=[other, t])[0] == cut  # (ids that hold it: kept)
    assert run(*tk, "--eos-token", name, lines=([3, 4, 5], {"prompt_token_ids": [3, 4, 5], "ignore_eos": True})) \
        == [cut, full[0]]


def test_cli_scores_completions_against_the_prompts_answers(tmp_path, bpe, capsys, monkeypatch):
    """A prompt line's "answer" (a training JSONL's) is scored with --tokenizer: each completion's record gets the
    reward the trainer gives it (math_reward of its text, a stop token left out), and the last line says the mean
    reward and pass@n; a resumed run says the same. Without --tokenizer a note says the answers are not scored; a
    bad answer is refused naming the line."""
    import json
    import rollout_server
    from model.tasks import extract_answer, math_reward
    tok = bpe(["1 2 3 4 5 6 7 8 9 0", "12 34 56 78 90", "the answer is 7"], vocab_size=60)
    cfg = tmp_path / "m.yaml"
    cfg.write_text(open("configs/tiny.yaml").read().replace("vocab_size: 14 ", "vocab_size: 64 "))
    src, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    base = ["--model", str(cfg), "--tokenizer", str(tmp_path), "--prompts", str(src), "--out", str(out),
            "--max-tokens", "8", "--max-model-len", "64", "--n", "3", "--seed", "5", "--chunk", "2"]
    prompts = [{"prompt": "1 2"}, {"prompt": "3 4"}, {"prompt": "5 6"}, {"prompt": "7 8"}]
    src.write_text("".join(json.dumps(x) + "\n" for x in prompts))
    rollout_server.main(base)
    free = [json.loads(x) for x in out.read_text().splitlines()]
    assert "reward" not in free[0] and "scored" not in capsys.readouterr().out

    def text(r):
        return tok.decode(r["token_ids"][:-1] if r["finish_reason"] == "stop" else r["token_ids"])
    # prompt 0: the final answer of one of its samples (others may differ); 1: one no completion gives; 2: a GSM8K
    # solution whose final answer is one of its samples'; 3: none
    picks = [extract_answer(text(r)) for r in free]
    a, b = (next(i for i in range(j, j + 3) if picks[i] is not None) for j in (0, 6))
    answers = [picks[a], "zzz", f"work ... #### {picks[b]}", None]
    src.write_text("".join(json.dumps({**x, **({} if a is None else {"answer": a})}) + "\n"
                           for x, a in zip(prompts, answers)))
    rollout_server.main(base)
    said = capsys.readouterr().out
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["token_ids"] for r in rows] == [r["token_ids"] for r in free]  # (answers change no completion)
    gold = [picks[a], "zzz", picks[b]]
    want = [math_reward(text(r), gold[i // 3]) if i < 9 else None for i, r in enumerate(rows)]
    assert [r.get("reward") for r in rows] == want
    assert [r.get("answer") for r in rows] == [gold[i // 3] if i < 9 else None for i in range(12)]  # (#### n: n)
    assert want[a] == 1.0 and want[3:6] == [0.0] * 3 and want[b] == 1.0 and "reward" not in rows[9]
    right = int(sum(want[:9]))
    hit = sum(any(w == 1.0 for w in want[j:j + 3]) for j in (0, 3, 6))
    # pass@2 from 3 samples: a prompt with c correct ones, the chance that 2 of its 3 drawn hold one
    two = sum({0: 0, 1: 2 / 3, 2: 1, 3: 1}[int(sum(want[j:j + 3]))] for j in (0, 3, 6)) / 3
    line = (f"scored 3 prompt(s) x 3 sample(s) against their answers: mean reward {right / 9:.4f} ({right} of 9 "
            f"completions correct), pass@2 {two:.4f}, pass@3 {hit / 3:.4f} ({hit} of 3 prompts)")
    assert hit == 2 and line in said.splitlines(), said
    # 8 samples, 1 and 2 correct: pass@2 (1 - 21/28 + 1 - 15/28) / 2, pass@4 (1 - 35/70 + 1 - 15/70) / 2
    assert rollout_server.score_note([1.0] + [0.0] * 7 + [1.0, 1.0] + [0.0] * 6 + [None] * 8, 8).endswith(
        "mean reward 0.1875 (3 of 16 completions correct), pass@2 0.3571, pass@4 0.6429, pass@8 1.0000 (2 of 2 "
        "prompts)")
    # interrupted after its first chunk, then resumed: the kept chunk's rewards count in the same line
    stop_generate_at(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        rollout_server.main(base)
    stop_generate_at(monkeypatch, 0)
    capsys.readouterr()
    rollout_server.main([*base, "--resume"])
    said, bar = capsys.readouterr()
    assert "resuming: 4 of 12 completions kept" in said and line in said.splitlines(), said
    assert " 4/12 [" in bar and "12/12 [" in bar and "completion/s" in bar  # (the bar counts completions as they end)
    assert [json.loads(x) for x in out.read_text().splitlines()] == rows
    # a dataset's own keys (GSM8K's question; an answer under another name): the same records and line; a line
    # with the default keys is then refused, naming the key
    src.write_text("".join(json.dumps({"question": x["prompt"], **({} if a is None else {"solution": a})}) + "\n"
                           for x, a in zip(prompts, answers)))
    rollout_server.main([*base, "--prompt-key", "question", "--answer-key", "solution"])
    assert line in capsys.readouterr().out.splitlines()
    assert [json.loads(x) for x in out.read_text().splitlines()] == rows
    src.write_text(json.dumps({"prompt": "1 2", "answer": "3"}) + "\n")
    with pytest.raises(SystemExit, match=re.escape("p.jsonl:1: unknown key 'answer' (a prompt line takes "
                                                   "prompt_token_ids or question, solution, and ")):
        rollout_server.main([*base, "--prompt-key", "question", "--answer-key", "solution"])
    # token-id prompts with answers and no tokenizer: not scored, and said so
    src.write_text(json.dumps({"prompt_token_ids": [3, 4], "answer": 7}) + "\n" + json.dumps([5]) + "\n")
    rollout_server.main(["--model", str(cfg), "--prompts", str(src), "--out", str(out), "--max-tokens", "2"])
    said = capsys.readouterr()
    assert "note: 1 prompt(s) have an answer, not scored: scoring decodes the completions, which needs " \
        "--tokenizer" in said.err and "scored" not in said.out
    for bad, msg in (({"prompt": "1", "answer": None}, "p.jsonl:2: answer None: a string or a finite number"),
                     ({"prompt": "1", "answer": "work #### "}, "p.jsonl:2: answer 'work #### ': no final answer"),
                     ({"prompt": "1", "answer": "4", "answers": 5}, "p.jsonl:2: unknown key 'answers'")):
        src.write_text(json.dumps(prompts[0]) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(SystemExit, match=re.escape(msg)):
            rollout_server.main(base)


def test_generate_reports_each_sequence_as_it_ends(model):
    """generate(progress=f) calls f(1) once a sequence ends, as it ends (the CLI's bar counts completions: it counted
    whole chunks before, standing still through a long one), with preemption too; and the same in the twin."""
    prompts = _prompts([5, 30, 3, 30, 28, 12], seed=2)
    sp = [SamplingParams(temperature=0.8, max_tokens=t, seed=1, ignore_eos=True) for t in (3, 30, 1, 30, 30, 7)]
    small = Engine(model, fp8=False, dtype=torch.float32, device="cpu", max_model_len=64, max_seqs=3, num_blocks=8,
                   block_entries=4)
    for eng in (small, SimpleEngine(model, fp8=False, dtype=torch.float32, device="cpu")):
        ends = []

        def seen(n):
            assert n == 1
            ends.append(getattr(eng, "stats", {}).get("decode_steps"))
        outs = eng.generate(prompts, sp, progress=seen)
        assert len(ends) == len(prompts) and [len(o.token_ids) for o in outs] == [3, 30, 1, 30, 30, 7]
        if eng is small:  # (the first ended before most of the run's steps; the longest at the end)
            assert eng.stats["preemptions"] > 0 and ends == sorted(ends) and ends[0] < ends[-1] / 2, (ends, eng.stats)
            assert eng.progress is None
        ends.clear()
        assert [o.token_ids for o in eng.generate(prompts, sp)] == [o.token_ids for o in outs] and not ends


def test_stop_tokens_eos_and_limits(model):
    for e in (Engine(model, fp8=False, dtype=torch.float32, device="cpu", max_model_len=64),
              SimpleEngine(model, fp8=False, dtype=torch.float32, device="cpu")):
        assert e.generate([], GREEDY) == []  # no prompts, no outputs (the simple engine crashed in torch.cat)
    eng = Engine(model, fp8=False, dtype=torch.float32, device="cpu", max_model_len=64)
    p = _prompts([9], 4)[0]
    free = eng.generate([p], GREEDY)[0]
    stop = free.token_ids[6]
    cut = eng.generate([p], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop]))[0]
    assert cut.token_ids == free.token_ids[:free.token_ids.index(stop) + 1] and cut.finish_reason == "stop"
    with pytest.raises(ValueError, match="exceed max_model_len"):
        eng.generate([p], SamplingParams(max_tokens=60))
    with pytest.raises(ValueError, match="empty"):
        eng.generate([[]], GREEDY)


@pytest.mark.parametrize("kw", [dict(max_seqs=3), dict(num_blocks=8, block_entries=4, max_seqs=4)],
                         ids=["joins", "preemption"])
def test_pipelined_decode_equals_one_step_at_a_time(model, kw, monkeypatch):
    """The pipelined decode loop (each step launched before the last one's tokens are read, its inputs taken from
    them on the device) against the one-step-at-a-time twin: sequences that stop on a token or on their length
    while the next step is in flight, others joining as they leave, preemption, and a top-k request mid-run
    (sampled inside the steps it is in, which stay pipelined)."""
    alone = []
    real = Engine._decode_alone
    monkeypatch.setattr(Engine, "_decode_alone", lambda self, *a: (alone.append(self.pipeline), real(self, *a))[1])
    prompts = _prompts([4, 9, 17, 2, 30, 6], 7)
    free = Engine(model, fp8=False, dtype=torch.float32, device="cpu", max_model_len=96,
                  pipeline=False).generate(prompts[:1], SamplingParams(temperature=0.9, seed=3, max_tokens=30))[0]
    stop = free.token_ids[11]
    params = [SamplingParams(temperature=0.9, seed=3, max_tokens=30, stop_token_ids=[stop]),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=1, max_tokens=23, ignore_eos=True),
              SamplingParams(temperature=1.1, seed=2, max_tokens=31, top_k=5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=4, max_tokens=17, ignore_eos=True)]
    outs = [Engine(model, fp8=False, dtype=torch.float32, device="cpu", max_model_len=96, pipeline=p,
                   **kw).generate(prompts, params) for p in (False, True)]
    for a, b in zip(*outs):  # log-probs to 1e-4: the two loops batch different rows together
        _same(a, b)
    assert outs[0][0].finish_reason == "stop" and len(outs[0][0].token_ids) == free.token_ids.index(stop) + 1 > 1
    assert alone and not any(alone)  # the pipelined engine never ran a step alone (the twin ran every one so)


FP8_KINDS = pytest.mark.parametrize("f8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=["e4m3fn", "e4m3fnuz"])


def _fp8_is(monkeypatch, f8):
    """The engine's FP8 dtype as on that hardware: float8_e4m3fnuz is what fp8_dtype picks on AMD gfx942 (MI300),
    float8_e4m3fn elsewhere; the CPU fallbacks run both."""
    monkeypatch.setattr(rollout_server, "fp8_dtype", lambda device=None: f8)


@FP8_KINDS
def test_fp8_logprobs_within_tolerance_of_the_model(monkeypatch, f8):
    """FP8 weights (W8A8 with 1x128 activation tiles: dims are multiples of 128 here) vs the fp32 model on the
    engine's own sampled tokens: mean |delta log p| < 0.05 and max < 0.3 (training init, std 0.02), in both FP8
    formats (fnuz: max 240 against 448, bias 8 against 7)."""
    _fp8_is(monkeypatch, f8)
    ov = ["model.vocab_size=64", "model.hidden_size=128", "model.head_dim=128", "model.qk_rope_head_dim=32",
          "model.q_lora_rank=128", "model.o_lora_rank=128", "model.moe_intermediate_size=128",
          "model.index_head_dim=128"]
    m = build_model(ModelConfig.from_dict(load_yaml("configs/tiny.yaml", ov)["model"]), seed=0)
    eng = Engine(m, fp8=True, dtype=torch.bfloat16, device="cpu", max_model_len=128)
    assert eng.model.layers[0].attn.wq_b.qweight.dtype == f8 and eng.model.layers[0].ffn.experts.w1.dtype == f8
    prompts = [torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 9, 30)] * 3
    outs = eng.generate(prompts, SamplingParams(temperature=1.0, max_tokens=24, seed=1, ignore_eos=True))
    diffs = []
    for o in outs:
        full = torch.tensor([o.prompt_token_ids + o.token_ids])
        with torch.no_grad():
            lp = m(full)[0, len(o.prompt_token_ids) - 1:-1].log_softmax(-1)
        diffs.append((lp.gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0] - torch.tensor(o.logprobs)).abs())
    d = torch.cat(diffs)
    assert d.mean() < 0.05 and d.max() < 0.3, (d.mean().item(), d.max().item())
    assert d.mean() > 0  # the FP8 path is really in use


def test_fp8_checkpoint_weights_keep_their_bits(model, tmp_path, monkeypatch):
    """Engine(directory, fp8=True) on an FP8 checkpoint (E8M0 block scales, save_pretrained's and the release's)
    holds the checkpoint's FP8 values: by default it quantizes the loaded weights again in the checkpoint's own
    scale format (stored_scale_fmt). With fp32 scales, the default before, the dequantized weights moved by up to
    0.03 and greedy tokens changed."""
    from safetensors import safe_open
    from kernels.quant import dequant_fp8_block
    from model.weights import save_pretrained, stored_scale_fmt
    save_pretrained(model, tmp_path, fp8=True, dtype=torch.float32)
    assert stored_scale_fmt(tmp_path) == "ue8m0"
    stored = {}
    for f in tmp_path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            stored.update({k: h.get_tensor(k) for k in h.keys() if k.startswith("layers.0.")})

    def want(name):
        return dequant_fp8_block(stored[name + ".weight"], stored[name + ".scale"])
    eng = Engine(tmp_path, fp8=True, dtype=torch.float32, device="cpu", max_model_len=64)
    assert torch.equal(eng.model.layers[0].attn.wq_b.weight, want("layers.0.attn.wq_b"))
    ex = eng.model.layers[0].ffn.experts
    assert torch.equal(dequant_fp8_block(ex.w2[1], ex.s2[1]), want("layers.0.ffn.experts.1.w2"))
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    again = Engine(model, fp8=True, dtype=torch.float32, device="cpu", max_model_len=64, fp8_scale_fmt="ue8m0")
    for a, b in zip(eng.generate(_prompts([4, 9]), sp), again.generate(_prompts([4, 9]), sp)):
        _same(a, b)
    # on AMD gfx942 the engine holds float8_e4m3fnuz: the checkpoint's e4m3fn values are the same numbers there
    # (a value past fnuz's 240 takes the next power-of-two scale and halves, exactly), so the same outputs
    _fp8_is(monkeypatch, torch.float8_e4m3fnuz)
    amd = Engine(tmp_path, fp8=True, dtype=torch.float32, device="cpu", max_model_len=64)
    assert amd.model.layers[0].attn.wq_b.qweight.dtype == torch.float8_e4m3fnuz
    assert torch.equal(amd.model.layers[0].attn.wq_b.weight, want("layers.0.attn.wq_b"))
    ex = amd.model.layers[0].ffn.experts
    assert ex.w2.dtype == torch.float8_e4m3fnuz
    assert torch.equal(dequant_fp8_block(ex.w2[1], ex.s2[1]), want("layers.0.ffn.experts.1.w2"))
    for a, b in zip(eng.generate(_prompts([4, 9]), sp), amd.generate(_prompts([4, 9]), sp)):
        _same(a, b)

def test_weight_updates_reach_the_paged_engine(model):
    eng = Engine(model, fp8=True, dtype=torch.float32, device="cpu", max_model_len=64)
    new = build_model(model.cfg, seed=9)
    eng.update_weights(new.state_dict().items())
    fresh = Engine(new, fp8=True, dtype=torch.float32, device="cpu", max_model_len=64)
    p = _prompts([5, 11], 6)
    a, b = eng.generate(p, GREEDY), fresh.generate(p, GREEDY)
    for x, y in zip(a, b):
        _same(x, y)


def test_weight_updates_of_the_wrong_shape_are_refused(model):
    """A tensor that torch's copy_ would broadcast over the model's (or that does not fit it) is refused, named,
    before it lands (it used to zero the embedding from a (64,) row)."""
    for fp8 in (False, True):
        eng = Engine(model, fp8=fp8, dtype=torch.float32, device="cpu", max_model_len=64)
        state = model.state_dict()
        before = eng.generate(_prompts([5], 1), GREEDY)[0].token_ids
        for name, t in (("embed.weight", torch.zeros(state["embed.weight"].shape[1])),
                        ("layers.1.ffn.experts.w1", torch.ones(1, *state["layers.1.ffn.experts.w1"].shape[1:])),
                        ("layers.0.attn.wq_a.weight", torch.ones(1, state["layers.0.attn.wq_a.weight"].shape[1])),
                        ("norm.weight", torch.tensor(1.0))):
            with pytest.raises(ValueError, match=re.escape(f"the rollout model's is {tuple(state[name].shape)}")):
                eng.update_weights([(name, t)])
        assert eng.generate(_prompts([5], 1), GREEDY)[0].token_ids == before


def test_generate_checks_its_arguments_again(model):
    """Sampling parameters changed after construction are checked again; other bad arguments are named."""
    eng = Engine(model, fp8=False, dtype=torch.float32, device="cpu", max_model_len=64)
    p = _prompts([5], 1)
    for field, bad in (("temperature", float("nan")), ("top_p", 0.0), ("max_tokens", 0), ("top_k", -3),
                       ("seed", 1.5)):
        sp = SamplingParams(temperature=1.0, max_tokens=5, seed=1)
        setattr(sp, field, bad)
        with pytest.raises(ValueError, match=f"sampling parameters 0: invalid sampling parameters: {field}="):
            eng.generate(p, sp)
    with pytest.raises(TypeError, match="neither a SamplingParams nor a list"):
        eng.generate(p, {"temperature": 0})
    # no parameters: SamplingParams()'s defaults; sampling_params= (vLLM's name) is the same argument
    simple = SimpleEngine(model, fp8=False, dtype=torch.float32, device="cpu")
    for e in (eng, simple):
        want = e.generate(p, SamplingParams())[0].token_ids
        assert e.generate(p)[0].token_ids == want and e.generate(p, None)[0].token_ids == want
        assert e.generate(p, sampling_params=GREEDY)[0].token_ids == e.generate(p, GREEDY)[0].token_ids
        with pytest.raises(TypeError, match="params and sampling_params are the same argument"):
            e.generate(p, GREEDY, sampling_params=GREEDY)
    with pytest.raises(TypeError, match="position 1: token id True"):
        eng.generate([[3, True, 4]], GREEDY)
    for fi in (2.5, None, -1, True):
        with pytest.raises(TypeError, match="first_index"):
            eng.generate(p, GREEDY, first_index=fi)
    for bad in (5, None):
        with pytest.raises(TypeError, match="model_or_path: a checkpoint directory"):
            Engine(bad, device="cpu")
    with pytest.raises(ValueError, match="num_blocks=.*keys 'csa', 'hca'"):
        Engine(model, device="cpu", num_blocks={"csa": 8, "hca": 8, "foo": 4})


def test_every_eos_id_of_a_list_ends_a_sequence(model, tmp_path):
    """A config.json's eos_token_id may list several ids (transformers stops on each): every one ends a sequence,
    and the list survives a save and a load."""
    from model import save_pretrained
    from model.config import ConfigError, load_hf_config
    free = Engine(model, fp8=False, dtype=torch.float32, device="cpu", max_model_len=64).generate(
        _prompts([9], 4), GREEDY)[0].token_ids
    j = next(j for j in range(1, len(free)) if free[j] not in free[:j])  # the second id of the list stops here
    other = next(t for t in range(3, 32) if t not in free[:j + 1])  # the first: never sampled before that
    save_pretrained(model, tmp_path, dtype=torch.float32)
    import json
    c = json.loads((tmp_path / "config.json").read_text())
    c["eos_token_id"] = [other, free[j]]
    (tmp_path / "config.json").write_text(json.dumps(c))
    cfg = load_hf_config(tmp_path)
    assert cfg.eos_ids == tuple(c["eos_token_id"])
    eng = Engine(str(tmp_path), fp8=False, dtype=torch.float32, max_model_len=64)
    out = eng.generate(_prompts([9], 4), SamplingParams(temperature=0, max_tokens=40))[0]
    assert out.token_ids == free[:j + 1] and out.finish_reason == "stop"
    for bad in ([], [1, -2], ["a"], 1.5, True):
        c["eos_token_id"] = bad
        (tmp_path / "config.json").write_text(json.dumps(c))
        if bad == []:
            assert load_hf_config(tmp_path).eos_ids == ()
            continue
        with pytest.raises(ConfigError, match="eos_token_id"):
            load_hf_config(tmp_path)


@pytest.mark.parametrize("send_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_send", [torch.float8_e4m3fn, torch.float8_e4m3fnuz, None],
                         ids=["fp8-send", "fnuz-send", "plain-send"])
@pytest.mark.parametrize("ep", [None, (None, 2, 1)], ids=["all-experts", "ep2-rank1"])
def test_weight_applier_equals_update_weights(model, send_dtype, fp8_send, ep, monkeypatch):
    """The receiver's fast path (persistent buckets, byte copies batched per bucket) leaves exactly the tensors
    the per-tensor slow twin leaves: FP8 bytes sent as they are or re-quantized on arrival, casts, expert slices
    under rollout expert parallelism, tensors split over many small buckets; fnuz-send: both sides on AMD gfx942,
    whose FP8 is float8_e4m3fnuz."""
    fp8 = fp8_send or fp8_dtype(torch.device("cpu"))
    _fp8_is(monkeypatch, fp8)
    new = build_model(model.cfg, seed=9)
    spec, tensors = [], []
    for name, t in new.state_dict().items():
        if fp8_send and is_fp8_held(name):
            q, s = quantize(t, fp8, "fp32")
            spec += [[name, str(q.dtype), list(q.shape)], [name + FP8_SCALE, str(s.dtype), list(s.shape)]]
            tensors += [q, s]
        else:
            t = t.to(send_dtype) if t.is_floating_point() and not Transformer.keeps_fp32(name) else t
            spec.append([name, str(t.dtype), list(t.shape)])
            tensors.append(t)
    fast, slow = (prepare_inference_model(model, True, torch.float32, "cpu", ep=ep) for _ in range(2))
    before = {k: v.clone() for k, v in slow.state_dict().items()}
    bucket = 4096
    ap = WeightApplier(fast, spec, bucket, "cpu")
    assert ap.matches(spec, bucket) and not ap.matches(spec, 2 * bucket)
    for k, idx in enumerate(bucket_plan(spec, bucket)):
        offs, sizes, size = bucket_layout(spec, idx)
        buf = ap.bufs[k % 2][:size]
        buf.zero_()
        for i, o, nb in zip(idx, offs, sizes):
            buf[o:o + nb].copy_(tensors[i].reshape(-1).view(torch.uint8))
        update_weights(slow, [(spec[i][0], buf[o:o + nb].view(tensors[i].dtype).view(tensors[i].shape))
                              for i, o, nb in zip(idx, offs, sizes)])
        ap.apply(k)
    a, b = fast.state_dict(), slow.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8) if a[k].dtype == fp8 else a[k],
                           b[k].view(torch.uint8) if b[k].dtype == fp8 else b[k]), k
    changed = [k for k in b if not torch.equal(b[k].float(), before[k].float())]
    assert len(changed) > len(b) // 2


def _preempting_rollout(rank: int, port: int, out: str):
    """Rank 0 drives, ranks 1 and 2 serve with pools too small for their requests (test below)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # (three processes on CI's two cores: more threads each oversubscribe them, 5x slower)
    dist.init_process_group("gloo", rank=rank, world_size=3)
    atexit.register(close_process_groups)  # (gloo's threads joined before the interpreter's finalization)
    cpu = torch.device("cpu")
    if rank == 0:
        client = rollout_server.RolloutClient([1, 2], None, cpu)
        prompts = _prompts([5, 17, 33, 50, 9, 21, 40, 3])
        outs = client.collect(client.submit(prompts, [GREEDY] * len(prompts), group_size=2))
        got = {"outputs": len(outs), **client.last_cache, "gen_s": client.last_gen_s}
        client.stop()
    else:
        cfg = ModelConfig.from_dict(load_yaml("configs/tiny.yaml", ["model.vocab_size=32"])["model"])
        eng = Engine(build_model(cfg, seed=0).eval(), fp8=False, dtype=torch.float32, device=cpu, max_model_len=128,
                     num_blocks=8, block_entries=4, max_seqs=4)
        rollout_server.serve(eng, 0, None, cpu)
        got = {k: eng.stats[k] for k in rollout_server.CACHE_COUNTS}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(got, f)


def test_the_driver_hears_what_the_rollouts_short_cache_cost(tmp_path):
    """Each reply carries the sequences its engine preempted, and those that waited for cache blocks, in that request
    (the trainer's rollout_preemptions and rollout_cache_waits metrics): two rollout ranks, each half of the groups,
    pools too small for them; the driver's counts are the sums."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks, deadline = mp.spawn(_preempting_rollout, args=(port, str(tmp_path)), nprocs=3, join=False), time.time() + 240
    while not ranks.join(timeout=2):  # (a rank's error is raised here)
        if time.time() > deadline:
            for p in ranks.processes:
                p.kill()
            pytest.fail("the three ranks did not finish in 240 s")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert got[0]["outputs"] == 8 and got[0]["gen_s"] > 0
    for k in ("preemptions", "cache_waits"):
        assert got[1][k] > 0 and got[2][k] > 0, got
        assert got[0][k] == got[1][k] + got[2][k], got
