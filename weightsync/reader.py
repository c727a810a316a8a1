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
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path

import torch

from weightsync.checksum import ChecksumMismatch, Grid, matrix_shape, region_hashes
from weightsync.layout import Box
from weightsync.patch import marked_range, scatter_into_box
from weightsync.redis_data import RawRedis, piece_ranges, tensor_view
from weightsync.store import Chunk, TensorEntry

SLAB_BYTES = 4 * 2**20


class _ShardFile:
    """One safetensors shard, mmapped (private, read-only use), with its parsed header."""

    def __init__(self, path: str) -> None:
        if not Path(path).is_file():
            raise FileNotFoundError(
                f"weight shard {path} is missing: the version was dropped or the trainer runs on "
                "another host (the shared-memory data plane needs the policy on the trainer's host; "
                "push with data_plane='redis' to serve other hosts)"
            )
        self.path = path
        with open(path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        (n,) = struct.unpack("<Q", self._mmap[:8])
        self.header = json.loads(self._mmap[8 : 8 + n])
        self.data_start = 8 + n
        self.bytes = torch.frombuffer(self._mmap, dtype=torch.uint8)

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


class ChunkSource:
    """Reads one version's chunks from shared-memory files or Redis; open once per update.

    ``redis_url`` is needed only for chunks stored in Redis; ``version`` names the version in
    error messages; ``verify=False`` skips the checksums (and the extra bytes of partial tiles).
    """

    def __init__(self, redis_url: str | None = None, version: int | None = None, verify: bool = True) -> None:
        self.redis_url = redis_url
        self.version = version
        self.verify = verify
        self.tiles_verified = 0
        self._files: dict[str, _ShardFile] = {}
        self._redis: RawRedis | None = None
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._pending: tuple[tuple, list] | None = None  # Redis ranges requested ahead of fetch

    def _file(self, path: str) -> _ShardFile:
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = _ShardFile(path)
        return f

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
            if self._staging.numel() < n:
                self._staging = torch.empty(n, dtype=torch.uint8)
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
        self._files.clear()
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
    elem = torch.empty(0, dtype=dtype).element_size()
    ndim = len(chunk.sizes)
    _, ncols = matrix_shape(chunk.sizes)
    if ndim == 0:
        rows, cols = (0, 1), (0, 1)
    elif ndim == 1:
        rows, cols = (0, 1), local[0]
    elif ndim == 2:
        rows, cols = local[0], local[1]
    else:  # rows of the matrix view, all their columns
        rows, cols = local[0], (0, ncols)
    check = source.verify and chunk.checksum is not None
    if check:
        grid, stored = Grid.from_json(chunk.checksum, chunk.sizes, elem)
        tiles = grid.tiles_of(rows, cols)
        region_rows, region_cols = grid.span(tiles)
        unit = grid.block_rows
    else:
        region_rows, region_cols = rows, cols
        unit = 1
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
        p0, p1 = max(rows[0], r0), min(rows[1], r1)
        if p0 >= p1:
            continue
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
