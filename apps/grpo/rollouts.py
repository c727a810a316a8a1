"""The policy's side of the loop: each step's batch of rollouts and the weight updates that follow.

``mode=sync`` (``ahead=0``): a step asks for its batch and waits for it; after training, the new
version is pushed and the loop waits for the policy to load it.

``mode=async`` (``ahead=d``, ``algo.max_staleness``): the batches of the next ``d`` steps are
requested before the current step trains, and a pushed version's update is queued without
waiting. Each policy replica's engine batches every request in flight (continuous batching) and
admits calls in the order they were made; a weight update reaches the engine between requests
(with ``policy.in_flight=finish`` a batch in flight finishes on the version that started it; with
``resample`` the update aborts it and the new version samples it again), and every prompt carries
the version that sampled it. The order of calls is: the batch of step ``k + d``, then the update
to version ``k + 1``, then the batch of step ``k + d + 1``, ... The batch trained at step ``k`` (by
the trainer at version ``k``) was sampled by version ``k - d`` or newer: the replay buffer checks
that bound. Before each push the loop waits until fewer than ``d`` updates are still queued,
so the policy is never more than ``d`` versions behind the store (which keeps ``keep_last >= d``).
With ``policy.replicas`` a batch is split among the replicas, each update goes to all of them
(``actors.policy_replicas``), and a replica that died and came back has loaded the newest version.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import ray

from actors.policy import Generation
from actors.policy_replicas import PendingCall, PolicyReplicas
from tasks.base import Problem

# A weight update's times in a step's metrics: the whole update, its reads and copies, vLLM's repacking.
UPDATE_TIMES = ("update_s", "update_copy_s", "update_repack_s")


@dataclass
class Rollout:
    problems: list[Problem]
    generation: Generation
    wait_s: float  # how long the loop waited for it (all of its generation time in sync mode)


class Rollouts:
    """Requests each step's batch from the ``policy`` replicas (``ahead`` steps early) and queues
    their updates.

    ``batches``: the task's train batches from the run's data cursor; ``seed_of(step, prompts)``:
    the sampling seed of a step's batch; ``n``: samples per prompt; ``steps``: the run's last step
    (nothing is requested beyond it).
    """

    def __init__(
        self,
        policy: PolicyReplicas,
        batches: Iterator[list[Problem]],
        seed_of: Callable[[int, int], int],
        n: int,
        steps: int,
        ahead: int,
    ) -> None:
        self.policy = policy
        self.batches = batches
        self.seed_of = seed_of
        self.n = n
        self.steps = steps
        self.ahead = ahead
        self._requested: deque[tuple[int, list[Problem], PendingCall]] = deque()
        self._updates: deque[list] = deque()  # each queued update's calls, one per replica
        self._next_step: int | None = None
        self.last_update: dict | None = None  # the result of the update that finished last

    def _request(self, step: int) -> None:
        problems = next(self.batches)
        pending = self.policy.submit_generate([p.prompt for p in problems], self.n, self.seed_of(step, len(problems)))
        self._requested.append((step, problems, pending))

    def take(self, step: int) -> Rollout:
        """Step ``step``'s batch, once generated; first requests the batches of the steps up to
        ``step + ahead`` that were not requested yet."""
        t = time.perf_counter()  # requests wait too when no replica is live (one restarting)
        if self._next_step is None:
            self._next_step = step
        while self._next_step <= min(step + self.ahead, self.steps - 1):
            self._request(self._next_step)
            self._next_step += 1
        first, problems, pending = self._requested.popleft()
        if first != step:
            raise RuntimeError(f"rollouts were requested for step {first}, the loop asked for step {step}")
        generation = self.policy.generation(pending)
        return Rollout(problems, generation, time.perf_counter() - t)

    def update(self, version: int) -> dict:
        """Ask the policy to load ``version`` (just pushed). Sync: waits and returns its times
        (``UPDATE_TIMES``). Async: queues it and returns the last finished update's, if any."""
        refs = self.policy.submit_update(version)
        if self.ahead == 0:
            self._finished(self.policy.wait_updates(refs))
        else:
            self._updates.append(refs)
            self._collect(wait=False)
        last = self.last_update or {}
        return {k: last[k] for k in UPDATE_TIMES if k in last}

    def _finished(self, result: dict | None) -> None:
        if result is not None:  # None: every replica it went to died (they load the newest when back)
            self.last_update = result

    def before_push(self) -> float:
        """Wait until fewer than ``ahead`` updates are queued (the policy then lags the version
        about to be pushed by at most ``ahead``); returns the seconds waited."""
        t = time.perf_counter()
        while self.ahead and len(self._updates) >= self.ahead:
            self._finished(self.policy.wait_updates(self._updates.popleft()))
        return time.perf_counter() - t

    def _collect(self, wait: bool) -> None:
        while self._updates:
            refs = self._updates[0]
            if not wait and refs and len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
                return
            self._finished(self.policy.wait_updates(self._updates.popleft()))

    def finish(self) -> None:
        """Wait for every queued update (the policy then holds the newest version)."""
        self._collect(wait=True)
