"""Read exactly the wanted boxes of stored tensors from a committed version, verifying checksums.

A box of a global tensor is intersected with the version's stored chunks. Each overlap is read
from where the chunk is stored: its shard file in shared memory (mmapped; only the touched pages
are read) or its Redis values (exact ``GETRANGE`` byte ranges into a reused buffer, see
``weightsync.redis_data``), and copied into the destination view. Nothing is unpickled.

Element patches (delta sync with ``delta_elements``, see ``weightsync.patch``): a chunk stored
as its base's pieces plus a patch is read as the pieces, then the patch's elements inside the
box written over them; ``update_box`` reads only the patch when the destination already holds an
earlier version on the same base.

Integrity (``verify``, on by default): a chunk's tile checksums (``weightsync.checksum``) are
checked for every tile the overlap touches before any of its bytes are copied; the rest of a
tile the overlap covers in part is read too, and counted in the bytes read. A mismatch raises
``ChecksumMismatch`` naming the version, tensor, chunk, tile and file or keys. Reads go in slabs
of whole row blocks (a few MiB), so a slab is still in cache when it is copied after its check.

Mapped reads (into CUDA tensors, or ``mapped_reads=True``): a shared-memory chunk is read from a
``MAP_SHARED`` mapping of its file, registered with CUDA (``weightsync.host_memory``; kept across
versions for files the writer marks ``pinnable``, so a recycled file is registered once), by
asynchronous DMA: whole rows of a slab go host-to-device on a copy stream, straight into the
destination when it is those rows exactly, else into a staging buffer on the device from which
the wanted columns are copied. The tile checksums are computed on the device on a second stream
while the next slab is copied, and compared once, in ``ChunkSource.finish``, which raises the same
``ChecksumMismatch``: a caller of ``read_box`` / ``update_box`` with mapped reads must call it
before using what they wrote (until then the destination may hold unverified or partly copied
bytes).
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from weightsync.checksum import ChecksumMismatch, Grid, matrix_shape, region_hashes, tile_hashes
from weightsync.host_memory import MappedFiles
from weightsync.layout import Box
from weightsync.patch import marked_range, scatter_into_box
from weightsync.redis_data import RawRedis, piece_ranges, tensor_view
from weightsync.store import Chunk, TensorEntry

SLAB_BYTES = 4 * 2**20
MAPPED_SLAB_BYTES = 64 * 2**20  # rows per host-to-device copy of mapped reads


class _ShardFile:
    """One safetensors shard, mmapped (private, read-only use; or ``mapped``: a shared mapping
    from ``weightsync.host_memory``), with its parsed header."""

    def __init__(self, path: str, mappings: MappedFiles | None = None) -> None:
        if not Path(path).is_file():
            raise FileNotFoundError(
                f"weight shard {path} is missing: the version was dropped or the trainer runs on "
                "another host (the shared-memory data plane needs the policy on the trainer's host; "
                "push with data_plane='redis' to serve other hosts)"
            )
        self.path = path
        if mappings is not None:
            self.bytes = mappings.get(path).bytes
        else:
            with open(path, "rb") as f:
                self.bytes = torch.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), dtype=torch.uint8)
        (n,) = struct.unpack("<Q", self.bytes[:8].numpy().tobytes())
        self.header = json.loads(self.bytes[8 : 8 + n].numpy().tobytes())
        self.data_start = 8 + n

    def chunk_start(self, name: str, row: int, sizes: list[int], elem: int) -> int:
        """Offset of the first byte of a piece: ``sizes`` elements from row ``row`` on of the
        stored tensor ``name`` (a whole tensor, or with delta sync a run of rows of one)."""
        meta = self.header.get(name)
        if meta is None:
            raise KeyError(f"weight shard {self.path} holds no tensor {name!r}")
        start, stop = meta["data_offsets"]
        shape = list(meta["shape"])
        if len(sizes) >= 2:
            fits = len(shape) == len(sizes) and shape[1:] == list(sizes[1:]) and row + sizes[0] <= shape[0]
        else:
            fits = row == 0 and shape == list(sizes)
        if not fits:
            raise ValueError(
                f"weight shard {self.path}: {name!r} is stored with shape {meta['shape']} "
                f"({stop - start} bytes), the index wants {sizes} from row {row}"
            )
        return self.data_start + start + row * math.prod(shape[1:]) * elem


@dataclass
class _Check:
    """A deferred tile check of a mapped read: the hashes computed on the device and the stored ones."""

    fqn: str
    index: int
    chunk: Chunk
    grid: Grid
    first: tuple[int, int]  # (row block, band) of ``got[0, 0]``
    got: torch.Tensor
    want: torch.Tensor


class _DeviceCopies:
    """Streams and staging buffers of mapped reads into one CUDA device: host-to-device copies
    on one stream, checksums and column copies on another, two staging buffers in turn."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy = torch.cuda.Stream(device)
        self.compute = torch.cuda.Stream(device)
        for stream in (self.copy, self.compute):  # after what the caller queued before the update
            stream.wait_stream(torch.cuda.current_stream(device))
        self._buffers: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8, device=device)] * 2
        self._free: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def stage(self, src: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Copy the host bytes ``src`` into the next staging buffer; (buffer number, its bytes)."""
        k = self._turn
        self._turn ^= 1
        if self._buffers[k].numel() < src.numel():
            self.compute.synchronize()  # the old buffer may still be read
            self._buffers[k] = torch.empty(max(src.numel(), MAPPED_SLAB_BYTES), dtype=torch.uint8, device=self.device)
            self._free[k] = None
        if self._free[k] is not None:
            self.copy.wait_event(self._free[k])
        buf = self._buffers[k][: src.numel()]
        self.to_device(buf, src)
        return k, buf

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Asynchronous DMA of host bytes into device bytes; the compute stream waits for it."""
        with torch.cuda.stream(self.copy):
            dst.copy_(src, non_blocking=True)
        self.compute.wait_stream(self.copy)

    def release(self, k: int) -> None:
        """Staging buffer ``k`` may be written again once the compute stream's work so far is done."""
        event = torch.cuda.Event()
        event.record(self.compute)
        self._free[k] = event

    def finish(self) -> None:
        self.compute.synchronize()
        self.copy.synchronize()


class ChunkSource:
    """Reads one version's chunks from shared-memory files or Redis; open once per update.

    ``redis_url`` is needed only for chunks stored in Redis; ``version`` names the version in
    error messages; ``verify=False`` skips the checksums (and the extra bytes of partial tiles).
    ``mappings``: the caller's mapped shard files, kept across updates (mapped reads of files
    marked ``pinnable``; others are mapped for this source alone); ``mapped_reads``: read
    shared-memory chunks the mapped way into CPU tensors too (reads into CUDA tensors always are).
    """

    def __init__(
        self,
        redis_url: str | None = None,
        version: int | None = None,
        verify: bool = True,
        mappings: MappedFiles | None = None,
        mapped_reads: bool = False,
    ) -> None:
        self.redis_url = redis_url
        self.version = version
        self.verify = verify
        self.mapped_reads = mapped_reads
        self.tiles_verified = 0
        self._files: dict[str, _ShardFile] = {}
        self._redis: RawRedis | None = None
        self._staging = torch.empty(0, dtype=torch.uint8)
        self.pin_staging = False  # Redis bytes bound for a GPU land in page-locked memory (DMA from there)
        self._pending: tuple[tuple, list] | None = None  # Redis ranges requested ahead of fetch
        self._mappings = mappings
        self._own_mappings: MappedFiles | None = None  # of files not marked pinnable
        self._mapped: dict[str, _ShardFile] = {}
        self._devices: dict[torch.device, _DeviceCopies] = {}
        self._checks: list[_Check] = []

    def _file(self, path: str) -> _ShardFile:
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = _ShardFile(path)
        return f

    def mapped_file(self, location: dict) -> _ShardFile:
        """The shard file of a chunk location through a shared (pinned on CUDA) mapping."""
        path = location["file"]
        f = self._mapped.get(path)
        if f is None:
            mappings = self._mappings if location.get("pinnable") and self._mappings is not None else None
            if mappings is None:
                if self._own_mappings is None:
                    self._own_mappings = MappedFiles()
                mappings = self._own_mappings
            f = self._mapped[path] = _ShardFile(path, mappings)
        return f

    def device_copies(self, device: torch.device) -> _DeviceCopies | None:
        """The streams of mapped reads into ``device`` (None for the CPU: plain copies)."""
        if device.type != "cuda":
            return None
        copies = self._devices.get(device)
        if copies is None:
            copies = self._devices[device] = _DeviceCopies(device)
        return copies

    @contextlib.contextmanager
    def device_paused(self, device: torch.device):
        """Work on the current stream in between mapped copies into ``device``: it sees the
        copies queued so far done, and the copies queued later wait for it."""
        copies = self._devices.get(device)
        if copies is not None:
            copies.finish()
        yield
        if copies is not None:
            for stream in (copies.copy, copies.compute):
                stream.wait_stream(torch.cuda.current_stream(device))

    def defer(self, check: _Check) -> None:
        self._checks.append(check)
        self.tiles_verified += check.got.numel()

    def finish(self) -> None:
        """Wait for the copies of mapped reads and compare the checksums they computed with the
        stored ones: raises ``ChecksumMismatch`` (naming the first bad tile) if any differ."""
        for copies in self._devices.values():
            copies.finish()
        checks, self._checks = self._checks, []
        if not checks:
            return
        got = torch.cat([c.got.reshape(-1) for c in checks]).cpu()
        want = torch.cat([c.want.reshape(-1) for c in checks])
        if torch.equal(got, want):
            return
        at = 0
        for c in checks:
            n = c.want.numel()
            mine = got[at : at + n].view(c.want.shape)
            if not torch.equal(mine, c.want):
                raise ChecksumMismatch(_mismatch(c.fqn, c.index, c.chunk, c.grid, c.first, mine, c.want, self))
            at += n

    def fetch(self, fqn: str, chunk: Chunk, elem: int, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """Stored bytes of the chunk's matrix rows x cols, as a uint8 ``(rows, cols * elem)`` tensor.

        The result may be a view of a reused buffer: use it before the next ``fetch``.
        """
        _, ncols = matrix_shape(chunk.sizes)
        row_bytes = ncols * elem
        height, width = rows[1] - rows[0], (cols[1] - cols[0]) * elem
        kind = chunk.location.get("kind")
        if kind == "shm":
            f = self._file(chunk.location["file"])
            loc = chunk.location
            start = f.chunk_start(loc.get("name", fqn), loc.get("row", 0), chunk.sizes, elem)
            region = f.bytes[start + rows[0] * row_bytes : start + rows[1] * row_bytes]
            return region.view(height, row_bytes)[:, cols[0] * elem : cols[1] * elem]
        if kind == "redis":
            n = height * width
            if self._staging.numel() < n or self._staging.is_pinned() != self.pin_staging:
                self._staging = torch.empty(n, dtype=torch.uint8, pin_memory=self.pin_staging)
            client = self._redis_client()
            try:
                if self._pending is not None and self._pending[0] == (id(chunk), rows, cols):
                    ranges = self._pending[1]
                    self._pending = None
                    client.recv_ranges_into(ranges, tensor_view(self._staging, n))
                else:
                    self._drain()
                    client.getrange_into(self._ranges(chunk, rows, cols, elem), tensor_view(self._staging, n))
            except BaseException:
                self._reset_redis()  # replies may still be in flight: never reuse the connection
                raise
            return self._staging[:n].view(height, width)
        raise ValueError(f"{fqn}: unknown chunk location {chunk.location!r}")

    def prefetch(self, chunk: Chunk, elem: int, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        """Ask Redis now for what the next ``fetch`` will want, so it works while this process
        verifies and copies the current slab. Shared-memory chunks need no prefetch."""
        if chunk.location.get("kind") != "redis" or rows[0] >= rows[1] or self._pending is not None:
            return
        ranges = self._ranges(chunk, rows, cols, elem)
        try:
            self._redis_client().send_getranges(ranges)
        except BaseException:
            self._reset_redis()
            raise
        self._pending = ((id(chunk), rows, cols), ranges)

    def _drain(self) -> None:
        """Read and drop the replies of a prefetch that was not fetched."""
        if self._pending is not None:
            ranges = self._pending[1]
            self._pending = None
            scratch = torch.empty(sum(length for _, _, length in ranges), dtype=torch.uint8)
            self._redis.recv_ranges_into(ranges, tensor_view(scratch, scratch.numel()))

    def _ranges(self, chunk: Chunk, rows: tuple[int, int], cols: tuple[int, int], elem: int) -> list:
        _, ncols = matrix_shape(chunk.sizes)
        row_bytes = ncols * elem
        if cols == (0, ncols):  # whole rows: one contiguous range
            return piece_ranges(chunk.location, rows[0] * row_bytes, (rows[1] - rows[0]) * row_bytes)
        width = (cols[1] - cols[0]) * elem
        return [r for i in range(*rows) for r in piece_ranges(chunk.location, i * row_bytes + cols[0] * elem, width)]

    def _redis_client(self) -> RawRedis:
        if self._redis is None:
            if self.redis_url is None:
                raise ValueError("chunks stored in Redis need ChunkSource(redis_url=...)")
            self._redis = RawRedis(self.redis_url)
        return self._redis

    def where(self, chunk: Chunk, rows: tuple[int, int], cols: tuple[int, int], elem: int) -> str:
        """Where the chunk's rows x cols are stored, for error messages."""
        if chunk.location.get("kind") == "redis":
            keys = sorted({key.decode() for key, _, _ in self._ranges(chunk, rows, cols, elem)})
            return f"Redis key(s) {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
        return f"file {chunk.location.get('file')}"

    def _reset_redis(self) -> None:
        self._pending = None
        if self._redis is not None:
            self._redis.close()
            self._redis = None

    def close(self) -> None:
        """Release files and connections (after waiting for any mapped copy still in flight)."""
        for copies in self._devices.values():
            with contextlib.suppress(RuntimeError):
                copies.finish()
        self._devices.clear()
        self._checks.clear()
        self._files.clear()
        self._mapped.clear()
        if self._own_mappings is not None:
            self._own_mappings.close()
            self._own_mappings = None
        self._reset_redis()


def _overlap(box: Box, chunk: Chunk) -> Box | None:
    out = []
    for (start, stop), off, size in zip(box, chunk.offsets, chunk.sizes):
        lo, hi = max(start, off), min(stop, off + size)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def _typed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 ``(rows, bytes)`` seen as ``dtype`` elements (copied first if misaligned)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    if raw.data_ptr() % elem:
        raw = raw.clone()
    return raw.view(dtype)


def _read_part(
    fqn: str, index: int, chunk: Chunk, local: Box, dtype: torch.dtype, dst: torch.Tensor, source: ChunkSource
) -> int:
    """Copy ``local`` (a box in the chunk's own coordinates) into ``dst``; returns bytes read."""
    if chunk.location.get("kind") == "shm" and (dst.device.type == "cuda" or source.mapped_reads):
        return _read_part_mapped(fqn, index, chunk, local, dtype, dst, source)
    source.pin_staging = dst.device.type == "cuda"
    elem, rows, cols, check, region_rows, region_cols, unit = _region(chunk, local, dtype, source.verify)
    if check:
        grid, stored, tiles = check
    row_bytes = max(1, (region_cols[1] - region_cols[0]) * elem)
    step = unit * max(1, SLAB_BYTES // (row_bytes * unit))
    nbytes = 0
    for r0 in range(region_rows[0], region_rows[1], step):
        r1 = min(r0 + step, region_rows[1])
        raw = source.fetch(fqn, chunk, elem, (r0, r1), region_cols)
        source.prefetch(chunk, elem, (r1, min(r1 + step, region_rows[1])), region_cols)
        nbytes += raw.numel()
        if check:
            got = region_hashes(raw, grid)
            k0 = r0 // grid.block_rows
            want = stored[k0 : k0 + got.shape[0], tiles[1][0] : tiles[1][1]]
            if not torch.equal(got, want):
                raise ChecksumMismatch(_mismatch(fqn, index, chunk, grid, (k0, tiles[1][0]), got, want, source))
            source.tiles_verified += got.numel()
        _copy_rows(raw, (r0, r1), region_cols, chunk, local, rows, cols, dtype, dst)
    return nbytes


def _region(chunk: Chunk, local: Box, dtype: torch.dtype, verify: bool):
    """What reading ``local`` of a chunk takes: (element size, the wanted matrix rows and columns,
    (grid, stored checksums, tile ranges) or None without verification, the rows and columns read
    (with verification: of the whole tiles they touch), the row unit a read is cut at)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    rows, cols = _matrix_box(chunk, local)
    if not verify or chunk.checksum is None:
        return elem, rows, cols, None, rows, cols, 1
    grid, stored = Grid.from_json(chunk.checksum, chunk.sizes, elem)
    tiles = grid.tiles_of(rows, cols)
    region_rows, region_cols = grid.span(tiles)
    return elem, rows, cols, (grid, stored, tiles), region_rows, region_cols, grid.block_rows


def _matrix_box(chunk: Chunk, local: Box) -> tuple[tuple[int, int], tuple[int, int]]:
    """The rows and columns of the chunk's matrix view (``checksum.matrix_shape``) that hold ``local``."""
    ndim = len(chunk.sizes)
    if ndim == 0:
        return (0, 1), (0, 1)
    if ndim == 1:
        return (0, 1), local[0]
    if ndim == 2:
        return local[0], local[1]
    return local[0], (0, matrix_shape(chunk.sizes)[1])  # rows of the matrix view, all their columns


def _copy_rows(raw, slab, region_cols, chunk, local, rows, cols, dtype, dst) -> None:
    """Copy what ``dst`` wants of the stored bytes ``raw`` (matrix rows ``slab``, columns
    ``region_cols``) into it; ``rows`` x ``cols`` is the wanted part of the matrix view."""
    r0, r1 = slab
    p0, p1 = max(rows[0], r0), min(rows[1], r1)
    if p0 >= p1:
        return
    ndim = len(chunk.sizes)
    src = _typed(raw, dtype)
    c0, c1 = cols[0] - region_cols[0], cols[1] - region_cols[0]
    if ndim == 0:
        dst.copy_(src.view(()))
    elif ndim == 1:
        dst.copy_(src[0, c0:c1])
    elif ndim == 2:
        dst[p0 - rows[0] : p1 - rows[0]].copy_(src[p0 - r0 : p1 - r0, c0:c1])
    else:
        inner = tuple(slice(lo, hi) for lo, hi in local[1:])
        block = src.view(r1 - r0, *chunk.sizes[1:])[(slice(p0 - r0, p1 - r0), *inner)]
        dst[p0 - rows[0] : p1 - rows[0]].copy_(block)


def _read_part_mapped(
    fqn: str, index: int, chunk: Chunk, local: Box, dtype: torch.dtype, dst: torch.Tensor, source: ChunkSource
) -> int:
    """``_read_part`` for a shared-memory chunk through its file's mapping (the module docstring's
    mapped reads). Whole rows of the region its tiles span go to the device, in slabs; returns
    the bytes copied from the host. Checksums are deferred to ``ChunkSource.finish``."""
    elem, rows, cols, check, region_rows, region_cols, unit = _region(chunk, local, dtype, source.verify)
    if check:
        grid, stored, tiles = check
    _, ncols = matrix_shape(chunk.sizes)
    row_bytes = max(1, ncols * elem)
    loc = chunk.location
    shard = source.mapped_file(loc)
    start = shard.chunk_start(loc.get("name", fqn), loc.get("row", 0), chunk.sizes, elem)
    whole = cols == (0, ncols) and all(hi - lo == n for (lo, hi), n in zip(local[1:], chunk.sizes[1:]))
    # The wanted elements are the region's rows whole and dst holds them in stored order:
    # the rows go straight into dst, and the checksums are computed on dst itself.
    direct = whole and (region_rows, region_cols) == (rows, cols) and dst.is_contiguous()
    into = dst.view(-1).view(torch.uint8) if direct else None
    copies = source.device_copies(dst.device)
    step = unit * max(1, MAPPED_SLAB_BYTES // (row_bytes * unit))
    nbytes = 0
    for r0 in range(region_rows[0], region_rows[1], step):
        r1 = min(r0 + step, region_rows[1])
        src = shard.bytes[start + r0 * row_bytes : start + r1 * row_bytes]
        nbytes += src.numel()
        slot = None
        if into is not None:
            target = into[(r0 - rows[0]) * row_bytes : (r1 - rows[0]) * row_bytes]
            if copies is None:
                target.copy_(src)
            else:
                copies.to_device(target, src)
            staged = target
        elif copies is None:
            staged = src
        else:
            slot, staged = copies.stage(src)
        with torch.cuda.stream(copies.compute) if copies is not None else contextlib.nullcontext():
            raw = staged.view(r1 - r0, row_bytes)[:, region_cols[0] * elem : region_cols[1] * elem]
            if check:
                k0 = r0 // grid.block_rows
                got = tile_hashes(raw, grid)
                want = stored[k0 : k0 + got.shape[0], tiles[1][0] : tiles[1][1]]
                source.defer(_Check(fqn, index, chunk, grid, (k0, tiles[1][0]), got, want))
            if into is None:
                _copy_rows(raw, (r0, r1), region_cols, chunk, local, rows, cols, dtype, dst)
        if slot is not None:
            copies.release(slot)
    return nbytes


def _mismatch(fqn, index, chunk, grid, first, got, want, source) -> str:
    bad = (got != want).nonzero()[0].tolist()
    k, m = first[0] + bad[0], first[1] + bad[1]
    rows, cols = grid.span(((k, k + 1), (m, m + 1)))
    version = "" if source.version is None else f"weight version {source.version}: "
    return (
        f"{version}checksum mismatch in tensor {fqn!r}, chunk {index} (offsets {chunk.offsets}, sizes "
        f"{chunk.sizes}), tile rows {rows[0]}:{rows[1]} x cols {cols[0]}:{cols[1]}, stored in "
        f"{source.where(chunk, rows, cols, grid.elem)}: expected {int(want[tuple(bad)]) & (2**64 - 1):#018x}, "
        f"read {int(got[tuple(bad)]) & (2**64 - 1):#018x}. The stored bytes are corrupt: push the version "
        "again or update to another one (until an update succeeds, this worker may hold mixed versions)."
    )


def covering(entry: TensorEntry, box: Box) -> list[Chunk]:
    """The stored pieces of ``entry`` that hold part of ``box``. Stored bytes never change, so
    two versions whose covering pieces are equal hold the same values in ``box``."""
    return [chunk for chunk in entry.chunks if _overlap(box, chunk) is not None]


def _is_patch(chunk: Chunk) -> bool:
    return chunk.location.get("kind") == "patch"


def _apply_patch(fqn: str, chunk: Chunk, dtype: torch.dtype, box: Box, dst: torch.Tensor, source: ChunkSource) -> int:
    """Read a chunk's element patch (verified) and write its elements inside ``box`` into
    ``dst``. Returns the bytes read.

    With row marks (``weightsync.patch.row_marks``) only the part of the patch that holds the
    box's rows is read, plus one element on each side: those show that the marks are right (the
    element before lies before the marked rows, the one after at or past their end), since a
    wrong mark would otherwise drop elements without a checksum noticing."""
    loc = chunk.location
    count = int(loc["count"])
    numel = math.prod(chunk.sizes)
    marks = loc.get("row_marks")
    p0, p1 = q0, q1 = 0, count
    if marks is not None:
        first = max(box[0][0] - chunk.offsets[0], 0)
        stop = min(box[0][1] - chunk.offsets[0], chunk.sizes[0])
        if first >= stop:
            return 0
        p0, p1, lo, hi = marked_range(marks, chunk.sizes, count, first, stop)
        q0, q1 = max(p0 - 1, 0), min(p1 + 1, count)
    parts = {}
    nbytes = 0
    for key, part_dtype in (("indices", getattr(torch, loc["indices"]["dtype"])), ("values", dtype)):
        stored = Chunk([0], [count], loc[key]["location"], loc[key].get("checksum"))
        parts[key] = torch.empty(max(0, q1 - q0), dtype=part_dtype)
        if q1 > q0:
            nbytes += _read_part(f"{fqn} (patch {key})", 0, stored, ((q0, q1),), part_dtype, parts[key], source)
    indices = parts["indices"]
    if len(indices) and (
        int(indices[0]) < 0 or int(indices[-1]) >= numel or not bool((indices[1:] > indices[:-1]).all())
    ):  # what the checksums would catch; with verify off, a clear error instead of stray writes
        raise ValueError(
            f"{fqn}: the element patch of the chunk at {chunk.offsets} is corrupt: its indices are not "
            "strictly increasing within the chunk"
        )
    if marks is not None and (
        (q0 < p0 and int(indices[0]) >= lo)
        or (p0 < p1 and not lo <= int(indices[p0 - q0]) <= int(indices[p1 - 1 - q0]) < hi)
        or (p1 < q1 and int(indices[-1]) < hi)
    ):
        raise ValueError(
            f"{fqn}: the element patch of the chunk at {chunk.offsets} has row marks that do not match "
            f"its indices ({marks}): the index is corrupt"
        )
    if dst.device.type != "cpu":  # patches are applied on the CPU; correct before fast on a GPU
        with source.device_paused(dst.device):
            on_host = dst.cpu()
            scatter_into_box(indices, parts["values"], chunk.offsets, chunk.sizes, box, on_host)
            dst.copy_(on_host)
    else:
        scatter_into_box(indices, parts["values"], chunk.offsets, chunk.sizes, box, dst)
    return nbytes


def update_box(
    fqn: str, entry: TensorEntry, previous: TensorEntry | None, box: Box, dst: torch.Tensor, source: ChunkSource
) -> tuple[int, int]:
    """Bring ``dst`` (holding ``box`` of ``previous``'s values, or anything when ``previous`` is
    None) to ``entry``'s values there. Returns (bytes read, bytes of ``box`` not read again).

    Equal covering pieces: nothing to do. Same base pieces and only newer element patches (their
    ``step`` since the base no smaller than ``previous``'s): only the patches are read and
    written over ``dst`` (``weightsync.patch`` says why that is exact). Otherwise all of
    ``box`` is read.
    """
    box_bytes = math.prod(hi - lo for lo, hi in box) * dst.element_size()
    now = covering(entry, box)
    if previous is not None:
        before = covering(previous, box)
        if before == now:
            return 0, box_bytes
        patches = [c for c in now if _is_patch(c)]
        steps_now = {tuple(c.offsets): c.location["step"] for c in patches}
        steps_before = {tuple(c.offsets): c.location["step"] for c in before if _is_patch(c)}
        if (
            patches
            and [c for c in now if not _is_patch(c)] == [c for c in before if not _is_patch(c)]
            and all(k in steps_now and step <= steps_now[k] for k, step in steps_before.items())
        ):
            dtype = getattr(torch, entry.dtype)
            nbytes = sum(_apply_patch(fqn, c, dtype, box, dst, source) for c in patches if c not in before)
            return nbytes, box_bytes
    return read_box(fqn, entry, box, dst, source), 0


def read_box(fqn: str, entry: TensorEntry, box: Box, dst: torch.Tensor, source: ChunkSource) -> int:
    """Copy ``box`` of the stored global tensor ``fqn`` into ``dst`` (shaped like the box).

    Returns the number of bytes read (with verification: including the rest of partly covered
    tiles). Raises if the stored chunks do not cover the box, or on a checksum mismatch.
    """
    if len(box) != len(entry.shape) or any(hi > n for (_, hi), n in zip(box, entry.shape)):
        raise ValueError(f"{fqn}: wanted box {box} does not fit the stored shape {entry.shape}")
    dtype = getattr(torch, entry.dtype)
    covered = 0
    nbytes = 0
    for index, chunk in enumerate(entry.chunks):
        part = _overlap(box, chunk)
        if part is None or _is_patch(chunk):
            continue
        local = tuple((lo - off, hi - off) for (lo, hi), off in zip(part, chunk.offsets))
        dst_idx = tuple(slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(part, box))
        nbytes += _read_part(fqn, index, chunk, local, dtype, dst[dst_idx], source)
        covered += math.prod(hi - lo for lo, hi in part)
    expected = math.prod(hi - lo for lo, hi in box)
    if covered != expected:
        raise RuntimeError(f"{fqn}: stored chunks cover {covered} of the {expected} wanted elements of box {box}")
    for chunk in entry.chunks:  # element patches go over the base pieces they patch
        if _is_patch(chunk) and _overlap(box, chunk) is not None:
            nbytes += _apply_patch(fqn, chunk, dtype, box, dst, source)
    return nbytes
