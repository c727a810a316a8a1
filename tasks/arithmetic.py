"""The built-in verifiable task: integer arithmetic.

A problem is ``a op b`` with ``op`` in the configured operators and ``a``, ``b`` in
``[low, high]``. The prompt text is exactly ``f"{a}{op}{b}="``; the correct completion is
``str(result)`` followed by EOS.

Splits are deterministic: every problem of the finite space is assigned to the held-out eval
split or to the train split by a seeded permutation, so the two never share a problem and the
same seed always gives the same splits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b}

# Every character that can appear in a prompt or a correct answer.
ALPHABET = "0123456789+-="


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> str:
        return str(OPERATORS[self.op](self.a, self.b))


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


class ArithmeticTask:
    """The problem space, split into train and held-out eval sets by ``seed``."""

    def __init__(
        self,
        low: int = 0,
        high: int = 99,
        ops: tuple[str, ...] | list[str] = ("+", "-"),
        eval_size: int = 500,
        seed: int = 0,
    ) -> None:
        ops = tuple(ops)
        if low < 0 or high < low:
            raise ValueError(f"task operand range [{low}, {high}] is invalid: need 0 <= low <= high")
        unknown = [op for op in ops if op not in OPERATORS]
        if not ops or unknown:
            raise ValueError(f"task.ops {list(ops)} is invalid: allowed operators are {sorted(OPERATORS)}")
        problems = [Problem(a, op, b) for op in ops for a in range(low, high + 1) for b in range(low, high + 1)]
        if not 0 < eval_size < len(problems):
            raise ValueError(
                f"task.eval_size={eval_size} must be between 1 and {len(problems) - 1} "
                f"(the space [{low}, {high}] x {list(ops)} has {len(problems)} problems)"
            )
        random.Random(seed).shuffle(problems)
        self.eval_problems: list[Problem] = problems[:eval_size]
        self.train_problems: list[Problem] = problems[eval_size:]
        self.seed = seed

    def train_batches(self, batch_size: int, start: int = 0):
        """Endless deterministic stream of train batches; ``start`` skips that many batches.

        Each epoch is a fresh seeded permutation of the train split.
        """
        n = len(self.train_problems)
        index = start * batch_size
        while True:
            epoch, offset = divmod(index, n)
            order = list(range(n))
            random.Random(self.seed * 1_000_003 + epoch + 1).shuffle(order)
            batch = []
            while len(batch) < batch_size:
                if offset == n:
                    epoch, offset = epoch + 1, 0
                    order = list(range(n))
                    random.Random(self.seed * 1_000_003 + epoch + 1).shuffle(order)
                batch.append(self.train_problems[order[offset]])
                offset += 1
                index += 1
            yield batch
