import pytest

from tasks.arithmetic import ArithmeticTask, Problem, reward


def test_prompt_and_answer_format():
    assert Problem(12, "+", 7).prompt == "12+7="
    assert Problem(12, "+", 7).answer == "19"
    assert Problem(3, "-", 40).prompt == "3-40="
    assert Problem(3, "-", 40).answer == "-37"


def test_splits_are_deterministic_disjoint_and_cover_the_space():
    a = ArithmeticTask(0, 20, ["+", "-"], eval_size=50, seed=3)
    b = ArithmeticTask(0, 20, ["+", "-"], eval_size=50, seed=3)
    c = ArithmeticTask(0, 20, ["+", "-"], eval_size=50, seed=4)
    assert a.eval_problems == b.eval_problems and a.train_problems == b.train_problems
    assert a.eval_problems != c.eval_problems
    assert not set(a.eval_problems) & set(a.train_problems)
    assert len(set(a.eval_problems) | set(a.train_problems)) == 21 * 21 * 2
    assert all(0 <= p.a <= 20 and 0 <= p.b <= 20 and p.op in "+-" for p in a.train_problems)


def test_train_batches_are_deterministic_and_resumable():
    task = ArithmeticTask(0, 9, ["+"], eval_size=10, seed=0)
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
    assert reward(Problem(12, "+", 7), completion, finished) == expected


def test_format_reward_only_for_well_formed_wrong_integers():
    p = Problem(3, "-", 40)
    assert reward(p, "-37", True, format_reward=0.1) == 1.0
    assert reward(p, "-36", True, format_reward=0.1) == 0.1
    assert reward(p, "-036", True, format_reward=0.1) == 0.0
    assert reward(p, "3-", True, format_reward=0.1) == 0.0
    assert reward(p, "-36", False, format_reward=0.1) == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"low": 5, "high": 2}, "range"),
        ({"ops": ["*"]}, "task.ops"),
        ({"eval_size": 0}, "task.eval_size"),
        ({"low": 0, "high": 1, "eval_size": 8}, "task.eval_size"),
    ],
)
def test_bad_task_settings_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticTask(**kwargs)
