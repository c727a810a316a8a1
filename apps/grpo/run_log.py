"""What a run shows and keeps of its steps: ``metrics.jsonl`` and the console's progress."""

from __future__ import annotations

import json
from pathlib import Path

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

# The phases a step's time is shown in, by their metric key; those a run does not have are left out.
PHASES = {
    "eval": "eval_s",
    "gen": "gen_s",
    "reward": "reward_s",
    "ref": "reference_s",
    "critic": "critic_s",
    "train": "train_s",
    "sync": "weight_sync_s",
}


def phase_times(row: dict) -> str:
    """A step's time by phase, e.g. ``gen 0.41 reward 0.02 train 0.30 sync 0.05 s``."""
    return " ".join(f"{name} {row[key]:.2f}" for name, key in PHASES.items() if key in row) + " s"


class RunLog:
    """Appends one JSON row per step to ``<out>/metrics.jsonl`` (and hands it to ``trackers``: TensorBoard,
    W&B) and shows progress: a live bar on
    a terminal (ETA, reward, eval accuracy, KL, the last step's phase times), else (CI, a log
    file) a line every 10 steps. A resumed run first drops the rows
    of the steps it will redo. Use as a context manager."""

    def __init__(
        self, out_dir: Path, console, title: str, steps: int, start: int, last_eval: float, trackers=None
    ) -> None:
        self.path = out_dir / "metrics.jsonl"
        self.trackers = trackers
        self.console = console
        self.steps = steps
        _keep_rows_before(self.path, start)
        columns = [
            TextColumn(f"[bold]{title}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn(
                "reward {task.fields[reward]:.3f}  eval {task.fields[eval]:.3f}  kl {task.fields[kl]:.1e}  "
                "Δlogp {task.fields[diff]:.1e}  {task.fields[phases]}"
            ),
        ]
        self.progress = Progress(*columns, console=console)
        self.bar = self.progress.add_task(
            title, total=steps, completed=start, reward=0.0, eval=last_eval, kl=0.0, diff=0.0, phases=""
        )
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
        if self.trackers is not None:
            self.trackers.log(row)

    def step(self, row: dict) -> None:
        """Keep a finished step's row and show it."""
        self._write(row)
        self.last_eval = row.get("eval_accuracy", self.last_eval)
        phases = phase_times(row)
        self.progress.update(
            self.bar,
            advance=1,
            reward=row["reward_mean"],
            eval=self.last_eval,
            kl=row["kl"],
            diff=row["logprob_diff_mean"],
            phases=phases,
        )
        step = row["step"]
        if not self.console.is_terminal and (step % 10 == 0 or step == self.steps - 1):
            self.console.print(
                f"step {step + 1}/{self.steps}: reward {row['reward_mean']:.3f}, eval {self.last_eval:.3f}, "
                f"kl {row['kl']:.1e}, logprob diff {row['logprob_diff_mean']:.1e}, step {row['step_s']:.2f}s "
                f"({phases})"
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
