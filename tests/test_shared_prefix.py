"""Shared-prefix logits (each distinct prompt run once for its group's samples) against the plain
forward pass over every ``prompt + completion``: same logits where completion tokens are
predicted, same loss, same gradient."""

from __future__ import annotations

import random

import torch

from actors.modeling import load_causal_lm
from algos.episodes import Episode, collate
from algos.policy_loss import token_logprobs
from algos.shared_prefix import causal_lm_logits


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


def _loss_and_grads(model, batch, shared: bool):
    model.zero_grad()
    logits = causal_lm_logits(model, batch, shared_prefix=shared).float()
    logp = token_logprobs(logits, batch["input_ids"])
    weights = torch.linspace(-1, 1, logp.numel()).reshape(logp.shape)  # a loss that weighs every token
    loss = (logp * weights * batch["completion_mask"]).sum()
    loss.backward()
    return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_shared_prefix_logits_and_gradient_equal_the_plain_forward_pass(tiny_model_path):
    model = load_causal_lm(tiny_model_path)
    batch = collate(_episodes(0), pad_id=0)
    plain_logits, plain_loss, plain_grads = _loss_and_grads(model, batch, shared=False)
    shared_logits, shared_loss, shared_grads = _loss_and_grads(model, batch, shared=True)

    # Where a completion token is predicted (the position before it), the logits agree.
    predicts = torch.nn.functional.pad(batch["completion_mask"][:, 1:], (0, 1)) > 0
    assert predicts.sum() == batch["completion_mask"].sum()
    assert torch.allclose(shared_logits[predicts], plain_logits[predicts], atol=1e-5)
    assert torch.allclose(shared_loss, plain_loss, atol=1e-5)
    for name, grad in plain_grads.items():
        assert torch.allclose(shared_grads[name], grad, atol=1e-5, rtol=1e-4), name
    assert max(g.abs().max() for g in plain_grads.values()) > 1e-3  # the check is not vacuous


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
