"""A DCP storage writer that writes each rank's safetensors shard straight from tensor memory.

PyTorch's ``HuggingFaceStorageWriter`` serialises a shard with ``safetensors.torch.save`` into
one Python ``bytes`` object and then writes that: two full copies of the shard, the first into
freshly allocated memory. This writer keeps everything else of it (DCP's planning, the shard
file names of ``save_distributed=True``, the ``DCP_SHARDING_INFO`` / ``DCP_VERSION`` header
metadata that DCP's own reader uses) and writes the safetensors header followed by each
tensor's bytes directly from the tensor: one copy, into the page cache of ``/dev/shm``.
The output is byte-for-byte a safetensors file that ``safe_open`` and DCP's
``HuggingFaceStorageReader`` read.

While writing, it records the index pieces of each chunk (``chunks``: fqn -> ``Chunk`` list with
offsets, sizes, location and tile checksums from ``weightsync.checksum``, unless
``checksums=False``), from which the push builds the index. Subclasses send the same shard bytes
elsewhere by overriding ``_emit`` (``weightsync.redis_data.RedisSafetensorsWriter`` stores them
as Redis values).

Delta sync (``base``: what this rank committed last, per chunk). The writer checksums every
chunk first and compares it, row block by row block (the checksums' row blocks, at most
256 KiB of whole rows), with the base. Only runs of changed row blocks are written, each as a
tensor of its own named ``{fqn}[{first}:{stop}]`` (rows of the chunk; ``DCP_SHARDING_INFO``
holds their offsets in the global tensor); the unchanged rows are described by the base's pieces,
cut to those rows, which point into older versions' storage. Such a shard is a valid safetensors
file, but only the version's index says how its pieces make up the tensors. If the reused pieces
would keep more than ``max_live`` times the rank's whole shard alive (counting each older unit
whole, as it is freed only whole), the writer writes every chunk whole instead.

Element patches (``elements=True``, see ``weightsync.patch``): a chunk whose base values the
rank kept may instead be stored as its base's pieces plus a patch, two 1-D tensors named
``{fqn}#patch-indices`` and ``{fqn}#patch-values`` in the shard, when that is smaller than its
changed row blocks. The index piece of a patch has ``location["kind"] == "patch"`` and covers the
whole chunk; its indices and values carry their own locations and checksums.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from weightsync.checksum import changed_row_blocks, chunk_checksums, row_block_slice
from weightsync.host_memory import MappedFiles
from weightsync.patch import (
    PatchState,
    bits,
    changed_since_base,
    index_dtype,
    patch_bytes,
    row_marks,
    worth_patching,
)
from weightsync.store import Chunk

DCP_SHARDING_INFO_KEY = "DCP_SHARDING_INFO"  # header keys DCP's Hugging Face writer and reader use
DCP_VERSION_KEY = "DCP_VERSION"
HF_DCP_VERSION = "1.0"
SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


RESERVED_PREFIX = "reserved-"  # spare files created ahead of the first pushes (``WeightPusher.reserve``)


def shard_file_name(shard_index: int) -> str:
    """DCP's name for rank ``shard_index - 1``'s single file with ``save_distributed=True``."""
    return f"shard-{shard_index:05d}-model-00001-of-00001.safetensors"


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """An asynchronous DMA copy of a GPU tensor into page-locked host memory (PyTorch's caching
    host allocator keeps the blocks, so later pushes reuse them); synchronise before reading it."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t.detach(), non_blocking=True)
    return out


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy())


@dataclass(frozen=True)
class BaseChunk:
    """What a rank committed last for one chunk: its layout, its tile checksums, and the index
    pieces that hold its bytes (in the unit that wrote them, possibly an older version's)."""

    offsets: list[int]
    sizes: list[int]
    dtype: torch.dtype
    checksum: dict
    pieces: list[Chunk]
    values: torch.Tensor | None = None  # the base's values, flat (kept for element patches)
    patch: PatchState | None = None  # the patch committed on top of it, if any


@dataclass(frozen=True)
class _PatchPlan:
    """A chunk that stays on its base: ``state`` is its patch (None: it equals its base);
    ``write``: the patch is new (else the last committed patch piece is reused)."""

    state: PatchState | None
    write: bool


def _rows(sizes: list[int]) -> int:
    """Rows a chunk is cut into for delta sync: its first dimension (a 0-/1-D chunk is one row)."""
    return sizes[0] if len(sizes) >= 2 else 1


def _row_runs(mask: torch.Tensor, block_rows: int, rows: int) -> list[tuple[int, int]]:
    """Row ranges of the runs of True row blocks in ``mask``."""
    runs = []
    flags = mask.tolist()
    k = 0
    while k < len(flags):
        if flags[k]:
            j = k
            while j < len(flags) and flags[j]:
                j += 1
            runs.append((k * block_rows, min(j * block_rows, rows)))
            k = j
        else:
            k += 1
    return runs


def _cut_piece(piece: Chunk, chunk_offsets: list[int], lo: int, hi: int, elem: int) -> Chunk:
    """Rows ``lo:hi`` (of the chunk at ``chunk_offsets``) of a stored piece that covers them."""
    first = piece.offsets[0] - chunk_offsets[0]
    if (first, first + piece.sizes[0]) == (lo, hi):
        return piece
    skip = lo - first
    location = dict(piece.location)
    if location["kind"] == "redis":
        location["offset"] += skip * math.prod(piece.sizes[1:]) * elem
    else:
        location["row"] = location.get("row", 0) + skip
    checksum = piece.checksum
    if checksum is not None:
        block_rows = checksum["block_rows"]
        checksum = row_block_slice(checksum, piece.sizes, elem, skip // block_rows, -(-(hi - first) // block_rows))
    return Chunk([piece.offsets[0] + skip, *piece.offsets[1:]], [hi - lo, *piece.sizes[1:]], location, checksum)


class ShmSafetensorsWriter(HuggingFaceStorageWriter):
    """``HuggingFaceStorageWriter(save_distributed=True)`` with a one-copy write path.

    ``unit``: the storage unit name recorded in every location (see ``weightsync.store``);
    ``base``: fqn -> ``BaseChunk`` for delta sync (None: write every chunk whole);
    ``unit_bytes``: bytes of the older units the base points into (for ``max_live``).
    """

    def __init__(
        self,
        path: str,
        checksums: bool = True,
        *,
        unit: str = "",
        base: dict[str, BaseChunk] | None = None,
        unit_bytes: dict[str, int] | None = None,
        max_live: float = 2.0,
        spare_dir: Path | None = None,
        elements: bool = False,
        mappings: MappedFiles | None = None,
    ) -> None:
        super().__init__(path=path, save_distributed=True)
        self.spare_dir = spare_dir  # freed shard files to write into (see ``claim_spare``)
        if base is not None and not checksums:
            raise ValueError("delta sync compares checksums: it needs checksums=True")
        if mappings is not None and base is not None:
            raise ValueError("writes through mapped shard files are for whole pushes, not delta sync")
        # Write the shard through a shared mapping of its file (pinned for CUDA, see
        # ``weightsync.host_memory``): tensors on a GPU go into the file by DMA.
        self.mappings = mappings
        self.checksums = checksums
        self.unit = unit
        self.base = base
        self.unit_bytes = unit_bytes or {}
        self.max_live = max_live
        self.elements = elements  # element patches (see weightsync.patch)
        self.on_base: dict[str, PatchState | None] = {}  # chunks that stayed on their base: patch
        self.rebased: dict[str, torch.Tensor] = {}  # chunks written as new bases (with ``elements``)
        self.chunks: dict[str, list[Chunk]] = {}  # index pieces per fqn
        self.chunk_checksums: dict[str, dict] = {}  # tile checksums of each whole chunk
        self.layouts: dict[str, tuple[list[int], list[int], torch.dtype]] = {}  # offsets, sizes, dtype
        self.shard_name: str | None = None
        self.shard_index = 0
        self.shard_bytes = 0
        self.bytes_reused = 0  # chunk bytes described by older versions' pieces
        self.recycled = False  # the shard was written over a spare file (no fresh tmpfs pages)
        # Tells this push's pieces from those of another push of the same version number (a
        # run pushed again into a store that still holds it): equal pieces mean equal bytes.
        self.push_id = uuid.uuid4().hex[:12]

    def location(self, name: str, byte_offset: int) -> dict:
        """The index's location of a stored tensor ``name`` that starts at ``byte_offset`` of the shard."""
        location = {
            "kind": "shm",
            "file": str(self.fs.concat_path(self.path, self.shard_name)),
            "name": name,
            "unit": self.unit,
            "push": self.push_id,
        }
        if self.mappings is not None:
            location["pinnable"] = True  # written at its final size: readers may keep it pinned
        return location

    def _emit(self, file_name: str, parts: list[memoryview | bytes]) -> None:
        """Store the shard, given as consecutive byte strings, in a recycled file if one is spare."""
        path = self.fs.concat_path(self.path, file_name)
        nbytes = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)
        self.recycled = self.spare_dir is not None and claim_spare(self.spare_dir, path, nbytes)
        with open(path, "r+b" if self.recycled else "wb") as f:
            for part in parts:
                f.write(part)
            if self.recycled:
                f.truncate()  # the spare may have been longer

    def _emit_mapped(self, file_name: str, head: bytes, tensors: list[torch.Tensor]) -> Callable[[], None]:
        """Store the shard through a shared mapping of its file; returns what waits for the copies.

        The file gets its final size before it is mapped and keeps it (see
        ``weightsync.host_memory``): a spare of exactly that size is written over (or a reserved
        one never published, cut to size), else a new file is allocated in full first, so that a
        full ``/dev/shm`` is an ``ENOSPC`` here, not a fault in the middle of a copy. Tensors on a
        GPU are copied on a stream of their own (after what the current stream has queued: the
        casts), asynchronously, so that the caller can checksum them on the GPU meanwhile.
        """
        path = str(self.fs.concat_path(self.path, file_name))
        nbytes = len(head) + sum(t.numel() * t.element_size() for t in tensors)
        self.recycled = self.spare_dir is not None and claim_spare(self.spare_dir, path, nbytes, fixed_size=True)
        if self.recycled:
            if os.path.getsize(path) != nbytes:
                os.truncate(path, nbytes)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
        dst = self.mappings.get(path).bytes
        dst[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        device = next((t.device for t in tensors if t.device.type == "cuda"), None)
        stream = None
        if device is not None:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
        offset = len(head)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for t in tensors:
                n = t.numel() * t.element_size()
                dst[offset : offset + n].copy_(t.reshape(-1).view(torch.uint8), non_blocking=stream is not None)
                offset += n
        return stream.synchronize if stream is not None else lambda: None

    def _plan_delta(self, fqn: str, offsets: list[int], tensor: torch.Tensor, checksum: dict):
        """(row ranges to write, pieces reused from the base) for one chunk."""
        rows = _rows(list(tensor.shape))
        base = self.base.get(fqn) if self.base else None
        if base is None or (base.offsets, base.sizes, base.dtype) != (offsets, list(tensor.shape), tensor.dtype):
            return [(0, rows)], []
        elem = tensor.element_size()
        changed = changed_row_blocks(checksum, base.checksum, list(tensor.shape), elem)
        block_rows = checksum["block_rows"] if len(tensor.shape) >= 2 else rows
        writes = _row_runs(changed, block_rows, rows)
        reused = []
        for lo, hi in _row_runs(~changed, block_rows, rows):
            for piece in base.pieces:
                first = piece.offsets[0] - offsets[0] if len(tensor.shape) >= 2 else 0
                a, b = max(lo, first), min(hi, first + _rows(piece.sizes))
                if a < b:
                    reused.append(_cut_piece(piece, offsets, a, b, elem) if len(tensor.shape) >= 2 else piece)
        return writes, reused

    def _plan_patch(
        self, fqn: str, offsets: list[int], tensor: torch.Tensor, rows: list[tuple[int, int]]
    ) -> _PatchPlan | None:
        """Keep the chunk on its base with an element patch, or None (write ``rows`` instead)."""
        base = self.base.get(fqn) if self.base else None
        if base is None or base.values is None:
            return None
        if (base.offsets, base.sizes, base.values.dtype) != (offsets, list(tensor.shape), tensor.dtype):
            return None
        previous = base.patch
        if previous is None and not rows:  # no row block changed: it equals its base
            return _PatchPlan(None, write=False)
        flat = tensor.view(-1)
        changed = changed_since_base(flat, base.values, None if previous is None else previous.indices)
        count = int(torch.count_nonzero(changed))
        if count == 0:
            return _PatchPlan(None, write=False)
        if (
            previous is not None
            and count == previous.indices.numel()  # the union did not grow,
            and torch.equal(bits(flat[previous.indices]), bits(previous.values))  # nor its values change
        ):
            return _PatchPlan(previous, write=False)  # the last committed patch holds: reuse it
        nbytes = patch_bytes(count, flat.numel(), tensor.element_size())
        cost, steps = (previous.cost, previous.steps) if previous else (flat.numel() * tensor.element_size(), 1)
        if not worth_patching(nbytes, _rows_bytes(tensor, rows), cost, steps):
            return None  # decided before listing the elements (an fp32 copy changes nearly all)
        indices = changed.nonzero().view(-1)
        return _PatchPlan(PatchState(indices, flat[indices], None, cost + nbytes, steps + 1), write=True)

    def _patch_piece(self, fqn: str, state: PatchState, stored: list[tuple], data_start: int) -> Chunk:
        """The index piece of a chunk's patch, stored as ``(key, name, tensor, offset)`` for its
        indices and its values."""
        offsets, sizes, _ = self.layouts[fqn]
        parts = {}
        for key, name, tensor, offset in stored:
            parts[key] = {
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "location": self.location(name, data_start + offset),
            }
            if self.checksums:
                parts[key]["checksum"] = chunk_checksums(tensor)
        location = {
            "kind": "patch",
            "unit": self.unit,
            "push": self.push_id,
            "step": state.steps,
            "count": state.values.numel(),
            **parts,
        }
        marks = row_marks(state.indices, sizes)
        if marks is not None:
            location["row_marks"] = marks
        return Chunk(list(offsets), list(sizes), location, None)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future: Future = Future()
        if not plan.items:
            future.set_result([])
            return future
        if any(item.type == WriteItemType.BYTE_IO for item in plan.items):
            raise ValueError("weight sync pushes tensors only; the state dict holds non-tensor values")
        self.shard_index = plan.storage_data["shard_index"]  # rank + 1
        self.shard_name = file_name = shard_file_name(self.shard_index)
        items = []
        pinned = False  # device tensors copied to pinned host memory, to wait for
        for item in plan.items:
            tensor = planner.resolve_data(item)
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{item.index.fqn}: weight sync writes tensors only")
            if tensor.device.type != "cpu" and self.mappings is None:
                tensor = _pinned_copy(tensor)  # Redis or delta sync from a GPU: through host memory
                pinned = True
            tensor = tensor.detach().contiguous()
            items.append((item, list(item.tensor_data.chunk.offsets), tensor))
            self.layouts[item.index.fqn] = (items[-1][1], list(tensor.shape), tensor.dtype)
        if pinned:
            torch.cuda.synchronize()  # the pinned copies have landed
        # Which rows of each chunk to write, and which pieces of the base describe the rest;
        # with element patches, which chunks stay on their base.
        plans = {item.index.fqn: ([(0, _rows(list(t.shape)))], []) for item, _, t in items}
        patches: dict[str, _PatchPlan] = {}
        if self.base is not None:
            self.chunk_checksums = {item.index.fqn: chunk_checksums(t) for item, _, t in items}
            delta = {
                item.index.fqn: self._plan_delta(item.index.fqn, off, t, self.chunk_checksums[item.index.fqn])
                for item, off, t in items
            }
            if self.elements:
                for item, off, t in items:
                    fqn = item.index.fqn
                    patch = self._plan_patch(fqn, off, t, delta[fqn][0])
                    if patch is not None:
                        patches[fqn] = patch
                        kept = [] if patch.state is None or patch.write else [patch.state.piece]
                        delta[fqn] = ([], [*self.base[fqn].pieces, *kept])
            total = sum(t.numel() * t.element_size() for _, _, t in items)
            new = sum(_rows_bytes(t, runs) for (_, _, t), (runs, _) in zip(items, delta.values()))
            new += sum(
                patch_bytes(p.state.indices.numel(), t.numel(), t.element_size())
                for item, _, t in items
                if (p := patches.get(item.index.fqn)) is not None and p.write
            )
            units = {p.location.get("unit") for _, reused in delta.values() for p in reused}
            if new + sum(self.unit_bytes.get(u, total) for u in units) <= self.max_live * total:
                plans = delta
            else:
                patches = {}
        self.on_base = {fqn: p.state for fqn, p in patches.items()}
        if self.elements:  # the chunks written as new bases: the pusher keeps a copy once committed
            self.rebased = {item.index.fqn: t for item, _, t in items if item.index.fqn not in patches}
        # The shard: every run to write, as a tensor of its own.
        header: dict[str, dict] = {}
        sharding: dict[str, dict] = {}
        runs = []  # (item, chunk offsets, whole chunk, name, rows, run tensor, offset in the data)
        offset = 0
        for item, offsets, tensor in items:
            whole = _rows(list(tensor.shape))
            for r0, r1 in plans[item.index.fqn][0]:
                is_whole = (r0, r1) == (0, whole)
                name = item.index.fqn if is_whole else f"{item.index.fqn}[{r0}:{r1}]"
                part = tensor if is_whole else tensor[r0:r1]
                nbytes = part.numel() * part.element_size()
                header[name] = {
                    "dtype": SAFETENSORS_DTYPES[part.dtype],
                    "shape": list(part.shape),
                    "data_offsets": [offset, offset + nbytes],
                }
                sharding[name] = {"saved_offsets": list(offsets) if is_whole else [offsets[0] + r0, *offsets[1:]]}
                runs.append((item, offsets, tensor, name, (r0, r1), part, offset))
                offset += nbytes
        patch_runs = []  # (fqn, [(key, stored name, tensor, offset in the data) for indices, values])
        for fqn, patch in patches.items():
            if not patch.write:
                continue
            numel = patch.state.values.numel()
            stored = []
            for key, t in (
                ("indices", patch.state.indices.to(index_dtype(math.prod(self.layouts[fqn][1])))),
                ("values", patch.state.values),
            ):
                name = f"{fqn}#patch-{key}"
                nbytes = numel * t.element_size()
                header[name] = {
                    "dtype": SAFETENSORS_DTYPES[t.dtype],
                    "shape": [numel],
                    "data_offsets": [offset, offset + nbytes],
                }
                stored.append((key, name, t, offset))
                offset += nbytes
            patch_runs.append((fqn, stored))
        header["__metadata__"] = {
            DCP_SHARDING_INFO_KEY: json.dumps(sharding),
            DCP_VERSION_KEY: HF_DCP_VERSION,
            "format": "pt",
        }
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8-byte alignment
        data_start = 8 + len(raw)
        head = struct.pack("<Q", len(raw)) + raw
        tensors = [part for *_, part, _ in runs if part.numel()]
        tensors += [t for _, stored in patch_runs for _, _, t, _ in stored]
        written = bool(runs or patch_runs)
        # The shard goes out on a thread (file writes and socket sends release the GIL), or by
        # asynchronous copies from a GPU, while this thread computes the checksums of the same,
        # unchanging tensors. Nothing changed: no shard at all.
        with ThreadPoolExecutor(1) as pool:
            emitted = None
            if written and self.mappings is not None:
                emitted = self._emit_mapped(file_name, head, tensors)
            elif written:
                emitted = pool.submit(self._emit, file_name, [head, *map(_tensor_bytes, tensors)]).result
            for item, _, tensor in items:
                fqn = item.index.fqn
                if self.checksums and fqn not in self.chunk_checksums:
                    self.chunk_checksums[fqn] = chunk_checksums(tensor)
                reused = plans[fqn][1]
                stored = [p for p in reused if p.location.get("kind") != "patch"]
                self.bytes_reused += sum(math.prod(p.sizes) for p in stored) * tensor.element_size()
                self.chunks[fqn] = list(reused)
            for item, offsets, tensor, name, (r0, r1), part, part_offset in runs:
                checksum = self.chunk_checksums.get(item.index.fqn)
                if checksum is not None and part is not tensor:
                    block_rows = checksum["block_rows"]
                    checksum = row_block_slice(
                        checksum, list(tensor.shape), tensor.element_size(), r0 // block_rows, -(-r1 // block_rows)
                    )
                first = list(offsets) if part is tensor else [offsets[0] + r0, *offsets[1:]]
                self.chunks[item.index.fqn].append(
                    Chunk(first, list(part.shape), self.location(name, data_start + part_offset), checksum)
                )
            for pieces in self.chunks.values():
                pieces.sort(key=lambda c: c.offsets[:1])
            for fqn, stored in patch_runs:
                self.chunks[fqn].append(self._patch_piece(fqn, patches[fqn].state, stored, data_start))
                self.on_base[fqn] = replace(patches[fqn].state, piece=self.chunks[fqn][-1])
            if emitted is not None:
                emitted()
        self.shard_bytes = data_start + offset if written else 0
        # DCP's write results; a chunk written in pieces points at its first written run (the
        # version's index, not DCP's metadata, says where all of a chunk's rows are).
        first_run: dict[str, tuple[int, int]] = {}
        for item, *_, part, part_offset in runs:
            first_run.setdefault(item.index.fqn, (data_start + part_offset, part.numel() * part.element_size()))
        future.set_result(
            [
                WriteResult(
                    index=item.index,
                    size_in_bytes=tensor.numel() * tensor.element_size(),
                    storage_data=_StorageInfo(file_name, *first_run.get(item.index.fqn, (0, 0))),
                )
                for item, _, tensor in items
            ]
        )
        return future


def claim_spare(spare_dir: Path, path: str, nbytes: int = 0, fixed_size: bool = False) -> bool:
    """Move a spare shard file to ``path``: the smallest one that holds ``nbytes``, else the
    largest. False if there is none. ``fixed_size``: only one of exactly ``nbytes``, or a
    reserved one (never published, so never mapped by a reader) that holds them.

    Writing into a file whose pages tmpfs already holds is a plain copy; a fresh file makes the
    kernel allocate and zero every page, and unlinking it later frees them again (measured here
    per GiB: 0.2 s to overwrite vs 0.45 s to write fresh + 0.17 s to unlink; 2-3.5 s to write
    fresh while a vLLM engine runs beside it on this VM). Spares are shard files no committed
    version uses any more (``WeightPusher.retire`` moves them there) and the files
    ``WeightPusher.reserve`` creates at start; the smallest fitting one is taken so that a small
    (delta) shard does not cut a big spare short. Rename is atomic, so two ranks never claim
    the same one.
    """
    try:
        entries = list(os.scandir(spare_dir))
    except FileNotFoundError:
        return False
    spares = []
    for entry in entries:
        try:
            spares.append((entry.stat().st_size, entry.path))
        except FileNotFoundError:  # another rank claimed it since the listing
            continue
    fitting = sorted(s for s in spares if s[0] >= nbytes)
    if fixed_size:
        fitting = [s for s in fitting if s[0] == nbytes or Path(s[1]).name.startswith(RESERVED_PREFIX)]
        fitting.sort(key=lambda s: s[0] != nbytes)  # exact ones first
    for _, spare in fitting + ([] if fixed_size else sorted((s for s in spares if s[0] < nbytes), reverse=True)):
        try:
            os.rename(spare, path)
            return True
        except FileNotFoundError:  # another rank took it
            continue
    return False


def _rows_bytes(tensor: torch.Tensor, runs: list[tuple[int, int]]) -> int:
    """Bytes of the row ranges ``runs`` of a chunk."""
    row = tensor.numel() * tensor.element_size() // max(1, _rows(list(tensor.shape)))
    return sum(r1 - r0 for r0, r1 in runs) * row
