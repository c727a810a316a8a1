"""Trainer rank actor: one rank of the policy's FSDP2 trainer group (``actors/rank_groups.py``).

The training itself is ``actors/fsdp_rank.py``'s; this rank's model is the policy's
``transformers`` causal LM, trained with the algorithm's policy loss, and its weights go out: to
the weight store for the vLLM policy (``push_weights``) and to a Hugging Face directory.
"""

from __future__ import annotations

import ray
import torch

from actors.engine_activity import EngineActivity, IdleCoreThreads
from actors.fsdp_rank import DTYPES, FSDPRank
from actors.modeling import completion_logprobs, load_causal_lm
from algos.episodes import Episode
from algos.policy_loss import PolicyLoss
from algos.train_config import TrainerConfig
from checkpointing.hf_export import export_hf
from weightsync.config import WeightSyncConfig
from weightsync.push import WeightPusher
from weightsync.store import WeightStore


@ray.remote(num_cpus=0)
class TrainerRank(FSDPRank):
    def __init__(
        self,
        rank: int,
        world: int,
        model_path: str,
        redis_url: str,
        run: str,
        config: TrainerConfig,
        loss: PolicyLoss,
        weightsync: WeightSyncConfig,
        *,
        sync_dtype: str = "float32",
        total_steps: int = 1,
        seed: int = 0,
        engine_activity: str | None = None,
    ) -> None:
        """``sync_dtype``: the policy's dtype, which pushed weights are cast to.
        ``engine_activity``: where the policy engines on this host mark when they work; on CPU the
        rank trains with ``config.idle_policy_threads`` more threads while none does
        (``actors.engine_activity``). None: always ``config.torch_threads``."""
        super().__init__(rank, world, config, loss, total_steps, seed)
        self.engine_activity = engine_activity
        self.model_path = model_path
        self.model = load_causal_lm(model_path)
        self.pusher = WeightPusher(WeightStore(redis_url, run), weightsync, sync_dtype)

    def _sharded(self) -> None:
        if self.engine_activity and self.device is None and self.config.idle_policy_threads:
            IdleCoreThreads(
                self.model.model.layers,
                EngineActivity(self.engine_activity),
                self.config.torch_threads,
                self.config.idle_policy_threads,
            )
        # The shard files the first weight pushes write over, allocated while the policy starts.
        self.pusher.reserve(self._model_state_dict(offload=False))

    def logprobs(self, episodes: list[Episode]) -> list[list[float]]:
        """Each episode's completion-token logprobs under the current weights (all ranks run it)."""
        return completion_logprobs(self.model, episodes, self.pad_id, self.config.completion_passes)

    def _model_state_dict(self, offload: bool = True) -> dict[str, torch.Tensor]:
        """This rank's shards of the weights (copied to the host on GPU unless ``offload=False``)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        cpu_offload = offload and self.device is not None
        return get_model_state_dict(self.model, options=StateDictOptions(cpu_offload=cpu_offload))

    def push_weights(self, version: int) -> dict:
        """Write this rank's shard of the current weights as ``version``; rank 0 commits it.
        On a GPU the shards stay there: the pusher casts them there and DMAs them into the
        shard files (``weightsync.host_memory``)."""
        return self.pusher.push(self._model_state_dict(offload=False), version)

    def remove_pushed(self) -> None:
        self.pusher.remove_all()

    def export_hf(self, out_dir: str, dtype: str | None = None, max_shard_bytes: int = 2 << 30) -> str:
        """Write a consolidated Hugging Face model directory together with the other ranks."""
        out = export_hf(
            self._model_state_dict(),
            out_dir,
            self.model.config,
            self.model_path,
            dtype=DTYPES[dtype] if dtype else None,
            max_shard_bytes=max_shard_bytes,
        )
        return str(out)
