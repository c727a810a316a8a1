"""Checkpoint folders: ``<root>/step_<N>/`` when complete, ``<root>/.step_<N>.tmp/`` while written.

A checkpoint is written under its temporary name and renamed when every part of it is on disk,
so a folder named ``step_<N>`` is always complete; a crash leaves only a ``.tmp`` folder, which
is never read and is cleaned up by the next run. Older checkpoints are removed only after a newer
one is complete, so a failed save never costs the previous good checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

LOOP_STATE = "loop_state.json"  # written last into a checkpoint, by the controller
_COMPLETE = re.compile(r"^step_(\d+)$")
_PARTIAL = re.compile(r"^\.step_(\d+)\.tmp$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing, partial, corrupt, or from another model)."""


def final_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step}"


def tmp_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f".step_{step}.tmp"


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _COMPLETE.match(child.name)
        if m and child.is_dir():
            found.append((int(m.group(1)), child))
    return sorted(found)


def newest_checkpoint(root: str | Path) -> tuple[int, Path]:
    found = complete_checkpoints(root)
    if not found:
        partial = sorted(p.name for p in Path(root).glob(".step_*.tmp")) if Path(root).is_dir() else []
        note = f" (only unfinished ones: {partial})" if partial else ""
        raise CheckpointError(f"no complete checkpoint in {root}{note}; nothing to resume from")
    return found[-1]


def remove_partial(root: str | Path) -> list[Path]:
    """Delete unfinished checkpoint folders a crashed run left behind; returns them."""
    root = Path(root)
    removed = [p for p in root.iterdir() if _PARTIAL.match(p.name)] if root.is_dir() else []
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def publish(tmp: Path, step_dir: Path) -> None:
    """Make a fully written checkpoint visible under its final name (an atomic rename)."""
    if step_dir.exists():  # the same step saved again after a resume: replace it
        old = step_dir.with_name(f".{step_dir.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(step_dir, old)
        os.rename(tmp, step_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, step_dir)


def prune(root: str | Path, keep_last: int) -> list[Path]:
    """Delete complete checkpoints older than the newest ``keep_last``; returns them."""
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1")
    old = [path for _, path in complete_checkpoints(root)[:-keep_last]]
    for path in old:
        shutil.rmtree(path)
    return old
