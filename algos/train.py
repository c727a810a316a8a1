"""One gradient computation over a batch of episodes, in micro-batches, on one or many ranks,
for whatever loss the algorithm gives (the policy's, a critic's).

No Ray, no vLLM: a model in, accumulated gradients and metrics out. Each micro-batch's loss is
weighted by its share of the whole batch (tokens, or sequences for per-sequence aggregations),
so the accumulated gradient and the metrics equal those of the whole batch at once, whatever the
micro-batch size.

Data parallelism: when the batch is split over ranks, each rank passes the *whole* batch's totals
(``BatchTotals``) so that its shares are shares of the whole batch; summing the ranks' gradients
and metrics then gives the whole batch's. Every rank must run the same number of forward/backward
passes (FSDP2 gathers and reduces in each), so a rank with fewer episodes than micro-batches runs
an empty pass that contributes zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from algos.episodes import Episode, collate
from algos.shared_prefix import zero_pass


class Loss(Protocol):
    """What ``backward`` minimises: ``loss(model, batch) -> (scalar, metrics)`` over a collated
    micro-batch (``algos.episodes.collate``, on the model's device).

    ``metrics`` holds ``"loss"``, every name in ``metric_names`` (means over the micro-batch's
    completion tokens) and in ``max_metric_names`` (maxima). ``per_sequence``: the loss is a mean
    over sequences rather than tokens (its micro-batches are weighted by sequence counts).
    ``forward_passes`` (optional, default 1): the forward passes it makes per micro-batch on
    data-parallel ranks, which a rank with no episodes left for a micro-batch makes too.
    """

    metric_names: tuple[str, ...]
    max_metric_names: tuple[str, ...]
    per_sequence: bool

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]: ...


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


def summed_metric_names(loss: Loss) -> tuple[str, ...]:
    """The metrics that add up over micro-batches and ranks (the rest are maxima)."""
    return ("loss", *loss.metric_names)


def backward(
    model: torch.nn.Module,
    episodes: list[Episode],
    pad_id: int,
    loss: Loss,
    micro_batch_size: int | None = None,
    *,
    num_micro_batches: int | None = None,
    totals: BatchTotals | None = None,
    grad_scale: float = 1.0,
) -> dict[str, float]:
    """Accumulate the gradient of ``loss`` over ``episodes`` into ``model``'s ``.grad``.

    ``micro_batch_size`` episodes per forward/backward, or exactly ``num_micro_batches`` passes
    (what data-parallel ranks use, so they all run the same number). ``totals`` are the whole
    batch's (default: these episodes'). The backward pass is scaled by ``grad_scale`` (e.g. the
    world size, when the ranks' gradients are averaged rather than summed); the metrics are not.
    """
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    if totals is None:
        if not episodes:
            raise ValueError("backward needs at least one episode")
        totals = BatchTotals.of(episodes)
    if num_micro_batches is None:
        size = micro_batch_size or max(1, len(episodes))
        num_micro_batches = max(1, -(-len(episodes) // size))
    device = next(model.parameters()).device
    total_tokens = max(1, totals.tokens)
    metrics = dict.fromkeys((*summed_metric_names(loss), *loss.max_metric_names), 0.0)
    for chunk in split_evenly(episodes, num_micro_batches):
        if not chunk:
            _empty_pass(model, device, getattr(loss, "forward_passes", 1))
            continue
        batch = {k: v.to(device) for k, v in collate(chunk, pad_id).items()}
        value, m = loss(model, batch)
        token_share = batch["completion_mask"].sum().item() / total_tokens
        share = len(chunk) / totals.sequences if loss.per_sequence else token_share
        (value * (share * grad_scale)).backward()
        metrics["loss"] += m["loss"] * share
        for key in loss.metric_names:
            metrics[key] += m[key] * token_share
        for key in loss.max_metric_names:
            metrics[key] = max(metrics[key], m[key])
    metrics["train_tokens"] = totals.tokens
    return metrics


def _empty_pass(model: torch.nn.Module, device: torch.device, passes: int = 1) -> None:
    """``passes`` forward passes (as many as the loss makes per micro-batch: ``forward_passes``)
    and a backward pass that add zero to every gradient but take part in the ranks' collectives."""
    sum(zero_pass(model, device) for _ in range(passes)).backward()
