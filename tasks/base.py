"""What every task is, and how a run finds one by name.

A task is one module ``tasks/<name>.py`` with one config file ``configs/task/<name>.yaml``
(whose ``name`` key is the module's name). The module defines ``Task``, a class with:

- ``Config``: its config dataclass (a subclass of ``TaskConfig``; ``rules()`` checks its values);
- ``__init__(config, seed, tokenizer)``: reads or makes its problems (``tokenizer``: the
  model's, for tasks that format prompts with its chat template); a ``ValueError`` names the
  key or the file and row that is wrong;
- ``train_batches(batch_size, start)``: an endless, deterministic stream of lists of
  ``Problem``; ``start`` skips that many batches (a resumed run continues its stream);
- ``heldout``: the held-out problems the run evaluates on, never trained on;
- ``scorer``: a small picklable object whose ``score(problem, completion, finished)`` is the
  reward and ``is_correct(...)`` the held-out metric's verdict (``finished``: the completion
  ended on EOS rather than on the length limit);
- ``summary()``: one line saying what the task holds.

``task.reward_fn=package.module:function`` replaces any task's ``score`` with the user's own
(``load_reward_fn``); correctness stays the task's.
"""

from __future__ import annotations

import importlib
import inspect
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from validation.plugins import available, plugin


@dataclass(frozen=True)
class Problem:
    prompt: str  # the text the policy continues
    answer: str  # the reference answer its completion is scored against


class Scorer(Protocol):
    def score(self, problem: Problem, completion: str, finished: bool) -> float: ...

    def is_correct(self, problem: Problem, completion: str, finished: bool) -> bool: ...


@dataclass
class TaskConfig:
    """The keys every task has: which module, and how its rewards are computed."""

    name: str  # the module in tasks/
    reward_fn: str | None  # "package.module:function" instead of the task's own reward
    reward_timeout_s: float  # a reward call that takes longer is stopped
    reward_fallback: float  # the reward of a call that raised, timed out or was not finite

    def rules(self) -> list[tuple[bool, str, str]]:
        return [
            (
                self.reward_fn is None or _is_import_path(self.reward_fn),
                "reward_fn",
                "null or an import path 'package.module:function'",
            ),
            (self.reward_timeout_s > 0, "reward_timeout_s", "a number of seconds > 0"),
            (math.isfinite(self.reward_fallback), "reward_fallback", "a finite number"),
        ]


class Task(Protocol):
    Config: type[TaskConfig]
    heldout: list[Problem]
    scorer: Scorer

    def __init__(self, config: TaskConfig, seed: int, tokenizer) -> None: ...

    def train_batches(self, batch_size: int, start: int = 0) -> Iterator[list[Problem]]: ...

    def summary(self) -> str: ...


def shuffled_batches(items: list, batch_size: int, seed: int, start: int = 0) -> Iterator[list]:
    """Endless deterministic stream of ``batch_size`` lists of ``items``; ``start`` skips that
    many batches. Each epoch is a fresh seeded permutation of ``items``; a batch may span two."""
    n = len(items)
    if not n:
        raise ValueError("no problems to draw train batches from")
    index = start * batch_size

    def permutation(epoch: int) -> list[int]:
        order = list(range(n))
        random.Random(seed * 1_000_003 + epoch + 1).shuffle(order)
        return order

    epoch, offset = divmod(index, n)
    order = permutation(epoch)
    while True:
        batch = []
        while len(batch) < batch_size:
            if offset == n:
                epoch, offset = epoch + 1, 0
                order = permutation(epoch)
            batch.append(items[order[offset]])
            offset += 1
        yield batch


def _is_import_path(path: str) -> bool:
    module, _, attr = path.partition(":")
    return bool(module) and bool(attr) and all(p.isidentifier() for p in [*module.split("."), *attr.split(".")])


REWARD_FN_ARGUMENTS = ("prompt", "completion", "answer", "finished")


def load_reward_fn(path: str) -> Callable[..., float]:
    """The user's reward function at ``package.module:function``; a ``ValueError`` saying what
    is wrong otherwise. It is called with keywords ``prompt``, ``completion``, ``answer``
    (strings) and ``finished`` (whether the completion ended on EOS) and returns a number."""
    key = f"task.reward_fn={path!r}"
    if not _is_import_path(path):
        raise ValueError(f"{key} is not an import path: expected 'package.module:function'")
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{key}: cannot import module {module_name!r} ({e}); is it on PYTHONPATH?") from e
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"{key}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"{key}: {attr!r} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind(**dict.fromkeys(REWARD_FN_ARGUMENTS, ""))
    except TypeError as e:
        args = ", ".join(REWARD_FN_ARGUMENTS)
        raise ValueError(f"{key}: it must accept the keyword arguments {args} (or **kwargs): {e}") from e
    except ValueError:  # a builtin without a signature: called as it is
        pass
    return fn


def available_tasks() -> list[str]:
    """The modules in ``tasks/`` that define ``Task``."""
    return available("tasks", "Task")


def task_class(name: str) -> type[Task]:
    """``tasks.<name>.Task``; a ``ValueError`` naming the ones there are for another name."""
    return plugin("tasks", "Task", "task.name", name)
