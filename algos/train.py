"""One GRPO gradient computation over a batch of episodes, in micro-batches.

No Ray, no vLLM: a ``transformers``-style causal LM in, accumulated gradients and metrics out.
Each micro-batch's loss is weighted by its share of the batch (tokens for ``token_mean``,
sequences for the per-sequence aggregations), so the accumulated gradient and the metrics equal
those of the whole batch at once, whatever the micro-batch size.
"""

from __future__ import annotations

import torch

from algos.episodes import Episode, collate
from algos.grpo import grpo_loss, masked_mean, token_entropy, token_logprobs

# Metrics that are means over completion tokens; they combine across micro-batches by token share.
TOKEN_MEAN_METRICS = ("kl", "clip_frac", "ratio_mean", "tis_weight_mean", "logprob_diff_mean", "entropy")


def grpo_backward(
    model: torch.nn.Module,
    episodes: list[Episode],
    pad_id: int,
    loss_options: dict | None = None,
    micro_batch_size: int | None = None,
) -> dict[str, float]:
    """Accumulate the gradient of the GRPO loss over ``episodes`` into ``model``'s ``.grad``.

    ``loss_options`` are keyword arguments of ``grpo_loss``. Also reports how far the rollout
    logprobs (the policy's) are from the model's logprobs of the same tokens, before any update.
    """
    if not episodes:
        raise ValueError("grpo_backward needs at least one episode")
    loss_options = loss_options or {}
    size = micro_batch_size or len(episodes)
    if size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    total_tokens = max(1, sum(len(e.completion_ids) for e in episodes))
    per_sequence = loss_options.get("aggregation", "token_mean") != "token_mean"
    metrics = dict.fromkeys(("loss", *TOKEN_MEAN_METRICS), 0.0)
    metrics["logprob_diff_max"] = 0.0
    for start in range(0, len(episodes), size):
        chunk = episodes[start : start + size]
        batch = collate(chunk, pad_id)
        mask = batch["completion_mask"]
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logprobs = token_logprobs(logits, batch["input_ids"])
        loss, m = grpo_loss(
            logprobs,
            batch["rollout_logprobs"],
            batch["advantages"],
            mask,
            ref_logprobs=batch.get("ref_logprobs"),
            **loss_options,
        )
        token_share = mask.sum().item() / total_tokens
        share = len(chunk) / len(episodes) if per_sequence else token_share
        (loss * share).backward()
        with torch.no_grad():
            diff = (logprobs.detach() - batch["rollout_logprobs"]).abs()
            m["logprob_diff_mean"] = masked_mean(diff, mask).item()
            m["entropy"] = masked_mean(token_entropy(logits.detach()), mask).item()
            metrics["logprob_diff_max"] = max(metrics["logprob_diff_max"], (diff * mask).max().item())
        metrics["loss"] += m["loss"] * share
        for key in TOKEN_MEAN_METRICS:
            metrics[key] += m[key] * token_share
    metrics["train_tokens"] = total_tokens
    return metrics
