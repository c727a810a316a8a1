"""GRPO math: group-normalised advantages, the k3 KL estimator and the clipped policy loss.

Pure tensor functions, no Ray or vLLM. Shapes: ``B`` sequences, ``T`` token positions; per-token
tensors are aligned so that position ``t`` holds the log-probability of token ``t`` of the
sequence, and ``mask`` is 1 exactly on completion tokens.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` within each group of ``group_size``.

    ``rewards`` is ``[num_groups * group_size]`` with each group's samples adjacent; ``std`` is the
    unbiased sample standard deviation. A group whose rewards are all equal gets zero advantages.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: GRPO needs at least 2 samples per prompt")
    grouped = rewards.view(-1, group_size).to(torch.float32)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True)
    return ((grouped - mean) / (std + eps)).view(-1)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): ``exp(ref - logp) - (ref - logp) - 1`` (>= 0)."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1 (token-mean over the whole batch)."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-ratio GRPO loss with an optional k3 KL penalty, token-mean over the batch.

    ``ratio_t = exp(logp_t - old_logp_t)``;
    ``L = -mean_t[min(ratio_t A, clip(ratio_t, 1 - eps, 1 + eps) A) - beta * k3_t]``,
    with the sequence's advantage ``A`` broadcast over its tokens. ``old_logprobs`` are those the
    rollout was sampled with. Returns the loss and detached metrics.
    """
    mask = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv
    objective = torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(logprobs)
    if kl_coef:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl = kl_k3(logprobs, ref_logprobs)
    loss = -masked_mean(objective - kl_coef * kl, mask)
    with torch.no_grad():
        metrics = {
            "loss": loss.item(),
            "kl": masked_mean(kl, mask).item(),
            "clip_frac": masked_mean((unclipped != clipped).to(mask.dtype), mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
        }
    return loss, metrics


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``out[b, t] = log softmax(logits[b, t - 1])[input_ids[b, t]]``, and 0 at ``t = 0``.

    ``logits`` is the causal LM output ``[B, T, V]`` for ``input_ids`` ``[B, T]``: position
    ``t - 1`` predicts token ``t``.
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))
