"""The launcher's run lock: one live launcher per run name on a host, released however it dies."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from apps.grpo.run_lock import RunLock, RunLocked, lock_path

REPO = Path(__file__).resolve().parent.parent


def test_a_held_lock_is_refused_with_the_holders_pid_and_free_again_after(tmp_path):
    path = lock_path(tmp_path / "shm", "r")
    with RunLock(path):
        with pytest.raises(RunLocked, match=f"pid {os.getpid()}"), RunLock(path):
            pass
        assert path.exists()
    assert not path.exists()  # removed at the end
    with RunLock(path):
        pass


def test_the_lock_of_a_killed_launcher_can_be_taken(tmp_path):
    path = lock_path(tmp_path, "r")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import time; from apps.grpo.run_lock import RunLock\nwith RunLock({str(path)!r}):\n"
            "    print('held', flush=True); time.sleep(120)",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLocked, match=f"pid {holder.pid}"), RunLock(path):
            pass
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert path.exists()  # a killed holder leaves its file, not its lock
        with RunLock(path):
            pass
    finally:
        holder.kill()
        holder.wait()
