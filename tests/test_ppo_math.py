"""PPO's math against hand-computed cases and direct, loop-by-loop reimplementations."""

import dataclasses
import random
import statistics

import pytest
import torch

from algos.episodes import Episode, collate
from algos.ppo import Algorithm, ValueLoss, explained_variance, gae, token_rewards, whiten
from tests.configs import defaults


def test_gae_on_a_hand_computed_case():
    # One completion of 3 tokens after 2 prompt positions, then 1 padding position.
    mask = torch.tensor([[0, 0, 1, 1, 1, 0.0]])
    rewards = torch.tensor([[9, 9, 0, 0, 1, 9.0]])  # off-mask entries must not matter
    values = torch.tensor([[7, 7, 0.5, 0.6, 0.8, 7.0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.9)
    # delta = [0.1, 0.2, 0.2]; A_2 = 0.2, A_1 = 0.2 + 0.9 * 0.2, A_0 = 0.1 + 0.9 * A_1
    assert adv[0].tolist() == pytest.approx([0, 0, 0.442, 0.38, 0.2, 0])
    assert ret[0].tolist() == pytest.approx([0, 0, 0.942, 0.98, 1.0, 0])


def _direct_gae(rewards, values, gamma, lam):
    """One sequence's tokens, plain Python: the textbook recursion with V after the last token 0."""
    n = len(rewards)
    adv = [0.0] * n
    running = 0.0
    for t in reversed(range(n)):
        next_value = values[t + 1] if t + 1 < n else 0.0
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        adv[t] = running
    return adv, [a + v for a, v in zip(adv, values)]


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_a_direct_loop_with_prompt_and_padding_masked(gamma, lam):
    rng = random.Random(0)
    B, T = 6, 12
    rewards, values, mask = torch.randn(B, T), torch.randn(B, T), torch.zeros(B, T)
    spans = []
    for b in range(B):
        start = rng.randrange(0, 5)  # prompt positions
        length = rng.randrange(1, T - start + 1)  # then the completion, then padding
        mask[b, start : start + length] = 1
        spans.append((start, start + length))
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for b, (lo, hi) in enumerate(spans):
        want_adv, want_ret = _direct_gae(rewards[b, lo:hi].tolist(), values[b, lo:hi].tolist(), gamma, lam)
        assert adv[b, lo:hi].tolist() == pytest.approx(want_adv, abs=1e-5)
        assert ret[b, lo:hi].tolist() == pytest.approx(want_ret, abs=1e-5)
        outside = torch.cat([adv[b, :lo], adv[b, hi:], ret[b, :lo], ret[b, hi:]])
        assert torch.all(outside == 0)


def test_whiten_and_explained_variance_match_statistics():
    g = torch.Generator().manual_seed(1)
    x, mask = torch.randn(4, 5, generator=g) * 3 + 2, (torch.rand(4, 5, generator=g) > 0.3).float()
    picked = x[mask.bool()].tolist()
    mean, std = statistics.fmean(picked), statistics.pstdev(picked)
    w = whiten(x, mask)
    assert w[mask.bool()].tolist() == pytest.approx([(v - mean) / std for v in picked], abs=1e-5)
    assert torch.all(w[~mask.bool()] == 0)

    returns = x
    values = x + torch.randn(4, 5, generator=g) * 0.5
    r, v = returns[mask.bool()].tolist(), values[mask.bool()].tolist()
    want = 1 - statistics.pvariance([a - b for a, b in zip(r, v)]) / statistics.pvariance(r)
    assert explained_variance(values, returns, mask) == pytest.approx(want, rel=1e-5)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 0.3), returns, mask) == pytest.approx(0.0, abs=1e-6)


class _Values(torch.nn.Module):
    """A stand-in value model: one learnable value per token id (its output at position t)."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table.clone())

    def forward(self, input_ids, attention_mask=None):
        return self.table[input_ids]


@pytest.mark.parametrize("clip", [None, 0.2])
def test_clipped_value_loss_matches_a_direct_loop(clip):
    g = torch.Generator().manual_seed(2)
    table = torch.randn(10, generator=g)
    episodes = [
        Episode([1, 2], [3, 4, 5], [0.0] * 3, 1.0, 0, values=[0.1, -0.4, 0.9], returns=[1.0, 0.5, -0.2]),
        Episode([6], [7, 8], [0.0] * 2, 0.0, 0, values=[0.3, 0.0], returns=[0.2, 0.8]),
    ]
    model = _Values(table)
    loss, metrics = ValueLoss(clip)(model, collate(episodes, pad_id=0))
    terms, clipped_count = [], 0
    for e in episodes:
        ids = e.prompt_ids + e.completion_ids
        for t, (old, ret) in enumerate(zip(e.values, e.returns)):
            v = table[ids[len(e.prompt_ids) + t - 1]].item()  # the state before the token: position t-1
            sq = (v - ret) ** 2
            if clip is not None:
                vc = old + max(-clip, min(clip, v - old))
                if abs(v - old) > clip and (vc - ret) ** 2 > sq:
                    clipped_count += 1
                    sq = (vc - ret) ** 2
            terms.append(0.5 * sq)
    assert loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    assert metrics["value_clip_frac"] == pytest.approx(clipped_count / len(terms))
    assert (metrics["value_clip_frac"] > 0) == (clip is not None)
    loss.backward()
    assert model.table.grad.abs().sum() > 0


def test_values_inside_the_clip_range_are_never_counted_clipped():
    """Inside old +- clip, ``old + (V - old)`` can differ from ``V`` by a rounding; that must not
    count as clipped (nor change the loss), or the metric flips with bit-level noise."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(64, generator=g) * 0.3
    ids = list(range(1, 64))
    values = (table[ids[:-1]] + (torch.rand(62, generator=g) - 0.5) * 0.3).tolist()  # |V - old| < 0.15
    returns = torch.randn(62, generator=g).tolist()
    episode = Episode([0], ids, [0.0] * 63, 0.0, 0, values=[table[0].item(), *values], returns=[0.0, *returns])
    batch = collate([episode], pad_id=0)
    loss, metrics = ValueLoss(0.2)(_Values(table), batch)
    unclipped, _ = ValueLoss(None)(_Values(table), batch)
    assert metrics["value_clip_frac"] == 0.0
    assert loss.item() == unclipped.item()


def test_token_rewards_put_the_reward_last_and_the_kl_on_every_token():
    e = Episode([1], [2, 3, 4], [-0.5, -1.0, -0.2], 1.0, 0, ref_logprobs=[-0.7, -1.0, -0.1])
    assert token_rewards([e], 0.0, "k1") == [pytest.approx([0.0, 0.0, 1.0])]
    # k1 = logp - ref: [0.2, 0.0, -0.1]
    assert token_rewards([e], 0.5, "k1") == [pytest.approx([-0.1, 0.0, 1.0 + 0.05])]


def test_ppo_experience_sets_whitened_advantages_and_returns():
    config = dataclasses.replace(compose_ppo(), gamma=1.0, lam=1.0, whiten_advantages=True, kl_coef=0.0)
    eps = [
        Episode([1], [2, 3], [-0.1, -0.2], 1.0, 0, values=[0.5, 0.5]),
        Episode([1], [4], [-0.3], 0.0, 0, values=[0.25]),
    ]
    metrics = Algorithm(config, max_tokens=6).make_experience(eps)
    # gamma = lam = 1: every token's return is the episode's reward, its advantage reward - value.
    assert eps[0].returns == pytest.approx([1.0, 1.0]) and eps[1].returns == pytest.approx([0.0])
    raw = [0.5, 0.5, -0.25]
    mean, std = statistics.fmean(raw), statistics.pstdev(raw)
    got = eps[0].advantages + eps[1].advantages
    assert got == pytest.approx([(a - mean) / std for a in raw], abs=1e-5)
    assert metrics["advantage_mean"] == pytest.approx(mean) and metrics["advantage_std"] == pytest.approx(std)
    want_ev = 1 - statistics.pvariance(raw) / statistics.pvariance([1.0, 1.0, 0.0])
    assert metrics["explained_variance"] == pytest.approx(want_ev)
    with pytest.raises(ValueError, match="critic's values"):
        Algorithm(config, 6).make_experience([Episode([1], [2], [-0.1], 1.0, 0)])


def compose_ppo():
    from apps.grpo.config import compose_config

    assert defaults().algo.name == "grpo"
    return compose_config("algo=ppo").algo
