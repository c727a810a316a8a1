"""Reference actor: a frozen copy of the initial policy, for the KL term."""

from __future__ import annotations

import ray
import torch

from actors.modeling import load_causal_lm, sequence_token_logprobs
from algos.episodes import Episode, collate


@ray.remote(num_cpus=0)
class Reference:
    def __init__(self, model_path: str, torch_threads: int = 1) -> None:
        torch.set_num_threads(torch_threads)
        self.model = load_causal_lm(model_path).eval().requires_grad_(False)
        self.pad_id = self.model.config.pad_token_id or 0

    @torch.no_grad()
    def logprobs(self, episodes: list[Episode]) -> list[list[float]]:
        """Each episode's completion-token log-probabilities under the reference model."""
        batch = collate(episodes, self.pad_id)
        logp = sequence_token_logprobs(self.model, batch)
        return [
            logp[b, len(e.prompt_ids) : len(e.prompt_ids) + len(e.completion_ids)].tolist()
            for b, e in enumerate(episodes)
        ]
