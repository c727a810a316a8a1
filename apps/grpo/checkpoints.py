"""The run's checkpoints: when to save, what the controller adds, publishing, resuming."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from actors.rank_groups import RankGroup
from apps.grpo.config import CheckpointConfig
from apps.grpo.start import Actors
from checkpointing import folders

CRITIC_FOLDER = "critic"  # the critic ranks' part of a checkpoint step folder


@dataclass
class LoopState:
    """The controller's part of a checkpoint: where the run is (the rank groups save their own).

    The replay buffer is empty between steps (each step takes all it added) and rollout seeds
    derive from ``seed`` and the step, so these few numbers are all the controller needs.
    """

    step: int  # the next step to run
    data_cursor: int  # train batches consumed
    policy_version: int
    eval_accuracy_start: float
    last_eval: float

    @staticmethod
    def load(folder: Path) -> LoopState:
        try:
            return LoopState(**json.loads((folder / folders.LOOP_STATE).read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise folders.CheckpointError(f"checkpoint {folder} has no valid {folders.LOOP_STATE}: {e}") from e


def rank_groups(actors: Actors) -> dict[str, RankGroup]:
    """Each rank group with training state, by its sub-folder in a checkpoint ("": the step folder)."""
    groups: dict[str, RankGroup] = {"": actors.trainer}
    if actors.critic is not None:
        groups[CRITIC_FOLDER] = actors.critic
    return groups


class Checkpointer:
    """Saves checkpoints every ``checkpoint.every`` steps into ``<out>/checkpoints``; keeps the last K.

    Each is written under a temporary name and published by a rename once every rank group's
    shards and the loop state are on disk (with ``async_save``, at a later step boundary).
    """

    def __init__(self, cfg: CheckpointConfig, out_dir: Path, actors: Actors, console) -> None:
        self.every, self.keep_last, self.async_save = cfg.every, cfg.keep_last, cfg.async_save
        self.root = out_dir / "checkpoints"
        self.groups = rank_groups(actors)
        self.console = console
        self.pending: tuple[Path, Path] | None = None

    def due(self, step_done: int, last: bool) -> bool:
        return self.every > 0 and (step_done % self.every == 0 or last)

    def save(self, state: LoopState) -> None:
        self.finish()
        tmp, final = folders.tmp_dir(self.root, state.step), folders.final_dir(self.root, state.step)
        if tmp.exists():
            shutil.rmtree(tmp)
        t0 = time.perf_counter()
        for sub, group in self.groups.items():
            folder = tmp / sub
            folder.mkdir(parents=True)
            group.save_checkpoint(str(folder.resolve()), self.async_save)
        (tmp / folders.LOOP_STATE).write_text(json.dumps(dataclasses.asdict(state)))
        self.pending = (tmp, final)
        if not self.async_save:
            self.finish()
        what = "staged (written in the background)" if self.async_save else "saved"
        self.console.print(f"checkpoint {final} {what} in {time.perf_counter() - t0:.1f}s")

    def poll(self) -> None:
        """Publish a pending async save as soon as every rank has written it (never blocks)."""
        if self.pending is not None and all(g.checkpoint_written() for g in self.groups.values()):
            self.finish()

    def finish(self) -> None:
        """Wait for a pending save, publish it, and drop checkpoints beyond ``keep_last``."""
        if self.pending is None:
            return
        tmp, final = self.pending
        self.pending = None
        for group in self.groups.values():
            group.wait_for_checkpoint()
        folders.publish(tmp, final)
        folders.prune(self.root, self.keep_last)


def resume_from_checkpoint(actors: Actors, out_dir: Path, console) -> LoopState:
    """Load the newest complete checkpoint into the rank groups and give the policy its weights."""
    root = out_dir / "checkpoints"
    for partial in folders.remove_partial(root):
        console.print(f"removed unfinished checkpoint {partial}")
    step, folder = folders.newest_checkpoint(root)
    state = LoopState.load(folder)
    for sub, group in rank_groups(actors).items():
        if not (folder / sub).is_dir():
            raise folders.CheckpointError(
                f"checkpoint {folder} has no {sub}/ folder: it was written by a run without a critic"
            )
        group.load_checkpoint(str((folder / sub).resolve()))
    actors.trainer.push_weights(state.policy_version)
    actors.policy.update(state.policy_version)
    console.print(f"resumed from {folder} (step {step}, policy version {state.policy_version})")
    return state
