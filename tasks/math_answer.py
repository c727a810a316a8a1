"""A reward for math answers: the completion's final answer against the reference, by value.

Built on ``math-verify``. The completion's final answer is its last complete ``\\boxed{...}``
when it has one (math-verify alone would read several boxes as one set), else the last number or
LaTeX expression in its text. The reference answer is a plain string ("42", "-3", "3/4", "1,234")
or LaTeX ("\\frac{3}{4}", "2\\pi"), read as math.

Equal means equal by value as math-verify compares them: ``3/4``, ``\\frac{3}{4}`` and ``0.75``
are one answer, ``1,234`` is ``1234``, a sign is part of the value (``-5`` is not ``5``), and
numbers agree when they round to the same 6 decimals. A completion without any answer, or one
that math-verify cannot parse or that takes too long to parse or compare, is wrong.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import lru_cache

from math_verify import parse, verify
from math_verify.errors import TimeoutException

from tasks.base import Problem

# Seconds one parse or one comparison may take. math-verify stops it with SIGALRM, which only
# works in the main thread; elsewhere it runs without its own limit (the caller's reward timeout
# still applies).
TIMEOUT_S = 2


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=65536)
def _gold(answer: str) -> tuple:
    """The parsed reference answer, cached: each problem's answer is scored many times.

    Read as LaTeX math (wrapped in ``$...$`` unless it has its own delimiters or a box), so that
    "\\sqrt{2}" or "2\\pi" parse whole; as plain text if that finds nothing."""
    text = answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
    parsed = parse(text, parsing_timeout=_timeout())
    return tuple(parsed or parse(answer, parsing_timeout=_timeout()))


def last_box(text: str) -> str | None:
    """The last ``\\boxed{...}`` of ``text`` whose braces close, or None."""
    start = text.rfind("\\boxed")
    while start >= 0:
        brace = start + len("\\boxed")
        while text[brace : brace + 1] == " ":
            brace += 1
        depth = 0
        for end in range(brace, len(text) if text[brace : brace + 1] == "{" else brace):
            if text[end] in "{}":
                depth += 1 if text[end] == "{" else -1
                if depth == 0:
                    return text[start : end + 1]
        start = text.rfind("\\boxed", 0, start)
    return None


def is_equal(answer: str, completion: str) -> bool:
    """Whether ``completion``'s final answer equals ``answer`` by value; never raises."""
    try:
        gold = _gold(answer.strip())
        if not gold:
            return False
        target = parse(last_box(completion) or completion, parsing_timeout=_timeout())
        return bool(target) and verify(list(gold), target, timeout_seconds=_timeout())
    except (Exception, TimeoutException):
        return False


@dataclass(frozen=True)
class MathAnswerScorer:
    """1.0 when the completion's final answer equals the reference by value, else 0.0.

    ``finished`` is ignored: the verdict is on the text alone. A completion cut by the length
    limit is still judged by the final answer that can be read from what it wrote (its box if it
    boxed one before the cut, else its last number), since only the answer is checked.
    """

    def score(self, problem: Problem, completion: str, finished: bool) -> float:
        return 1.0 if is_equal(problem.answer, completion) else 0.0

    def is_correct(self, problem: Problem, completion: str, finished: bool) -> bool:
        return is_equal(problem.answer, completion)
