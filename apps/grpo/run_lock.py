"""One live launcher per run name on a host: an advisory lock held for the run's whole life.

The launcher removes what a run of its name left in shared memory (``{shm_root}/ws-{run}``):
files that a killed run can no longer use. Without a lock it could not tell those from the files
of a run of that name still going on this host (started with another ``output_dir``, or with
``overwrite=true``), and would pull its weights from under it. ``RunLock`` takes ``flock`` on
``{shm_root}/ws-{run}.lock``; the kernel drops the lock when its holder dies, however it dies,
so a lock that can be taken proves no launcher of this run is alive here.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


class RunLocked(RuntimeError):
    """Another live process holds the run's lock."""


def lock_path(shm_root: str | Path, run: str) -> Path:
    return Path(shm_root) / f"ws-{run}.lock"


class RunLock:
    """``with RunLock(path):`` holds the lock (and writes this process's pid in the file for the
    message another launcher shows), or raises ``RunLocked`` naming the holder's pid."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunLocked(f"pid {holder}") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)  # releases the lock
        self._fd = None
