"""The policy's side of the loop in async mode: requests made steps ahead, weight updates queued
behind them (each batch sampled by the version loaded when it started, with that version's
logprobs), and the replay buffer's staleness bound."""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import pytest
import torch

from actors.modeling import load_causal_lm, sequence_token_logprobs
from actors.policy_replicas import PolicyReplicas
from algos.episodes import Episode
from apps.grpo.rollouts import Rollouts
from tests.configs import make_pusher
from tests.fsdp_push import perturbed_model
from weightsync.store import WeightStore


def _episode(version: int) -> Episode:
    return Episode([1, 2], [3], [-0.5], 1.0, version)


def test_the_replay_buffer_hands_out_only_episodes_within_the_staleness_bound(ray_session):
    from actors.replay import ReplayBuffer

    buffer = ReplayBuffer.remote(2)
    ray_session.get(buffer.add.remote([_episode(v) for v in (0, 1, 2, 3, 4, 5)]))
    taken = ray_session.get(buffer.take.remote(5))
    assert sorted(e.policy_version for e in taken) == [3, 4, 5]
    assert ray_session.get(buffer.stats.remote()) == {"size": 0, "evicted": 3}
    ray_session.get(buffer.add.remote([_episode(5), _episode(7)]))
    assert [e.policy_version for e in ray_session.get(buffer.take.remote(7, max_episodes=1))] == [5]
    assert [e.policy_version for e in ray_session.get(buffer.take.remote(8))] == [7]
    on_policy = ReplayBuffer.remote(0)
    ray_session.get(on_policy.add.remote([_episode(3), _episode(4)]))
    assert [e.policy_version for e in ray_session.get(on_policy.take.remote(4))] == [4]


def _completion_logprobs(model, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
    ids = prompt_ids + token_ids
    batch = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    with torch.no_grad():
        return sequence_token_logprobs(model, batch)[0, len(prompt_ids) :].tolist()


@contextlib.contextmanager
def _two_versions(policy, ray, redis_url, model_path, tmp_path, first: int, seeds: tuple[int, int]):
    """Versions ``first`` (loaded by the shared engine) and ``first + 1`` (pushed, not loaded) of
    two perturbed models, yielded; afterwards the engine is back at the initial weights (as
    ``first + 2``) and the store empty (later tests push low version numbers, which high ones
    left committed would retire at once)."""
    a, b = perturbed_model(model_path, seed=seeds[0]), perturbed_model(model_path, seed=seeds[1])
    store = WeightStore(redis_url, "test-sync")
    pusher = make_pusher(store, shm_root=tmp_path, keep_last=3)
    try:
        pusher.push(a.state_dict(), first)
        ray.get(policy.update_weights.remote(first))
        pusher.push(b.state_dict(), first + 1)
        yield a, b
    finally:
        pusher.push(load_causal_lm(model_path).state_dict(), first + 2)
        ray.get(policy.update_weights.remote(first + 2))
        pusher.remove_all()
        store.clear_run()
        store.close()


@pytest.mark.slow
def test_an_update_queued_behind_requests_reaches_the_engine_between_them(
    policy, ray_session, redis_url, tiny_model_path, tmp_path
):
    """ahead=1: steps 0 and 1 are requested before version B's update, step 2 after it; each
    batch says the version that sampled it and its logprobs are that version's, per token."""
    with _two_versions(policy, ray_session, redis_url, tiny_model_path, tmp_path, 101, (1, 2)) as (a, b):
        prompts = [SimpleNamespace(prompt=f"{x}+{y}=") for x, y in ((3, 4), (12, 30))]
        replicas = PolicyReplicas([policy])
        rollouts = Rollouts(replicas, iter([prompts] * 3), lambda step, k: 1000 * step, n=4, steps=3, ahead=1)
        first = rollouts.take(0)  # requests steps 0 and 1, both ahead of the update
        assert rollouts.before_push() >= 0 and rollouts.update(102) == {}  # queued, not waited for
        second = rollouts.take(1)  # requests step 2, behind the update
        third = rollouts.take(2)
        rollouts.finish()
        assert rollouts.last_update["version"] == 102
        assert [r.generation.version for r in (first, second, third)] == [101, 101, 102]
        for rollout, model in ((second, a), (third, b)):
            generation = rollout.generation
            for prompt_ids, group in zip(generation.prompt_ids, generation.samples, strict=True):
                for sample in group:
                    want = _completion_logprobs(model, prompt_ids, sample.token_ids)
                    assert max(abs(x - y) for x, y in zip(sample.logprobs, want, strict=True)) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("in_flight", ["finish", "resample"])
def test_an_update_while_requests_are_in_flight_reaches_the_engine_between_them(
    policy, ray_session, redis_url, tiny_model_path, tmp_path, in_flight
):
    """A batch large enough to keep the engine busy, then an update to version B made once some
    of its prompts are done and the others are in the engine, then a second batch. ``finish``:
    the update waits and the whole first batch is version A's; ``resample``: the update aborts
    what is in flight, and those prompts are sampled again by B (and say so). Either way each
    prompt's logprobs are those of the version it names, and the batch asked for after the
    update is B's."""
    with _two_versions(policy, ray_session, redis_url, tiny_model_path, tmp_path, 201, (3, 4)) as (a, b):
        status = ray_session.get(policy.status.remote())
        seq, resampled = status["calls"], status["resampled"]
        prompts = [f"{x}+{y}=" for x in range(16) for y in range(32)]
        busy = policy.generate.remote(prompts, 8, 5, seq=seq)
        deadline = time.monotonic() + 60
        # Some prompts done, the others in flight: the update must leave the first version's and
        # (resample) abort every one of the others, wherever in vLLM each is.
        while not 0 < ray_session.get(policy.status.remote())["in_engine"] < len(prompts):
            assert time.monotonic() < deadline, "the batch never got partly done"
            time.sleep(0.005)
        update = policy.update_weights.remote(202, in_flight, seq=seq + 1)
        after = policy.generate.remote(prompts[:4], 2, 9, seq=seq + 2)
        first, stats, second = ray_session.get([busy, update, after])
        assert ray_session.get(policy.status.remote())["in_engine"] == 0
        assert stats["version"] == 202 and second.versions == [202] * 4
        now_resampled = ray_session.get(policy.status.remote())["resampled"] - resampled
        if in_flight == "finish":
            assert first.versions == [201] * len(prompts) and first.resampled == now_resampled == 0
            assert stats["in_flight_wait_s"] > 0
        else:
            assert (
                set(first.versions) == {201, 202} and first.versions.count(202) == first.resampled == now_resampled > 0
            )
        assert ray_session.get(policy.kept_sampled_logprobs.remote()) == [0]  # aborted ones' too
        checked = {201: 0, 202: 0}
        for prompt_ids, group, version in zip(first.prompt_ids, first.samples, first.versions, strict=True):
            if checked[version] >= 3:
                continue
            checked[version] += 1
            model = a if version == 201 else b
            for sample in group:
                want = _completion_logprobs(model, prompt_ids, sample.token_ids)
                assert max(abs(x - y) for x, y in zip(sample.logprobs, want, strict=True)) < 1e-3


@pytest.mark.slow
def test_samples_carry_the_prompt_tokens_and_texts_a_transformers_tokenizer_gives(policy, ray_session, tiny_model_path):
    """The actor tokenizes the prompts and decodes the samples itself (batched, not vLLM per
    request): its prompt ids are ``transformers``' tokenization, each text the decoding of its
    tokens without special tokens (a sample stopped on EOS ends with the EOS id, not in its
    text), and there is one logprob per sampled token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    prompts = [f"{x}-{y}=" for x in (5, 61, 99) for y in (0, 7)]
    generation = ray_session.get(policy.generate.remote(prompts, 4, 77))
    assert generation.prompt_ids == [tokenizer(p)["input_ids"] for p in prompts]
    finished = 0
    for group in generation.samples:
        assert len(group) == 4
        for sample in group:
            assert sample.text == tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            assert len(sample.logprobs) == len(sample.token_ids) and all(lp <= 0 for lp in sample.logprobs)
            if sample.finished:
                finished += 1
                assert sample.token_ids[-1] == tokenizer.eos_token_id
                assert tokenizer.eos_token not in sample.text
    assert finished > 0


@pytest.mark.slow
def test_sampling_beside_greedy_and_scoring_calls_leaves_no_logprobs_behind(policy, ray_session):
    """The worker keeps the logprobs of sampling requests (``actors.sampled_logprobs``): greedy
    and scoring requests batched with them are not kept, and each sample's logprobs are its own
    tokens', as vLLM scores them again as a prompt (whatever weights the engine holds now)."""
    prompts = [f"{x}+{y}=" for x in range(8) for y in range(8)]
    sampled = policy.generate.remote(prompts, 8, 5)
    greedy = policy.greedy.remote(prompts[:16])
    scored = policy.prompt_logprobs.remote([[2, 3, 4, 5]] * 8)
    generation, completions, _ = ray_session.get([sampled, greedy, scored])
    assert len(completions) == 16
    assert ray_session.get(policy.kept_sampled_logprobs.remote()) == [0]
    pairs = [(p, s) for p, group in zip(generation.prompt_ids, generation.samples, strict=True) for s in group]
    assert len(pairs) == 64 * 8
    pairs = pairs[::37]
    rescored = ray_session.get(policy.prompt_logprobs.remote([p + s.token_ids for p, s in pairs]))
    for (prompt_ids, sample), row in zip(pairs, rescored, strict=True):
        want = row[len(prompt_ids) :]
        assert max(abs(x - y) for x, y in zip(sample.logprobs, want, strict=True)) < 1e-4
