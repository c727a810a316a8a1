"""GRPO: group-normalised advantages, no critic.

Each prompt is sampled ``group_size`` times; an episode's advantage is its reward's distance
from its group's mean (divided by the group's std unless ``advantage_std_norm=false``, Dr.
GRPO), the same for every token of its completion. With ``kl_mode=reward`` each reward is first
reduced by ``kl_coef`` times the sum of the per-token KL to the reference model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algos.base import AlgoConfig
from algos.episodes import Episode
from algos.policy_loss import PolicyLoss, kl_estimate


@dataclass
class GRPOConfig(AlgoConfig):
    group_size: int
    advantage_std_norm: bool

    def rules(self) -> list[tuple[bool, str, str]]:
        return [
            (self.group_size >= 2, "group_size", "an integer >= 2 (GRPO compares samples within a group)"),
            *super().rules(),
        ]


def group_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6, normalize_std: bool = True
) -> torch.Tensor:
    """``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` within each group of ``group_size``.

    ``rewards`` is ``[num_groups * group_size]`` with each group's samples adjacent; ``std`` is the
    unbiased sample standard deviation. A group whose rewards are all equal gets zero advantages.
    ``normalize_std=False`` gives Dr. GRPO's ``A_i = r_i - mean(r_group)``.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: GRPO needs at least 2 samples per prompt")
    grouped = rewards.view(-1, group_size).to(torch.float32)
    mean = grouped.mean(dim=1, keepdim=True)
    if not normalize_std:
        return (grouped - mean).view(-1)
    std = grouped.std(dim=1, keepdim=True)
    return ((grouped - mean) / (std + eps)).view(-1)


def kl_shaped_rewards(episodes: list[Episode], coef: float, estimator: str) -> list[float]:
    """Each episode's reward less ``coef * sum_t KL_t`` (the estimator applied to the rollout's and
    the reference's logprobs of its completion tokens); the rewards themselves when ``coef`` is 0."""
    if not coef:
        return [e.reward for e in episodes]
    if any(e.ref_logprobs is None for e in episodes):
        raise ValueError("KL as a reward penalty needs the reference logprobs of every episode")
    return [
        e.reward
        - coef * kl_estimate(torch.tensor(e.rollout_logprobs), torch.tensor(e.ref_logprobs), estimator).sum().item()
        for e in episodes
    ]


class Algorithm:
    Config = GRPOConfig
    uses_critic = False

    def __init__(self, config: GRPOConfig, max_tokens: int) -> None:
        self.config = config
        self.max_tokens = max_tokens
        self.samples_per_prompt = config.group_size
        self.uses_reference = config.uses_reference

    def policy_loss(self) -> PolicyLoss:
        return self.config.policy_loss(self.max_tokens)

    def critic(self) -> None:
        return None

    def make_experience(self, episodes: list[Episode]) -> dict[str, float]:
        """Set each episode's advantages (its group advantage on every token); ``episodes`` come
        in groups of ``group_size`` samples of one prompt. No metrics of its own."""
        cfg = self.config
        rewards = kl_shaped_rewards(episodes, cfg.kl_reward_coef, cfg.kl_estimator)
        advantages = group_advantages(torch.tensor(rewards), cfg.group_size, normalize_std=cfg.advantage_std_norm)
        for e, a in zip(episodes, advantages.tolist(), strict=True):
            e.advantages = [a] * len(e.completion_ids)
        return {}
