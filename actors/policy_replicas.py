"""Several vLLM policy engines (``policy.replicas``) driven as one, from the controller.

A batch of prompts is cut into contiguous shares, one per live replica; each share keeps the
seeds it would have in one engine (prompt ``i`` samples from ``seed + i * n``), so the split does
not change which random streams the prompts get. Every weight update goes to every live replica.
Each replica admits the calls made to it in the order they were made (they are numbered here,
``Policy``'s ``seq``), and an update reaches its engine between requests, so a share requested
before an update is sampled by the version before it (with ``policy.in_flight=resample`` the
update aborts what is in flight and it is sampled again after: by the new version), and says
so: a ``Generation`` carries each prompt's version.

A replica whose process dies (Ray's ``max_restarts``, ``policy.max_restarts``) is restarted by
Ray with its constructor's arguments: a fresh engine with the model's initial weights. Calls made
to it meanwhile fail at once (Ray does not queue them), and so do the ones it was running: its
shares go to a live replica instead, and it takes no work until it answers again. It then first
gets an update to the newest version pushed (``latest``), and only after that, in its queue,
any share: no sample from a restarted engine predates that update. A replica that died more
than ``max_restarts`` times, or whose engine did not start again, is left out; the run stops when
none is left.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
from ray.exceptions import ActorDiedError, RayActorError

from actors.policy import Completion, Generation


class NoLivePolicyReplica(RuntimeError):
    """Every replica died and Ray will not restart any of them (or none came back in time)."""


@dataclass
class _Replica:
    handle: ray.actor.ActorHandle
    name: str
    state: str = "live"  # live | restarting | dead
    epoch: int = 0  # times it came back; errors of calls made before that are old news
    deaths: int = 0
    probe: ray.ObjectRef | None = None  # a status call, while restarting
    probe_at: float = 0.0  # when the last probe was sent
    down_since: float = 0.0
    calls: int | None = None  # numbered calls made to its process (the next one's ``seq``); None: ask it

    def call(self, method: str, *args, **kwargs) -> ray.ObjectRef:
        """Call ``method`` with the next number: the replica admits it after every earlier one."""
        if self.calls is None:  # an actor others may have called before (waits for its engine)
            try:
                self.calls = ray.get(self.handle.status.remote())["calls"]
            except RayActorError:
                self.calls = 0  # dead: this call fails too, and is dealt with as any call to it
        ref = getattr(self.handle, method).remote(*args, **kwargs, seq=self.calls)
        self.calls += 1
        return ref


@dataclass
class _Share:
    start: int  # index of its first item in the whole batch
    items: list
    replica: int
    epoch: int  # the replica's when asked
    ref: ray.ObjectRef


@dataclass
class PendingCall:
    """A batch in flight: its shares, and how to ask a replica for one (to send it elsewhere)."""

    shares: list[_Share]
    call: Callable[[_Replica, int, list], ray.ObjectRef] = field(repr=False)


def share_bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """``total`` items cut into ``parts`` contiguous shares whose sizes differ by at most one
    (the first ones larger); empty shares are left out."""
    base, extra = divmod(total, parts)
    bounds, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        if size:
            bounds.append((start, start + size))
        start += size
    return bounds


def merge_generations(parts: list[Generation]) -> Generation:
    """The shares' generations as one, in order (engines sampled side by side: ``seconds`` is the
    longest share's)."""
    return Generation(
        [ids for g in parts for ids in g.prompt_ids],
        [group for g in parts for group in g.samples],
        [v for g in parts for v in g.versions],
        max(g.seconds for g in parts),
        sum(g.resampled for g in parts),
    )


class PolicyReplicas:
    """``handles``: the replicas' actors (``actors.policy.Policy``, started with Ray's
    ``max_restarts``, the same number here), ``names``: theirs, for messages.
    ``restart_timeout_s``: how long a replica may take to come back. ``in_flight``: what an
    update does to the requests in flight (``policy.in_flight``: ``finish`` or ``resample``)."""

    def __init__(
        self,
        handles: list,
        names: list[str] | None = None,
        max_restarts: int = 0,
        probe_period_s: float = 1.0,
        restart_timeout_s: float = 900.0,
        in_flight: str = "finish",
    ) -> None:
        names = names or [f"policy-{i}" for i in range(len(handles))]
        self.replicas = [_Replica(h, n) for h, n in zip(handles, names, strict=True)]
        self.max_restarts = max_restarts
        self.probe_period_s = probe_period_s
        self.restart_timeout_s = restart_timeout_s
        self.in_flight = in_flight
        self.latest: int | None = None  # the newest version the replicas were asked to load
        self.failures = 0  # replica deaths seen
        self._updates: dict[ray.ObjectRef, tuple[int, int]] = {}  # update in flight -> (replica, epoch)

    @property
    def handles(self) -> list:
        return [r.handle for r in self.replicas]

    def live(self) -> list[int]:
        """Indices of the replicas that take work now (after looking at the restarting ones)."""
        self._poll_restarting()
        return [i for i, r in enumerate(self.replicas) if r.state == "live"]

    # -- sampling ----------------------------------------------------------------------------

    def submit_generate(self, prompts: list[str], n: int, seed: int | None) -> PendingCall:
        """Request ``n`` samples of each prompt, split among the live replicas; ``result`` waits."""

        def call(replica: _Replica, start: int, items: list) -> ray.ObjectRef:
            return replica.call("generate", items, n, None if seed is None else seed + start * n)

        return self._submit(prompts, call)

    def generation(self, pending: PendingCall) -> Generation:
        return merge_generations(self._results(pending))

    def greedy(self, prompts: list[str]) -> list[Completion]:
        """Greedy completions of ``prompts``, split among the live replicas."""
        pending = self._submit(prompts, lambda replica, start, items: replica.call("greedy", items))
        return [c for part in self._results(pending) for c in part]

    def _submit(self, items: list, call) -> PendingCall:
        live = self._wait_for_live()
        shares = []
        for k, (a, b) in enumerate(share_bounds(len(items), len(live))):
            replica = self.replicas[live[k]]
            shares.append(_Share(a, items[a:b], live[k], replica.epoch, call(replica, a, items[a:b])))
        return PendingCall(shares, call)

    def _results(self, pending: PendingCall) -> list:
        """Each share's result in order; a share whose replica died is asked of a live one."""
        results = []
        for share in pending.shares:
            while True:
                try:
                    results.append(ray.get(share.ref))
                    break
                except RayActorError as err:
                    self._down(share.replica, share.epoch, err)
                    live = self._wait_for_live()
                    share.replica = live[share.start % len(live)]
                    replica = self.replicas[share.replica]
                    share.epoch, share.ref = replica.epoch, pending.call(replica, share.start, share.items)
        return results

    # -- weight updates ----------------------------------------------------------------------

    def submit_update(self, version: int) -> list[ray.ObjectRef]:
        """Ask every live replica to load ``version`` (committed in the store), behind the
        calls already queued on it."""
        self.latest = version
        refs = []
        for i in self.live():
            ref = self.replicas[i].call("update_weights", version, self.in_flight)
            self._updates[ref] = (i, self.replicas[i].epoch)
            refs.append(ref)
        return refs

    def wait_updates(self, refs: list[ray.ObjectRef]) -> dict | None:
        """Wait for ``refs`` (from ``submit_update``); the slowest replica's result (its
        ``update_s``), or None when every one of them died meanwhile (a restarted replica loads
        the newest version before it samples again). A failed update raises."""
        results = []
        for ref in refs:
            try:
                results.append(ray.get(ref))
            except RayActorError as err:
                self._down(*self._updates[ref], err)
            finally:
                self._updates.pop(ref, None)
        return max(results, key=lambda r: r["update_s"]) if results else None

    def update(self, version: int) -> dict | None:
        """Load ``version`` into every live replica and wait."""
        return self.wait_updates(self.submit_update(version))

    # -- replicas that die ---------------------------------------------------------------------

    def _down(self, index: int, epoch: int, err: RayActorError) -> None:
        """A call made to replica ``index`` (in its ``epoch``) failed because its process died."""
        replica = self.replicas[index]
        if replica.state != "live" or epoch != replica.epoch:
            return  # the same death seen again, or one it has come back from
        self.failures += 1
        replica.deaths += 1
        replica.down_since, replica.probe = time.monotonic(), None
        if replica.deaths > self.max_restarts:
            replica.state = "dead"
            print(
                f"policy replica {replica.name} died ({type(err).__name__}) for the {replica.deaths}th time, "
                f"beyond policy.max_restarts={self.max_restarts}: left out of the run",
                flush=True,
            )
            return
        replica.state = "restarting"
        print(
            f"policy replica {replica.name} died ({type(err).__name__}); Ray restarts it, its work goes to the others",
            flush=True,
        )

    def _left_out(self, index: int, why: str) -> None:
        self.replicas[index].state, self.replicas[index].probe = "dead", None
        print(f"policy replica {self.replicas[index].name} {why}: left out of the run", flush=True)

    def _poll_restarting(self) -> None:
        """A restarting replica that answers gets the newest version before any other work."""
        now = time.monotonic()
        for i, replica in enumerate(self.replicas):
            if replica.state != "restarting":
                continue
            if replica.probe is None:
                if now - replica.probe_at >= self.probe_period_s:
                    replica.probe, replica.probe_at = replica.handle.status.remote(), now
                continue
            if not ray.wait([replica.probe], timeout=0)[0]:
                continue
            try:
                status = ray.get(replica.probe)
            except RayActorError as err:  # not back yet, or Ray will not restart it
                replica.probe = None
                if getattr(err, "actor_init_failed", False):
                    self._left_out(i, f"did not start again: {str(err).strip().splitlines()[-1][:300]}")
                elif isinstance(err, ActorDiedError):  # (restarting is ActorUnavailableError)
                    self._left_out(i, "is dead and Ray will not restart it")
                elif now - replica.down_since > self.restart_timeout_s:
                    self._left_out(i, f"did not come back within {self.restart_timeout_s:.0f} s")
                continue
            replica.probe, replica.calls = None, status["calls"]  # a new process counts from 0
            if self.latest is not None and status["version"] != self.latest:
                try:
                    ray.get(replica.call("update_weights", self.latest, self.in_flight))
                except RayActorError:  # died again before taking any work: still restarting
                    continue
            replica.state, replica.epoch = "live", replica.epoch + 1
            print(
                f"policy replica {replica.name} is back after {now - replica.down_since:.0f} s, "
                f"at version {self.latest if self.latest is not None else status['version']}",
                flush=True,
            )

    def _wait_for_live(self) -> list[int]:
        """The live replicas, waiting for a restarting one when none is live."""
        while True:
            live = self.live()
            if live:
                return live
            if all(r.state == "dead" for r in self.replicas):
                raise NoLivePolicyReplica(
                    f"every policy replica is left out (died more than policy.max_restarts={self.max_restarts} "
                    f"times, or did not start again); {self.failures} deaths in this run"
                )
            time.sleep(min(0.2, self.probe_period_s))

    def close(self, timeout_s: float = 60) -> None:
        """Stop every replica's engine (those alive)."""
        refs = [r.handle.close.remote() for r in self.replicas if r.state != "dead"]
        for ref in refs:
            with contextlib.suppress(RayActorError):  # died since: nothing of its engine to stop
                ray.get(ref, timeout=timeout_s)
