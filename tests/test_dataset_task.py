"""The dataset task (prompts and answers from a JSONL or Parquet file) and its scorers."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from tasks.base import Problem, available_tasks, task_class
from tasks.dataset import DatasetConfig, ExactAnswerScorer, Task
from tasks.math_answer import MathAnswerScorer
from validation.config import ConfigError, check_config

YAML = Path(__file__).parent.parent / "configs" / "task" / "dataset.yaml"


def config(**overrides) -> DatasetConfig:
    """The typed config: the YAML's defaults with ``overrides``."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DatasetConfig), OmegaConf.load(YAML), overrides))


def rows(n: int, prompt_key: str = "prompt", answer_key: str = "answer") -> list[dict]:
    return [{prompt_key: f"What is {i} + 1?", answer_key: str(i + 1)} for i in range(n)]


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def write_parquet(path: Path, records: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(records), path)
    return str(path)


def problems(n: int) -> set[Problem]:
    return {Problem(r["prompt"], r["answer"]) for r in rows(n)}


def test_the_task_is_found_by_name_and_the_yaml_fits_its_config():
    assert "dataset" in available_tasks()
    assert task_class("dataset") is Task
    cfg = config(path="data.jsonl")
    assert cfg.name == "dataset" and cfg.heldout_size == 200 and cfg.bad_rows == "skip" and cfg.reward == "math"
    check_config(cfg, "task")


def test_jsonl_and_parquet_give_the_same_problems(tmp_path):
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows(30))
    parquet = write_parquet(tmp_path / "d.parquet", rows(30))
    a = Task(config(path=jsonl, heldout_size=5), seed=1, tokenizer=None)
    b = Task(config(path=parquet, heldout_size=5), seed=1, tokenizer=None)
    assert a.train_problems == b.train_problems and a.heldout == b.heldout
    assert set(a.train_problems) | set(a.heldout) == problems(30)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_custom_column_names(tmp_path, suffix):
    records = [{**r, "prompt": "a decoy", "answer": "0"} for r in rows(10, "question", "solution")]
    write = write_jsonl if suffix == ".jsonl" else write_parquet
    path = write(tmp_path / f"d{suffix}", records)
    task = Task(config(path=path, prompt_key="question", answer_key="solution", heldout_size=2), 0, None)
    assert set(task.train_problems) | set(task.heldout) == problems(10)


def test_heldout_split_is_seeded_disjoint_and_adds_up(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(50))
    a, b, c = (Task(config(path=path, heldout_size=10), seed, None) for seed in (3, 3, 4))
    assert a.heldout == b.heldout and a.train_problems == b.train_problems
    assert set(a.heldout) != set(c.heldout)
    assert len(a.heldout) == 10 and len(a.train_problems) == 40
    assert not set(a.heldout) & set(a.train_problems)
    assert set(a.heldout) | set(a.train_problems) == problems(50)
    assert a.summary() == "dataset d.jsonl: 40 train / 10 held-out problems"


def test_split_must_leave_a_train_row(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(5))
    assert len(Task(config(path=path, heldout_size=4), 0, None).train_problems) == 1
    with pytest.raises(ValueError, match=r"task.heldout_size=5 .*has 5 usable rows"):
        Task(config(path=path, heldout_size=5), 0, None)


def test_a_heldout_file(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", rows(20))
    test_records = [{"prompt": f"Test {i}", "answer": str(i)} for i in range(8)]
    test = write_parquet(tmp_path / "test.parquet", test_records)
    whole = Task(config(path=train, heldout_path=test, heldout_size=None), 0, None)
    assert len(whole.train_problems) == 20  # the train file is all trained on
    assert set(whole.heldout) == {Problem(r["prompt"], r["answer"]) for r in test_records}
    some = Task(config(path=train, heldout_path=test, heldout_size=3), 0, None)
    assert Task(config(path=train, heldout_path=test, heldout_size=3), 0, None).heldout == some.heldout
    assert len(some.heldout) == 3 and set(some.heldout) < set(whole.heldout)
    by_seed = {
        tuple(Task(config(path=train, heldout_path=test, heldout_size=3), seed, None).heldout) for seed in range(4)
    }
    assert len(by_seed) > 1  # the first 3 after a seeded shuffle, not the file's first 3
    assert some.summary() == "dataset train.jsonl + test.parquet: 20 train / 3 held-out problems"


def test_train_batches_resume_with_start(tmp_path):
    task = Task(config(path=write_jsonl(tmp_path / "d.jsonl", rows(25)), heldout_size=5), 7, None)
    first = task.train_batches(6)
    batches = [next(first) for _ in range(10)]  # 60 problems: crosses epochs of 20
    resumed = task.train_batches(6, start=4)
    assert [next(resumed) for _ in range(6)] == batches[4:]
    assert set(p for b in batches for p in b) == set(task.train_problems)


BAD_LINES = [
    ({"answer": "1"}, "line 2: no field 'prompt'"),
    ({"prompt": "Q", "answer": 7}, "line 2: field 'answer' is int, not a string"),
    ({"prompt": None, "answer": "1"}, "line 2: field 'prompt' is null"),
    ("{not json", "line 2: not valid JSON"),
    ([1, 2], "line 2: a JSON list, not an object"),
]


@pytest.mark.parametrize("bad, message", BAD_LINES)
def test_bad_jsonl_rows_are_skipped_and_counted_or_an_error(tmp_path, bad, message):
    good = rows(6)
    lines = [json.dumps(good[0]), bad if isinstance(bad, str) else json.dumps(bad), "", *map(json.dumps, good[1:])]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    task = Task(config(path=str(path), heldout_size=1), 0, None)
    assert set(task.train_problems) | set(task.heldout) == problems(6)
    assert task.skipped_rows == {str(path): 1}
    assert task.summary() == "dataset d.jsonl: 5 train / 1 held-out problems (1 bad row skipped)"
    with pytest.raises(ValueError, match=f"task.path='{path}' {message}"):
        Task(config(path=str(path), heldout_size=1, bad_rows="error"), 0, None)


def test_bad_parquet_rows_name_the_row_index(tmp_path):
    records = [*rows(4), {"prompt": "Q", "answer": None}]
    path = write_parquet(tmp_path / "d.parquet", records)
    assert Task(config(path=path, heldout_size=1), 0, None).skipped_rows == {path: 1}
    with pytest.raises(ValueError, match=r"row 4 \(0-based\): field 'answer' is null"):
        Task(config(path=path, heldout_size=1, bad_rows="error"), 0, None)


def test_skipped_rows_are_counted_per_file(tmp_path):
    train = write_jsonl(tmp_path / "a.jsonl", [*rows(5), {"prompt": 1}, {"prompt": 2}])
    test = write_jsonl(tmp_path / "b.jsonl", [*rows(2), ["x"]])
    task = Task(config(path=train, heldout_path=test, heldout_size=None), 0, None)
    assert task.skipped_rows == {train: 2, test: 1}
    assert task.summary().endswith("(3 bad rows skipped: 2 in a.jsonl, 1 in b.jsonl)")


@pytest.mark.parametrize(
    "make, overrides, match",
    [
        (None, {}, r"task.path='.*missing.jsonl': no such file"),
        (lambda p: write_parquet(p.with_suffix(".parquet"), rows(3)), {"answer_key": "solution"}, "task.answer_key"),
        (lambda p: write_jsonl(p, [{"q": "x"}] * 3), {}, r"task.path='.*' has no usable rows \(3 bad rows skipped\)"),
        (lambda p: p.write_text("\n\n"), {}, "has no usable rows"),
    ],
)
def test_unusable_files_are_clear_errors(tmp_path, make, overrides, match):
    file = tmp_path / "missing.jsonl"
    if make:
        make(file)
    file = next(tmp_path.iterdir(), file)
    with pytest.raises(ValueError, match=match):
        Task(config(path=str(file), heldout_size=1, **overrides), 0, None)


def test_a_missing_parquet_column_names_the_ones_there_are(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", rows(3, "question", "answer"))
    with pytest.raises(ValueError, match=r"task.prompt_key='prompt'.*\['question', 'answer'\]"):
        Task(config(path=path, heldout_size=1), 0, None)


def test_a_non_string_parquet_column_is_an_error(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", [{"prompt": "Q", "answer": i} for i in range(3)])
    with pytest.raises(ValueError, match="task.answer_key='answer'.*int64, not strings"):
        Task(config(path=path, heldout_size=1), 0, None)


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"bad_rows": "drop"}, "task.bad_rows='drop'"),
        ({"reward": "fuzzy"}, "task.reward='fuzzy'"),
        ({"heldout_size": 0}, "task.heldout_size=0"),
        ({"heldout_size": None}, "task.heldout_size=None"),
        ({"path": None}, "task.path=None"),
        ({"path": "data.csv"}, "task.path='data.csv'"),
        ({"heldout_path": "data.jsonl"}, "task.heldout_path='data.jsonl'"),
        ({"reward_timeout_s": 0}, "task.reward_timeout_s=0"),
    ],
)
def test_bad_values_are_config_errors(overrides, key):
    cfg = config(**{"path": "data.jsonl", **overrides})
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_config(cfg, "task")


def tokenizer(chat_template: str | None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]")
    tok.chat_template = chat_template
    return tok


TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_prompts_with_prefix_suffix_and_chat_template(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "What is 2+2?", "answer": "4"}] * 2)
    affixes = {"prompt_prefix": "Solve: ", "prompt_suffix": " Box it.", "heldout_size": 1}
    plain = Task(config(path=path, **affixes), 0, tokenizer(None))
    assert plain.heldout == [Problem("Solve: What is 2+2? Box it.", "4")]
    chat = Task(config(path=path, chat_template=True, **affixes), 0, tokenizer(TEMPLATE))
    assert chat.heldout == [Problem("<|user|>Solve: What is 2+2? Box it.<|end|><|assistant|>", "4")]
    assert chat.train_problems == chat.heldout
    for no_template in (tokenizer(None), None):
        with pytest.raises(ValueError, match="task.chat_template"):
            Task(config(path=path, chat_template=True, heldout_size=1), 0, no_template)


def test_the_reward_key_picks_the_scorer(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(3))
    assert isinstance(Task(config(path=path, heldout_size=1), 0, None).scorer, MathAnswerScorer)
    assert isinstance(Task(config(path=path, heldout_size=1, reward="exact"), 0, None).scorer, ExactAnswerScorer)


@pytest.mark.parametrize(
    "answer, completion, correct",
    [
        ("42", "So the answer is \\boxed{42}. Checking: 6 * 7 = 41 + 1", True),
        ("41", "So the answer is \\boxed{42}. Checking: 6 * 7 = 41 + 1", False),
        ("4", "First I got \\boxed{3}. No wait, it is \\boxed{4}.", True),
        ("3", "First I got \\boxed{3}. No wait, it is \\boxed{4}.", False),
        ("8", "There are 3 apples and 5 pears, so 8 fruits in all.", True),
        ("3", "There are 3 apples and 5 pears, so 8 fruits in all.", False),
        ("0.75", "\\boxed{\\frac{3}{4}}", True),
        ("\\frac{3}{4}", "It is 0.75", True),
        ("3/4", "\\boxed{0.75}", True),
        ("3/4", "\\boxed{0.7}", False),
        ("1,234", "The total is 1234.", True),
        ("1234", "The total is \\boxed{1,234}", True),
        ("-5", "x = 5", False),
        ("5", "\\boxed{-5}", False),
        ("-3", "so x = -3", True),
        ("\\sqrt{2}", "\\boxed{\\sqrt 2}", True),
        ("42", "I do not know.", False),
        ("42", "", False),
        ("42", "\\boxed{\\frac{1}{", False),
        ("42", "\\boxed{\\frac{1}{0}} \\left( \\right \\begin{matrix", False),
        ("\\frac{3}{", "3/4", False),
        ("", "42", False),
    ],
)
def test_math_scorer(answer, completion, correct):
    problem = Problem("Q", answer)
    for finished in (True, False):  # the verdict is on the text alone
        assert MathAnswerScorer().is_correct(problem, completion, finished) is correct
        assert MathAnswerScorer().score(problem, completion, finished) == float(correct)


@pytest.mark.parametrize(
    "answer, completion, correct",
    [
        ("42", "42", True),
        (" 42\n", "42 ", True),
        ("42", "\\boxed{42}", False),
        ("3/4", "0.75", False),
        ("4", "", False),
    ],
)
def test_exact_scorer(answer, completion, correct):
    problem = Problem("Q", answer)
    assert ExactAnswerScorer().is_correct(problem, completion, True) is correct
    assert ExactAnswerScorer().score(problem, completion, False) == float(correct)


def test_scorers_survive_pickling():
    import pickle

    for scorer in (MathAnswerScorer(), ExactAnswerScorer()):
        copy = pickle.loads(pickle.dumps(scorer))
        assert copy == scorer and copy.score(Problem("Q", "3/4"), "3/4", True) == 1.0
