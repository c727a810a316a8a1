"""Reference actor: a frozen copy of the initial policy, for the KL term."""

from __future__ import annotations

import ray
import torch

from actors.modeling import completion_logprobs, load_causal_lm
from algos.episodes import Episode


@ray.remote(num_cpus=0)
class Reference:
    def __init__(self, model_path: str, torch_threads: int = 1) -> None:
        torch.set_num_threads(torch_threads)
        self.model = load_causal_lm(model_path).eval().requires_grad_(False)
        self.pad_id = self.model.config.pad_token_id or 0

    def logprobs(self, episodes: list[Episode]) -> list[list[float]]:
        """Each episode's completion-token log-probabilities under the reference model."""
        return completion_logprobs(self.model, episodes, self.pad_id)
