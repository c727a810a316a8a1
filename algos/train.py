"""One GRPO gradient computation over a batch of episodes, in micro-batches, on one or many ranks.

No Ray, no vLLM: a ``transformers``-style causal LM in, accumulated gradients and metrics out.
Each micro-batch's loss is weighted by its share of the whole batch (tokens for ``token_mean``,
sequences for the per-sequence aggregations), so the accumulated gradient and the metrics equal
those of the whole batch at once, whatever the micro-batch size.

Data parallelism: when the batch is split over ranks, each rank passes the *whole* batch's totals
(``BatchTotals``) so that its shares are shares of the whole batch; summing the ranks' gradients
and metrics then gives the whole batch's. Every rank must run the same number of forward/backward
passes (FSDP2 gathers and reduces in each), so a rank with fewer episodes than micro-batches runs
an empty pass that contributes zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algos.episodes import Episode, collate
from algos.grpo import grpo_loss, masked_mean, token_entropy, token_logprobs

# Metrics that are means over completion tokens; they combine across micro-batches by token share.
TOKEN_MEAN_METRICS = ("kl", "clip_frac", "ratio_mean", "tis_weight_mean", "logprob_diff_mean", "entropy")
# Metrics that add up over micro-batches and ranks (the rest of the returned dict is a maximum).
SUMMED_METRICS = ("loss", *TOKEN_MEAN_METRICS)


@dataclass(frozen=True)
class BatchTotals:
    """The whole batch's completion tokens and sequences (over all ranks)."""

    tokens: int
    sequences: int

    @staticmethod
    def of(episodes: list[Episode]) -> BatchTotals:
        return BatchTotals(sum(len(e.completion_ids) for e in episodes), len(episodes))


def split_evenly(items: list, parts: int) -> list[list]:
    """``items`` in ``parts`` contiguous pieces whose sizes differ by at most one (some may be empty)."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + size + (i < extra)
        out.append(items[start:stop])
        start = stop
    return out


def grpo_backward(
    model: torch.nn.Module,
    episodes: list[Episode],
    pad_id: int,
    loss_options: dict | None = None,
    micro_batch_size: int | None = None,
    *,
    num_micro_batches: int | None = None,
    totals: BatchTotals | None = None,
    grad_scale: float = 1.0,
) -> dict[str, float]:
    """Accumulate the gradient of the GRPO loss over ``episodes`` into ``model``'s ``.grad``.

    ``loss_options`` are keyword arguments of ``grpo_loss``. ``micro_batch_size`` episodes per
    forward/backward, or exactly ``num_micro_batches`` passes (what data-parallel ranks use, so
    they all run the same number). ``totals`` are the whole batch's (default: these episodes').
    The backward pass is scaled by ``grad_scale`` (e.g. the world size, when the ranks' gradients
    are averaged rather than summed); the metrics are not. Also reports how far the rollout
    logprobs (the policy's) are from the model's logprobs of the same tokens, before any update.
    """
    loss_options = loss_options or {}
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    if totals is None:
        if not episodes:
            raise ValueError("grpo_backward needs at least one episode")
        totals = BatchTotals.of(episodes)
    if num_micro_batches is None:
        size = micro_batch_size or max(1, len(episodes))
        num_micro_batches = max(1, -(-len(episodes) // size))
    device = next(model.parameters()).device
    total_tokens = max(1, totals.tokens)
    per_sequence = loss_options.get("aggregation", "token_mean") != "token_mean"
    metrics = dict.fromkeys(SUMMED_METRICS, 0.0)
    metrics["logprob_diff_max"] = 0.0
    for chunk in split_evenly(episodes, num_micro_batches):
        if not chunk:
            _empty_pass(model, device)
            continue
        batch = {k: v.to(device) for k, v in collate(chunk, pad_id).items()}
        mask = batch["completion_mask"]
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
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
        share = len(chunk) / totals.sequences if per_sequence else token_share
        (loss * (share * grad_scale)).backward()
        with torch.no_grad():
            diff = (logprobs.detach() - batch["rollout_logprobs"]).abs()
            m["logprob_diff_mean"] = masked_mean(diff, mask).item()
            m["entropy"] = masked_mean(token_entropy(logits.detach()), mask).item()
            metrics["logprob_diff_max"] = max(metrics["logprob_diff_max"], (diff * mask).max().item())
        metrics["loss"] += m["loss"] * share
        for key in TOKEN_MEAN_METRICS:
            metrics[key] += m[key] * token_share
    metrics["train_tokens"] = totals.tokens
    return metrics


def _empty_pass(model: torch.nn.Module, device: torch.device) -> None:
    """A forward/backward that adds zero to every gradient but takes part in the ranks' collectives."""
    logits = model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device)).logits
    (logits.float().sum() * 0.0).backward()
