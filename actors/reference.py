"""Reference actor: a frozen copy of the initial policy, for the KL term."""

from __future__ import annotations

import ray
import torch

from actors.modeling import completion_logprobs, load_causal_lm
from algos.episodes import Episode


@ray.remote(num_cpus=0)
class Reference:
    def __init__(
        self,
        model_path: str,
        torch_threads: int = 1,
        device: str = "cpu",
        dtype: str = "float32",
        completion_passes: int = 1,
    ) -> None:
        """``device``: ``cpu``, or ``cuda`` in an actor given a GPU (``num_gpus=1``); ``dtype``:
        the weights' dtype there (the launcher passes the trainer's compute dtype on a GPU);
        ``completion_passes``: as the trainer's (``trainer.completion_passes``)."""
        torch.set_num_threads(torch_threads)
        self.completion_passes = completion_passes
        model = load_causal_lm(model_path, getattr(torch, dtype))
        self.model = model.to(device).eval().requires_grad_(False)
        self.pad_id = self.model.config.pad_token_id or 0

    def logprobs(self, episodes: list[Episode]) -> list[list[float]]:
        """Each episode's completion-token log-probabilities under the reference model."""
        return completion_logprobs(self.model, episodes, self.pad_id, self.completion_passes)

    def device(self) -> str:
        return str(next(self.model.parameters()).device)
