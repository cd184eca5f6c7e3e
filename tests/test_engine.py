"""The simple rollout engine (the paged engine's slow twin) against the model's full-sequence forward, sampling
controls, FP8 holders, weight updates."""
import pytest
import torch

from model import ModelConfig, build_model
from model.config import load_yaml
from rollout_server import Engine, EngineExperts, FP8Linear, SamplingParams, SimpleEngine
from tests.conftest import input_dependent

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.from_dict(load_yaml("configs/tiny.yaml", ["model.vocab_size=32"])["model"])
    return input_dependent(build_model(cfg, seed=0)).eval()


def _prompts(lengths, vocab=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def test_greedy_matches_full_forward(model):
    """Mixed prompt lengths, 40 new tokens: the CSA (ratio 4) and HCA (ratio 16) layers and the 16-token window
    all roll over many times inside incremental decoding."""
    eng = SimpleEngine(model, fp8=False, dtype=torch.float32, device="cpu", max_batch_tokens=40)
    prompts = _prompts([1, 5, 17, 33, 50])
    outs = eng.generate(prompts, GREEDY)
    for o in outs:
        full = torch.tensor([o.prompt_token_ids + o.token_ids])
        with torch.no_grad():
            logits, routing = model(full, return_routing=True)
        P = len(o.prompt_token_ids)
        step_logits = logits[0, P - 1:-1]
        assert step_logits.argmax(-1).tolist() == o.token_ids
        lp = step_logits.log_softmax(-1).gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]
        assert torch.allclose(lp, torch.tensor(o.logprobs), atol=1e-4)
        assert o.routed_experts.dtype == torch.uint8
        assert torch.equal(o.routed_experts.long(), routing[0, :-1])
        assert o.finish_reason == "length" and len(o.token_ids) == 40


def test_shared_prefixes_and_stops(model):
    eng = SimpleEngine(model, fp8=False, dtype=torch.float32, device="cpu")
    p = _prompts([9], seed=1)[0]
    alone = eng.generate([p], GREEDY)[0]
    batch = eng.generate([p, _prompts([4], seed=2)[0], p, p], GREEDY)
    for o in (batch[0], batch[2], batch[3]):
        assert o.token_ids == alone.token_ids and torch.equal(o.routed_experts, alone.routed_experts)
    stop = alone.token_ids[5]
    cut = eng.generate([p], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop], ignore_eos=True))[0]
    first = alone.token_ids.index(stop)
    assert cut.token_ids == alone.token_ids[:first + 1] and cut.finish_reason == "stop"


def test_filter_threshold_keeps_what_the_sorted_definition_keeps():
    """filter_threshold against top-k / top-p's definition over each row sorted: its largest logits, at most top_k,
    while the probability mass before each is below top_p. torch.topk of filter_candidates' count gives the
    thresholds the sort gives; a token tied with the last one kept is kept; the torch twin draws kept tokens only."""
    from rollout_server import filter_candidates, filter_threshold, sample_filtered
    g = torch.Generator().manual_seed(0)
    B, V = 64, 500
    scaled = torch.randn(B, V, generator=g) * torch.rand(B, 1, generator=g) * 6
    top_k = torch.randint(0, 60, (B,), generator=g)
    top_p = torch.where(torch.rand(B, generator=g) < 0.5, torch.rand(B, generator=g), torch.ones(B))
    top_k[0], top_p[0] = 0, 1.0  # a row without either
    thr = filter_threshold(scaled, None, top_k, top_p)
    srt, order = scaled.sort(-1, descending=True)
    probs = srt.softmax(-1)
    keep = (torch.arange(V) < torch.where(top_k > 0, top_k, V)[:, None]) & \
        (((probs.cumsum(-1) - probs) < top_p[:, None]) | (top_p[:, None] == 1))  # (top_p 1: off)
    assert torch.equal(scaled >= thr[:, None], torch.zeros_like(keep).scatter(-1, order, keep))
    filtered = (top_k > 0) | (top_p < 1)
    assert (thr[~filtered] == float("-inf")).all() and 0 < int(keep.sum(-1).min())
    assert int(keep[filtered].sum(-1).max()) < V and int(keep[filtered].sum(-1).min()) == 1
    # every filtered row with a top-k: the largest top_k of them ranked by torch.topk, the same thresholds
    k = top_k.clamp(min=1)
    params = [SamplingParams(top_k=int(a), top_p=float(b)) for a, b in zip(k, top_p)]
    assert filter_candidates(params) == int(k.max()) < V
    assert torch.equal(filter_threshold(scaled, None, k, top_p, filter_candidates(params)),
                       filter_threshold(scaled, None, k, top_p))
    assert filter_candidates(params + [SamplingParams(top_p=0.5)]) is None  # top-p alone: the sort
    assert filter_candidates([SamplingParams(), SamplingParams(top_k=3)]) == 3  # (rows without a filter: ignored)
    # ties at the edge: top-k 2 of (5, 3, 3, 3, 1) keeps the three 3s
    tied = torch.tensor([[5.0, 3.0, 1.0, 3.0, 3.0]])
    assert filter_threshold(tied, None, torch.tensor([2]), torch.tensor([1.0])).item() == 3.0
    # the twin's draws (30 steps a row) are kept tokens, greedy rows aside
    temps = torch.where(torch.arange(B) % 4 == 0, 0.0, 1.0)
    for step in range(30):
        tok, _ = sample_filtered(scaled, temps, top_k, top_p, torch.arange(B), torch.full((B,), step), fused=False)
        kept = (scaled >= thr[:, None]).gather(-1, tok[:, None])[:, 0]
        assert kept[temps > 0].all()


def test_sampling_seeds_top_k_top_p(model):
    eng = SimpleEngine(model, fp8=False, dtype=torch.float32, device="cpu")
    prompts = _prompts([6, 6, 11], seed=3)
    sp = SamplingParams(temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    a, b = eng.generate(prompts, sp), eng.generate(prompts, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    c = eng.generate(prompts, SamplingParams(temperature=1.0, max_tokens=12, seed=8, ignore_eos=True))
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    assert a[0].token_ids != a[1].token_ids or a[0].prompt_token_ids != a[1].prompt_token_ids
    greedy = [o.token_ids for o in eng.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
    top1 = eng.generate(prompts, SamplingParams(temperature=1.0, top_k=1, max_tokens=12, seed=1, ignore_eos=True))
    tiny_p = eng.generate(prompts, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=12, seed=1, ignore_eos=True))
    assert [o.token_ids for o in top1] == greedy and [o.token_ids for o in tiny_p] == greedy
    # log-probs are those of the temperature-scaled distribution, before truncation
    hot = eng.generate(prompts[:1], SamplingParams(temperature=2.0, top_k=1, max_tokens=1, seed=1))[0]
    with torch.no_grad():
        ref = (model(torch.tensor([prompts[0]]))[0, -1] / 2.0).log_softmax(-1)[hot.token_ids[0]]
    assert hot.logprobs[0] == pytest.approx(ref.item(), abs=1e-5)
    with pytest.raises(ValueError, match="empty"):
        eng.generate([[]], sp)
    with pytest.raises(TypeError, match=r"prompt 1, position 2: token id 2.5 is not an integer"):
        eng.generate([[1, 2], [3, 4, 2.5]], sp)
    # bad sampling parameters: the message names each field and its rule
    with pytest.raises(ValueError, match=r"temperature=-1.0 \(>= 0.*top_p=0.0 \(in \(0, 1\]\)"):
        SamplingParams(temperature=-1.0, top_p=0.0)
    with pytest.raises(ValueError, match=r"max_tokens=0 \(>= 1\)$"):
        SamplingParams(max_tokens=0)
    # each was taken and failed deep inside generate (or, 1e-40, gave NaN log-probs: logits / T overflows fp32)
    for kw, msg in ((dict(stop_token_ids=5), r"stop_token_ids=5 \(a list of token ids\)"),
                    (dict(seed="abc"), r"seed='abc' \(an integer\)"), (dict(top_k=2.5), r"top_k=2.5 \(an integer\)"),
                    (dict(max_tokens=None), r"max_tokens=None \(an integer\)"),
                    (dict(temperature=1e-40), r"temperature=1e-40 \(>= 0, 0 = greedy; a positive one >= 1e-30\)"),
                    (dict(temperature=float("nan")), "temperature=nan")):
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**kw)
    import numpy as np
    sp = SamplingParams(max_tokens=np.int64(3), seed=torch.tensor(4), stop_token_ids=(np.int32(9),))
    assert (type(sp.max_tokens), type(sp.seed), sp.stop_token_ids) == (int, int, [9])
    V = model.cfg.vocab_size  # a stop id no sample can be (another model's vocabulary, a typo) is refused
    with pytest.raises(ValueError, match=rf"sampling parameters 1: stop token id {V} outside \[0, {V}\)"):
        eng.generate(prompts[:2], [sp, SamplingParams(stop_token_ids=[4, V])])
    with pytest.raises(TypeError, match="prompt 0: 5 is not a sequence of token ids"):
        eng.generate([5, 6, 7], sp)  # a flat list: one prompt, not a list of them
    out = eng.generate(torch.tensor([prompts[0]]), sp)[0]  # a (1, T) tensor of prompts: plain ints out
    assert out.prompt_token_ids == prompts[0] and {type(t) for t in out.prompt_token_ids} == {int}
    for kw, msg in ((dict(max_seqs=0), "max_seqs=0"), (dict(max_batch_tokens=0), "max_batch_tokens=0"),
                    (dict(num_blocks={"csa": 0, "hca": 4}), r"num_blocks\['csa'\]=0"),
                    (dict(mem_fraction=1.5), r"mem_fraction=1.5 \(in \(0, 1\]\)")):
        with pytest.raises(ValueError, match=msg):
            Engine(model, fp8=False, dtype=torch.float32, device="cpu", **kw)
    P = model.cfg.max_position_embeddings  # allowed (RoPE extrapolates), but said: when a request reaches past
    # it, once an engine (not for a max_model_len it may never reach: the default 4096 is past a tiny model's)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eng = Engine(model, fp8=False, dtype=torch.float32, device="cpu", max_model_len=P + 1)
        eng.generate([[3] * (P - 1)], SamplingParams(temperature=0, max_tokens=1))
    with pytest.warns(UserWarning, match=f"prompt 1: {P - 1} tokens \\+ max_tokens 2 reach past the model's "
                      f"max_position_embeddings {P}"):
        eng.generate([[3], [3] * (P - 1)], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eng.generate([[3] * (P - 1)], SamplingParams(temperature=0, max_tokens=2))


def test_fp8_holders_and_weight_updates(model):
    eng = SimpleEngine(model, fp8=True, dtype=torch.float32, device="cpu")
    attn = eng.model.layers[1].attn
    assert isinstance(attn.wq_a, FP8Linear) and attn.wq_a.qweight.dtype == torch.float8_e4m3fn
    assert isinstance(eng.model.layers[0].ffn.experts, EngineExperts)
    assert eng.model.layers[0].ffn.experts.w1.dtype == torch.float8_e4m3fn
    # the shared expert is one more expert of the grouped kernel; its FP8 holders are views of the stacks
    ffn = eng.model.layers[0].ffn
    assert ffn.shared_in_experts and ffn.experts.w1.shape[0] == ffn.experts.n_local + 1
    assert ffn.shared_experts.w2.qweight.data_ptr() == ffn.experts.w2[-1].data_ptr()
    assert not isinstance(attn.compressor.wkv, FP8Linear) and not isinstance(attn.indexer.weights_proj, FP8Linear)
    # new weights arrive by name and are re-quantized in place: same as an engine built from the new model
    new = build_model(model.cfg, seed=5)
    eng.update_weights(new.state_dict().items())
    fresh = SimpleEngine(new, fp8=True, dtype=torch.float32, device="cpu")
    for (k, a), (k2, b) in zip(eng.model.state_dict().items(), fresh.model.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    with pytest.raises(KeyError, match="not a tensor"):
        eng.update_weights([("layers.0.nope", torch.zeros(1))])


def test_q_lora_prenorm_gives_the_normed_rows_to_both_wq_b(model):
    """q_lora(prenorm=True): the rows un-normed with a Prenorm marker, which the layer's and the indexer's wq_b
    (FP8 holders, and the model's plain linears) apply first: the same products as from the normed rows."""
    eng = SimpleEngine(model, fp8=True, dtype=torch.float32, device="cpu")
    x = torch.randn(1, 2, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for attn in (eng.model.layers[1].attn, model.layers[1].attn):  # a CSA layer (an indexer)
        normed, _ = attn.q_lora(x)
        raw, marker = attn.q_lora(x, prenorm=True)
        assert torch.equal(raw, attn.wq_a(x)) and not torch.equal(raw, normed)
        for lin in (attn.wq_b, attn.indexer.wq_b):
            assert torch.equal(lin(raw, marker), lin(normed))


def test_run_layers_side_stream_joins_first(model, monkeypatch):
    """A CUDA graph capture fails where the main stream waits on a side stream that no captured work has reached
    (cudaErrorStreamCaptureIsolation): run_layers must have the side stream wait on the main one before any join
    back, whichever layer first puts work there. Streams recorded by fakes (the order of the waits is the contract;
    on CPU nothing runs on them)."""
    import rollout_server
    log = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append((self.name, other.name))

    main, side = Stream("main"), Stream("side")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    ids = torch.tensor([3, 4, 5])
    with torch.no_grad():
        logits, _ = rollout_server.run_layers(model, ids, torch.arange(3), lambda li, attn, h, tables, hq:
                                              torch.zeros_like(h), side=side)
    assert logits.shape[0] == 3
    joins = [i for i, (a, b) in enumerate(log) if (a, b) == ("main", "side")]
    assert joins and log.index(("side", "main")) < joins[0], log
