"""The trainer group: ``ranks`` ``TrainerRank`` actors that form one FSDP2 process group.

Used by the controller like a single trainer. A batch is split into equal contiguous shares,
one per rank, and every rank runs the same number of micro-batches; the returned metrics are the
whole batch's. Checkpoints are written by all ranks into a temporary folder and published (an
atomic rename) by ``publish_checkpoint`` once every rank's shards and the controller's own state
are on disk.
"""

from __future__ import annotations

import ray

from actors.trainer import TrainerRank
from algos.episodes import Episode
from algos.train import BatchTotals, split_evenly


class TrainerGroup:
    def __init__(
        self,
        ranks: int,
        model_path: str,
        redis_url: str,
        run: str,
        *,
        use_cuda: bool = False,
        actor_options: dict | None = None,
        micro_batch_size: int | None = None,
        **options,
    ):
        """``options`` are ``TrainerRank``'s keyword arguments; ``start()`` forms the group.
        ``actor_options``: Ray options for every rank (where to run it)."""
        if ranks < 1:
            raise ValueError(f"trainer.ranks={ranks} must be >= 1")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"trainer.micro_batch_size={micro_batch_size} must be >= 1")
        self.ranks = [
            TrainerRank.options(num_gpus=1 if use_cuda else 0, **(actor_options or {})).remote(
                rank, ranks, model_path, redis_url, run, **options
            )
            for rank in range(ranks)
        ]
        self.micro_batch_size = micro_batch_size

    def start(self) -> TrainerGroup:
        """Wait for every rank's model, then form the process group and shard the model."""
        address = ray.get(self.ranks[0].rendezvous_address.remote())
        ray.get([r.join.remote(address) for r in self.ranks])
        return self

    def _all(self, method: str, *args, **kwargs) -> list:
        return ray.get([getattr(r, method).remote(*args, **kwargs) for r in self.ranks])

    def train_step(self, episodes: list[Episode]) -> dict[str, float]:
        if not episodes:
            raise ValueError("train_step needs at least one episode")
        shares = split_evenly(episodes, len(self.ranks))
        largest = max(len(s) for s in shares)
        micro = -(-largest // self.micro_batch_size) if self.micro_batch_size else 1
        totals = BatchTotals.of(episodes)
        results = ray.get([r.train_step.remote(s, totals, micro) for r, s in zip(self.ranks, shares, strict=True)])
        return results[0]

    def logprobs(self, episodes: list[Episode]) -> list[list[float]]:
        return self._all("logprobs", episodes)[0]

    def full_state_dict(self) -> dict:
        return self._all("full_state_dict")[0]

    def push_weights(self, version: int) -> dict:
        """Push from every rank: the slowest rank's time, the bytes of all ranks."""
        stats = self._all("push_weights", version)
        return {
            "push_s": max(s["push_s"] for s in stats),
            "bytes_written": sum(s["bytes_written"] for s in stats),
            "bytes_reused": sum(s["bytes_reused"] for s in stats),
            "ranks_wrote_over_spare": sum(s["wrote_over_spare"] for s in stats),
            "dropped_versions": stats[0]["dropped_versions"],
        }

    def export_hf(self, out_dir: str, dtype: str | None = None, max_shard_bytes: int = 2 << 30) -> str:
        return self._all("export_hf", out_dir, dtype, max_shard_bytes)[0]

    def save_checkpoint(self, path: str, async_save: bool = False) -> None:
        self._all("save_checkpoint", path, async_save)

    def checkpoint_written(self) -> bool:
        return all(self._all("checkpoint_written"))

    def wait_for_checkpoint(self) -> None:
        self._all("wait_for_checkpoint")

    def load_checkpoint(self, path: str) -> None:
        self._all("load_checkpoint", path)

    def close(self) -> None:
        self._all("close")
