"""GRPO math against direct, loop-by-loop reimplementations on small tensors."""

import math
import statistics

import pytest
import torch

from algos.episodes import Episode, collate
from algos.grpo import group_advantages, kl_shaped_rewards
from algos.policy_loss import clipped_policy_loss as grpo_loss
from algos.policy_loss import kl_estimate, kl_k3, token_entropy, token_logprobs


def test_group_advantages_match_per_group_statistics():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (24,), generator=g).float()
    rewards[:6] = 1.0  # one group with equal rewards
    got = group_advantages(rewards, group_size=6)
    for start in range(0, 24, 6):
        group = rewards[start : start + 6].tolist()
        mean, std = statistics.fmean(group), statistics.stdev(group)
        for i, r in enumerate(group):
            assert got[start + i].item() == pytest.approx((r - mean) / (std + 1e-6), abs=1e-5)
    assert torch.all(got[:6] == 0)


def test_group_advantages_reject_bad_shapes():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(10), 4)
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(torch.zeros(4), 1)


def test_kl_k3_formula_and_sign():
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    ref = torch.tensor([-1.5, -1.0, -0.5, -0.1])
    for a, b, k in zip(logp.tolist(), ref.tolist(), kl_k3(logp, ref).tolist()):
        assert k == pytest.approx(math.exp(b - a) - (b - a) - 1, rel=1e-6)
        assert k >= 0
    assert kl_k3(logp, logp).abs().max() == 0


def _reference_loss(logp, old, adv, mask, eps, beta, ref):
    """Direct loop: token-mean over all completion tokens of the clipped objective minus beta*k3."""
    total, count = 0.0, 0
    for b in range(len(logp)):
        for t in range(len(logp[b])):
            if mask[b][t] == 0:
                continue
            ratio = math.exp(logp[b][t] - old[b][t])
            obj = min(ratio * adv[b], max(min(ratio, 1 + eps), 1 - eps) * adv[b])
            kl = math.exp(ref[b][t] - logp[b][t]) - (ref[b][t] - logp[b][t]) - 1 if beta else 0.0
            total += obj - beta * kl
            count += 1
    return -total / count


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_grpo_loss_matches_direct_loop(beta):
    g = torch.Generator().manual_seed(1)
    B, T = 5, 7
    logp = -torch.rand(B, T, generator=g) * 3
    old = logp + (torch.rand(B, T, generator=g) - 0.5) * 0.8  # ratios both inside and outside the clip
    ref = logp + (torch.rand(B, T, generator=g) - 0.5)
    adv = torch.randn(B, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    loss, metrics = grpo_loss(logp, old, adv, mask, clip_eps=0.2, kl_coef=beta, ref_logprobs=ref)
    expected = _reference_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, beta, ref.tolist())
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert 0 < metrics["clip_frac"] < 1
    assert (metrics["kl"] > 0) == (beta > 0)


def test_grpo_loss_gradient_raises_logprob_of_positive_advantage():
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.ones(2, 3)
    loss, _ = grpo_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask)
    loss.backward()
    assert torch.all(logp.grad[0] < 0) and torch.all(logp.grad[1] > 0)  # descent raises row 0, lowers row 1


def test_grpo_loss_needs_reference_when_kl_is_on():
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), kl_coef=0.1)


def test_token_logprobs_match_manual_softmax():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 4, 6, generator=g)
    ids = torch.randint(0, 6, (2, 4), generator=g)
    got = token_logprobs(logits, ids)
    for b in range(2):
        assert got[b, 0] == 0
        for t in range(1, 4):
            row = logits[b, t - 1].tolist()
            log_z = math.log(sum(math.exp(x) for x in row))
            assert got[b, t].item() == pytest.approx(row[ids[b, t]] - log_z, abs=1e-5)


def test_collate_aligns_completion_tokens_and_logprobs():
    eps = [
        Episode([5, 6, 7], [8, 1], [-0.1, -0.2], 1.0, 3, advantages=[0.5, 0.25], ref_logprobs=[-0.3, -0.4]),
        Episode([5, 6], [9, 9, 1], [-1.0, -2.0, -3.0], 0.0, 3, [-0.5] * 3, ref_logprobs=[-1.5, -2.5, -3.5]),
    ]
    batch = collate(eps, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 1], [5, 6, 9, 9, 1]]
    assert batch["completion_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]]
    assert batch["rollout_logprobs"][0, 3:].tolist() == pytest.approx([-0.1, -0.2])
    assert batch["rollout_logprobs"][1, 2:].tolist() == pytest.approx([-1.0, -2.0, -3.0])
    assert batch["ref_logprobs"][1, 2:].tolist() == pytest.approx([-1.5, -2.5, -3.5])
    assert batch["advantages"].tolist() == [[0, 0, 0, 0.5, 0.25], [0, 0, -0.5, -0.5, -0.5]]
    short = collate([Episode([5], [1], [-0.1], 1.0, 0), eps[1]], pad_id=0)
    assert short["input_ids"][0].tolist() == [5, 1, 0, 0, 0] and short["attention_mask"][0].tolist() == [1, 1, 0, 0, 0]
    assert "ref_logprobs" not in short and "advantages" not in short  # only fields every episode has
    with pytest.raises(ValueError, match="rollout_logprobs"):
        collate([Episode([5], [1, 2], [-0.1], 1.0, 0)], pad_id=0)
    with pytest.raises(ValueError, match="advantages"):
        collate([Episode([5], [1, 2], [-0.1, -0.2], 1.0, 0, advantages=[1.0])], pad_id=0)


def test_dr_grpo_advantages_skip_std_normalisation():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    got = group_advantages(rewards, 3, normalize_std=False)
    assert got.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3])


def test_kl_estimators_k1_k2_k3():
    for a, b in [(-1.0, -1.5), (-2.0, -1.0), (-0.3, -0.3)]:
        logp, ref = torch.tensor([a]), torch.tensor([b])
        r = b - a
        assert kl_estimate(logp, ref, "k1").item() == pytest.approx(-r)
        assert kl_estimate(logp, ref, "k2").item() == pytest.approx(r * r / 2)
        assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(r) - r - 1)
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, "k4")


def _direct_variant_loss(logp, old, adv, mask, eps_low, eps_high, beta, ref, estimator, agg, norm, cap):
    """Per-token loop over every variant: clip bounds, estimator, aggregation, truncated IS."""
    per_seq, all_tokens = [], []
    for b in range(len(logp)):
        terms = []
        for t in range(len(logp[b])):
            if mask[b][t] == 0:
                continue
            if cap is None:
                ratio, weight = math.exp(logp[b][t] - old[b][t]), 1.0
            else:  # ratio against the trainer's own logprobs: 1 in value
                ratio, weight = 1.0, min(math.exp(logp[b][t] - old[b][t]), cap)
            obj = weight * min(ratio * adv[b], max(min(ratio, 1 + eps_high), 1 - eps_low) * adv[b])
            r = ref[b][t] - logp[b][t]
            kl = {"k1": -r, "k2": r * r / 2, "k3": math.exp(r) - r - 1}[estimator]
            terms.append(obj - beta * kl)
        all_tokens += terms
        per_seq.append(terms)
    if agg == "token_mean":
        return -sum(all_tokens) / len(all_tokens)
    if agg == "seq_mean_token_mean":
        return -sum(sum(s) / len(s) for s in per_seq) / len(per_seq)
    return -sum(sum(s) / norm for s in per_seq) / len(per_seq)


@pytest.mark.parametrize(
    "eps_high, estimator, agg, cap",
    [
        (0.28, "k3", "token_mean", None),
        (None, "k1", "seq_mean_token_mean", None),
        (None, "k2", "seq_mean_token_sum_norm", None),
        (0.28, "k3", "seq_mean_token_mean", 2.0),
        (None, "k3", "token_mean", 1.05),
    ],
)
def test_loss_variants_match_direct_loop(eps_high, estimator, agg, cap):
    g = torch.Generator().manual_seed(3)
    B, T = 6, 5
    logp = -torch.rand(B, T, generator=g) * 3
    old = logp + (torch.rand(B, T, generator=g) - 0.5) * 0.8
    ref = logp + (torch.rand(B, T, generator=g) - 0.5)
    adv = torch.randn(B, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[:, 0] = 1  # every sequence has a token
    loss, metrics = grpo_loss(
        logp,
        old,
        adv,
        mask,
        clip_eps=0.2,
        kl_coef=0.1,
        ref_logprobs=ref,
        clip_eps_high=eps_high,
        kl_estimator=estimator,
        aggregation=agg,
        length_normalizer=8,
        tis_cap=cap,
    )
    expected = _direct_variant_loss(
        logp.tolist(),
        old.tolist(),
        adv.tolist(),
        mask.tolist(),
        0.2,
        0.2 if eps_high is None else eps_high,
        0.1,
        ref.tolist(),
        estimator,
        agg,
        8,
        cap,
    )
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    if cap is not None:
        assert metrics["tis_weight_mean"] <= cap


def test_truncated_is_gradient_is_weighted_policy_gradient():
    """With TIS the gradient is -w_t * A * dlogp_t / n, w_t = min(exp(logp - old), cap)."""
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.0]])
    loss, _ = grpo_loss(logp, old, torch.tensor([2.0]), torch.ones(1, 2), tis_cap=1.2)
    loss.backward()
    w = [min(math.exp(0.5), 1.2), min(math.exp(-1.0), 1.2)]
    assert logp.grad[0].tolist() == pytest.approx([-w[0] * 2.0 / 2, -w[1] * 2.0 / 2])


def test_token_entropy_matches_manual_softmax():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 5, generator=g)
    got = token_entropy(logits)
    for b in range(2):
        assert got[b, 0] == 0
        for t in range(1, 3):
            p = torch.softmax(logits[b, t - 1], dim=-1).tolist()
            assert got[b, t].item() == pytest.approx(-sum(x * math.log(x) for x in p), rel=1e-5)


def test_grpo_experience_with_kl_as_reward_penalty():
    import dataclasses

    from algos.grpo import Algorithm
    from tests.configs import defaults

    def episodes():
        return [
            Episode([1], [2, 3], [-0.5, -1.0], 1.0, 0, ref_logprobs=[-0.7, -1.0]),
            Episode([1], [2], [-0.2], 0.0, 0, ref_logprobs=[-0.1]),
        ]

    eps = episodes()
    shaped = kl_shaped_rewards(eps, 0.5, "k1")
    # k1 per token = logp - ref: episode 0 sums 0.2 + 0.0, episode 1 sums -0.1
    assert shaped == pytest.approx([1.0 - 0.5 * 0.2, 0.0 + 0.5 * 0.1])
    config = dataclasses.replace(
        defaults().algo, group_size=2, advantage_std_norm=False, kl_coef=0.5, kl_mode="reward", kl_estimator="k1"
    )
    Algorithm(config, max_tokens=6).make_experience(eps)
    mean = sum(shaped) / 2
    assert eps[0].advantages == pytest.approx([shaped[0] - mean] * 2)  # the same on every token
    assert eps[1].advantages == pytest.approx([shaped[1] - mean])
    plain = episodes()
    Algorithm(dataclasses.replace(config, kl_coef=0.0, advantage_std_norm=True), 6).make_experience(plain)
    assert plain[0].advantages[0] > 0 > plain[1].advantages[0]
