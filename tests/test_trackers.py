"""TensorBoard and W&B trackers: what they write is read back with each library's own reader
(TensorBoard's EventAccumulator; W&B's protobuf records: tests/tracker_files.py)."""

from __future__ import annotations

import time

import pytest
from rich.console import Console

from apps.grpo.config import compose_config
from apps.grpo.trackers import TensorBoardTracker, Trackers, WandbConfig, WandbTracker, logger_names
from tests.tracker_files import history, run_ids, tensorboard_scalars
from validation.config import ConfigError


def _rows(steps, scale=1.0):
    return [
        {"step": s, "reward_mean": scale * s / 10, "kl": 1e-3 * s, "gen_s": 0.5, "final": False, "note": "x"}
        for s in steps
    ]


def test_logger_names_accept_a_name_or_a_list_and_name_a_bad_one():
    assert logger_names([]) == [] and logger_names(None) == []
    assert logger_names("tensorboard") == ["tensorboard"]
    assert logger_names(["wandb", "tensorboard", "wandb"]) == ["wandb", "tensorboard"]
    with pytest.raises(ConfigError, match=r"logger='mlflow' is invalid: expected any of \['tensorboard', 'wandb'\]"):
        logger_names("mlflow")
    cfg = compose_config("logger=[tensorboard,wandb]", "wandb.mode=offline", "wandb.project=p")
    assert cfg.logger == ["tensorboard", "wandb"] and cfg.wandb == WandbConfig("p", None, "offline")
    with pytest.raises(ConfigError, match="config key wandb.mode='cloud' is invalid"):
        compose_config("wandb.mode=cloud")


def test_tensorboard_gets_every_number_and_a_resume_replaces_the_redone_steps(tmp_path):
    tracker = TensorBoardTracker(tmp_path, start_step=0)
    for row in _rows(range(5)):
        tracker.log(row)
    tracker.close()
    tracker = TensorBoardTracker(tmp_path, start_step=3)  # resumed from the step-3 checkpoint
    for row in _rows(range(3, 6), scale=2.0):
        tracker.log(row)
    tracker.close()

    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert set(scalars) == {"reward_mean", "kl", "gen_s"}  # strings, bools and the step are not scalars
    expected = [(s, s / 10) for s in range(3)] + [(s, 2 * s / 10) for s in range(3, 6)]
    assert [(s, pytest.approx(v)) for s, v in expected] == scalars["reward_mean"]


def test_wandb_offline_logs_every_row_and_a_resume_continues_the_same_run(tmp_path):
    cfg = WandbConfig(project="rlsys-test", entity=None, mode="offline")
    tracker = WandbTracker(tmp_path, "run-a", cfg, {"steps": 6, "algo": {"name": "grpo"}}, resume=False)
    for row in _rows(range(3)):
        tracker.log(row)
    tracker.close()
    # W&B names a run's folder by its start time, to the second: a resume started within the same
    # second as the first run would share its folder (a real resume restarts the whole run first).
    time.sleep(1.0 - time.time() % 1.0 + 0.01)
    tracker = WandbTracker(tmp_path, "run-a", cfg, {"steps": 6}, resume=True)
    for row in _rows(range(3, 5)):
        tracker.log(row)
    tracker.close()

    first, second = sorted((tmp_path / "wandb").glob("offline-run-*"))
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    assert run_ids(tmp_path / "wandb") == [run_id, run_id]
    rows = history(first) + history(second)
    assert [r["_step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["reward_mean"] for r in rows] == pytest.approx([s / 10 for s in range(5)])
    assert all("note" not in r and "final" not in r for r in rows)


def test_a_tracker_that_fails_is_dropped_with_a_warning_and_the_others_go_on(tmp_path):
    class Broken:
        def log(self, row):
            raise RuntimeError("quota exceeded")

        def close(self):
            pass

    console = Console(record=True, width=200)
    good = TensorBoardTracker(tmp_path, start_step=0)
    trackers = Trackers([Broken(), good], console)
    for row in _rows(range(3)):
        trackers.log(row)
    trackers.close()
    assert console.export_text().count("Broken failed (quota exceeded); no longer logging to it") == 1
    assert [s for s, _ in tensorboard_scalars(tmp_path / "tensorboard")["kl"]] == [0, 1, 2]
