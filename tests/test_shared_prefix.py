"""Shared-prefix logits (each distinct prompt run once for its group's samples) against the plain
forward pass over every ``prompt + completion``: same logits where completion tokens are
predicted, same loss, same gradient."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from actors.modeling import load_causal_lm
from algos import shared_prefix
from algos.episodes import Episode, collate
from algos.policy_loss import token_logprobs
from algos.shared_prefix import causal_lm_logits, length_buckets


def _episodes(seed: int) -> list[Episode]:
    """Groups of samples per prompt, prompts of different lengths, completions of 1 to 7 tokens,
    in shuffled order (a group's samples need not be next to each other)."""
    rng = random.Random(seed)
    out = []
    for _ in range(5):
        prompt = [rng.randrange(3, 15) for _ in range(rng.randint(2, 9))]
        for _ in range(rng.randint(1, 4)):
            completion = [rng.randrange(3, 15) for _ in range(rng.randint(1, 7))]
            out.append(Episode(prompt, completion, [-1.0] * len(completion), 0.0, 0))
    rng.shuffle(out)
    return out


def _loss_and_grads(model, batch, shared: bool, passes: int = 1):
    model.zero_grad()
    logits = causal_lm_logits(model, batch, shared_prefix=shared, completion_passes=passes).float()
    logp = token_logprobs(logits, batch["input_ids"])
    weights = torch.linspace(-1, 1, logp.numel()).reshape(logp.shape)  # a loss that weighs every token
    loss = (logp * weights * batch["completion_mask"]).sum()
    loss.backward()
    return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("passes", [1, 3])
def test_shared_prefix_logits_and_gradient_equal_the_plain_forward_pass(tiny_model_path, passes, monkeypatch):
    monkeypatch.setattr(shared_prefix, "PASS_COST_POSITIONS", 0)  # this small batch splits anyway
    model = load_causal_lm(tiny_model_path)
    batch = collate(_episodes(0), pad_id=0)
    plain_logits, plain_loss, plain_grads = _loss_and_grads(model, batch, shared=False)
    widths = []
    hook = model.register_forward_pre_hook(lambda _, args, kw: widths.append(kw["input_ids"].shape), with_kwargs=True)
    shared_logits, shared_loss, shared_grads = _loss_and_grads(model, batch, shared=True, passes=passes)
    hook.remove()
    # The prompt pass, then the completions in the planned passes (all of them when passes=3:
    # this batch's completions have 7 different lengths).
    completion_widths = [shape[1] for shape in widths[1:]]
    need = (batch["completion_mask"].sum(dim=1).long() - 1).tolist()
    assert completion_widths == length_buckets(need, passes) and len(completion_widths) == passes

    # Where a completion token is predicted (the position before it), the logits agree.
    predicts = torch.nn.functional.pad(batch["completion_mask"][:, 1:], (0, 1)) > 0
    assert predicts.sum() == batch["completion_mask"].sum()
    assert torch.allclose(shared_logits[predicts], plain_logits[predicts], atol=1e-5)
    assert torch.allclose(shared_loss, plain_loss, atol=1e-5)
    for name, grad in plain_grads.items():
        assert torch.allclose(shared_grads[name], grad, atol=1e-5, rtol=1e-4), name
    assert max(g.abs().max() for g in plain_grads.values()) > 1e-3  # the check is not vacuous


def _fewest_positions(widths: list[int], passes: int, pass_cost: int) -> int:
    """Brute force: every choice of up to ``passes`` pass widths among the widths."""
    need = sorted({w for w in widths if w > 0})
    best = math.inf
    for k in range(1, passes + 1):
        for chosen in itertools.combinations(need, k):
            if chosen[-1] == need[-1]:
                best = min(best, sum(min(c for c in chosen if c >= w) for w in widths if w > 0) + pass_cost * k)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_length_buckets_compute_the_fewest_positions(seed):
    rng = random.Random(seed)
    widths = [rng.choice([0, 1, 2, 3, 3, 4, 4, 5, 9]) for _ in range(rng.randint(1, 60))]
    passes, pass_cost = rng.randint(1, 4), rng.choice([0, 5, 64])
    got = length_buckets(widths, passes, pass_cost)
    assert len(got) <= passes and got == sorted(got)
    if any(widths):
        assert got[-1] == max(widths)
        positions = sum(min(c for c in got if c >= w) for w in widths if w > 0) + pass_cost * len(got)
        assert positions == _fewest_positions(widths, passes, pass_cost)
    else:
        assert got == []


def test_a_batch_of_distinct_prompts_and_one_token_completions_also_agrees(tiny_model_path):
    model = load_causal_lm(tiny_model_path)
    episodes = [Episode([5, 6, 7][: 1 + i % 3], [8 + i % 6], [-1.0], 0.0, 0) for i in range(6)]
    batch = collate(episodes, pad_id=0)
    plain, *_ = _loss_and_grads(model, batch, shared=False)
    shared, *_ = _loss_and_grads(model, batch, shared=True)
    predicts = torch.nn.functional.pad(batch["completion_mask"][:, 1:], (0, 1)) > 0
    assert torch.allclose(shared[predicts], plain[predicts], atol=1e-5)


def test_completion_logprobs_for_the_reference_equal_each_episode_run_alone(tiny_model_path):
    from actors.modeling import completion_logprobs, sequence_token_logprobs

    model = load_causal_lm(tiny_model_path)
    episodes = _episodes(1)
    got = completion_logprobs(model, episodes, pad_id=0)
    for e, logprobs in zip(episodes, got, strict=True):
        ids = torch.tensor([e.prompt_ids + e.completion_ids])
        with torch.no_grad():
            alone = sequence_token_logprobs(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        assert torch.allclose(torch.tensor(logprobs), alone[0, len(e.prompt_ids) :], atol=1e-5)
