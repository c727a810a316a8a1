"""Element patches for delta sync: the few elements of a chunk that changed since its base.

Row-block delta sync (``weightsync.shm_writer``) reuses row blocks that did not change. With a
16-bit policy copy that saves nothing: one RL step moves each fp32 master weight by ~lr, which
changes the rounded bf16 value of only a few percent of the elements (the bench measures 4% at
lr=1e-6), but those are spread over every row block. An element patch stores those elements
instead: their flat indices in the chunk and their values (4 + 2 bytes each for bf16).

Semantics (what makes a patch safe to apply on top of any earlier state). A chunk written whole
(or by row blocks) is a *base*; the pusher keeps a copy of its values. Each later version stores,
for that chunk, the base's pieces plus one patch: every element that differed from the base in
*any* version since it (the union), with its value now. So for versions ``b <= u <= v`` on the
same base, ``u``'s values with ``v``'s patch written over them are ``v``'s values: an element
outside ``v``'s patch equals the base in ``b``, ``u`` and ``v``. A reader holding ``u`` reads only
``v``'s patch; a reader holding anything else reads the base pieces, then the patch.

Row marks: a TP worker with a row cut (column-parallel layers) needs only its rows' elements.
Each patch records where every run of rows (1/64 of the chunk's) starts among its sorted indices
(``row_marks``), and such a reader reads only that part (``weightsync.reader``).

When to start a new base: patches grow with every step (the union), and a new base costs the
chunk's bytes once. The pusher keeps patching while this step's patch is no larger than the
bytes it wrote for the chunk per version since its base (the base counted whole), and while it
is smaller than the changed row blocks it would write instead. For a fraction ``q`` of elements
changing per step at random that settles near the best fixed cycle length (``q = 4%``: a new
base every 4 versions, 0.43 of the chunk's bytes per version against 1.0).

Cost: patches trade bytes for CPU time. Comparing every element, listing the changed ones and
scattering them into a worker's slice costs more than copying the bytes on one host (bench,
512 MiB bf16 copy, TP=2: push 0.74-0.97 s against 0.18-0.19 s whole, update 0.54-0.55 against
0.39-0.44 s), for 0.66 of the bytes not written and 0.18 of the model read per worker against
0.50. They are for scarce bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from weightsync.store import Chunk

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
ROW_MARKS = 64  # row runs a patch's row marks cut a chunk into


@dataclass(frozen=True)
class PatchState:
    """A chunk's patch as last committed: the elements that differ from its base (union since
    the base), their values, the index piece that stores them, and the cycle's bookkeeping."""

    indices: torch.Tensor  # sorted flat indices into the chunk, int64
    values: torch.Tensor  # the chunk's values there
    piece: Chunk | None  # where they are stored (None until written)
    cost: int  # bytes written for the chunk since its base: the base counted whole, every patch
    steps: int  # versions since the base, the base included


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` seen as integers of the same width: equality is bitwise (NaN equals itself, -0 != 0)."""
    return t.view(_BITS[t.element_size()])


def changed_since_base(values: torch.Tensor, base: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """Mask of the elements of the 1-D ``values`` that differ bitwise from ``base``, or that the
    ``previous`` patch holds (the union since the base)."""
    changed = bits(values) != bits(base)
    if previous is not None and previous.numel():
        changed[previous] = True
    return changed


def row_marks(indices: torch.Tensor, sizes: list[int]) -> dict | None:
    """Where each run of ``rows`` rows of a chunk starts in its patch: ``starts[k]`` is the number
    of patch elements before row ``k * rows`` (the last entry is the count). A reader of a row
    range (a TP worker's row cut) then reads only that part of the patch. At most
    ``ROW_MARKS + 1`` entries; None for a chunk of fewer than two dimensions (one row)."""
    if len(sizes) < 2 or sizes[0] < 2:
        return None
    rows = -(-sizes[0] // ROW_MARKS)
    cuts = torch.arange(0, sizes[0], rows, dtype=torch.int64) * math.prod(sizes[1:])
    starts = torch.searchsorted(indices, cuts).tolist() + [indices.numel()]
    return {"rows": rows, "starts": starts}


def marked_range(marks: dict, sizes: list[int], count: int, first: int, stop: int) -> tuple[int, int, int, int]:
    """For chunk rows ``first:stop``: the patch positions ``p0:p1`` that hold every element of
    the marked rows around them, and those rows' first flat indices ``lo, hi`` (``hi`` is the
    chunk's size at the end). Raises on marks that do not fit a chunk of ``sizes`` with a patch
    of ``count`` elements."""
    rows, starts = int(marks["rows"]), [int(x) for x in marks["starts"]]
    if (
        rows < 1
        or len(starts) != -(-sizes[0] // rows) + 1
        or starts != sorted(starts)
        or (starts[0], starts[-1]) != (0, count)
    ):
        raise ValueError(f"row marks {marks} do not fit a chunk of {sizes} with a patch of {count} elements")
    k0, k1 = first // rows, min(-(-stop // rows), len(starts) - 1)
    row = math.prod(sizes[1:])
    return starts[k0], starts[k1], k0 * rows * row, min(k1 * rows, sizes[0]) * row


def index_dtype(numel: int) -> torch.dtype:
    """The dtype of a chunk's patch indices: int32 while they fit."""
    return torch.int32 if numel <= 2**31 else torch.int64


def patch_bytes(count: int, numel: int, elem: int) -> int:
    """Bytes of a patch of ``count`` elements of a chunk of ``numel`` elements of ``elem`` bytes."""
    return count * (index_dtype(numel).itemsize + elem)


def worth_patching(nbytes: int, rows_bytes: int, cost: int, steps: int) -> bool:
    """Patch (rather than write a new base) when the patch is smaller than the changed row
    blocks and no larger than the bytes per version written since the base (module docstring)."""
    return nbytes < rows_bytes and nbytes * steps <= cost


def scatter_into_box(
    indices: torch.Tensor,
    values: torch.Tensor,
    chunk_offsets: list[int],
    chunk_sizes: list[int],
    box: tuple[tuple[int, int], ...],
    dst: torch.Tensor,
) -> int:
    """Write the patch elements that fall inside ``box`` (global coordinates) into ``dst`` (shaped
    like the box, any strides). ``indices`` are sorted flat indices into the chunk at
    ``chunk_offsets`` of size ``chunk_sizes``. Returns the number of elements written.

    The chunk's rows inside the box are one range of flat indices, found by binary search; where
    the box also spans the chunk's other dimensions whole and ``dst`` is contiguous, that range
    maps to ``dst`` by one shift. Otherwise the indices are unravelled and filtered per dimension.
    Elements land by memory offset in ``dst``'s storage (a 1-D index, not an N-D one).
    """
    if not chunk_sizes:  # a 0-d tensor: one element
        if indices.numel():
            dst.copy_(values[-1].view(()))
        return int(indices.numel() > 0)
    row = math.prod(chunk_sizes[1:])
    first = max(box[0][0] - chunk_offsets[0], 0)
    stop = min(box[0][1] - chunk_offsets[0], chunk_sizes[0])
    if first >= stop or indices.numel() == 0 or dst.numel() == 0:
        return 0
    bounds = torch.tensor([first * row, stop * row], dtype=indices.dtype)
    lo, hi = torch.searchsorted(indices, bounds).tolist()
    values = values[lo:hi]
    span = sum((n - 1) * stride for n, stride in zip(dst.shape, dst.stride())) + 1
    # int32 arithmetic where it cannot overflow: 3x faster than int64 here.
    dtype = torch.int32 if max(math.prod(chunk_sizes), span) < 2**31 else torch.int64
    flat = indices[lo:hi].to(dtype)
    whole = all(
        (lo_d, hi_d) == (off, off + size)
        for (lo_d, hi_d), off, size in zip(box[1:], chunk_offsets[1:], chunk_sizes[1:])
    )
    if whole and dst.is_contiguous():
        memory = flat + (chunk_offsets[0] - box[0][0]) * row
    else:
        memory = keep = None
        for d in reversed(range(len(chunk_sizes))):
            if d:
                quotient = flat // chunk_sizes[d]
                local = flat - quotient * chunk_sizes[d] + (chunk_offsets[d] - box[d][0])
                flat = quotient
                if (box[d][0], box[d][1]) != (chunk_offsets[d], chunk_offsets[d] + chunk_sizes[d]):
                    inside = (local >= 0) & (local < box[d][1] - box[d][0])
                    keep = inside if keep is None else keep & inside
            else:
                local = flat + (chunk_offsets[0] - box[0][0])
            memory = local * dst.stride(d) if memory is None else memory + local * dst.stride(d)
        if keep is not None:
            memory, values = memory[keep], values[keep]
    target = dst.as_strided((span,), (1,), dst.storage_offset())
    target.index_copy_(0, memory.to(torch.int64), values.to(dst.dtype))
    return int(memory.numel())
