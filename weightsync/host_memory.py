"""Shard files mapped into this process, registered with CUDA as pinned memory, kept across versions.

On a GPU, copies between device memory and ordinary (pageable) host memory go through the
driver's small staging buffers at a fraction of the bus's speed; copies to and from memory
registered with ``cudaHostRegister`` are DMA at full speed and can run asynchronously on a
stream. A shard file in ``/dev/shm`` mapped with ``MAP_SHARED`` is the file's own page-cache
pages, so registering the mapping lets a trainer rank DMA its shard from the GPU straight into
the file, and a vLLM worker DMA its slices from the file straight into its parameters: no copy
of the shard anywhere else.

Registering pins every page, which costs time in proportion to the mapping's size, so mappings
are kept and reused: shard files are recycled (a retired version's file becomes a spare that a
later push writes over, renamed but the same inode), and a mapping is looked up by the file's
device, inode and size. A mapping whose file was unlinked (it would pin memory the file system
has already given up) or changed size is dropped at the next lookup (``prune``).

The pinned pages are the file's pages only while the file keeps its size: a file truncated
shorter loses the pages past its new end, and grown again gets new ones, which a mapping that
pinned the old ones would not see. Writers that publish files for pinned readers therefore never
resize a file in place (``weightsync.shm_writer``: files for pinned readers are written at
their final size, and a spare of another size is not reused for them), and readers keep a
mapping only for files the index marks as such (``pinnable``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass

import torch


def _register(ptr: int, nbytes: int) -> None:
    cudart = torch.cuda.cudart()
    torch.cuda.check_error(cudart.cudaHostRegister(ptr, nbytes, 0))


def _unregister(ptr: int) -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ptr))


@dataclass
class MappedFile:
    """One file mapped ``MAP_SHARED`` read-write; ``bytes`` is a uint8 tensor over the mapping
    (pinned for CUDA when ``registered``)."""

    path: str
    key: tuple[int, int, int]  # (device, inode, size)
    fd: int
    map: mmap.mmap
    bytes: torch.Tensor
    registered: bool = False

    @classmethod
    def open(cls, path: str, register: bool) -> MappedFile:
        fd = os.open(path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            mapping = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        mapped = cls(path, (st.st_dev, st.st_ino, st.st_size), fd, mapping, tensor)
        if register:
            try:
                _register(tensor.data_ptr(), st.st_size)
            except BaseException:
                mapped.close()
                raise
            mapped.registered = True
        return mapped

    def current(self) -> bool:
        """The file still exists under some name and has the size it was mapped with."""
        st = os.fstat(self.fd)
        return st.st_nlink > 0 and st.st_size == self.key[2]

    def close(self) -> None:
        """Unregister and unmap (after any copy in flight on the GPU has finished)."""
        if self.registered:
            torch.cuda.synchronize()
            _unregister(self.bytes.data_ptr())
            self.registered = False
        del self.bytes
        with contextlib.suppress(BufferError):  # a view is still alive: unmapped when the last one goes
            self.map.close()
        os.close(self.fd)


class MappedFiles:
    """The mappings of one process, by (device, inode, size); ``register`` pins each for CUDA."""

    def __init__(self, register: bool | None = None) -> None:
        self.register = torch.cuda.is_available() if register is None else register
        self._maps: dict[tuple[int, int, int], MappedFile] = {}
        self.opened = 0  # files mapped (and registered) so far: each costs time in proportion to its size

    def get(self, path: str) -> MappedFile:
        """The mapping of the file now at ``path``: the kept one if that file was mapped before."""
        self.prune()
        st = os.stat(path)
        key = (st.st_dev, st.st_ino, st.st_size)
        mapped = self._maps.get(key)
        if mapped is None:
            mapped = self._maps[key] = MappedFile.open(path, self.register)
            self.opened += 1
            if mapped.key != key:  # the file changed between the stat and the mapping
                del self._maps[key]
                self._maps[mapped.key] = mapped
        mapped.path = path
        return mapped

    def prune(self) -> None:
        """Drop the mappings of files that were unlinked or resized since they were mapped."""
        for key, mapped in list(self._maps.items()):
            if not mapped.current():
                mapped.close()
                del self._maps[key]

    def __len__(self) -> int:
        return len(self._maps)

    def close(self) -> None:
        for mapped in self._maps.values():
            mapped.close()
        self._maps.clear()
