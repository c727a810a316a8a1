"""Replay buffer actor: holds episodes stamped with their policy version, refuses stale ones."""

from __future__ import annotations

import ray

from algos.episodes import Episode


@ray.remote(num_cpus=0)
class ReplayBuffer:
    def __init__(self, max_staleness: int = 0) -> None:
        """``max_staleness``: ``algo.max_staleness`` (checked with the config)."""
        self.max_staleness = max_staleness
        self.episodes: list[Episode] = []
        self.evicted = 0

    def add(self, episodes: list[Episode]) -> int:
        self.episodes.extend(episodes)
        return len(self.episodes)

    def take(self, current_version: int, max_episodes: int | None = None) -> list[Episode]:
        """Hand out (and remove) up to ``max_episodes`` episodes at most ``max_staleness`` old.

        Older episodes are dropped and counted in ``evicted``.
        """
        fresh = [e for e in self.episodes if current_version - e.policy_version <= self.max_staleness]
        self.evicted += len(self.episodes) - len(fresh)
        n = len(fresh) if max_episodes is None else max_episodes
        out, self.episodes = fresh[:n], fresh[n:]
        return out

    def stats(self) -> dict[str, int]:
        return {"size": len(self.episodes), "evicted": self.evicted}
