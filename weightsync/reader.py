"""Read exactly the wanted boxes of stored tensors from a committed version.

A box of a global tensor is intersected with the version's stored chunks; each overlap is read
from the chunk's safetensors file with ``get_slice`` on the mmap (only those bytes are touched)
and copied into the destination view. Nothing is unpickled.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from weightsync.layout import Box
from weightsync.store import Chunk, TensorEntry


class ShardFiles:
    """Open safetensors handles for one version's shard files, opened once and reused."""

    def __init__(self) -> None:
        self._handles: dict[str, object] = {}

    def handle(self, file: str):
        h = self._handles.get(file)
        if h is None:
            if not Path(file).is_file():
                raise FileNotFoundError(
                    f"weight shard {file} is missing: the version was dropped or the trainer runs on "
                    "another host (the shared-memory data plane needs the policy on the trainer's host)"
                )
            h = self._handles[file] = safe_open(file, framework="pt")
        return h

    def close(self) -> None:
        self._handles.clear()


def _overlap(box: Box, chunk: Chunk) -> Box | None:
    out = []
    for (start, stop), off, size in zip(box, chunk.offsets, chunk.sizes):
        lo, hi = max(start, off), min(stop, off + size)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def read_box(fqn: str, entry: TensorEntry, box: Box, dst: torch.Tensor, files: ShardFiles) -> int:
    """Copy ``box`` of the stored global tensor ``fqn`` into ``dst`` (shaped like the box).

    Returns the number of bytes read. Raises if the stored chunks do not cover the box.
    """
    if len(box) != len(entry.shape) or any(hi > n for (_, hi), n in zip(box, entry.shape)):
        raise ValueError(f"{fqn}: wanted box {box} does not fit the stored shape {entry.shape}")
    covered = 0
    nbytes = 0
    for chunk in entry.chunks:
        part = _overlap(box, chunk)
        if part is None:
            continue
        src = tuple(slice(lo - off, hi - off) for (lo, hi), off in zip(part, chunk.offsets))
        dst_idx = tuple(slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(part, box))
        data = files.handle(chunk.location["file"]).get_slice(fqn)[src]
        dst[dst_idx].copy_(data)
        covered += data.numel()
        nbytes += data.numel() * data.element_size()
    expected = 1
    for lo, hi in box:
        expected *= hi - lo
    if covered != expected:
        raise RuntimeError(f"{fqn}: stored chunks cover {covered} of the {expected} wanted elements of box {box}")
    return nbytes
