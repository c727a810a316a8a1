"""Push a trainer's weights into the store: DCP safetensors shards in shared memory + a Redis index.

Every trainer rank writes only its own shard with PyTorch's DCP and its Hugging Face safetensors
storage writer (``save_distributed=True``; ``ShmSafetensorsWriter`` gives it a one-copy write
path), into ``{shm_root}/ws-{run}/v{version}/``. The rank then reads its own file's safetensors
header (``DCP_SHARDING_INFO`` gives each chunk's offsets in the global tensor) and records its
chunks in the store; rank 0 commits the version once all ranks have done so. A failed push
removes its files and parts, so nothing half-written remains.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from weightsync.redis_data import RedisSafetensorsWriter
from weightsync.shm_writer import SAFETENSORS_DTYPES, ShmSafetensorsWriter
from weightsync.store import Chunk, TensorEntry, WeightStore

# The dtypes a policy can be served in (the push casts the fp32 master weights to one of them).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# dtype -> name as stored in the index.
DTYPE_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in SAFETENSORS_DTYPES}
DATA_PLANES = ("shm", "redis")


def run_dir(shm_root: str | Path, run: str) -> Path:
    """The run's shared-memory folder: one ``v{version}`` folder per live version."""
    return Path(shm_root) / f"ws-{run}"


def version_dir(shm_root: str | Path, run: str, version: int) -> Path:
    return run_dir(shm_root, run) / f"v{version}"


def without_aliases(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop keys whose tensor is another key's tensor (tied embeddings): stored once.

    Two entries alias when their local data is the same memory seen the same way (address,
    shape, strides, dtype); distinct views into one buffer are kept apart.
    """
    seen: set[tuple] = set()
    out = {}
    for fqn, t in state_dict.items():
        local = t.to_local() if hasattr(t, "to_local") else t
        key = (local.data_ptr(), tuple(local.shape), local.stride(), local.dtype) if local.numel() else (id(t),)
        if key in seen:
            continue
        seen.add(key)
        out[fqn] = t
    return out


def _entries(writer: ShmSafetensorsWriter, global_shapes: dict[str, list[int]]) -> dict[str, TensorEntry]:
    """This rank's chunks, as the writer recorded them while writing its shard."""
    return {
        fqn: TensorEntry(
            dtype=DTYPE_NAMES[w.dtype],
            shape=global_shapes[fqn],
            chunks=[Chunk(w.offsets, w.sizes, writer.location(w.byte_offset), w.checksum)],
        )
        for fqn, w in writer.written.items()
    }


class WeightPusher:
    """Writes versions of one trainer rank's state dict and (on rank 0) commits and retires them."""

    def __init__(
        self,
        store: WeightStore,
        shm_root: str | Path = "/dev/shm",
        dtype: str = "float32",
        keep_last: int = 2,
        *,
        data_plane: str = "shm",
        checksums: bool = True,
    ) -> None:
        """``data_plane``: "shm" (shard files in ``shm_root``, same host) or "redis" (shard bytes
        as Redis values, any host). ``checksums=False`` skips the tile checksums (then readers
        cannot verify what they read)."""
        if dtype not in DTYPES:
            raise ValueError(f"weight sync dtype {dtype!r} is not supported; allowed: {sorted(DTYPES)}")
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be >= 1")
        if data_plane not in DATA_PLANES:
            raise ValueError(f"weight sync data_plane {data_plane!r} is not supported; allowed: {list(DATA_PLANES)}")
        self.store = store
        self.shm_root = Path(shm_root)
        self.dtype = DTYPES[dtype]
        self.keep_last = keep_last
        self.data_plane = data_plane
        self.checksums = checksums

    def push(self, state_dict: dict[str, torch.Tensor], version: int) -> dict:
        """Write and commit ``version``; returns timing and byte counts."""
        distributed = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if distributed else 0
        world = dist.get_world_size() if distributed else 1
        out_dir = version_dir(self.shm_root, self.store.run, version)
        start = time.perf_counter()
        if self.data_plane == "redis":
            writer = RedisSafetensorsWriter(str(out_dir), self.store, version, checksums=self.checksums)
        else:
            writer = ShmSafetensorsWriter(str(out_dir), checksums=self.checksums)
        try:
            cast = {k: v.detach().to(self.dtype) for k, v in without_aliases(state_dict).items()}
            metadata = dcp.save(cast, storage_writer=writer, no_dist=not distributed)
            shapes = {fqn: list(md.size) for fqn, md in metadata.state_dict_metadata.items()}
            self.store.put_part(version, rank, _entries(writer, shapes))
            if distributed:
                dist.barrier()
            if rank == 0:
                self.store.commit(version, world)
        except BaseException:
            if self.data_plane == "redis":
                self.store.drop_data(version, writer.keys)
            if rank == 0:
                self.store.abort(version, world)
            shutil.rmtree(out_dir, ignore_errors=True)
            raise
        dropped = self.retire() if rank == 0 else []
        return {
            "push_s": time.perf_counter() - start,
            "bytes_written": writer.shard_bytes,
            "dropped_versions": dropped,
        }

    def retire(self) -> list[int]:
        """Drop committed versions beyond ``keep_last`` that no policy replica holds."""
        dropped = self.store.retire(self.keep_last)
        for v in dropped:
            shutil.rmtree(version_dir(self.shm_root, self.store.run, v), ignore_errors=True)
        return dropped

    def remove_all(self) -> None:
        """Remove this run's shared-memory directory and Redis data keys (at the end of a run)."""
        shutil.rmtree(run_dir(self.shm_root, self.store.run), ignore_errors=True)
        if self.data_plane == "redis":
            self.store.drop_all_data()
