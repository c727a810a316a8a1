"""Several policy replicas driven as one: shares of a batch, updates to all, a replica that dies.

The replicas here are Ray actors with the policy's methods and no engine (the subject is how the
pool splits work and survives a process dying, which Ray does for real: ``ray.kill`` ends the
actor's process and Ray restarts it); whole runs with vLLM replicas are in test_grpo_app.py."""

from __future__ import annotations

import os
import time

import pytest

from actors.policy import Generation, Sample
from actors.policy_replicas import NoLivePolicyReplica, PolicyReplicas, merge_generations, share_bounds


def test_shares_are_contiguous_and_differ_by_at_most_one():
    assert share_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert share_bounds(2, 3) == [(0, 1), (1, 2)]  # no empty share
    assert share_bounds(8, 1) == [(0, 8)]


def test_merged_generations_keep_order_versions_and_the_longest_time():
    def gen(prompts, version, seconds):
        return Generation(
            [[p] for p in prompts],
            [[Sample([p], [-0.1], str(p), True)] for p in prompts],
            [version] * len(prompts),
            seconds,
        )

    merged = merge_generations([gen([1, 2], 5, 0.3), gen([3], 6, 0.7)])
    assert merged.prompt_ids == [[1], [2], [3]] and [g[0].text for g in merged.samples] == ["1", "2", "3"]
    assert merged.versions == [5, 5, 6] and merged.version == 5 and merged.seconds == 0.7


def _fake_replica_class(ray):
    @ray.remote(num_cpus=0)
    class FakeReplica:
        """The policy's calls, answered from memory: a sample's text says the prompt, the seed it
        was given and the version that 'sampled' it; each call may take ``delay_s``, and starting
        ``start_s`` (an engine's start: a restarted replica is not back at once). Numbered calls
        must come numbered 0, 1, 2, ... in this process (as ``Policy`` admits them)."""

        def __init__(self, delay_s: float = 0.0, start_s: float = 0.0) -> None:
            time.sleep(start_s)
            self.version, self.delay_s, self.calls, self.admitted = 0, delay_s, [], 0

        def _turn(self, seq):
            assert seq == self.admitted, f"call number {seq}, expected {self.admitted}"
            self.admitted += 1

        def generate(self, prompts, n, seed=None, seq=None):
            self._turn(seq)
            time.sleep(self.delay_s)
            self.calls.append(("generate", len(prompts)))
            samples = [
                [Sample([i], [0.0], f"{p}|{seed + i * n + j}|{self.version}", True) for j in range(n)]
                for i, p in enumerate(prompts)
            ]
            return Generation([[0] for _ in prompts], samples, [self.version] * len(prompts), self.delay_s)

        def greedy(self, prompts, seq=None):
            self._turn(seq)
            return [f"{p}@{self.version}" for p in prompts]

        def update_weights(self, version, in_flight="finish", seq=None):
            self._turn(seq)
            self.calls.append(("update", version, in_flight))
            self.version = version
            return {"version": version, "update_s": 0.01}

        def status(self):
            return {"replica": "fake", "version": self.version, "pid": os.getpid(), "calls": self.admitted}

        def log(self):
            return self.calls

        def close(self):
            pass

    return FakeReplica


def test_a_batch_is_split_with_the_seeds_one_engine_would_use_and_updates_reach_every_replica(ray_session):
    fake = _fake_replica_class(ray_session)
    pool = PolicyReplicas([fake.remote() for _ in range(3)], in_flight="resample")
    assert pool.update(4)["version"] == 4
    prompts = [f"p{i}" for i in range(7)]
    generation = pool.generation(pool.submit_generate(prompts, 2, seed=100))
    texts = [s.text for group in generation.samples for s in group]
    assert texts == [f"p{i}|{100 + 2 * i + j}|4" for i in range(7) for j in range(2)]
    assert [ray_session.get(r.log.remote()) for r in pool.handles] == [
        [("update", 4, "resample"), ("generate", 3)],
        [("update", 4, "resample"), ("generate", 2)],
        [("update", 4, "resample"), ("generate", 2)],
    ]
    assert pool.greedy(["a", "b"]) == ["a@4", "b@4"]


def test_a_replica_killed_mid_batch_has_its_share_sampled_elsewhere_and_loads_the_newest_version_when_back(
    ray_session,
):
    fake = _fake_replica_class(ray_session)
    handles = [fake.options(max_restarts=1).remote(0.5, start_s=3.0) for _ in range(2)]
    pool = PolicyReplicas(handles, ["a", "b"], max_restarts=1, probe_period_s=0.1)
    pool.update(1)
    pending = pool.submit_generate(["x", "y", "z", "w"], 1, seed=0)
    ray_session.kill(handles[1], no_restart=False)  # dies during its share ("z", "w")
    generation = pool.generation(pending)
    assert [g[0].text for g in generation.samples] == ["x|0|1", "y|1|1", "z|2|1", "w|3|1"]
    assert pool.failures == 1 and pool.live() == [0]

    # While it is down, version 2 goes to the live replica only; once back, the restarted replica
    # first loads version 2, then samples.
    assert pool.update(2)["version"] == 2
    deadline = time.monotonic() + 60
    while pool.live() != [0, 1]:
        assert time.monotonic() < deadline, "the killed replica did not come back"
        time.sleep(0.1)
    assert ray_session.get(handles[1].log.remote()) == [("update", 2, "finish")]  # a fresh process: nothing before
    generation = pool.generation(pool.submit_generate(["x", "y"], 1, seed=0))
    assert generation.versions == [2, 2] and [g[0].text for g in generation.samples] == ["x|0|2", "y|1|2"]

    # Beyond max_restarts it is left out; with none left the pool says so.
    ray_session.kill(handles[1], no_restart=False)
    ray_session.kill(handles[0], no_restart=True)
    with pytest.raises(NoLivePolicyReplica, match="every policy replica is left out"):
        pool.generation(pool.submit_generate(["x", "y"], 1, seed=0))


def test_async_rollouts_with_a_replica_killed_keep_each_batch_within_the_staleness_bound(ray_session):
    """ahead=1 over two replicas: steps 0 and 1 are requested before version 1's update; one
    replica dies with its share of step 1, which the other samples after the update it has queued
    (so that share says version 1, the rest of the step version 0); every later batch is version 1."""
    from types import SimpleNamespace

    from apps.grpo.rollouts import Rollouts

    fake = _fake_replica_class(ray_session)
    handles = [fake.options(max_restarts=1).remote(0.3, start_s=2.0) for _ in range(2)]
    pool = PolicyReplicas(handles, ["a", "b"], max_restarts=1, probe_period_s=0.1)
    batch = [SimpleNamespace(prompt=f"p{i}") for i in range(4)]
    rollouts = Rollouts(pool, iter([batch] * 3), lambda step, k: 100 * step, n=1, steps=3, ahead=1)
    assert rollouts.take(0).generation.versions == [0, 0, 0, 0]
    rollouts.before_push()
    rollouts.update(1)
    ray_session.kill(handles[1], no_restart=False)  # with its share of step 1 in flight or queued
    second = rollouts.take(1).generation
    assert second.versions == [0, 0, 1, 1] and pool.failures == 1
    assert [g[0].text for g in second.samples] == ["p0|100|0", "p1|101|0", "p2|102|1", "p3|103|1"]
    rollouts.before_push()
    assert rollouts.take(2).generation.versions == [1, 1, 1, 1]
    rollouts.finish()
    assert rollouts.last_update["version"] == 1
