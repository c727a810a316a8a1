"""The reference model's actor: completion logprobs against a plain ``transformers`` computation,
on a CPU and (marked ``gpu``, skipped without CUDA) on a GPU of its own."""

from __future__ import annotations

import pytest
import torch

from actors.modeling import load_causal_lm
from tests.test_trainer_group import episodes


def _plain_logprobs(model, batch) -> list[list[float]]:
    """One unpadded sequence at a time: log-softmax of the logits that predict each completion token."""
    out = []
    for e in batch:
        ids = torch.tensor([e.prompt_ids + e.completion_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        token_lp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
        out.append(token_lp[len(e.prompt_ids) - 1 :].tolist())
    return out


def test_completion_logprobs_in_several_passes_match_transformers(tiny_model_path):
    """Short and long completions: the passes really split (algos.shared_prefix.length_buckets),
    and every completion's logprobs are still the plain forward pass's."""
    import random

    from actors.modeling import completion_logprobs
    from algos.episodes import Episode
    from algos.shared_prefix import length_buckets

    rng = random.Random(7)
    batch = []
    for i in range(24):
        prompt = [rng.randrange(2, 15) for _ in range(rng.randint(3, 7))]
        completion = [rng.randrange(1, 15) for _ in range(rng.randint(1, 3) if i % 3 else rng.randint(30, 40))]
        batch.append(Episode(prompt, completion, [0.0] * len(completion), 0.0, 0))
    assert len(length_buckets([len(e.completion_ids) - 1 for e in batch], 3)) > 1
    model = load_causal_lm(tiny_model_path)
    expected = _plain_logprobs(model, batch)
    assert _max_diff(completion_logprobs(model, batch, pad_id=0, completion_passes=3), expected) < 1e-5
    assert _max_diff(completion_logprobs(model, batch, pad_id=0), expected) < 1e-5


def _max_diff(a, b) -> float:
    """The largest difference, relative to the expected logprob where that is below -1: float32
    rounding in a differently batched pass grows with the logits (the warm-started model puts
    some tokens at -13)."""
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) / max(1.0, abs(y)) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _reference(ray_session, model_path, gpus=0, **kwargs):
    from actors.reference import Reference

    actor = Reference.options(num_gpus=gpus).remote(model_path, **kwargs)
    ray_session.get(actor.__ray_ready__.remote())
    return actor


def test_reference_logprobs_match_transformers_and_follow_the_dtype(ray_session, tiny_model_path):
    batch = episodes(9, seed=3)  # ragged: the actor pads them into one batch
    expected = _plain_logprobs(load_causal_lm(tiny_model_path), batch)
    fp32 = _reference(ray_session, tiny_model_path)
    bf16 = _reference(ray_session, tiny_model_path, dtype="bfloat16")
    try:
        assert ray_session.get(fp32.device.remote()) == "cpu"
        assert _max_diff(ray_session.get(fp32.logprobs.remote(batch)), expected) < 1e-5
        diff = _max_diff(ray_session.get(bf16.logprobs.remote(batch)), expected)
        assert 1e-4 < diff < 0.5  # bfloat16 weights: close, and not the float32 numbers
    finally:
        for actor in (fp32, bf16):
            ray_session.kill(actor)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reference_on_a_gpu_of_its_own_matches_the_cpu(ray_session, tiny_model_path):
    batch = episodes(9, seed=4)
    expected = _plain_logprobs(load_causal_lm(tiny_model_path), batch)
    fp32 = _reference(ray_session, tiny_model_path, gpus=1, device="cuda")
    try:
        assert ray_session.get(fp32.device.remote()).startswith("cuda")
        assert _max_diff(ray_session.get(fp32.logprobs.remote(batch)), expected) < 1e-3
    finally:
        ray_session.kill(fp32)
    bf16 = _reference(ray_session, tiny_model_path, gpus=1, device="cuda", dtype="bfloat16")
    try:
        assert _max_diff(ray_session.get(bf16.logprobs.remote(batch)), expected) < 0.5
    finally:
        ray_session.kill(bf16)
