"""The policy's side of the loop in async mode: requests made steps ahead, weight updates queued
behind them (each batch sampled by the version loaded when it started, with that version's
logprobs), and the replay buffer's staleness bound."""

from __future__ import annotations

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


@pytest.mark.slow
def test_an_update_queued_behind_requests_reaches_the_engine_between_them(
    policy, ray_session, redis_url, tiny_model_path, tmp_path
):
    """ahead=1: steps 0 and 1 are requested before version B's update, step 2 after it; each
    batch says the version that sampled it and its logprobs are that version's, per token."""
    a, b = perturbed_model(tiny_model_path, seed=1), perturbed_model(tiny_model_path, seed=2)
    store = WeightStore(redis_url, "test-sync")
    pusher = make_pusher(store, shm_root=tmp_path, keep_last=3)
    try:
        pusher.push(a.state_dict(), 101)
        ray_session.get(policy.update_weights.remote(101))
        pusher.push(b.state_dict(), 102)
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
    finally:  # leave the shared engine and its store as the session found them (later tests
        # push low version numbers, which versions 101-103 left committed would retire at once)
        pusher.push(load_causal_lm(tiny_model_path).state_dict(), 103)
        ray_session.get(policy.update_weights.remote(103))
        pusher.remove_all()
        store.clear_run()
        store.close()
