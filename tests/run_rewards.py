"""Reward functions that misbehave, for whole runs (``task.reward_fn=tests.run_rewards:<name>``).

Imported by the reward actor's scoring process, which inherits the launcher's environment."""

from __future__ import annotations

import os
import time
from pathlib import Path


def misbehaving(prompt: str, completion: str, answer: str, finished: bool) -> float:
    """The exact-match reward, except: a completion ending in 1 raises, one ending in 2 scores NaN,
    and the first call after ``RLSYS_TEST_HANG_ONCE`` names a file that does not exist yet hangs
    (it makes the file first, so later calls do not)."""
    marker = os.environ.get("RLSYS_TEST_HANG_ONCE")
    if marker and not Path(marker).exists():
        Path(marker).touch()
        time.sleep(3600)
    if completion.endswith("1"):
        raise ValueError(f"cannot score {completion!r}")
    if completion.endswith("2"):
        return float("nan")
    return 1.0 if finished and completion == answer else 0.0
