"""The built-in verifiable task: integer arithmetic.

A problem is ``a op b`` with ``op`` in the configured operators and ``a``, ``b`` in
``[low, high]``. The prompt text is exactly ``f"{a}{op}{b}="``; the correct completion is
``str(result)`` followed by EOS.

Splits are deterministic: every problem of the finite space is assigned to the held-out split
or to the train split by a seeded permutation, so the two never share a problem and the same
seed always gives the same splits.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from tasks.base import Problem, TaskConfig, shuffled_batches

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b}

# Every character that can appear in a prompt or a correct answer.
ALPHABET = "0123456789+-="


@dataclass
class ArithmeticConfig(TaskConfig):
    low: int
    high: int
    ops: list[str]
    eval_size: int
    format_reward: float

    def rules(self) -> list[tuple[bool, str, str]]:
        space = len(self.ops) * (self.high - self.low + 1) ** 2
        return [
            (self.low >= 0, "low", "an integer >= 0"),
            (self.high >= self.low, "high", f"an integer >= task.low={self.low}"),
            (bool(self.ops) and set(self.ops) <= set(OPERATORS), "ops", f"a non-empty list of {sorted(OPERATORS)}"),
            (0 < self.eval_size < space, "eval_size", f"between 1 and {space - 1} (the space has {space} problems)"),
            (0 <= self.format_reward < 1, "format_reward", "a number within [0, 1)"),
            *super().rules(),
        ]


def problem(a: int, op: str, b: int) -> Problem:
    return Problem(f"{a}{op}{b}=", str(OPERATORS[op](a, b)))


def reward(problem: Problem, completion: str, finished: bool, format_reward: float = 0.0) -> float:
    """1.0 for an exact answer that ended with EOS.

    ``completion`` is the generated text without special tokens; ``finished`` says whether the
    generation stopped on EOS (rather than on the length limit). When ``format_reward`` > 0, a
    wrong answer that is still a well-formed integer ended by EOS earns that much: a small shaping
    term, off by default.
    """
    if finished and completion == problem.answer:
        return 1.0
    if format_reward and finished and _is_integer(completion):
        return format_reward
    return 0.0


def _is_integer(text: str) -> bool:
    digits = text.removeprefix("-")
    return digits.isdigit() and (digits == "0" or not digits.startswith("0"))


@dataclass(frozen=True)
class ArithmeticScorer:
    format_reward: float = 0.0

    def score(self, problem: Problem, completion: str, finished: bool) -> float:
        return reward(problem, completion, finished, self.format_reward)

    def is_correct(self, problem: Problem, completion: str, finished: bool) -> bool:
        return finished and completion == problem.answer


def split(low: int, high: int, ops: tuple[str, ...] | list[str], eval_size: int, seed: int):
    """(train, held-out) problems of the space ``[low, high]^2 x ops``, split by ``seed``."""
    problems = [problem(a, op, b) for op in ops for a in range(low, high + 1) for b in range(low, high + 1)]
    random.Random(seed).shuffle(problems)
    return problems[eval_size:], problems[:eval_size]


class Task:
    Config = ArithmeticConfig

    def __init__(self, config: ArithmeticConfig, seed: int, tokenizer=None) -> None:
        self.seed = seed
        self.train_problems, self.heldout = split(config.low, config.high, config.ops, config.eval_size, seed)
        self.scorer = ArithmeticScorer(config.format_reward)
        self.summary_line = (
            f"arithmetic {config.low}..{config.high} {' '.join(config.ops)}: "
            f"{len(self.train_problems)} train / {len(self.heldout)} held-out problems"
        )

    def train_batches(self, batch_size: int, start: int = 0) -> Iterator[list[Problem]]:
        """Each epoch is a fresh seeded permutation of the train split."""
        return shuffled_batches(self.train_problems, batch_size, self.seed, start)

    def summary(self) -> str:
        return self.summary_line
