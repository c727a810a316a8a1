import dataclasses

import pytest

from tasks.arithmetic import ArithmeticScorer, problem, reward
from tasks.base import Problem, available_tasks, task_class
from tests.configs import defaults


def test_prompt_and_answer_format():
    assert problem(12, "+", 7) == Problem("12+7=", "19")
    assert problem(3, "-", 40) == Problem("3-40=", "-37")


def test_tasks_are_found_by_name():
    assert {"arithmetic", "dataset"} <= set(available_tasks())
    with pytest.raises(ValueError, match=r"task.name='nope': no module tasks/nope.py defines Task; available: \["):
        task_class("nope")


def _operands(p: Problem) -> tuple[int, str, int]:
    op = "+" if "+" in p.prompt else "-"
    a, b = p.prompt.rstrip("=").split(op)
    return int(a), op, int(b)


def test_splits_are_deterministic_disjoint_and_cover_the_space():
    config = dataclasses.replace(defaults().task, low=0, high=20, eval_size=50)
    a, b, c = (task_class("arithmetic")(config, seed) for seed in (3, 3, 4))
    assert a.heldout == b.heldout and a.train_problems == b.train_problems
    assert a.heldout != c.heldout
    assert not set(a.heldout) & set(a.train_problems)
    assert len(set(a.heldout) | set(a.train_problems)) == 21 * 21 * 2
    for p in a.train_problems:
        x, op, y = _operands(p)
        assert 0 <= x <= 20 and 0 <= y <= 20 and p.answer == str(x + y if op == "+" else x - y)


def test_train_batches_are_deterministic_and_resumable():
    task = task_class("arithmetic")(dataclasses.replace(defaults().task, low=0, high=9, ops=["+"], eval_size=10), 0)
    stream = task.train_batches(7)
    first = [next(stream) for _ in range(30)]  # 210 problems: crosses epoch boundaries (90 each)
    again = task.train_batches(7)
    assert first == [next(again) for _ in range(30)]
    resumed = task.train_batches(7, start=13)
    assert [next(resumed) for _ in range(17)] == first[13:]
    epoch = [p for batch in first for p in batch][:90]
    assert sorted(epoch, key=repr) == sorted(task.train_problems, key=repr)  # each epoch is a permutation


@pytest.mark.parametrize(
    "completion, finished, expected",
    [("19", True, 1.0), ("19", False, 0.0), ("18", True, 0.0), ("019", True, 0.0), (" 19", True, 0.0), ("", True, 0.0)],
)
def test_reward_is_exact_match_ended_by_eos(completion, finished, expected):
    assert reward(problem(12, "+", 7), completion, finished) == expected
    assert ArithmeticScorer().is_correct(problem(12, "+", 7), completion, finished) == (expected == 1.0)


def test_format_reward_only_for_well_formed_wrong_integers():
    p = problem(3, "-", 40)
    scorer = ArithmeticScorer(format_reward=0.1)
    assert scorer.score(p, "-37", True) == 1.0
    assert scorer.score(p, "-36", True) == 0.1 and not scorer.is_correct(p, "-36", True)
    assert scorer.score(p, "-036", True) == 0.0
    assert scorer.score(p, "3-", True) == 0.0
    assert scorer.score(p, "-36", False) == 0.0


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"low": 5, "high": 2}, "task.high"),
        ({"ops": ["*"]}, "task.ops"),
        ({"eval_size": 0}, "task.eval_size"),
        ({"low": 0, "high": 1, "eval_size": 8}, "task.eval_size"),
        ({"reward_fn": "not a path"}, "task.reward_fn"),
        ({"reward_timeout_s": 0.0}, "task.reward_timeout_s"),
        ({"reward_fallback": float("nan")}, "task.reward_fallback"),
    ],
)
def test_bad_task_settings_are_clear_errors(changes, key):
    from validation.config import ConfigError, check_config

    with pytest.raises(ConfigError, match=f"config key {key}=.* is invalid: expected"):
        check_config(dataclasses.replace(defaults().task, **changes), "task")
