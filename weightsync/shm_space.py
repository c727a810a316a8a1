"""Room in the shared-memory data plane: what a run needs, what is free, and a clear error.

A run with ``data_plane=shm`` keeps ``keep_last`` versions of every trainer rank's shard in
``shm_root`` (a tmpfs, usually /dev/shm) plus the one being written. Containers often give
/dev/shm 64 MiB; without a check the first push that does not fit fails deep inside DCP. The
launcher checks from the checkpoint's tensor sizes before starting any actor, each trainer rank
again from its own shard when it reserves its files (``WeightPusher.reserve``), and a push that
still runs out of space fails with ``NotEnoughSharedMemory`` saying what to change.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import torch

from weightsync.failures import caused_by

HEADER_SLACK = 64 * 2**10  # room a shard file needs for its safetensors header (+ 512 per tensor)
SHM_REMEDIES = (
    "Give the machine more shared memory (in a container: docker run --shm-size=...), point "
    "weightsync.shm_root at a tmpfs with room, lower weightsync.keep_last, or push through Redis "
    "(weightsync.data_plane=redis)."
)


class NotEnoughSharedMemory(RuntimeError):
    """``shm_root`` cannot hold the shard files a run keeps (found at start, or by a push that ran
    out of space)."""


def free_bytes(path: str | Path) -> int:
    """Bytes free to us on the filesystem of ``path`` (or of its nearest existing folder)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def check_shm_room(shm_root: str | Path, free: int, ranks: int, file_bytes: int, keep_last: int, delta: bool) -> None:
    """Raise ``NotEnoughSharedMemory`` unless ``free`` bytes hold the shard files a run keeps:
    ``keep_last + 1`` per rank (the kept versions and the one being written; 1 with delta sync,
    whose later shards are small), each ``file_bytes``, all ranks on one host."""
    needed = 1 if delta else keep_last + 1
    total = needed * ranks * file_bytes
    if free >= total:
        return
    kept = "" if delta else f": weightsync.keep_last={keep_last} + the one being written"
    raise NotEnoughSharedMemory(
        f"weight sync needs {total / 2**20:.1f} MiB of shared memory in {shm_root} ({ranks} trainer "
        f"rank(s) x {needed} shard file(s) of {file_bytes / 2**20:.1f} MiB{kept}), but only "
        f"{free / 2**20:.1f} MiB are free. " + SHM_REMEDIES
    )


def shard_file_bytes(numel: int, dtype: torch.dtype, tensors: int) -> int:
    """Bytes of a shard file holding ``numel`` elements of ``dtype`` in ``tensors`` tensors, with
    room for its safetensors header."""
    return numel * torch.empty(0, dtype=dtype).element_size() + HEADER_SLACK + 512 * tensors


def no_space(exc: BaseException) -> bool:
    """Was ``exc`` (or a failure DCP wrapped in it, or its cause) "No space left on device"?"""
    return caused_by(exc, lambda e: isinstance(e, OSError) and e.errno == errno.ENOSPC)
