"""Groups of FSDP2 rank actors driven as one: the policy's trainer and PPO's critic.

A batch is split into equal contiguous shares, one per rank, and every rank runs the same number
of micro-batches; the returned metrics are the whole batch's. Checkpoints are written by all
ranks into a folder that the controller publishes (an atomic rename) once every part of it is on
disk.
"""

from __future__ import annotations

import ray

from actors.critic import CriticRank
from actors.trainer import TrainerRank
from algos.episodes import Episode
from algos.policy_loss import PolicyLoss
from algos.train import BatchTotals, Loss, split_evenly
from algos.train_config import TrainerConfig
from weightsync.config import WeightSyncConfig


class RankGroup:
    def __init__(
        self, actor_class, config: TrainerConfig, *args, use_cuda: bool = False, actor_options: dict | None = None, **kw
    ) -> None:
        """``config.ranks`` actors of ``actor_class`` (one GPU each on CUDA), made with ``(rank,
        world, *args, **kw)``; ``actor_options``: Ray options for every rank (where to run it; a
        ``num_gpus`` there replaces the one GPU).
        ``start()`` forms the group."""
        world = config.ranks
        self.ranks = [
            actor_class.options(**{"num_gpus": 1 if use_cuda else 0, **(actor_options or {})}).remote(
                rank, world, *args, **kw
            )
            for rank in range(world)
        ]
        self.micro_batch_size = config.micro_batch_size

    def start(self) -> RankGroup:
        """Wait for every rank's model, then form the process group and shard the model."""
        address = ray.get(self.ranks[0].rendezvous_address.remote())
        ray.get([r.join.remote(address) for r in self.ranks])
        return self

    def _all(self, method: str, *args, **kwargs) -> list:
        return ray.get([getattr(r, method).remote(*args, **kwargs) for r in self.ranks])

    def submit_train_step(self, episodes: list[Episode]) -> list[ray.ObjectRef]:
        """Start one optimizer step over ``episodes`` on every rank; ``ray.get(refs)[0]`` are its metrics."""
        if not episodes:
            raise ValueError("a train step needs at least one episode")
        shares = split_evenly(episodes, len(self.ranks))
        largest = max(len(s) for s in shares)
        micro = -(-largest // self.micro_batch_size) if self.micro_batch_size else 1
        totals = BatchTotals.of(episodes)
        return [r.train_step.remote(s, totals, micro) for r, s in zip(self.ranks, shares, strict=True)]

    def train_step(self, episodes: list[Episode]) -> dict[str, float]:
        return ray.get(self.submit_train_step(episodes))[0]

    def full_state_dict(self) -> dict:
        return self._all("full_state_dict")[0]

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


class TrainerGroup(RankGroup):
    """The policy's trainer: ``TrainerRank`` actors."""

    def __init__(
        self,
        config: TrainerConfig,
        model_path: str,
        redis_url: str,
        run: str,
        *,
        loss: PolicyLoss,
        weightsync: WeightSyncConfig,
        sync_dtype: str = "float32",
        total_steps: int = 1,
        seed: int = 0,
        use_cuda: bool = False,
        actor_options: dict | None = None,
        engine_activity: str | None = None,
    ) -> None:
        super().__init__(
            TrainerRank,
            config,
            model_path,
            redis_url,
            run,
            config,
            loss,
            weightsync,
            sync_dtype=sync_dtype,
            total_steps=total_steps,
            seed=seed,
            use_cuda=use_cuda,
            actor_options=actor_options,
            engine_activity=engine_activity,
        )

    def logprobs(self, episodes: list[Episode]) -> list[list[float]]:
        return self._all("logprobs", episodes)[0]

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


class CriticGroup(RankGroup):
    """PPO's critic: ``CriticRank`` actors."""

    def __init__(
        self,
        config: TrainerConfig,
        model_path: str,
        *,
        loss: Loss,
        total_steps: int = 1,
        seed: int = 0,
        use_cuda: bool = False,
        actor_options: dict | None = None,
    ) -> None:
        super().__init__(
            CriticRank,
            config,
            model_path,
            config,
            loss,
            total_steps=total_steps,
            seed=seed,
            use_cuda=use_cuda,
            actor_options=actor_options,
        )

    def submit_values(self, episodes: list[Episode]) -> list[ray.ObjectRef]:
        """Start every rank on ``episodes``' values (FSDP2 needs all of them); ``ray.get(refs)[0]`` are the values."""
        return [r.values.remote(episodes) for r in self.ranks]

    def values(self, episodes: list[Episode]) -> list[list[float]]:
        return ray.get(self.submit_values(episodes))[0]
