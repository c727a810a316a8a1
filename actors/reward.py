"""Reward scoring that a bad reward function cannot break.

The task's scorer (or the user's ``task.reward_fn``) runs in a child process, so a call that
hangs can be stopped by killing the child, and one that crashes the interpreter only costs a
restart. A call that raises, runs past ``reward_timeout_s`` or returns something that is not a
finite number gets ``reward_fallback``: one bad reward must not turn the loss into NaN or end the
run. Such calls are counted, and the first one's text is reported once.

A batch of calls goes to the child in one message and the child sends back one result per call,
so the parent can give each call its own deadline while paying one message per call, not a
process per call.
"""

from __future__ import annotations

import math
import multiprocessing
import numbers
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import ray

from tasks.base import Problem, Scorer, TaskConfig, load_reward_fn

# How long the child may take to start (import the scorer's and the reward function's modules).
START_TIMEOUT_S = 120.0

Call = tuple[Problem, str, bool]
Result = tuple[float | None, bool, str | None]  # reward (None: use the fallback), correct, error


@dataclass
class Scores:
    """The outcome of one batch of reward calls, in call order."""

    rewards: list[float]
    correct: list[bool]  # the scorer's is_correct; False where it failed
    errors: int  # calls that raised, timed out, died or returned a non-finite reward
    first_error: str | None  # the first error the scorer has ever had, only in the batch where it happened


class RewardWorker:
    """Scores completions in a child process, with a per-call timeout and a fallback reward.

    ``reward_fn`` (an import path ``package.module:function``, or None) replaces
    ``scorer.score``; ``scorer.is_correct`` always decides ``correct``. The child is started here,
    so a ``reward_fn`` that cannot be loaded raises its ``ValueError`` now rather than on every call.
    """

    def __init__(self, scorer: Scorer, reward_fn: str | None, timeout_s: float, fallback: float) -> None:
        self.scorer = scorer
        self.reward_fn = reward_fn
        self.timeout_s = timeout_s
        self.fallback = fallback
        self._reported = False
        self._start()

    @property
    def pid(self) -> int | None:
        """The child's process id; None once closed."""
        return self._process.pid if self._finalizer.alive else None

    def score(
        self, problems: list[Problem], completions: list[str], finished: list[bool], with_rewards: bool = True
    ) -> Scores:
        """Rewards and verdicts for ``completions`` of ``problems``; never raises for a bad call.
        ``with_rewards=False`` (evaluation) asks for the verdicts alone: ``rewards`` stays empty and
        neither the reward function nor ``scorer.score`` is called."""
        if not self._finalizer.alive:
            raise RuntimeError("this RewardWorker is closed")
        calls = list(zip(problems, completions, finished, strict=True))
        scores = Scores([], [], 0, None)
        for i, (reward, correct, error) in enumerate(self._run(calls, with_rewards)):
            if with_rewards:
                scores.rewards.append(self.fallback if reward is None else reward)
            scores.correct.append(correct)
            if error is not None:
                scores.errors += 1
                if not self._reported:
                    self._reported = True
                    problem, completion, _ = calls[i]
                    scores.first_error = (
                        f"reward call {i} of {len(calls)} (prompt {_short(problem.prompt)}, "
                        f"completion {_short(completion)}): {error}"
                    )
        return scores

    def close(self) -> None:
        """Stops the child; idempotent."""
        self._finalizer()

    def _run(self, calls: list[Call], with_rewards: bool) -> list[Result]:
        """One result per call. A call whose result does not come within the timeout, or whose
        child died, is an error; the child is replaced and given the calls after it."""
        results: list[Result] = []
        while len(results) < len(calls):
            self._send((with_rewards, calls[len(results) :]))
            for _ in range(len(calls) - len(results)):
                if not self._conn.poll(self.timeout_s):
                    results.append((None, False, f"timed out after {self.timeout_s:g} s"))
                    self._restart()
                    break
                try:
                    results.append(self._conn.recv())
                except (EOFError, OSError):
                    self._process.join()
                    results.append((None, False, f"the reward process died (exit code {self._process.exitcode})"))
                    self._restart()
                    break
        return results

    def _send(self, batch: tuple[bool, list[Call]]) -> None:
        try:
            self._conn.send(batch)
        except OSError:  # the child died between batches (killed from outside): no call is to blame
            self._restart()
            self._conn.send(batch)

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_end = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child_end, self.scorer, self.reward_fn, os.getpid()), name="reward"
        )
        self._process.start()
        child_end.close()  # so that the child's death reads as EOF here
        self._finalizer = weakref.finalize(self, _stop, self._process, self._conn)
        if not self._conn.poll(START_TIMEOUT_S):
            self._finalizer()
            raise RuntimeError(f"the reward process did not start within {START_TIMEOUT_S:g} s")
        try:
            error = self._conn.recv()
        except EOFError:
            self._finalizer()
            raise RuntimeError(
                f"the reward process exited while starting (exit code {self._process.exitcode}); see its stderr"
            ) from None
        if error is not None:
            self._finalizer()
            raise ValueError(error)

    def _restart(self) -> None:
        self._finalizer()
        self._start()


@ray.remote(num_cpus=0)
class Reward:
    """The run's reward actor: a ``RewardWorker`` configured by the task's config."""

    def __init__(self, scorer: Scorer, config: TaskConfig) -> None:
        self.worker = RewardWorker(scorer, config.reward_fn, config.reward_timeout_s, config.reward_fallback)

    def score(
        self, problems: list[Problem], completions: list[str], finished: list[bool], with_rewards: bool = True
    ) -> Scores:
        return self.worker.score(problems, completions, finished, with_rewards)

    def close(self) -> None:
        self.worker.close()


def _stop(process: multiprocessing.Process, conn: Connection) -> None:
    process.kill()
    process.join()
    conn.close()


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _serve(conn: Connection, scorer: Scorer, reward_fn: str | None, parent: int) -> None:
    """The child: loads the reward function, says so (None, or the error's text), then answers
    each batch of calls with one result per call until the parent closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    try:
        fn = load_reward_fn(reward_fn) if reward_fn else None
    except Exception as e:
        conn.send(str(e) if isinstance(e, ValueError) else f"task.reward_fn={reward_fn!r}: {type(e).__name__}: {e}")
        return
    conn.send(None)
    while True:
        try:
            with_rewards, calls = conn.recv()
        except EOFError:
            return
        for problem, completion, finished in calls:
            conn.send(_call(scorer, fn, problem, completion, finished, with_rewards))


def _exit_with_parent(parent: int) -> None:
    """Ends a child whose parent died without stopping it (killed), even while a call hangs."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _call(
    scorer: Scorer,
    fn: Callable[..., float] | None,
    problem: Problem,
    completion: str,
    finished: bool,
    with_rewards: bool,
) -> Result:
    errors = []
    reward = _reward(scorer, fn, problem, completion, finished, errors) if with_rewards else None
    try:
        correct = bool(scorer.is_correct(problem, completion, finished))
    except Exception as e:
        correct = False
        errors.append(f"is_correct raised {type(e).__name__}: {e}")
    return reward, correct, "; ".join(errors) or None


def _reward(
    scorer: Scorer, fn: Callable[..., float] | None, problem: Problem, completion: str, finished: bool, errors: list
) -> float | None:
    """The reward function's (else the scorer's) finite reward; None, with the reason in ``errors``, if it has none."""
    try:
        if fn is None:
            value = scorer.score(problem, completion, finished)
        else:
            value = fn(prompt=problem.prompt, completion=completion, answer=problem.answer, finished=finished)
    except Exception as e:
        errors.append(f"raised {type(e).__name__}: {e}")
        return None
    if not isinstance(value, numbers.Real):
        errors.append(f"returned {_short(value)}, not a number")
    elif not math.isfinite(float(value)):
        errors.append(f"returned {float(value)}")
    else:
        return float(value)
    return None
