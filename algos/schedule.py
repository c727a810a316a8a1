"""Learning-rate schedules as pure multipliers of the base rate (for ``torch.optim.lr_scheduler.LambdaLR``)."""

from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "linear", "cosine")


def lr_multiplier(
    step: int, total_steps: int, warmup_steps: int = 0, schedule: str = "constant", min_ratio: float = 0.0
) -> float:
    """The factor on the base learning rate for optimizer step ``step`` (0-based).

    Linear warm-up from ``1 / (warmup_steps + 1)`` to 1 over the first ``warmup_steps`` steps, then
    ``constant`` (1), or a ``linear`` / ``cosine`` decay from 1 towards ``min_ratio``, which it
    would reach at step ``total_steps`` (as Hugging Face's schedules do, so the last step still
    trains).
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule {schedule!r} is not one of {list(LR_SCHEDULES)}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio={min_ratio} must be within [0, 1]")
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    decay_steps = total_steps - warmup_steps
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - warmup_steps) / decay_steps)
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape
