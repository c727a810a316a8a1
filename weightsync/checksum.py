"""Tile checksums of stored chunks: verifiable from the slices a tensor-parallel worker reads.

A TP worker reads only part of each chunk: row slices for column-parallel layers, a column slice
of every row for row-parallel layers (``o_proj``, ``down_proj``). One checksum over a whole chunk
could only be checked by reading all of it, which would double what each worker reads at TP=2.
So every chunk is cut into tiles, each with its own checksum, and a reader checks the tiles its
slice covers (reading the rest of any tile it covers in part).

Tile geometry (``Grid``). A chunk is seen as a matrix: a 2-D chunk as itself, a 1-D chunk as one
row, an N-D chunk as ``(sizes[0], product of the other sizes)``.

- Column bands: a 2-D chunk whose column count divides by 8 has 8 equal bands (so TP=2/4/8
  column cuts fall on band edges), else one band. A 1-D chunk is cut into contiguous blocks
  (the last may be shorter).
- Row blocks: ``block_rows`` rows, a power of two, at most ``TILE_BYTES`` of whole rows (a few
  hundred KiB) and small enough that a chunk has at least 16 row blocks, so TP row cuts
  (multiples of head sizes, of ``rows / tp``) fall on block edges also for small tensors.
- Tile ``(k, m)`` = row block ``k`` x band ``m``; the checksums are kept row-major.

The checksum ("mlh64"): a multilinear hash mod 2^64 of the tile's bytes seen as little-endian
signed integer words of ``word`` bytes (8 where the band width in bytes allows, else 4, 2 or 1),

    h = sum_i sum_j b_i * a_j * w_ij   (mod 2^64)

over the tile's rows ``i`` and the words ``j`` of each row within the band. ``a_j`` and ``b_i``
are fixed odd 64-bit constants (splitmix64 streams). Any change of a single word changes ``h``:
odd numbers are invertible mod 2^64, so ``b_i * a_j * delta`` is never 0 for ``delta != 0``.
Changes of several words go unnoticed only if their weighted deltas cancel mod 2^64. This
guards against corruption (a bad page, a truncated or overwritten value), not against a writer
forging data: the store trusts those who can write to it.

It is computed on strided views of the stored bytes with a few vectorised ops per batch of row
blocks (a wrapping int64 matmul with ``a``, then a weighted sum with ``b``), no Python loop per
row: 0.08-0.13 s per GiB on one core here, a fifth of a memcpy into fresh memory. A verified
read of shared memory costs 0.2-0.5 s per GiB more than an unverified one (bench.weightsync).

In the index a chunk's checksums are ``{"algo": "mlh64", "block_rows", "band_cols", "word",
"hex"}``, ``hex`` being the tiles' checksums as 16 hex digits each, big-endian, row-major.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

ALGO = "mlh64"
TILE_BYTES = 256 * 2**10  # bytes of one row block (2-D) or eight blocks (1-D)
BANDS = 8
MIN_ROW_BLOCKS = 16
_BATCH_BYTES = 4 * 2**20  # bytes hashed per vectorised step
_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
_SEED_A, _SEED_B = 0x5EED_A11C_0FFE_E001, 0x5EED_B0B5_CAFE_F002


class ChecksumMismatch(RuntimeError):
    """Stored bytes do not match the checksum the writer recorded: the data is corrupt."""


def matrix_shape(sizes: list[int]) -> tuple[int, int]:
    """The ``(rows, cols)`` a chunk of ``sizes`` is tiled as."""
    if len(sizes) <= 1:
        return 1, (sizes[0] if sizes else 1)
    return sizes[0], math.prod(sizes[1:])


def _pow2_at_most(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


@dataclass(frozen=True)
class Grid:
    """Tile geometry of one chunk (see the module docstring)."""

    rows: int
    cols: int
    elem: int  # bytes per element
    block_rows: int
    band_cols: int
    word: int  # bytes per hashed word

    @classmethod
    def for_chunk(cls, sizes: list[int], elem: int) -> Grid:
        rows, cols = matrix_shape(sizes)
        if len(sizes) <= 1:
            block_rows = 1
            wanted = min(TILE_BYTES // BANDS // elem, -(-cols // MIN_ROW_BLOCKS))
            band_cols = min(cols, _pow2_at_most(wanted)) if cols else 1
        else:
            band_cols = cols // BANDS if cols % BANDS == 0 and cols else max(cols, 1)
            wanted = min(TILE_BYTES // max(1, cols * elem), -(-rows // MIN_ROW_BLOCKS))
            block_rows = _pow2_at_most(wanted)
        word = math.gcd(8, band_cols * elem, cols * elem) if cols else 1
        return cls(rows, cols, elem, block_rows, band_cols, word)

    @property
    def shape(self) -> tuple[int, int]:
        """Tiles along rows and along columns."""
        return -(-self.rows // self.block_rows), -(-self.cols // self.band_cols)

    def tiles_of(self, rows: tuple[int, int], cols: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
        """The tile ranges (row blocks, bands) that the element range ``rows`` x ``cols`` touches."""
        return (
            (rows[0] // self.block_rows, -(-rows[1] // self.block_rows)),
            (cols[0] // self.band_cols, -(-cols[1] // self.band_cols)),
        )

    def span(self, tiles: tuple[tuple[int, int], tuple[int, int]]) -> tuple[tuple[int, int], tuple[int, int]]:
        """The element rows and columns covered by a range of tiles (clipped to the chunk)."""
        (k0, k1), (m0, m1) = tiles
        return (
            (k0 * self.block_rows, min(k1 * self.block_rows, self.rows)),
            (m0 * self.band_cols, min(m1 * self.band_cols, self.cols)),
        )

    def to_json(self, hashes: torch.Tensor) -> dict:
        return {
            "algo": ALGO,
            "block_rows": self.block_rows,
            "band_cols": self.band_cols,
            "word": self.word,
            "hex": hashes.numpy().astype(">u8").tobytes().hex(),
        }

    @classmethod
    def from_json(cls, raw: dict, sizes: list[int], elem: int) -> tuple[Grid, torch.Tensor]:
        """The grid and the stored checksums (shaped like ``grid.shape``) of a chunk's JSON."""
        if raw.get("algo") != ALGO:
            raise ValueError(f"unknown checksum algorithm {raw.get('algo')!r}; this reader knows {ALGO!r}")
        rows, cols = matrix_shape(sizes)
        grid = cls(rows, cols, elem, int(raw["block_rows"]), int(raw["band_cols"]), int(raw["word"]))
        hashes = np.frombuffer(bytes.fromhex(raw["hex"]), dtype=">u8").astype(np.int64)
        if hashes.size != math.prod(grid.shape):
            raise ValueError(f"checksum list holds {hashes.size} tiles, the chunk's grid {grid.shape}")
        return grid, torch.from_numpy(hashes).view(grid.shape)


def _splitmix64(seed: int, n: int) -> torch.Tensor:
    """``n`` odd 64-bit constants (splitmix64 of ``seed + i * golden``, low bit set), as int64."""
    with np.errstate(over="ignore"):
        z = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = (z ^ (z >> np.uint64(31))) | np.uint64(1)
    return torch.from_numpy(z.view(np.int64))


_COEFFS: dict[int, torch.Tensor] = {}


def coefficients(seed: int, n: int) -> torch.Tensor:
    """The first ``n`` coefficients of a stream (``_SEED_A``: per column word, ``_SEED_B``: per row)."""
    have = _COEFFS.get(seed)
    if have is None or have.numel() < n:
        have = _COEFFS[seed] = _splitmix64(seed, _pow2_at_most(2 * n))
    return have[:n]


def _words(raw: torch.Tensor, word: int) -> torch.Tensor:
    """``raw`` (uint8, last dim contiguous) seen as signed ``word``-byte integers, copied if misaligned."""
    if raw.data_ptr() % word or any(s % word for s in raw.stride()[:-1]):
        raw = raw.clone()
    return raw.view(_WORD_DTYPES[word])


def region_hashes(raw: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Checksums of the tiles that make up ``raw``, shaped (row blocks, bands).

    ``raw`` is a 2-D uint8 view ``(rows, cols * elem)`` of stored bytes (strides allowed, last
    dim contiguous) that starts on a tile corner and ends on tile edges or the chunk's edges.
    The sums run in numpy: its integer matmul is one fused, single-threaded pass, which is as
    fast as torch's multiply-and-sum on an idle core and does not collapse, as torch's OpenMP
    threads do, when the cores are oversubscribed (measured 0.1 vs 4 s per GiB here then).
    """
    words = _words(raw, grid.word).numpy()
    rows, cols = words.shape
    band = grid.band_cols * grid.elem // grid.word
    out = np.empty((-(-rows // grid.block_rows), -(-cols // band)), dtype=np.int64)
    a = coefficients(_SEED_A, band).numpy()
    b = coefficients(_SEED_B, grid.block_rows).numpy()
    with np.errstate(over="ignore"):
        for (s0, s1), (c0, c1), height, width, tiles_at in _pieces(rows, cols, band, grid, _BATCH_BYTES // grid.word):
            tiles = words[s0:s1, c0:c1].reshape(-1, height, (c1 - c0) // width, width)
            per_row = tiles @ a[:width]  # (blocks, height, bands), wrapping int64
            out[tiles_at] = (per_row * b[:height, None]).sum(1)
    return torch.from_numpy(out)


def _pieces(rows: int, cols: int, band: int, grid: Grid, batch_words: int):
    """The pieces a region of ``rows`` x ``cols`` words is hashed in: batches of at most about
    ``batch_words`` words of whole row blocks, split into the full bands and the last partial
    band, and into the batch's whole row blocks and its partial last block. Yields the word rows,
    word columns, block height, band width and the slice of the output tiles each piece fills."""
    full_cols = cols - cols % band
    col_parts = [(0, full_cols, band), (full_cols, cols, cols - full_cols)]
    per_batch = max(1, batch_words // (max(1, cols) * grid.block_rows)) * grid.block_rows
    for r0 in range(0, rows, per_batch):
        r1 = min(rows, r0 + per_batch)
        tail = r1 - (r1 - r0) % grid.block_rows
        for c0, c1, width in col_parts:
            if c1 <= c0:
                continue
            for s0, s1 in ((r0, tail), (tail, r1)):
                if s1 <= s0:
                    continue
                tiles_at = (slice(s0 // grid.block_rows, -(-s1 // grid.block_rows)), slice(c0 // band, -(-c1 // band)))
                yield (s0, s1), (c0, c1), min(grid.block_rows, s1 - s0), width, tiles_at


_DEVICE_COEFFS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _device_coefficients(seed: int, n: int, device: torch.device) -> torch.Tensor:
    have = _DEVICE_COEFFS.get((seed, device))
    if have is None or have.numel() < n:
        have = _DEVICE_COEFFS[(seed, device)] = coefficients(seed, n).to(device)
    return have[:n]


def region_hashes_torch(raw: torch.Tensor, grid: Grid, batch_bytes: int = 256 * 2**20) -> torch.Tensor:
    """``region_hashes`` in torch ops on ``raw``'s own device (a GPU: no bytes leave it).

    The same sums as the numpy path, bit for bit: the words are widened to int64 (sign
    extended, as numpy's matmul does), multiplied by ``a`` and summed per row and band, then
    weighted by ``b`` and summed per row block; int64 products and sums wrap mod 2^64 on every
    device torch runs on, and a sum mod 2^64 does not depend on its order. CUDA has no integer
    matmul, hence a multiply and a sum; ``batch_bytes`` bounds the int64 temporaries. Returns
    a tensor on ``raw``'s device, shaped (row blocks, bands).
    """
    words = _words(raw, grid.word)
    rows, cols = words.shape
    band = grid.band_cols * grid.elem // grid.word
    out = torch.empty((-(-rows // grid.block_rows), -(-cols // band)), dtype=torch.int64, device=raw.device)
    a = _device_coefficients(_SEED_A, band, raw.device)
    b = _device_coefficients(_SEED_B, grid.block_rows, raw.device)
    for (s0, s1), (c0, c1), height, width, tiles_at in _pieces(rows, cols, band, grid, batch_bytes // 8):
        tiles = words[s0:s1, c0:c1].to(torch.int64).view(-1, height, (c1 - c0) // width, width)
        per_row = (tiles * a[:width]).sum(-1)  # (blocks, height, bands), wrapping int64
        out[tiles_at] = (per_row * b[:height, None]).sum(1)
    return out


def tile_hashes(raw: torch.Tensor, grid: Grid) -> torch.Tensor:
    """``region_hashes`` where ``raw`` lives: numpy on the CPU, torch ops on a GPU."""
    return region_hashes(raw, grid) if raw.device.type == "cpu" else region_hashes_torch(raw, grid)


def chunk_checksums(tensor: torch.Tensor) -> dict:
    """The JSON checksum record of a whole (contiguous) chunk, as the writer stores it (hashed
    on the tensor's device)."""
    grid = Grid.for_chunk(list(tensor.shape), tensor.element_size())
    raw = tensor.detach().contiguous().view(-1).view(torch.uint8).view(grid.rows, grid.cols * grid.elem)
    return grid.to_json(tile_hashes(raw, grid).cpu())


def row_block_slice(record: dict, sizes: list[int], elem: int, k0: int, k1: int) -> dict:
    """The checksum record of row blocks ``k0:k1`` of a chunk: the record of the rows they
    span, seen as a chunk of its own (its grid keeps the parent's block rows and bands)."""
    grid, hashes = Grid.from_json(record, sizes, elem)
    return grid.to_json(hashes[k0:k1])


def changed_row_blocks(new: dict, old: dict | None, sizes: list[int], elem: int) -> torch.Tensor:
    """Per row block of a chunk: does any of its tiles' checksums differ from ``old``'s?

    All blocks count as changed when there is no ``old`` record or it has another grid. Two
    different contents with equal checksums (odds about 2^-64 per tile for any change that is
    not crafted) would count as unchanged.
    """
    grid, hashes = Grid.from_json(new, sizes, elem)
    if old is None or any(old.get(k) != new[k] for k in ("algo", "block_rows", "band_cols", "word")):
        return torch.ones(grid.shape[0], dtype=torch.bool)
    _, before = Grid.from_json(old, sizes, elem)
    return (hashes != before).any(dim=1)
