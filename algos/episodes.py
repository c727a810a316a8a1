"""Episodes (one sampled completion each) and their collation into padded training tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algos.grpo import group_advantages, kl_estimate


@dataclass
class Episode:
    prompt_ids: list[int]
    completion_ids: list[int]
    rollout_logprobs: list[float]  # what the policy (vLLM) reported for each completion token
    reward: float
    advantage: float
    policy_version: int
    ref_logprobs: list[float] | None = None


def collate(episodes: list[Episode], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``prompt + completion`` ids with per-token tensors aligned to them.

    ``completion_mask[b, t]`` is 1 where token ``t`` is a completion token, and
    ``rollout_logprobs`` / ``ref_logprobs`` hold that token's log-probability there (0 elsewhere).
    """
    if not episodes:
        raise ValueError("cannot collate an empty batch of episodes")
    width = max(len(e.prompt_ids) + len(e.completion_ids) for e in episodes)
    B = len(episodes)
    input_ids = torch.full((B, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, width), dtype=torch.long)
    completion_mask = torch.zeros((B, width), dtype=torch.float32)
    rollout = torch.zeros((B, width), dtype=torch.float32)
    ref = torch.zeros((B, width), dtype=torch.float32)
    has_ref = all(e.ref_logprobs is not None for e in episodes)
    for b, e in enumerate(episodes):
        p, c = len(e.prompt_ids), len(e.completion_ids)
        if len(e.rollout_logprobs) != c:
            raise ValueError(f"episode {b}: {c} completion tokens but {len(e.rollout_logprobs)} logprobs")
        input_ids[b, : p + c] = torch.tensor(e.prompt_ids + e.completion_ids)
        attention_mask[b, : p + c] = 1
        completion_mask[b, p : p + c] = 1
        rollout[b, p : p + c] = torch.tensor(e.rollout_logprobs)
        if has_ref:
            ref[b, p : p + c] = torch.tensor(e.ref_logprobs)
    out = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "completion_mask": completion_mask,
        "rollout_logprobs": rollout,
        "advantages": torch.tensor([e.advantage for e in episodes], dtype=torch.float32),
    }
    if has_ref:
        out["ref_logprobs"] = ref
    return out


def assign_advantages(
    episodes: list[Episode],
    group_size: int,
    normalize_std: bool = True,
    kl_reward_coef: float = 0.0,
    kl_estimator: str = "k3",
) -> list[float]:
    """Set each episode's group-normalised advantage; returns the rewards they were computed from.

    With ``kl_reward_coef > 0`` (KL as a reward penalty) the reward of each episode is first
    reduced by ``coef * sum_t KL_t``, the estimator applied to the rollout's and the reference's
    logprobs of its completion tokens.
    """
    rewards = []
    for e in episodes:
        r = e.reward
        if kl_reward_coef:
            if e.ref_logprobs is None:
                raise ValueError("KL as a reward penalty needs the reference logprobs of every episode")
            kl = kl_estimate(torch.tensor(e.rollout_logprobs), torch.tensor(e.ref_logprobs), kl_estimator)
            r -= kl_reward_coef * kl.sum().item()
        rewards.append(r)
    advantages = group_advantages(torch.tensor(rewards), group_size, normalize_std=normalize_std).tolist()
    for e, a in zip(episodes, advantages, strict=True):
        e.advantage = a
    return rewards
