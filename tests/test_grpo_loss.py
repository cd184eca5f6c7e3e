"""GRPO pieces against hand-computed values: advantages, clipping on both sides, the TIS cap, aggregation modes."""
import math

import pytest
import torch

from train_grpo import TrainConfig, group_advantages, policy_loss, token_logprobs


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5])
    a = group_advantages(r, 2)
    s = math.sqrt(0.5)  # unbiased std of {1, 0}
    assert torch.allclose(a, torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0.0, 0.0]), atol=1e-5)
    assert torch.allclose(group_advantages(r, 2, std_norm=False), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0]))
    r3 = torch.tensor([3.0, 0.0, 0.0])
    assert torch.allclose(group_advantages(r3, 3, std_norm=False), torch.tensor([2.0, -1.0, -1.0]))
    # groups of equal rewards carry exactly zero advantage: in float32 the mean of eight 1/3s is not 1/3, and that
    # rounding divided by a ~1e-8 std gave 0.03 on every sample of such a group
    flat = torch.tensor([1 / 3] * 8 + [2 / 3] * 8 + [0.1] * 8 + [0.7] * 8)
    for std_norm in (True, False):
        a = group_advantages(flat, 8, std_norm)
        assert a.dtype == torch.float32 and torch.equal(a, torch.zeros(32))


def _one_token(adv, ratio, behav=1.0, **kw):
    cfg = TrainConfig(eps_low=0.2, eps_high=0.28, tis_cap=2.0, **kw)
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), math.log(ratio), requires_grad=True)
    roll = old - math.log(behav)
    loss, st = policy_loss(logp, old, roll, torch.tensor([adv]), torch.ones(1, 1), cfg, {"tokens": 1, "seqs": 1})
    loss.backward()
    return loss.item(), logp.grad.item(), st


@pytest.mark.parametrize("adv, ratio, want, clipped", [
    (1.0, 1.5, -1.28, True),    # positive advantage, ratio above 1 + eps_high: clipped, no gradient
    (1.0, 0.5, -0.5, False),    # positive advantage, ratio below 1 - eps_low: not clipped (pessimistic bound)
    (-1.0, 0.5, 0.8, True),     # negative advantage, ratio below 1 - eps_low: clipped, no gradient
    (-1.0, 1.5, 1.5, False),    # negative advantage, ratio above 1 + eps_high: not clipped
    (2.0, 1.1, -2.2, False),    # inside the trust region
])
def test_clipping_both_sides(adv, ratio, want, clipped):
    loss, grad, st = _one_token(adv, ratio)
    assert loss == pytest.approx(want, abs=1e-6)
    assert st["clip"] == (1.0 if clipped else 0.0)
    # d/dlogp of -A * ratio = -A * ratio where unclipped; zero where the clipped branch is active
    assert grad == pytest.approx(0.0 if clipped else -adv * ratio, abs=1e-6)


def test_truncated_importance_sampling_cap():
    # pi_old / mu = 3 > cap 2: weight 2, counted as truncated
    loss, grad, st = _one_token(1.0, 1.0, behav=3.0)
    assert loss == pytest.approx(-2.0) and grad == pytest.approx(-2.0) and st["tis_trunc"] == 1.0
    loss, grad, st = _one_token(1.0, 1.0, behav=0.5)
    assert loss == pytest.approx(-0.5) and st["tis_trunc"] == 0.0


def test_aggregation_modes():
    # two sequences: 3 completion tokens with per-token loss -1 (A=1, ratio 1) and 1 token with loss -2 (A=2)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    adv = torch.tensor([1.0, 2.0])
    z = torch.zeros(2, 4)
    norm = {"tokens": 4, "seqs": 2}

    def agg(mode, max_tokens=4):
        cfg = TrainConfig(loss_agg=mode)
        return policy_loss(z.clone(), z, z, adv, mask, cfg, norm, max_tokens=max_tokens)[0].item()
    assert agg("token-mean") == pytest.approx((-3 - 2) / 4)
    assert agg("seq-mean-token-mean") == pytest.approx((-1 + -2) / 2)
    assert agg("seq-mean-token-sum-norm", max_tokens=5) == pytest.approx((-3 - 2) / (2 * 5))
    # the denominators are the global mini-batch's: this rank's share of a 4-sequence batch counts half
    cfg = TrainConfig(loss_agg="seq-mean-token-mean")
    half = policy_loss(z.clone(), z, z, adv, mask, cfg, {"tokens": 8, "seqs": 4})[0].item()
    assert half == pytest.approx((-1 + -2) / 4)


def test_kl_to_reference_k3():
    cfg = TrainConfig(kl_coef=0.5)
    logp = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    z = torch.zeros(1, 1)
    loss, _ = policy_loss(logp, logp, logp, torch.tensor([0.0]), torch.ones(1, 1), cfg, {"tokens": 1, "seqs": 1},
                          ref_logp=ref)
    d = math.log(0.25) - math.log(0.5)
    assert loss.item() == pytest.approx(0.5 * (math.exp(d) - d - 1))
    assert z.sum() == 0


def test_token_logprobs_match_full_logits():
    from model import ModelConfig, build_model
    from model.config import load_yaml
    m = build_model(ModelConfig.from_dict(load_yaml("configs/tiny.yaml")["model"]), seed=1)
    ids = torch.randint(0, m.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    mask = torch.zeros(2, 11)
    mask[0, 3:8] = 1
    mask[1, 5:11] = 1
    lp, ent = token_logprobs(m, ids, attn, mask, temperature=0.7)
    full = (m(ids)[:, :-1].float() / 0.7).log_softmax(-1)
    want = full.gather(-1, ids[:, 1:, None])[..., 0] * mask
    assert torch.allclose(lp, want, atol=1e-5)
    assert ent.item() == pytest.approx((-(full.exp() * full).sum(-1) * mask).sum().item(), rel=1e-4)


def test_routing_diff_counts_the_fed_top_k_positions():
    """routing_mismatch outside R3: expert sets (order aside) of the top-k layers that differ, at the positions the
    rollout fed (each real token but a row's last)."""
    from train_grpo import routing_diff
    rollout = torch.tensor([[[[0, 1], [2, 3]]] * 4, [[[0, 1], [2, 3]]] * 4], dtype=torch.uint8)  # (2, 4, 2, 2)
    own = rollout.long().clone()
    own[0, 0, 1] = torch.tensor([3, 2])      # the same set, another order: no difference
    own[0, 1, 1] = torch.tensor([2, 4])      # differs
    own[0, 3, 1] = torch.tensor([5, 6])      # row 0's last real token: not fed, not counted
    own[1, 0, 0] = torch.tensor([7, 1])      # layer 0 is a hash layer: not counted
    own[1, 1, 1] = torch.tensor([1, 0])      # row 1 has 2 real tokens: position 1 is its last
    attn = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert routing_diff(own, rollout, attn, n_hash=1) == (1.0, 4.0)   # 3 + 1 fed positions x 1 top-k layer
    assert routing_diff(own, rollout, attn, n_hash=0) == (2.0, 8.0)
