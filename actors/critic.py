"""Critic rank actor: one rank of PPO's value model, sharded with FSDP2 like the trainer.

The model is the policy's architecture with a fresh scalar head (``actors.modeling.ValueModel``),
its body initialised from the policy's weights; it trains with its own optimizer and LR schedule
(``algo.critic``) on the algorithm's value loss, and saves into the run's checkpoints.
"""

from __future__ import annotations

import ray

from actors.fsdp_rank import FSDPRank
from actors.modeling import completion_values, load_value_model
from algos.episodes import Episode
from algos.train import Loss
from algos.train_config import TrainerConfig


@ray.remote(num_cpus=0)
class CriticRank(FSDPRank):
    def __init__(
        self,
        rank: int,
        world: int,
        model_path: str,
        config: TrainerConfig,
        loss: Loss,
        *,
        total_steps: int = 1,
        seed: int = 0,
    ) -> None:
        super().__init__(rank, world, config, loss, total_steps, seed)
        self.model = load_value_model(model_path)

    def values(self, episodes: list[Episode]) -> list[list[float]]:
        """Each episode's per-completion-token values under the current weights (all ranks run it)."""
        return completion_values(self.model, episodes, self.pad_id)
