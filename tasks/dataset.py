"""Prompts and reference answers from a local file: ``task=dataset task.path=FILE``.

The file is JSON lines (``.jsonl``/``.json``: one object per line) or Parquet (``.parquet``);
each row gives a prompt (``task.prompt_key``) and its reference answer (``task.answer_key``).
A row whose prompt or answer is missing or not a string (or a line that is not a JSON object)
is skipped and counted, or with ``task.bad_rows=error`` stops the run naming the file and row.

The held-out problems are ``task.heldout_path``'s rows, or else ``task.heldout_size`` rows taken
out of ``task.path`` by a permutation seeded with the run's seed: the same seed always gives the
same split, and the held-out rows are never trained on.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tasks.base import Problem, TaskConfig, shuffled_batches
from tasks.math_answer import MathAnswerScorer

JSON_SUFFIXES = (".jsonl", ".json")
SUFFIXES = (*JSON_SUFFIXES, ".parquet")
BAD_ROWS = ("skip", "error")


@dataclass(frozen=True)
class ExactAnswerScorer:
    """1.0 when the completion, stripped of surrounding whitespace, is the stripped answer.

    ``finished`` is ignored, as in ``MathAnswerScorer``: the verdict is on the text alone."""

    def score(self, problem: Problem, completion: str, finished: bool) -> float:
        return 1.0 if self.is_correct(problem, completion, finished) else 0.0

    def is_correct(self, problem: Problem, completion: str, finished: bool) -> bool:
        return completion.strip() == problem.answer.strip()


SCORERS = {"math": MathAnswerScorer, "exact": ExactAnswerScorer}


@dataclass
class DatasetConfig(TaskConfig):
    path: str | None
    prompt_key: str
    answer_key: str
    heldout_path: str | None
    heldout_size: int | None
    chat_template: bool
    prompt_prefix: str
    prompt_suffix: str
    bad_rows: str
    reward: str

    def rules(self) -> list[tuple[bool, str, str]]:
        files = f"a file ending in one of {list(SUFFIXES)}"
        return [
            (self.path is not None and _suffix_ok(self.path), "path", f"the data file (required): {files}"),
            (self.heldout_path is None or _suffix_ok(self.heldout_path), "heldout_path", f"null or {files}"),
            (
                self.heldout_size is None or self.heldout_size >= 1,
                "heldout_size",
                "an integer >= 1, or null with task.heldout_path (all its rows)",
            ),
            (
                self.heldout_size is not None or self.heldout_path is not None,
                "heldout_size",
                "an integer >= 1 (null only with task.heldout_path)",
            ),
            (
                self.heldout_path is None or self.heldout_path != self.path,
                "heldout_path",
                "null or a file other than task.path",
            ),
            (bool(self.prompt_key), "prompt_key", "a non-empty field name"),
            (bool(self.answer_key), "answer_key", "a non-empty field name"),
            (self.bad_rows in BAD_ROWS, "bad_rows", f"one of {list(BAD_ROWS)}"),
            (self.reward in SCORERS, "reward", f"one of {list(SCORERS)}"),
            *super().rules(),
        ]


def _suffix_ok(path: str) -> bool:
    return Path(path).suffix.lower() in SUFFIXES


class Task:
    Config = DatasetConfig

    def __init__(self, config: DatasetConfig, seed: int, tokenizer=None) -> None:
        """``config``: checked by its ``rules()`` (the launcher does, with the whole config)."""
        self.seed = seed
        self.skipped_rows: dict[str, int] = {}
        rows = self._read(config, "path")
        if config.heldout_path is None:
            if len(rows) - config.heldout_size < 1:
                raise ValueError(
                    f"task.heldout_size={config.heldout_size} leaves no train problems: "
                    f"task.path={config.path!r} has {len(rows)} usable rows; set task.heldout_size "
                    f"below {len(rows)} or give a separate task.heldout_path"
                )
            order = list(range(len(rows)))
            random.Random(seed).shuffle(order)
            heldout_rows = [rows[i] for i in order[: config.heldout_size]]
            train_rows = [rows[i] for i in sorted(order[config.heldout_size :])]
        else:
            train_rows = rows
            heldout_rows = self._read(config, "heldout_path")
            random.Random(seed).shuffle(heldout_rows)
            heldout_rows = heldout_rows[: config.heldout_size]
        format_prompt = _prompt_formatter(config, tokenizer)
        self.train_problems = [Problem(format_prompt(p), a) for p, a in train_rows]
        self.heldout: list[Problem] = [Problem(format_prompt(p), a) for p, a in heldout_rows]
        self.scorer = SCORERS[config.reward]()
        files = " + ".join(Path(p).name for p in (config.path, config.heldout_path) if p is not None)
        self.summary_line = (
            f"dataset {files}: {len(self.train_problems)} train / {len(self.heldout)} held-out problems"
            f"{_skipped_note(self.skipped_rows)}"
        )

    def _read(self, config: DatasetConfig, key: str) -> list[tuple[str, str]]:
        """(prompt, answer) of each usable row of the file at ``config.<key>``, in file order."""
        path = getattr(config, key)
        label = f"task.{key}={path!r}"
        file = Path(path).expanduser()
        if not file.is_file():
            raise ValueError(f"{label}: no such file ({file.resolve()})")
        read = _read_parquet if file.suffix.lower() == ".parquet" else _read_json_lines
        rows, skipped = [], 0
        for where, row in read(file, label, config.prompt_key, config.answer_key):
            problem = row if isinstance(row, str) else _check_row(row, config)
            if problem is None:
                rows.append((row[config.prompt_key], row[config.answer_key]))
                continue
            if config.bad_rows == "error":
                raise ValueError(f"{label} {where}: {problem} (task.bad_rows='error'; 'skip' skips such rows)")
            skipped += 1
        self.skipped_rows[path] = skipped
        if not rows:
            hint = " (a .json file must be JSON lines: one object per line)" if file.suffix.lower() == ".json" else ""
            raise ValueError(
                f"{label} has no usable rows ({skipped} bad rows skipped): each row needs string fields "
                f"task.prompt_key={config.prompt_key!r} and task.answer_key={config.answer_key!r}{hint}"
            )
        return rows

    def train_batches(self, batch_size: int, start: int = 0) -> Iterator[list[Problem]]:
        """Each epoch is a fresh seeded permutation of the train split."""
        return shuffled_batches(self.train_problems, batch_size, self.seed, start)

    def summary(self) -> str:
        return self.summary_line


def _check_row(row: dict, config: DatasetConfig) -> str | None:
    """What is wrong with a row's two fields, or None when it is usable."""
    for key in (config.prompt_key, config.answer_key):
        if key not in row:
            return f"no field {key!r}"
        if row[key] is None:
            return f"field {key!r} is null"
        if not isinstance(row[key], str):
            return f"field {key!r} is {type(row[key]).__name__}, not a string"
    return None


def _read_json_lines(file: Path, label: str, prompt_key: str, answer_key: str) -> Iterator[tuple[str, dict | str]]:
    """(where, the row's object or what is wrong with the line) per non-blank line; ``where`` is
    the 1-based line number."""
    with file.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:  # also bytes that are not UTF-8
                yield f"line {number}", f"not valid JSON ({e})"
                continue
            yield f"line {number}", row if isinstance(row, dict) else f"a JSON {type(row).__name__}, not an object"


def _read_parquet(file: Path, label: str, prompt_key: str, answer_key: str) -> Iterator[tuple[str, dict | str]]:
    """(where, the row's two fields) per row, reading only those two columns; ``where`` is the
    0-based row index. A null is a bad row; a column that does not hold strings is an error."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(file).names
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{label}: not a readable Parquet file ({e})") from e
    keys = {"task.prompt_key": prompt_key, "task.answer_key": answer_key}
    for config_key, column in keys.items():
        if column not in names:
            raise ValueError(f"{config_key}={column!r}: {label} has no such column; its columns: {names}")
    table = pq.read_table(file, columns=list(dict.fromkeys(keys.values())))
    for config_key, column in keys.items():
        kind = table.schema.field(column).type
        value_kind = kind.value_type if pa.types.is_dictionary(kind) else kind
        if not (pa.types.is_string(value_kind) or pa.types.is_large_string(value_kind)):
            raise ValueError(f"{config_key}={column!r}: that column of {label} holds {kind}, not strings")
    prompts, answers = table.column(prompt_key).to_pylist(), table.column(answer_key).to_pylist()
    for index, (prompt, answer) in enumerate(zip(prompts, answers)):
        yield f"row {index} (0-based)", {prompt_key: prompt, answer_key: answer}


def _prompt_formatter(config: DatasetConfig, tokenizer):
    """The function from a file's prompt to the text the policy continues."""
    prefix, suffix = config.prompt_prefix, config.prompt_suffix
    if not config.chat_template:
        return lambda prompt: f"{prefix}{prompt}{suffix}"
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "task.chat_template=True but the model's tokenizer has no chat template; "
            "set task.chat_template=false (prompts are then used as they are) or use a chat model"
        )

    def format_prompt(prompt: str) -> str:
        messages = [{"role": "user", "content": f"{prefix}{prompt}{suffix}"}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return format_prompt


def _skipped_note(skipped: dict[str, int]) -> str:
    total = sum(skipped.values())
    note = f" ({total} bad row{'s' * (total != 1)} skipped"
    if not total:
        return ""
    if sum(1 for n in skipped.values() if n) == 1:
        return f"{note})"
    return f"{note}: {', '.join(f'{n} in {Path(p).name}' for p, n in skipped.items() if n)})"
