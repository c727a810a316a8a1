"""Where a run's rows go besides ``metrics.jsonl``: TensorBoard event files and Weights & Biases.

Both are optional (``pip install -e '.[log]'``) and chosen with ``logger=tensorboard``,
``logger=wandb`` or ``logger=[tensorboard,wandb]``. Every number of a step's row is logged at that
step under the same key as in ``metrics.jsonl``.
"""

from __future__ import annotations

import importlib.util
import math
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from validation.config import ConfigError

# logger name -> the package it needs
BACKENDS = {"tensorboard": "tensorboard", "wandb": "wandb"}
WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class WandbConfig:
    project: str
    # null: your default entity (W&B's login).
    entity: str | None
    # online, offline (no network; `wandb sync` the run folder's wandb/ later), disabled, or null:
    # W&B decides (WANDB_MODE, else online).
    mode: str | None

    def rules(self) -> list[tuple[bool, str, str]]:
        return [
            (bool(self.project.strip()), "project", "a non-empty W&B project name"),
            (self.mode is None or self.mode in WANDB_MODES, "mode", f"one of {list(WANDB_MODES)} or null"),
        ]


def logger_names(logger: Any) -> list[str]:
    """``logger`` as given (``[]``, a name, or a list of names) as a list of known names whose
    package is installed; ``ConfigError`` names what is wrong."""
    names = [logger] if isinstance(logger, str) else list(logger or [])
    for name in names:
        if name not in BACKENDS:
            raise ConfigError(f"config key logger={logger!r} is invalid: expected any of {list(BACKENDS)} (or [])")
        if importlib.util.find_spec(BACKENDS[name]) is None:
            raise ConfigError(f"logger={name} needs the {BACKENDS[name]} package: pip install -e '.[log]'")
    return list(dict.fromkeys(names))


def _numbers(row: dict) -> dict[str, float]:
    """The row's finite numbers (bools and the step itself left out)."""
    return {
        key: float(value)
        for key, value in row.items()
        if key != "step" and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    }


class TensorBoardTracker:
    """Event files in ``<out>/tensorboard``; a resumed run first hides the events of the steps it
    redoes (TensorBoard's ``purge_step``)."""

    def __init__(self, out_dir: Path, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = out_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.dir), purge_step=start_step or None)

    def log(self, row: dict) -> None:
        for key, value in _numbers(row).items():
            self.writer.add_scalar(key, value, global_step=row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run named like the run, its files under ``<out>/wandb``, the resolved config as its
    config. A resumed run continues the same W&B run (its id is kept in ``<out>/wandb_run_id``);
    W&B ignores rows of steps it has already seen, so the steps a resume redoes keep their first
    values there."""

    def __init__(self, out_dir: Path, run_name: str, cfg: WandbConfig, config: dict, resume: bool) -> None:
        import wandb

        id_file = out_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume and id_file.exists() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=run_name,
            id=run_id,
            resume="allow",
            dir=str(out_dir),
            mode=cfg.mode,
            config=config,
            # The console stays ours (rich's live display); W&B gets the rows.
            settings=wandb.Settings(console="off"),
        )

    def log(self, row: dict) -> None:
        self.run.log(_numbers(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """The chosen trackers as one. A tracker that fails mid-run is dropped with a warning; the
    run goes on (its rows are still in ``metrics.jsonl``)."""

    def __init__(self, trackers: list, console) -> None:
        self.trackers = trackers
        self.console = console

    def log(self, row: dict) -> None:
        for tracker in list(self.trackers):
            try:
                tracker.log(row)
            except Exception as e:  # noqa: BLE001 (a tracker must not end the training run)
                self.console.print(f"[yellow]warning: {type(tracker).__name__} failed ({e}); no longer logging to it")
                self.trackers.remove(tracker)

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as e:  # noqa: BLE001
                self.console.print(f"[yellow]warning: closing {type(tracker).__name__} failed ({e})")
        self.trackers = []


def open_trackers(
    names: list[str], out_dir: Path, run_name: str, wandb_cfg: WandbConfig, config: dict, start_step: int, console
) -> Trackers:
    """Start the named trackers (before any actor, so that a W&B login error comes first)."""
    trackers: list = []
    try:
        for name in names:
            if name == "tensorboard":
                trackers.append(TensorBoardTracker(out_dir, start_step))
                console.print(f"tensorboard: tensorboard --logdir {trackers[-1].dir}")
            else:
                trackers.append(WandbTracker(out_dir, run_name, wandb_cfg, config, resume=start_step > 0))
    except Exception as e:
        Trackers(trackers, console).close()
        raise ConfigError(f"logger={name}: could not start ({type(e).__name__}: {e})") from e
    return Trackers(trackers, console)
