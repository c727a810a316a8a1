"""Reward actor: scores completions with the task's rule-based verifier."""

from __future__ import annotations

import ray

from tasks.arithmetic import Problem, reward


@ray.remote(num_cpus=0)
class Reward:
    def __init__(self, format_reward: float = 0.0) -> None:
        self.format_reward = format_reward

    def score(self, problems: list[Problem], completions: list[str], finished: list[bool]) -> list[float]:
        return [reward(p, c, f, self.format_reward) for p, c, f in zip(problems, completions, finished, strict=True)]
