"""Episodes (one sampled completion each) and their collation into padded training tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Per-completion-token lists an episode may carry, collated into [B, T] tensors of the same name.
TOKEN_FIELDS = ("rollout_logprobs", "advantages", "ref_logprobs", "values", "returns")


@dataclass
class Episode:
    prompt_ids: list[int]
    completion_ids: list[int]
    rollout_logprobs: list[float]  # what the policy (vLLM) reported for each completion token
    reward: float
    policy_version: int  # the weights version that sampled it
    # Set by the run and the algorithm, one value per completion token:
    advantages: list[float] | None = None
    ref_logprobs: list[float] | None = None  # the reference model's (when the algorithm has a KL term)
    values: list[float] | None = None  # the critic's when the episode was made (PPO)
    returns: list[float] | None = None  # the critic's targets (PPO)


def collate(episodes: list[Episode], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``prompt + completion`` ids with per-token tensors aligned to them.

    ``completion_mask[b, t]`` is 1 where token ``t`` is a completion token; each per-token field
    (``TOKEN_FIELDS``) that every episode has becomes a ``[B, T]`` tensor holding the token's
    value there and 0 elsewhere.
    """
    if not episodes:
        raise ValueError("cannot collate an empty batch of episodes")
    width = max(len(e.prompt_ids) + len(e.completion_ids) for e in episodes)
    B = len(episodes)
    input_ids = torch.full((B, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, width), dtype=torch.long)
    completion_mask = torch.zeros((B, width), dtype=torch.float32)
    fields = [f for f in TOKEN_FIELDS if all(getattr(e, f) is not None for e in episodes)]
    out = {f: torch.zeros((B, width), dtype=torch.float32) for f in fields}
    for b, e in enumerate(episodes):
        p, c = len(e.prompt_ids), len(e.completion_ids)
        input_ids[b, : p + c] = torch.tensor(e.prompt_ids + e.completion_ids)
        attention_mask[b, : p + c] = 1
        completion_mask[b, p : p + c] = 1
        for f in fields:
            values = getattr(e, f)
            if len(values) != c:
                raise ValueError(f"episode {b}: {c} completion tokens but {len(values)} {f}")
            out[f][b, p : p + c] = torch.tensor(values, dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask, **out}
