"""LR schedules against torch's own schedulers; checkpoint folders; the DCP GC toggle."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from algos.schedule import lr_multiplier
from checkpointing import dcp_io, folders


def _torch_rates(scheduler_cls, steps: int, **kwargs) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = scheduler_cls(opt, **kwargs)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


@pytest.mark.parametrize("min_ratio", [0.0, 0.1])
def test_decay_matches_torch_schedulers(min_ratio):
    total = 12
    cosine = _torch_rates(torch.optim.lr_scheduler.CosineAnnealingLR, total, T_max=total, eta_min=min_ratio)
    linear = _torch_rates(
        torch.optim.lr_scheduler.LinearLR, total, start_factor=1.0, end_factor=min_ratio, total_iters=total
    )
    for step in range(total):
        assert lr_multiplier(step, total, 0, "cosine", min_ratio) == pytest.approx(cosine[step], abs=1e-9)
        assert lr_multiplier(step, total, 0, "linear", min_ratio) == pytest.approx(linear[step], abs=1e-9)
        assert lr_multiplier(step, total, 0, "constant") == 1.0


def test_warmup_then_decay_towards_min():
    rates = [lr_multiplier(s, 10, 3, "cosine", 0.2) for s in range(11)]
    assert rates[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert rates[9] > 0.2 and rates[10] == pytest.approx(0.2)  # the last step (9) still trains
    assert all(a > b for a, b in zip(rates[3:], rates[4:]))
    with pytest.raises(ValueError, match="schedule"):
        lr_multiplier(0, 10, 0, "step")


def test_publish_prune_and_partial(tmp_path):
    for step in (2, 4, 6):
        tmp = folders.tmp_dir(tmp_path, step)
        tmp.mkdir()
        (tmp / "x").write_text(str(step))
        folders.publish(tmp, folders.final_dir(tmp_path, step))
    folders.tmp_dir(tmp_path, 8).mkdir()  # a save that never finished
    assert [s for s, _ in folders.complete_checkpoints(tmp_path)] == [2, 4, 6]
    assert folders.newest_checkpoint(tmp_path)[0] == 6  # the unfinished step 8 is never picked
    assert [p.name for p in folders.prune(tmp_path, 2)] == ["step_2"]
    assert [p.name for p in folders.remove_partial(tmp_path)] == [".step_8.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4", "step_6"]
    # Saving a step again (after a resume) replaces it.
    tmp = folders.tmp_dir(tmp_path, 6)
    tmp.mkdir()
    (tmp / "x").write_text("again")
    folders.publish(tmp, folders.final_dir(tmp_path, 6))
    assert (folders.final_dir(tmp_path, 6) / "x").read_text() == "again"


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(folders.CheckpointError, match="no complete checkpoint"):
        folders.newest_checkpoint(tmp_path / "missing")
    folders.tmp_dir(tmp_path, 3).mkdir()
    with pytest.raises(folders.CheckpointError, match=r"only unfinished ones: \['.step_3.tmp'\]"):
        folders.newest_checkpoint(tmp_path)


def _gc_state_during_planning(monkeypatch, tmp_path, async_save: bool) -> list[bool]:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    seen = []
    plan = DefaultSavePlanner.create_local_plan
    stage = FileSystemWriter.stage

    def recording_plan(self):
        seen.append(("plan", gc.isenabled()))
        return plan(self)

    def recording_stage(self, state_dict):
        seen.append(("stage", gc.isenabled()))
        return stage(self, state_dict)

    monkeypatch.setattr(DefaultSavePlanner, "create_local_plan", recording_plan)
    monkeypatch.setattr(FileSystemWriter, "stage", recording_stage)
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    future = dcp_io.save(state, tmp_path, async_save=async_save)
    if future is not None:
        future.result()
    loaded = {"w": torch.zeros(2, 3)}
    dcp_io.load(loaded, tmp_path)
    assert torch.equal(loaded["w"], state["w"])
    return seen


@pytest.mark.parametrize("async_save", [False, True])
def test_gc_is_paused_during_dcp_planning_and_staging(monkeypatch, tmp_path, async_save):
    assert gc.isenabled()
    monkeypatch.setenv(dcp_io.GC_ENV, "1")
    seen = _gc_state_during_planning(monkeypatch, tmp_path / "on", async_save)
    assert ("plan", False) in seen and not any(enabled for _, enabled in seen)
    if async_save:
        assert ("stage", False) in seen
    assert gc.isenabled()  # and switched back on afterwards
    from torch.distributed.checkpoint.planner import SavePlanner

    assert "training-state" in SavePlanner._cached_global_plan  # plans are cached for the next save

    monkeypatch.setenv(dcp_io.GC_ENV, "0")
    seen = _gc_state_during_planning(monkeypatch, tmp_path / "off", async_save)
    assert seen and all(enabled for _, enabled in seen)


def test_gc_env_value_is_checked(monkeypatch):
    monkeypatch.setenv(dcp_io.GC_ENV, "maybe")
    with pytest.raises(ValueError, match=dcp_io.GC_ENV):
        dcp_io.gc_pause_enabled()


def test_gc_pause_nests():
    with dcp_io.gc_paused():
        with dcp_io.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


class _FailingTrainer:
    """Stands in for the trainer group: its save fails midway, after writing part of a shard."""

    def save_checkpoint(self, path, async_save):
        (Path(path) / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    def wait_for_checkpoint(self):
        pass


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path):
    from types import SimpleNamespace

    from rich.console import Console

    from apps.grpo.checkpoints import Checkpointer, LoopState

    good = folders.final_dir(tmp_path / "checkpoints", 2)
    good.mkdir(parents=True)
    (good / folders.LOOP_STATE).write_text("{}")
    cfg = SimpleNamespace(every=2, keep_last=1, async_save=False)
    actors = SimpleNamespace(trainer=_FailingTrainer(), critic=None)
    checkpointer = Checkpointer(cfg, tmp_path, actors, Console(quiet=True))
    with pytest.raises(OSError, match="disk full"):
        checkpointer.save(LoopState(4, 4, 4, 0.0, 0.0))
    assert folders.newest_checkpoint(tmp_path / "checkpoints") == (2, good)  # keep_last=1 pruned nothing
    assert (good / folders.LOOP_STATE).exists()
