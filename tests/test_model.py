"""Model behaviour beyond the oracle: routing exposure and replay, activation checkpointing, dtypes."""
import pytest
import torch

from model import ModelConfig, build_model
from model.config import load_yaml
from model.model import Experts
from tests.conftest import input_dependent


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.from_dict(load_yaml("configs/tiny.yaml")["model"])
    return _model(cfg)


def _model(cfg):
    return input_dependent(build_model(cfg, seed=0))


def test_routing_is_returned_and_replay_uses_exactly_the_given_experts(tiny, monkeypatch):
    cfg = tiny.cfg
    ids = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    logits, routing = tiny(ids, return_routing=True)
    L, k, E = cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.n_routed_experts
    assert routing.shape == (2, 48, L, k) and routing.max() < E
    # hash layers route by the table
    assert torch.equal(routing[:, :, 0].sort(-1).values, tiny.layers[0].ffn.gate.tid2eid[ids].sort(-1).values)
    # replaying the model's own routing reproduces its logits
    assert torch.allclose(tiny(ids, replay_experts=routing), logits, atol=1e-5)

    # replay a different, random routing and record what the experts actually receive
    g = torch.Generator().manual_seed(1)
    replay = torch.rand(2, 48, L, E, generator=g).argsort(-1)[..., :k].to(torch.uint8)
    seen = []
    orig = Experts.forward

    def spy(self, x, idx, w):
        seen.append(idx.clone())
        return orig(self, x, idx, w)
    monkeypatch.setattr(Experts, "forward", spy)
    out, used = tiny(ids, replay_experts=replay, return_routing=True)
    monkeypatch.undo()
    for layer in range(L):
        want = routing[:, :, layer] if layer < cfg.num_hash_layers else replay[:, :, layer].long()
        assert torch.equal(seen[layer].view(2, 48, k), want), layer
        assert torch.equal(used[:, :, layer], want)
    assert not torch.allclose(out, logits, atol=1e-3)

    # gate weights still come from the model's own scores: the router of a replayed layer learns
    tiny.zero_grad()
    tiny(ids, replay_experts=replay).logsumexp(-1).mean().backward()
    for layer in range(cfg.num_hash_layers, L):
        gw = tiny.layers[layer].ffn.gate.weight.grad
        assert gw is not None and gw.abs().sum() > 0, layer


def test_activation_checkpointing_same_loss_and_grads(tiny):
    ids = torch.randint(0, tiny.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))

    def grads(ckpt):
        tiny.zero_grad()
        tiny.activation_checkpointing = ckpt
        loss = torch.nn.functional.cross_entropy(tiny(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        tiny.activation_checkpointing = False
        return loss.item(), {n: p.grad.clone() for n, p in tiny.named_parameters() if p.grad is not None}

    l0, g0 = grads(False)
    l1, g1 = grads(True)
    assert l0 == l1 and g0.keys() == g1.keys()
    for n in g0:
        assert torch.allclose(g0[n], g1[n], atol=1e-6, rtol=1e-5), n


def test_bf16_model_keeps_fp32_islands_and_tracks_fp32(tiny):
    m = build_model(tiny.cfg, seed=0)
    m16 = build_model(tiny.cfg, seed=0, dtype=torch.bfloat16)
    dt = {n: p.dtype for n, p in m16.named_parameters()}
    assert dt["layers.0.attn.wq_a.weight"] == torch.bfloat16 and dt["embed.weight"] == torch.bfloat16
    for n in ["layers.0.attn.attn_sink", "layers.0.hc_attn_fn", "layers.1.attn.compressor.ape", "norm.weight",
              "layers.1.attn.norm.weight", "hc_head_scale"]:
        assert dt[n] == torch.float32, n
    ids = torch.randint(0, tiny.cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = m(ids).float().log_softmax(-1), m16(ids).float().log_softmax(-1)
    assert (a - b).abs().mean() < 0.02


def test_padding_must_be_on_the_right(tiny):
    ids = torch.zeros(2, 8, dtype=torch.long)
    mask = torch.tensor([[1] * 8, [0, 0] + [1] * 6])
    with pytest.raises(ValueError, match="right-padded"):
        tiny(ids, attention_mask=mask)


def _dense_attention(att, x, ctx):
    """The slow twin of Attention.forward: every query against every key through `_attend`, one dense mask."""
    from model.model import _attend
    pos = ctx["pos"]
    cos, sin = ctx[att.rope_kind]
    q, q_res = att.project_q(x, cos, sin)
    kv = att.project_kv(x, cos, sin)
    comp = mask = None
    if att.compressor is not None:
        comp = att.compressor(x, ctx["compress"])
        S = comp.shape[1]
        mask = (att.indexer.select(x, q_res, pos, ctx["compress"], ctx["compress"], S) if att.indexer is not None
                else (torch.arange(S) < ((pos + 1) // att.compressor.ratio)[:, None])[None])
    qp, kp = pos[:, None], pos[None]
    window = ((kp <= qp) & (kp > qp - att.window))[None]
    return att.project_out(_attend(q, kv, window, comp, mask, att.attn_sink, att.scale), cos, sin)


@pytest.mark.parametrize("T,chunk", [(300, 256), (128, 512), (77, 128), (500, 128)])
def test_blocked_attention_matches_dense_twin(T, chunk):
    """Query blocks of 128 with their own window keys, chunks of blocks and a padded last block give the dense
    formulation's output and gradients, for a sliding, a CSA and an HCA layer."""
    cfg = ModelConfig.from_dict(load_yaml("configs/tiny.yaml", ["model.sliding_window=40", "model.index_topk=8",
                                                                 "model.max_position_embeddings=1024"])["model"])
    m = _model(cfg)
    g = torch.Generator().manual_seed(T)
    ctx = m.rope_ctx(T, "cpu")
    for layer in m.layers[:3]:
        att = layer.attn
        x = torch.randn(2, T, cfg.hidden_size, generator=g, requires_grad=True)
        got = att(x, ctx, chunk=chunk)
        (gx,) = torch.autograd.grad((got * torch.linspace(-1, 1, cfg.hidden_size)).sum(), x)
        want = _dense_attention(att, x, ctx)
        (wx,) = torch.autograd.grad((want * torch.linspace(-1, 1, cfg.hidden_size)).sum(), x)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (att.layer_type, (got - want).abs().max())
        assert torch.allclose(gx, wx, atol=1e-5, rtol=1e-4), (att.layer_type, (gx - wx).abs().max())


def test_grouped_linear_matches_einsum_twin():
    """The output projection's strided batched GEMMs (what CUDA runs) against the einsum twin: values and both
    gradients."""
    from model.model import _GroupedLinear, _grouped_linear
    from tests.kernel_cases import grad_case
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 4, 16, generator=g), torch.randn(4, 6, 16, generator=g)
    assert grad_case(_GroupedLinear.apply, _grouped_linear, [x, w]) < 1e-6


def test_widths_grouped_mm_refuses_take_the_expert_loop():
    """Rows that are not a multiple of 16 bytes (hidden 43, expert width 10), which torch._grouped_mm refuses
    ('strides should be multiple of 16 bytes'): the experts run their loop, so the FP32 forward and backward and
    the BF16 forward run, and the paged engine's greedy tokens equal the full forward's argmax."""
    from model.model import grouped_mm_takes
    from rollout_server import Engine, SamplingParams
    cfg = ModelConfig.from_dict(load_yaml("configs/tiny.yaml", ["model.hidden_size=43",
                                                                "model.moe_intermediate_size=10"])["model"])
    m = _model(cfg)
    w1 = m.layers[0].ffn.experts.w1
    assert not grouped_mm_takes(torch.empty(1, 43), w1) and not grouped_mm_takes(torch.empty(1, 43).bfloat16(), w1)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    m(ids).logsumexp(-1).mean().backward()
    grads = [p.grad for n, p in m.named_parameters() if ".experts.w" in n]
    assert len(grads) == 3 * cfg.num_hidden_layers and all(g.isfinite().all() and g.abs().sum() > 0 for g in grads)
    with torch.no_grad():
        assert build_model(cfg, seed=0, dtype=torch.bfloat16)(ids).isfinite().all()
        prompt = ids[0, :9].tolist()
        out = Engine(m, fp8=False, dtype=torch.float32, device="cpu", max_model_len=64).generate(
            [prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
        full = m(torch.tensor([prompt + out.token_ids]))[0, len(prompt) - 1:-1].argmax(-1)
    assert full.tolist() == out.token_ids


@pytest.mark.parametrize("tie", [False, True])
def test_random_state_tensor_by_tensor_is_init_weights(tie):
    """A model too large for one device is built on meta and initialized tensor by tensor (the actor's shards from
    random_state): every state_dict name (a tied head's too) with init_weights' values for the seed, and no tensor
    of the meta model materialized on the way."""
    tied = f"model.tie_word_embeddings={str(tie).lower()}"
    cfg = ModelConfig.from_dict(load_yaml("configs/tiny.yaml", [tied])["model"])
    whole = build_model(cfg, seed=7).state_dict()
    meta = build_model(cfg, "meta", seed=None)
    got = dict(meta.random_state(7, device="cpu"))
    assert got.keys() == whole.keys() and all(torch.equal(got[k], whole[k]) for k in whole)
    assert all(t.is_meta for t in meta.state_dict().values())
    assert not torch.equal(dict(meta.random_state(8, device="cpu"))["embed.weight"], whole["embed.weight"])
