"""Push a trainer's weights into the store: DCP safetensors shards in shared memory + a Redis index.

Every trainer rank writes only its own shard with PyTorch's DCP and its Hugging Face safetensors
storage writer (``save_distributed=True``; ``ShmSafetensorsWriter`` gives it a one-copy write
path), into ``{shm_root}/ws-{run}/v{version}/`` (or Redis values, ``data_plane="redis"``). The
writer records each chunk's offsets in the global tensor, location and checksums as it writes;
the rank puts that part of the index in the store, and rank 0 commits the version once every
rank has (the ranks agree on success before and after the commit). A failed push removes its
files, parts and Redis data on every rank, so nothing half-written remains.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from redis import RedisError

from weightsync.config import WeightSyncConfig
from weightsync.host_memory import MappedFiles
from weightsync.redis_data import PIECE_BYTES, RawRedis, RedisSafetensorsWriter
from weightsync.redis_space import REDIS_REMEDIES, NotEnoughRedisMemory, out_of_memory, redis_memory
from weightsync.shm_space import (
    SHM_REMEDIES,
    NotEnoughSharedMemory,
    check_shm_room,
    free_bytes,
    no_space,
    shard_file_bytes,
)
from weightsync.shm_writer import (
    RESERVED_PREFIX,
    SAFETENSORS_DTYPES,
    BaseChunk,
    ShmSafetensorsWriter,
    shard_file_name,
)
from weightsync.store import TensorEntry, WeightStore, parse_unit, unit_name

# The dtypes a policy can be served in (the push casts the fp32 master weights to one of them).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# dtype -> name as stored in the index.
DTYPE_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in SAFETENSORS_DTYPES}
RESERVE_EXPIRE_MS = 10 * 60 * 1000  # reservation values left by a process that died reserving

log = logging.getLogger(__name__)


def run_dir(shm_root: str | Path, run: str) -> Path:
    """The run's shared-memory folder: one ``v{version}`` folder per live version."""
    return Path(shm_root) / f"ws-{run}"


def spare_dir(shm_root: str | Path, run: str) -> Path:
    """Shard files no version uses any more, kept to be written over by the next pushes."""
    return run_dir(shm_root, run) / "spare"


def version_dir(shm_root: str | Path, run: str, version: int) -> Path:
    return run_dir(shm_root, run) / f"v{version}"


def _local(t: torch.Tensor) -> torch.Tensor:
    """A rank's own part of a (possibly distributed) tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def without_aliases(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop keys whose tensor is another key's tensor (tied embeddings): stored once.

    Two entries alias when their local data is the same memory seen the same way (address,
    shape, strides, dtype); distinct views into one buffer are kept apart.
    """
    seen: set[tuple] = set()
    out = {}
    for fqn, t in state_dict.items():
        local = _local(t)
        key = (local.data_ptr(), tuple(local.shape), local.stride(), local.dtype) if local.numel() else (id(t),)
        if key in seen:
            continue
        seen.add(key)
        out[fqn] = t
    return out


def _entries(writer: ShmSafetensorsWriter, global_shapes: dict[str, list[int]]) -> dict[str, TensorEntry]:
    """This rank's chunks, as the writer recorded them while writing its shard."""
    return {
        fqn: TensorEntry(dtype=DTYPE_NAMES[writer.layouts[fqn][2]], shape=global_shapes[fqn], chunks=pieces)
        for fqn, pieces in writer.chunks.items()
    }


def _agree(ok: bool, distributed: bool) -> bool:
    """True on every rank only if ``ok`` on every rank (a collective when distributed)."""
    if not distributed:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _min_over_ranks(value: int, distributed: bool) -> int:
    """The smallest ``value`` of all ranks (a collective when distributed)."""
    if not distributed:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


class PushFailed(RuntimeError):
    """Another trainer rank's part of a push failed (that rank raised the cause)."""


def _touch_pages(f, nbytes: int) -> None:
    """Write zeros over the first ``nbytes`` of ``f`` so that every page is faulted in now.

    ``posix_fallocate`` on tmpfs allocates pages without touching them. On a VM whose host backs
    guest memory lazily (this project's machines), the first write to a guest page that has not
    been used since boot, or that the guest has handed back, costs a host-side fault: measured
    here, four fallocated 1 GiB files took 0.49 / 0.50 / 2.64 / 4.10 s for their first write and
    0.46 s each for the second; written with zeros at reservation instead, every later write
    took 0.45-0.56 s. On bare metal this moves the zeroing of the pages out of the first pushes.
    """
    zeros = memoryview(bytes(min(nbytes, 16 * 2**20)))  # only while reserving
    left = nbytes
    while left > 0:
        left -= f.write(zeros[: min(left, len(zeros))])
    f.flush()


class WeightPusher:
    """Writes versions of one trainer rank's state dict and (on rank 0) commits and retires them.

    Delta sync (``delta=True``): after the first version, each rank writes only the row blocks
    of its chunks whose tile checksums changed since the version it committed last; the index
    points the unchanged rows at the storage of the versions that wrote them, and the store's use
    counts keep that storage until no committed version points into it. ``delta_max_live``
    bounds what reuse may keep alive (see ``ShmSafetensorsWriter``).

    Element patches (``delta_elements=True``, with ``delta``): a chunk may instead be stored as
    the pieces of its last whole (or row-block) version plus the elements that changed since
    (``weightsync.patch``): what saves bytes for a bf16/fp16 policy, where one step changes a
    few percent of the elements but nearly every row block. Costs this rank a copy of its shard
    at the push dtype in CPU memory (the base values it compares with), and a comparison of
    every element per push.
    """

    def __init__(
        self, store: WeightStore, config: WeightSyncConfig, dtype: str = "float32", mapped_writes: bool = False
    ) -> None:
        """``config``: the run's ``weightsync`` group (checked when the config was loaded);
        ``dtype``: the policy's, which pushed weights are cast to. Whole pushes into shared memory
        of a state dict on a GPU write through pinned mappings of the shard files (DMA from the
        GPU, checksums on the GPU; ``weightsync.host_memory``); ``mapped_writes`` takes that
        path for a CPU state dict too (plain copies into the mapping)."""
        self.store = store
        self.shm_root = Path(config.shm_root)
        self.dtype = DTYPES[dtype]
        self.keep_last = config.keep_last
        self.data_plane = config.data_plane
        self.checksums = config.checksums
        self.delta = config.delta
        self.delta_max_live = config.delta_max_live
        self.delta_elements = config.delta_elements
        self._base: dict[str, BaseChunk] | None = None  # this rank's last committed chunks
        self._unit_bytes: dict[str, int] = {}  # bytes of this rank's units the base points into
        self._world = 1  # trainer ranks (set by push)
        self._reserving: threading.Thread | None = None
        self.reserve_error: Exception | None = None
        self.mapped_writes = mapped_writes
        self._mappings: MappedFiles | None = None  # this rank's shard files, mapped (and pinned)

    def reserve_count(self) -> int:
        """Shard files this rank's first pushes write before retired ones come back as spares:
        ``keep_last`` kept versions, the one a policy still leases while it has not yet moved to
        the newest, and the one being written (only 1 with delta sync: later shards are deltas)."""
        return 1 if self.delta else self.keep_last + 2

    def reserve(self, state_dict: dict[str, torch.Tensor], background: bool = True) -> None:
        """Create the shard files this rank's first pushes will write over, so that they cost
        what later pushes do (with the Redis data plane: see ``_reserve_redis``).

        A push into a fresh tmpfs file makes the kernel allocate and zero every page: measured
        here 0.45 s per GiB on an idle VM and 2-3.5 s per GiB while a vLLM engine runs beside
        it, against 0.2 s writing over a file whose pages are there. Call this at start, while
        the policy's engine starts: ``background`` allocates in a thread (``posix_fallocate``
        for the room, then zeros written over it: see ``_touch_pages``), which ``push`` waits
        for. Only the shapes of ``state_dict`` are used (this rank's local
        shards, at the push dtype).

        A collective when distributed (every rank calls it). Space: the ranks (all on one host,
        as the shared-memory plane requires) need ``keep_last + 1`` shard files each for the
        versions a run keeps (1 with delta sync); if ``shm_root`` has less free space this
        raises ``NotEnoughSharedMemory`` saying what to change, instead of a push failing
        later. Without room for the lagging policy's extra file, fewer files are reserved and a
        warning says so. A failure while allocating (another process filled ``/dev/shm``) is
        logged and kept in ``reserve_error``; the pushes then write fresh files.
        """
        self._wait_reserved()
        tensors = without_aliases(state_dict)
        local = [_local(t) for t in tensors.values()]
        nbytes = shard_file_bytes(sum(t.numel() for t in local), self.dtype, len(local))
        count = self.reserve_count()
        if self.data_plane == "redis":
            # Not the lagging policy's version: Redis keeps reserved pages for good, and a run
            # whose policy keeps up never holds more than the kept versions and the new one.
            self._start_reserving(self._reserve_redis, nbytes, max(1, count - 1), background)
            return
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
        # Every rank measures before any rank allocates: the smallest reading is what all use.
        free = _min_over_ranks(free_bytes(self.shm_root), distributed)
        check_shm_room(self.shm_root, free, world, nbytes, self.keep_last, self.delta)
        per_file = world * nbytes  # one file per rank on this host
        fits = free // per_file
        if fits < count:
            log.warning(
                "weight sync: %s has room for %d of the %d shard files per rank that a run with a lagging "
                "policy keeps (%.1f MiB each); reserving those, a push may fail with 'No space left on "
                "device' if the policy falls behind",
                self.shm_root,
                fits,
                count,
                nbytes / 2**20,
            )
            count = fits
        self._start_reserving(self._reserve, nbytes, count, background)

    def _start_reserving(self, reserve, nbytes: int, count: int, background: bool) -> None:
        if background:
            self._reserving = threading.Thread(target=reserve, args=(nbytes, count), daemon=True)
            self._reserving.start()
        else:
            reserve(nbytes, count)

    def _reserve_redis(self, nbytes: int, count: int) -> None:
        """Make Redis allocate ``count`` shards' worth of values, then free them.

        Redis's allocator keeps the pages of freed values when its ``dirty_decay_ms`` is -1, as
        the run's private ``LocalRedis`` sets it: the first pushes then write into pages Redis
        has, as later pushes do into those of retired versions (measured with 1 GiB shards:
        1.2 / 2.1 / 1.4 s for the first three pushes unreserved, 0.3 s from the fourth on). A
        Redis with the default settings returns the pages within seconds and this only costs a
        background thread's time. The values expire after ``RESERVE_EXPIRE_MS`` in case this
        process dies before deleting them. A failure (``maxmemory`` reached) is logged and kept
        in ``reserve_error``.
        """
        prefix = self.store.reserve_prefix(uuid.uuid4().hex[:8])
        keys = [f"{prefix}:{i}" for i in range(count * -(-nbytes // PIECE_BYTES))]
        zeros = memoryview(bytearray(PIECE_BYTES))
        try:
            client = RawRedis(self.store.url)
            try:
                client.set_pieces(keys, [[zeros]] * len(keys), expire_ms=RESERVE_EXPIRE_MS)
            finally:
                client.close()
        except (RedisError, OSError) as exc:
            self.reserve_error = exc
            log.warning(
                "weight sync: could not reserve %.0f MiB of Redis memory for the first pushes: %s; they "
                "will make Redis allocate",
                len(keys) * PIECE_BYTES / 2**20,
                exc,
            )
        finally:
            self.store.drop_reserved(keys)

    def _reserve(self, nbytes: int, count: int) -> None:
        run = run_dir(self.shm_root, self.store.run)
        spare = spare_dir(self.shm_root, self.store.run)
        tag = uuid.uuid4().hex[:8]
        for i in range(count):
            # Allocated outside the spare folder and moved in whole: a push never claims a
            # file that is still being allocated.
            partial = run / f"reserving-{tag}-{i}"
            try:
                spare.mkdir(parents=True, exist_ok=True)
                with open(partial, "wb") as f:
                    os.posix_fallocate(f.fileno(), 0, nbytes)  # the room, or ENOSPC at once
                    _touch_pages(f, nbytes)
                partial.rename(spare / f"{RESERVED_PREFIX}{tag}-{i}.safetensors")
            except OSError as exc:
                partial.unlink(missing_ok=True)
                self.reserve_error = exc
                log.warning(
                    "weight sync: could not reserve shard file %d of %d (%.0f MiB each) in %s: %s; "
                    "the first pushes will write fresh files",
                    i + 1,
                    count,
                    nbytes / 2**20,
                    spare,
                    exc,
                )
                return

    def _wait_reserved(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def push(self, state_dict: dict[str, torch.Tensor], version: int) -> dict:
        """Write and commit ``version``; returns timing and byte counts."""
        distributed = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if distributed else 0
        world = dist.get_world_size() if distributed else 1
        out_dir = version_dir(self.shm_root, self.store.run, version)
        unit = unit_name(version, rank)
        self._world = world
        start = time.perf_counter()
        self._wait_reserved()  # counted in push_s: a reservation still running delays the push
        delta = {
            "base": self._base,
            "unit_bytes": self._unit_bytes,
            "max_live": self.delta_max_live,
            "elements": self.delta_elements,
        }
        if not self.delta:
            delta["base"] = None
        if self.data_plane == "redis":
            writer = RedisSafetensorsWriter(str(out_dir), self.store, version, self.checksums, unit=unit, **delta)
        else:
            spare = spare_dir(self.shm_root, self.store.run)
            mappings = self._mappings_for(state_dict)
            writer = ShmSafetensorsWriter(
                str(out_dir), self.checksums, unit=unit, spare_dir=spare, mappings=mappings, **delta
            )
        error: BaseException | None = None
        try:
            cast = {k: v.detach().to(self.dtype) for k, v in without_aliases(state_dict).items()}
            metadata = dcp.save(cast, storage_writer=writer, no_dist=not distributed)
            shapes = {fqn: list(md.size) for fqn, md in metadata.state_dict_metadata.items()}
            self.store.put_part(version, rank, _entries(writer, shapes))
        except BaseException as exc:  # every rank must learn of it before the commit
            error = exc
        if not _agree(error is None, distributed):
            self._clean_up(version, rank, world, writer, out_dir)
            if error is not None and self.data_plane == "shm" and no_space(error):
                raise NotEnoughSharedMemory(
                    f"weight version {version}: {self.shm_root} ran out of space while this trainer rank wrote "
                    f"its shard ({free_bytes(self.shm_root) / 2**20:.1f} MiB free after removing it; the run "
                    f"keeps weightsync.keep_last={self.keep_last} versions plus any a policy still holds). "
                    + SHM_REMEDIES
                ) from error
            if error is not None and self.data_plane == "redis" and out_of_memory(error):
                memory = redis_memory(self.store.url)
                limit = f"maxmemory {memory[0] / 2**20:.1f} MiB, {memory[1] / 2**20:.1f} MiB in use" if memory else "?"
                raise NotEnoughRedisMemory(
                    f"weight version {version}: Redis at {self.store.url} refused this trainer rank's shard for "
                    f"lack of memory ({limit} after removing it; the run keeps weightsync.keep_last="
                    f"{self.keep_last} versions plus any a policy still holds). " + REDIS_REMEDIES
                ) from error
            raise error or PushFailed(f"weight version {version}: another trainer rank failed to write its part")
        if rank == 0:
            try:
                self.store.commit(version, world)
            except BaseException as exc:
                error = exc
        if not _agree(error is None, distributed):
            self._clean_up(version, rank, world, writer, out_dir)
            raise error or PushFailed(f"weight version {version}: rank 0 failed to commit it")
        self._remember(writer, unit)
        dropped = self.retire() if rank == 0 else []
        return {
            "push_s": time.perf_counter() - start,
            "bytes_written": writer.shard_bytes,
            "bytes_reused": writer.bytes_reused,
            "wrote_over_spare": self.data_plane == "shm" and writer.recycled,
            "dropped_versions": dropped,
        }

    def _mappings_for(self, state_dict: dict[str, torch.Tensor]) -> MappedFiles | None:
        """The mapped files a whole push writes through (None: plain file writes)."""
        if self.delta or self.data_plane != "shm":
            return None
        on_gpu = any(_local(t).device.type == "cuda" for t in state_dict.values())
        if not (on_gpu or self.mapped_writes):
            return None
        if self._mappings is None:
            self._mappings = MappedFiles(register=on_gpu)
        return self._mappings

    def _clean_up(self, version, rank, world, writer, out_dir) -> None:
        if self.data_plane == "redis":
            self.store.drop_data(version, rank, writer.keys)
        if rank == 0:
            self.store.abort(version, world)
        shutil.rmtree(out_dir, ignore_errors=True)

    def _remember(self, writer: ShmSafetensorsWriter, unit: str) -> None:
        """Keep what this rank committed, as the base of the next delta push."""
        if not self.delta:
            return
        base = {}
        for fqn, (offsets, sizes, dtype) in writer.layouts.items():
            if fqn in writer.on_base:  # stays on its base, with this patch (None: equal to it)
                base[fqn] = replace(self._base[fqn], patch=writer.on_base[fqn])
            else:
                values = self._base_copy(fqn, writer.rebased.get(fqn))
                base[fqn] = BaseChunk(offsets, sizes, dtype, writer.chunk_checksums[fqn], writer.chunks[fqn], values)
        self._base = base
        self._unit_bytes[unit] = writer.shard_bytes
        used = {p.location.get("unit") for b in self._base.values() for p in b.pieces}
        used |= {b.patch.piece.location["unit"] for b in self._base.values() if b.patch is not None}
        self._unit_bytes = {u: n for u, n in self._unit_bytes.items() if u in used}

    def _base_copy(self, fqn: str, values: torch.Tensor | None) -> torch.Tensor | None:
        """A copy of a chunk's new base values (element patches), in the buffer of the base it
        supersedes where that fits: copying into warm memory, not into freshly faulted pages
        (512 MiB fp32, every element moved: 0.6 s more per push with a fresh copy each time).
        Only called once the version is committed, so a failed push leaves the old base whole."""
        if values is None:
            return None
        old = self._base.get(fqn) if self._base else None
        flat = values.reshape(-1)
        if (
            old is not None
            and old.values is not None
            and (old.values.shape, old.values.dtype) == (flat.shape, flat.dtype)
        ):
            return old.values.copy_(flat)
        return flat.clone()

    def retire(self) -> list[int]:
        """Drop committed versions beyond ``keep_last`` that no policy replica holds, and the
        shard files no remaining version points into."""
        retired = self.store.retire(self.keep_last)
        run = self.store.run
        spare = spare_dir(self.shm_root, run)
        for unit in retired.freed:
            version, rank = parse_unit(unit)
            path = version_dir(self.shm_root, run, version) / shard_file_name(rank + 1)
            # One spare file per trainer rank is what the next push needs; the rest are removed.
            kept = len(list(spare.iterdir())) if spare.exists() else 0
            if kept < self._world and path.exists():
                spare.mkdir(exist_ok=True)
                path.rename(spare / f"{unit.replace(':', '-')}.safetensors")
            else:
                path.unlink(missing_ok=True)
        for version in {parse_unit(u)[0] for u in retired.freed} | set(retired.dropped):
            with contextlib.suppress(OSError):  # not empty: a later version still uses some of it
                version_dir(self.shm_root, run, version).rmdir()
        return retired.dropped

    def remove_all(self) -> None:
        """Remove this run's shared-memory directory and Redis data keys (at the end of a run)."""
        self._wait_reserved()
        if self._mappings is not None:
            self._mappings.close()
        shutil.rmtree(run_dir(self.shm_root, self.store.run), ignore_errors=True)
        if self.data_plane == "redis":
            self.store.drop_all_data()
