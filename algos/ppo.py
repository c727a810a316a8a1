"""PPO with a learned critic: token-level values, GAE, whitened advantages, a clipped value loss.

Each completion token ``t`` is an action taken in the state "prompt + completion tokens before
``t``"; the critic's value ``V_t`` of that state comes from the same position of a value model as
the logits that predict token ``t`` (``token_values``). The task's reward arrives on the last
token; with ``kl_mode=reward`` every token's reward is also lowered by ``kl_coef * KL_t`` to the
reference model. GAE then gives per-token advantages and the critic's targets (returns).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algos.base import AlgoConfig
from algos.episodes import Episode
from algos.policy_loss import PolicyLoss, kl_estimate, masked_mean
from algos.train_config import TrainerConfig


@dataclass
class PPOConfig(AlgoConfig):
    samples_per_prompt: int
    gamma: float
    lam: float
    whiten_advantages: bool
    value_clip: float | None
    critic: TrainerConfig

    def rules(self) -> list[tuple[bool, str, str]]:
        return [
            (self.samples_per_prompt >= 1, "samples_per_prompt", "an integer >= 1"),
            (0 < self.gamma <= 1, "gamma", "a number within (0, 1]"),
            (0 <= self.lam <= 1, "lam", "a number within [0, 1]"),
            (self.value_clip is None or self.value_clip > 0, "value_clip", "null (off) or a number > 0"),
            *super().rules(),
        ]


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's masked tokens; ``(advantages, returns)``.

    ``rewards``, ``values``, ``mask``: ``[B, T]``; a row's tokens are its positions where ``mask``
    is 1 (one contiguous run: prompt and padding positions around it are ignored). With the row's
    tokens ``t = 0 .. L-1`` and ``V_L = 0`` (the episode ends after its last token):
    ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = sum_k (gamma lam)^k delta_{t+k}``,
    ``R_t = A_t + V_t``. Both outputs are 0 off the mask.
    """
    mask = mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = advantage * m
        # Off the mask (padding after the row's tokens) the carried values stay what they were.
        next_value = m * values[:, t] + (1 - m) * next_value
        next_advantage = m * advantage + (1 - m) * next_advantage
    return advantages, (advantages + values) * mask


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` with the mean and (population) std over the masked entries; 0 off the mask."""
    mask = mask.to(values.dtype)
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    return (values - mean) / (var.sqrt() + eps) * mask


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the masked entries: 1 for a perfect critic, 0 for one
    no better than a constant, negative for a worse one (0 when the returns do not vary)."""
    mask = mask.to(values.dtype)
    var_returns = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    error = returns - values
    var_error = masked_mean((error - masked_mean(error, mask)) ** 2, mask)
    return 0.0 if var_returns.item() == 0 else (1 - var_error / var_returns).item()


def token_rewards(episodes: list[Episode], kl_coef: float, estimator: str) -> list[list[float]]:
    """Each completion token's reward: the task's reward on the last token, and, with ``kl_coef``,
    ``-kl_coef * KL_t`` (the estimator on the rollout's and the reference's logprobs) on every one."""
    out = []
    for e in episodes:
        rewards = torch.zeros(len(e.completion_ids))
        if kl_coef:
            if e.ref_logprobs is None:
                raise ValueError("KL as a reward penalty needs the reference logprobs of every episode")
            rewards -= kl_coef * kl_estimate(torch.tensor(e.rollout_logprobs), torch.tensor(e.ref_logprobs), estimator)
        if len(rewards):
            rewards[-1] += e.reward
        out.append(rewards.tolist())
    return out


def padded(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged rows as a left-aligned ``[B, L]`` tensor and its mask."""
    width = max((len(r) for r in rows), default=0)
    out, mask = torch.zeros(len(rows), width), torch.zeros(len(rows), width)
    for b, r in enumerate(rows):
        out[b, : len(r)] = torch.tensor(r, dtype=torch.float32)
        mask[b, : len(r)] = 1
    return out, mask


def token_values(values: torch.Tensor) -> torch.Tensor:
    """A value model's per-position outputs ``[B, T]`` aligned like ``token_logprobs``: the value
    of the state before token ``t`` is the output at ``t - 1`` (0 at ``t = 0``)."""
    return torch.nn.functional.pad(values[:, :-1], (1, 0))


@dataclass(frozen=True)
class ValueLoss:
    """The critic's loss for ``algos.train.backward``: ``0.5 (V_t - R_t)^2`` per completion token,
    token-mean; with ``clip``, PPO's clipped form ``0.5 max((V_t - R_t)^2, (V_clip_t - R_t)^2)``,
    ``V_clip_t = V_old_t + clamp(V_t - V_old_t, -clip, clip)`` (``V_old``: the values the episode
    was made with). The model maps ``input_ids`` / ``attention_mask`` to per-position values."""

    clip: float | None

    metric_names = ("value_clip_frac", "value_mean")
    max_metric_names = ()
    per_sequence = False

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        if "returns" not in batch or "values" not in batch:
            raise ValueError("the value loss needs every episode's values and returns (set by PPO)")
        mask = batch["completion_mask"]
        values = token_values(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).float())
        returns, old = batch["returns"], batch["values"]
        loss_tokens = (values - returns) ** 2
        clipped_tokens, used_clipped = loss_tokens, torch.zeros_like(mask, dtype=torch.bool)
        if self.clip is not None:
            # Only a value outside old +- clip is clipped: inside, old + (V - old) can differ from V
            # by a rounding, and a bare max would count (and use) that as clipped.
            outside = (values - old).abs() > self.clip
            clipped_loss = (old + torch.clamp(values - old, -self.clip, self.clip) - returns) ** 2
            used_clipped = outside & (clipped_loss > loss_tokens)
            clipped_tokens = torch.where(used_clipped, clipped_loss, loss_tokens)
        loss = 0.5 * masked_mean(clipped_tokens, mask)
        with torch.no_grad():
            metrics = {
                "loss": loss.item(),
                "value_clip_frac": masked_mean(used_clipped.to(mask.dtype), mask).item(),
                "value_mean": masked_mean(values, mask).item(),
            }
        return loss, metrics


class Algorithm:
    Config = PPOConfig
    uses_critic = True

    def __init__(self, config: PPOConfig, max_tokens: int) -> None:
        self.config = config
        self.max_tokens = max_tokens
        self.samples_per_prompt = config.samples_per_prompt
        self.uses_reference = config.uses_reference

    def policy_loss(self) -> PolicyLoss:
        return self.config.policy_loss(self.max_tokens)

    def critic(self) -> tuple[TrainerConfig, ValueLoss]:
        return self.config.critic, ValueLoss(self.config.value_clip)

    def make_experience(self, episodes: list[Episode]) -> dict[str, float]:
        """Set each episode's advantages and returns from its token rewards and the critic's
        ``values`` (which the run set); advantages whitened over the batch's tokens when asked."""
        cfg = self.config
        if any(e.values is None for e in episodes):
            raise ValueError("PPO needs the critic's values of every episode")
        rewards, mask = padded(token_rewards(episodes, cfg.kl_reward_coef, cfg.kl_estimator))
        values, _ = padded([e.values for e in episodes])
        advantages, returns = gae(rewards, values, mask, cfg.gamma, cfg.lam)
        metrics = {
            "advantage_mean": masked_mean(advantages, mask).item(),
            "advantage_std": masked_mean((advantages - masked_mean(advantages, mask)) ** 2, mask).sqrt().item(),
            "explained_variance": explained_variance(values, returns, mask),
            "return_mean": masked_mean(returns, mask).item(),
        }
        if cfg.whiten_advantages:
            advantages = whiten(advantages, mask)
        for b, e in enumerate(episodes):
            n = len(e.completion_ids)
            e.advantages = advantages[b, :n].tolist()
            e.returns = returns[b, :n].tolist()
        return metrics
