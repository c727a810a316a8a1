"""What a run shows and keeps of its steps: ``metrics.jsonl`` and the console's progress."""

from __future__ import annotations

import json
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class RunLog:
    """Appends one JSON row per step to ``<out>/metrics.jsonl`` and shows progress: a live bar on
    a terminal, else (CI, a log file) a line every 10 steps. A resumed run first drops the rows
    of the steps it will redo. Use as a context manager."""

    def __init__(self, out_dir: Path, console, title: str, steps: int, start: int, last_eval: float) -> None:
        self.path = out_dir / "metrics.jsonl"
        self.console = console
        self.steps = steps
        _keep_rows_before(self.path, start)
        columns = [
            TextColumn(f"[bold]{title}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("reward {task.fields[reward]:.3f}  eval {task.fields[eval]:.3f}  Δlogp {task.fields[diff]:.1e}"),
        ]
        self.progress = Progress(*columns, console=console)
        self.bar = self.progress.add_task(title, total=steps, completed=start, reward=0.0, eval=last_eval, diff=0.0)
        self.last_eval = last_eval

    def __enter__(self) -> RunLog:
        self.file = open(self.path, "a")  # noqa: SIM115 (closed in __exit__)
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)
        self.file.close()

    def _write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def step(self, row: dict) -> None:
        """Keep a finished step's row and show it."""
        self._write(row)
        self.last_eval = row.get("eval_accuracy", self.last_eval)
        self.progress.update(
            self.bar, advance=1, reward=row["reward_mean"], eval=self.last_eval, diff=row["logprob_diff_mean"]
        )
        step = row["step"]
        if not self.console.is_terminal and (step % 10 == 0 or step == self.steps - 1):
            self.console.print(
                f"step {step + 1}/{self.steps}: reward {row['reward_mean']:.3f}, eval {self.last_eval:.3f}, "
                f"logprob diff {row['logprob_diff_mean']:.1e}, step {row['step_s']:.2f}s"
            )

    def final(self, eval_accuracy: float, policy_version: int) -> None:
        row = {"step": self.steps, "final": True, "eval_accuracy": eval_accuracy, "policy_version": policy_version}
        self._write(row)


def _keep_rows_before(path: Path, step: int) -> None:
    """Drop the metric rows of steps a resumed run will redo (and a previous final line)."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line, row in zip(lines, map(json.loads, lines)) if not row.get("final") and row["step"] < step]
    path.write_text("".join(line + "\n" for line in kept))
