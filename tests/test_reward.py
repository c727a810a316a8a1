"""The reward worker: the task's scores, the user's reward function, and a fallback for every
kind of bad call (raises, hangs, dies, returns a non-finite value) without ending the run.

The reward functions below are imported by the scoring child as ``tests.test_reward:<name>``."""

from __future__ import annotations

import gc
import math
import os
import time
from dataclasses import dataclass

import pytest

from actors.reward import Reward, RewardWorker
from tasks.arithmetic import ArithmeticScorer, problem
from tasks.base import Problem, TaskConfig

HERE = "tests.test_reward"
FALLBACK = -1.0


def length_reward(prompt: str, completion: str, answer: str, finished: bool) -> float:
    return float(len(completion))


def raising_reward(prompt: str, completion: str, answer: str, finished: bool) -> float:
    if completion == "boom":
        raise ValueError("cannot parse 'boom'")
    return 1.0


def bad_value_reward(prompt: str, completion: str, answer: str, finished: bool) -> object:
    return {"nan": math.nan, "inf": -math.inf, "none": None, "text": "1.0"}.get(completion, 0.5)


def hanging_reward(prompt: str, completion: str, answer: str, finished: bool) -> float:
    if completion == "hang":
        time.sleep(3600)
    return float(completion)


def dying_reward(prompt: str, completion: str, answer: str, finished: bool) -> float:
    if completion == "die":
        os._exit(3)
    return float(completion)


@dataclass(frozen=True)
class FussyScorer:
    """Its ``is_correct`` raises on one completion."""

    def score(self, problem: Problem, completion: str, finished: bool) -> float:
        return 1.0

    def is_correct(self, problem: Problem, completion: str, finished: bool) -> bool:
        if completion == "odd":
            raise KeyError("odd")
        return True


def worker(reward_fn: str | None = None, timeout_s: float = 5.0, scorer=None) -> RewardWorker:
    return RewardWorker(scorer or ArithmeticScorer(), reward_fn, timeout_s, FALLBACK)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split(")")[-1].split()[0] != "Z"


def test_task_scorer_gives_its_own_rewards_and_verdicts():
    scorer = ArithmeticScorer(format_reward=0.25)
    cases = [(problem(2, "+", 3), "5", True), (problem(2, "+", 3), "5", False), (problem(9, "-", 4), "6", True)]
    cases += [(problem(1, "-", 7), "-6", True), (problem(1, "+", 1), "x", True), (problem(1, "+", 1), "", False)]
    w = worker(scorer=scorer)
    try:
        scores = w.score(*map(list, zip(*cases)))
    finally:
        w.close()
    assert scores.rewards == [scorer.score(*c) for c in cases] == [1.0, 0.0, 0.25, 1.0, 0.0, 0.0]
    assert scores.correct == [scorer.is_correct(*c) for c in cases] == [True, False, False, True, False, False]
    assert (scores.errors, scores.first_error) == (0, None)


def test_user_reward_fn_replaces_the_score_but_not_the_verdict():
    w = worker(f"{HERE}:length_reward")
    try:
        scores = w.score([problem(2, "+", 3)] * 3, ["5", "55", "abc"], [True, True, True])
    finally:
        w.close()
    assert scores.rewards == [1.0, 2.0, 3.0]
    assert scores.correct == [True, False, False]
    assert scores.errors == 0


def test_a_reward_fn_that_cannot_be_loaded_fails_at_construction():
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        worker(f"{HERE}:missing")


def test_a_raising_reward_gets_the_fallback_and_is_reported_once():
    w = worker(f"{HERE}:raising_reward")
    p = problem(2, "+", 3)
    try:
        first = w.score([p] * 4, ["5", "boom", "4", "boom"], [True] * 4)
        second = w.score([p] * 2, ["boom", "5"], [True] * 2)
    finally:
        w.close()
    assert first.rewards == [1.0, FALLBACK, 1.0, FALLBACK]
    assert first.correct == [True, False, False, False]
    assert first.errors == 2
    assert "call 1 of 4" in first.first_error and "ValueError: cannot parse 'boom'" in first.first_error
    assert (second.rewards, second.errors, second.first_error) == ([FALLBACK, 1.0], 1, None)


def test_non_finite_and_non_numeric_rewards_get_the_fallback():
    w = worker(f"{HERE}:bad_value_reward")
    try:
        scores = w.score([problem(2, "+", 3)] * 5, ["ok", "nan", "inf", "none", "text"], [True] * 5)
    finally:
        w.close()
    assert scores.rewards == [0.5] + [FALLBACK] * 4
    assert scores.errors == 4
    assert "call 1 of 5" in scores.first_error and scores.first_error.endswith("returned nan")


def test_a_failing_is_correct_is_false_and_counted():
    w = worker(scorer=FussyScorer())
    try:
        scores = w.score([problem(2, "+", 3)] * 2, ["odd", "even"], [True, True])
    finally:
        w.close()
    assert scores.rewards == [1.0, 1.0]
    assert scores.correct == [False, True]
    assert scores.errors == 1 and "is_correct raised KeyError" in scores.first_error


def test_a_hanging_call_times_out_and_the_process_is_replaced():
    w = worker(f"{HERE}:hanging_reward", timeout_s=0.5)
    p = problem(2, "+", 3)
    try:
        hung_pid = w.pid
        started = time.monotonic()
        scores = w.score([p] * 4, ["1", "hang", "2", "3"], [True] * 4)
        assert time.monotonic() - started < 10
        assert scores.rewards == [1.0, FALLBACK, 2.0, 3.0]
        assert scores.errors == 1
        assert "call 1 of 4" in scores.first_error and "timed out after 0.5 s" in scores.first_error
        assert w.pid != hung_pid and not alive(hung_pid)
        again = w.score([p] * 2, ["4", "5"], [True, True])
        assert (again.rewards, again.correct, again.errors, again.first_error) == ([4.0, 5.0], [False, True], 0, None)
    finally:
        w.close()


def test_a_dying_call_gets_the_fallback_and_the_rest_are_scored():
    w = worker(f"{HERE}:dying_reward")
    try:
        scores = w.score([problem(2, "+", 3)] * 4, ["1", "die", "2", "die"], [True] * 4)
    finally:
        w.close()
    assert scores.rewards == [1.0, FALLBACK, 2.0, FALLBACK]
    assert scores.errors == 2
    assert "call 1 of 4" in scores.first_error and "died (exit code 3)" in scores.first_error


def test_close_and_garbage_collection_leave_no_child():
    w = worker()
    pid = w.pid
    w.close()
    w.close()
    assert not alive(pid) and w.pid is None
    with pytest.raises(RuntimeError, match="closed"):
        w.score([problem(2, "+", 3)], ["5"], [True])
    w = worker()
    pid = w.pid
    del w
    gc.collect()
    assert not alive(pid)


@pytest.fixture(scope="module")
def ray_module():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def test_the_ray_actor_scores_with_the_task_config(ray_module):
    config = TaskConfig(
        name="arithmetic", reward_fn=f"{HERE}:bad_value_reward", reward_timeout_s=5.0, reward_fallback=FALLBACK
    )
    actor = Reward.remote(ArithmeticScorer(), config)
    try:
        scores = ray_module.get(actor.score.remote([problem(2, "+", 3)] * 2, ["5", "nan"], [True, True]))
        ray_module.get(actor.close.remote())
    finally:
        ray_module.kill(actor)
    assert (scores.rewards, scores.correct, scores.errors) == ([0.5, FALLBACK], [True, False], 1)
    assert "returned nan" in scores.first_error


def test_verdicts_alone_do_not_call_the_reward_function():
    w = worker(f"{HERE}:hanging_reward", timeout_s=2.0)
    try:
        scores = w.score([problem(2, "+", 3)] * 2, ["hang", "5"], [True, True], with_rewards=False)
    finally:
        w.close()
    assert (scores.rewards, scores.correct, scores.errors, scores.first_error) == ([], [False, True], 0, None)
