"""Micro-batched gradient accumulation gives exactly the whole batch's gradient and metrics."""

import random

import pytest
import torch

from algos.episodes import Episode
from algos.policy_loss import PolicyLoss
from algos.train import backward
from tinymodel.build import TinyModelRecipe, build_model, build_tokenizer


@pytest.fixture(scope="module")
def model():
    recipe = TinyModelRecipe(
        hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16, intermediate_size=64
    )
    return build_model(recipe, build_tokenizer())


def _episodes(n=7, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(2, 15) for _ in range(rng.randint(3, 6))]
        completion = [rng.randrange(1, 15) for _ in range(rng.randint(1, 4))]
        logprobs = [-rng.random() * 3 for _ in completion]
        advantages = [rng.uniform(-1, 1) for _ in completion]  # per token, as PPO's
        ref = [-rng.random() * 3 for _ in completion]
        out.append(Episode(prompt, completion, logprobs, float(i % 2), 0, advantages=advantages, ref_logprobs=ref))
    return out


def _loss(**options) -> PolicyLoss:
    defaults = dict(
        clip_eps=0.2,
        clip_eps_high=None,
        kl_coef=0.0,
        kl_estimator="k3",
        aggregation="token_mean",
        length_normalizer=6,
        tis_cap=None,
    )
    return PolicyLoss(**{**defaults, **options})


def _grads(model, episodes, options, micro):
    model.zero_grad(set_to_none=True)
    metrics = backward(model, episodes, 0, _loss(**options), micro)
    return [p.grad.clone() for p in model.parameters()], metrics


@pytest.mark.parametrize(
    "options",
    [
        {"aggregation": "token_mean"},
        {"aggregation": "seq_mean_token_mean", "kl_coef": 0.1, "kl_estimator": "k2"},
        {"aggregation": "seq_mean_token_sum_norm", "length_normalizer": 6, "tis_cap": 2.0, "clip_eps_high": 0.3},
    ],
)
@pytest.mark.parametrize("micro", [1, 3])
def test_micro_batches_accumulate_to_the_whole_batch(model, options, micro):
    episodes = _episodes()
    full_grads, full = _grads(model, episodes, options, None)
    micro_grads, parts = _grads(model, episodes, options, micro)
    for a, b in zip(full_grads, micro_grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in full_grads)
    for key in ("loss", "kl", "clip_frac", "entropy", "logprob_diff_mean", "logprob_diff_max", "train_tokens"):
        assert parts[key] == pytest.approx(full[key], rel=1e-5, abs=1e-7), key


def test_bad_micro_batch_size_is_an_error(model):
    with pytest.raises(ValueError, match="micro_batch_size"):
        backward(model, _episodes(2), 0, _loss(), -1)


@pytest.mark.parametrize("micro", [None, 3])
def test_the_shared_prefix_pass_gives_the_full_sequences_gradient_and_metrics(model, micro):
    """Groups of samples of one prompt (as GRPO makes them), some split across micro-batches."""
    episodes = [
        Episode(e.prompt_ids, c.completion_ids, c.rollout_logprobs, c.reward, 0, c.advantages, c.ref_logprobs)
        for e in _episodes(3, seed=1)
        for c in _episodes(4, seed=len(e.prompt_ids))
    ]
    model.zero_grad(set_to_none=True)
    plain = backward(model, episodes, 0, _loss(shared_prefix=False), micro)
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    shared = backward(model, episodes, 0, _loss(shared_prefix=True), micro)
    for a, b in zip(plain_grads, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    for key in ("loss", "clip_frac", "entropy", "logprob_diff_mean", "logprob_diff_max"):
        assert shared[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-6), key
