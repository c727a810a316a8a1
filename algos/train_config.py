"""The settings of an FSDP2-sharded model trained with AdamW: the policy's trainer (the
``trainer`` config group) and a critic (PPO's ``algo.critic``) each have one."""

from __future__ import annotations

from dataclasses import dataclass

from algos.schedule import LR_SCHEDULES

TRAIN_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class TrainerConfig:
    ranks: int  # FSDP2 ranks, one Ray actor each
    lr: float
    lr_schedule: str
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    max_grad_norm: float
    micro_batch_size: int | None
    param_dtype: str
    reduce_dtype: str
    torch_threads: int
    # Updates skipped in a row (non-finite loss or gradient norm) before the run stops.
    max_skipped_steps: int
    # The policy's trainer runs each distinct prompt once for the samples that share it
    # (algos.shared_prefix); a critic (PPO's algo.critic) runs full sequences and ignores it.
    shared_prefix: bool = True
    # With shared_prefix: the most passes a micro-batch's completions are split into by length,
    # each padded to its longest (algos.shared_prefix.length_buckets).
    completion_passes: int = 3
    # On CPU, threads each policy trainer rank adds to torch_threads while the policy engines on
    # its host are idle (actors.engine_activity); a critic ignores it.
    idle_policy_threads: int = 0

    def rules(self) -> list[tuple[bool, str, str]]:
        return [
            (self.ranks >= 1, "ranks", "an integer >= 1"),
            (self.lr > 0, "lr", "a number > 0"),
            (self.lr_schedule in LR_SCHEDULES, "lr_schedule", f"one of {list(LR_SCHEDULES)}"),
            (0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "a number within [0, 1]"),
            (self.warmup_steps >= 0, "warmup_steps", "an integer >= 0"),
            (self.weight_decay >= 0, "weight_decay", "a number >= 0"),
            (self.max_grad_norm > 0, "max_grad_norm", "a number > 0"),
            (
                self.micro_batch_size is None or self.micro_batch_size >= 1,
                "micro_batch_size",
                "null (the whole batch) or an integer >= 1",
            ),
            (self.param_dtype in TRAIN_DTYPES, "param_dtype", f"one of {list(TRAIN_DTYPES)}"),
            (self.reduce_dtype in TRAIN_DTYPES, "reduce_dtype", f"one of {list(TRAIN_DTYPES)}"),
            (self.torch_threads >= 1, "torch_threads", "an integer >= 1"),
            (self.completion_passes >= 1, "completion_passes", "an integer >= 1"),
            (self.idle_policy_threads >= 0, "idle_policy_threads", "an integer >= 0"),
            (self.max_skipped_steps >= 1, "max_skipped_steps", "an integer >= 1"),
        ]
