"""Tile checksums: the hash itself, verification on read, and what verification costs in bytes."""

import random

import numpy as np
import pytest
import torch

from tests.boxes import random_box
from tests.chunks import CHUNK_CASES, CHUNK_IDS, random_chunk
from tests.configs import make_pusher
from weightsync.checksum import (
    _SEED_A,
    _SEED_B,
    ChecksumMismatch,
    Grid,
    chunk_checksums,
    coefficients,
    region_hashes,
    region_hashes_torch,
)
from weightsync.layout import Layout, plan_pieces
from weightsync.reader import ChunkSource, read_box


def _reference_hash(words: np.ndarray) -> int:
    """The module docstring's formula, spelled out: sum_i sum_j b_i a_j w_ij mod 2^64."""
    a = coefficients(_SEED_A, words.shape[1]).numpy().view(np.uint64)
    b = coefficients(_SEED_B, words.shape[0]).numpy().view(np.uint64)
    total = 0
    for i in range(words.shape[0]):
        for j in range(words.shape[1]):
            total += int(b[i]) * int(a[j]) * int(words[i, j])
    return total % 2**64


def _as_unsigned(h: int) -> int:
    return h & (2**64 - 1)


@pytest.mark.parametrize(
    ("shape", "dtype"), [((64, 48), torch.float32), ((40, 128), torch.bfloat16), ((33, 10), torch.float32)]
)
def test_strided_tile_hashes_equal_contiguous_copies_and_the_formula(shape, dtype):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(shape, generator=g).to(dtype)
    grid = Grid.for_chunk(list(shape), t.element_size())
    raw = t.view(-1).view(torch.uint8).view(grid.rows, grid.cols * grid.elem)
    full = region_hashes(raw, grid)
    rows, bands = grid.shape
    band_bytes = grid.band_cols * grid.elem
    word_dtype = {8: "<i8", 4: "<i4", 2: "<i2", 1: "i1"}[grid.word]
    for k in range(rows):
        for m in range(bands):
            tile = raw[k * grid.block_rows : (k + 1) * grid.block_rows, m * band_bytes : (m + 1) * band_bytes]
            assert not tile.is_contiguous() or bands == 1
            alone = region_hashes(tile.contiguous(), grid)  # the same tile, copied out
            assert alone.shape == (1, 1) and alone.item() == full[k, m].item()
            words = tile.contiguous().numpy().view(word_dtype)
            assert _as_unsigned(full[k, m].item()) == _reference_hash(words)


@pytest.mark.parametrize(("sizes", "dtype"), CHUNK_CASES, ids=CHUNK_IDS)
def test_torch_tile_hashes_equal_numpy_bit_for_bit(sizes, dtype):
    """The device checksum (torch ops, here on the CPU) against the numpy one: the whole chunk,
    random tile-aligned regions of it as strided views (what a reader hashes), a misaligned copy,
    and small batches (the int64 temporaries cut into many pieces)."""
    g = torch.Generator().manual_seed(len(sizes) * 1000 + sum(sizes))
    rng = random.Random(sum(sizes))
    t = random_chunk(list(sizes), dtype, g)
    grid = Grid.for_chunk(list(sizes), t.element_size())
    raw = t.reshape(-1).view(torch.uint8).view(grid.rows, grid.cols * grid.elem)
    want = region_hashes(raw, grid)
    assert torch.equal(region_hashes_torch(raw, grid), want)
    assert torch.equal(region_hashes_torch(raw, grid, batch_bytes=1), want)
    misaligned = torch.empty(raw.numel() + 1, dtype=torch.uint8)[1:].view(raw.shape)
    misaligned.copy_(raw)
    assert torch.equal(region_hashes_torch(misaligned, grid), want)
    rows, bands = grid.shape
    for _ in range(6):
        k0 = rng.randrange(rows)
        k1 = rng.randrange(k0 + 1, rows + 1)
        m0 = rng.randrange(bands)
        m1 = rng.randrange(m0 + 1, bands + 1)
        (r0, r1), (c0, c1) = grid.span(((k0, k1), (m0, m1)))
        region = raw[r0:r1, c0 * grid.elem : c1 * grid.elem]
        assert torch.equal(region_hashes_torch(region, grid), want[k0:k1, m0:m1])


def test_flipping_any_single_word_changes_the_tile_hash():
    rng = random.Random(0)
    t = torch.randn(96, 256)
    grid = Grid.for_chunk([96, 256], 4)
    assert grid.word == 8 and grid.shape[1] == 8
    base = region_hashes(t.view(torch.uint8).view(96, 1024), grid)
    words = t.view(-1).view(torch.int64)  # the hashed words, as the grid sees them
    for _ in range(200):
        pos = rng.randrange(words.numel())
        old = words[pos].item()
        mask = rng.choice([1 << rng.randrange(64), rng.randrange(1, 2**64)])  # one bit, or any change
        new = (old & (2**64 - 1)) ^ mask
        words[pos] = new - 2**64 if new >= 2**63 else new
        changed = region_hashes(t.view(torch.uint8).view(96, 1024), grid)
        words[pos] = old
        row, col = divmod(pos, 256 // 2)
        k, m = row // grid.block_rows, col // (grid.band_cols // 2)
        diff = (changed != base).nonzero().tolist()
        assert diff == [[k, m]]  # exactly the tile holding the word, and always detected


def test_checksum_records_are_compact_json_and_round_trip():
    t = torch.randn(300, 64)
    record = chunk_checksums(t)
    assert set(record) == {"algo", "block_rows", "band_cols", "word", "hex"}
    grid, hashes = Grid.from_json(record, [300, 64], 4)
    assert hashes.shape == grid.shape and len(record["hex"]) == 16 * hashes.numel()
    assert torch.equal(hashes, region_hashes(t.view(torch.uint8).view(300, 256), grid))


def _state_dict(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model.layers.0.self_attn.o_proj.weight": torch.randn(64, 256, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(200, 64, generator=g),
        "model.norm.weight": torch.randn(1000, generator=g),
        "odd.weight": torch.randn(9, 7, generator=g),
    }


def _corrupt_file_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def _byte_of(store, version, fqn, row, col) -> tuple[str, int]:
    """(file, offset) of element [row, col] of ``fqn`` in its shard."""
    chunk = store.index(version)[fqn].chunks[0]
    source = ChunkSource()
    view = source.fetch(fqn, chunk, 4, (0, chunk.sizes[0]), (0, chunk.sizes[1]))
    base = source._file(chunk.location["file"]).bytes.data_ptr()
    return chunk.location["file"], view.data_ptr() - base + (row * chunk.sizes[1] + col) * 4


def test_a_corrupt_byte_in_shared_memory_is_a_clear_error(store, shm_root):
    sd = _state_dict()
    make_pusher(store, shm_root=shm_root).push(sd, version=7)
    fqn = "model.layers.0.self_attn.o_proj.weight"
    file, offset = _byte_of(store, 7, fqn, row=5, col=200)
    _corrupt_file_byte(file, offset)
    entry = store.index(7)[fqn]
    # A row-parallel TP worker reading the other column half reads clean tiles only ...
    out = torch.empty(64, 128)
    read_box(fqn, entry, ((0, 64), (0, 128)), out, ChunkSource(version=7))
    assert torch.equal(out, sd[fqn][:, :128])
    # ... the one whose half holds the byte gets an error naming what and where.
    with pytest.raises(ChecksumMismatch) as err:
        read_box(fqn, entry, ((0, 64), (128, 256)), torch.empty(64, 128), ChunkSource(version=7))
    message = str(err.value)
    assert fqn in message and "weight version 7" in message and file in message and "chunk 0" in message
    assert "cols 192:224" in message  # the 8th band of 32 columns holds column 200
    # Without verification the corrupt value goes through: the check is what catches it.
    out = torch.empty(64, 128)
    read_box(fqn, entry, ((0, 64), (128, 256)), out, ChunkSource(verify=False))
    assert not torch.equal(out, sd[fqn][:, 128:])
    # Other tensors of the same shard still read fine.
    out = torch.empty(1000)
    read_box("model.norm.weight", store.index(7)["model.norm.weight"], ((0, 1000),), out, ChunkSource())
    assert torch.equal(out, sd["model.norm.weight"])


def test_push_without_checksums_records_none_and_reads_unverified(store, shm_root):
    sd = _state_dict()
    make_pusher(store, shm_root=shm_root, checksums=False).push(sd, version=1)
    index = store.index(1)
    assert all(c.checksum is None for e in index.values() for c in e.chunks)
    source = ChunkSource()
    out = torch.empty(200, 64)
    read_box(
        "model.layers.0.mlp.up_proj.weight",
        index["model.layers.0.mlp.up_proj.weight"],
        ((0, 200), (0, 64)),
        out,
        source,
    )
    assert torch.equal(out, sd["model.layers.0.mlp.up_proj.weight"]) and source.tiles_verified == 0


def _tile_bytes(entry, box) -> int:
    """Bytes of the tiles that ``box`` touches (the reader reads them whole to verify them)."""
    chunk = entry.chunks[0]
    grid, _ = Grid.from_json(chunk.checksum, chunk.sizes, 4)
    if len(box) == 1:
        rows, cols = (0, 1), box[0]
    else:
        rows, cols = box
    (r0, r1), (c0, c1) = grid.span(grid.tiles_of(rows, cols))
    return (r1 - r0) * (c1 - c0) * 4


def test_verified_reads_equal_slicing_and_count_partial_tiles(store, shm_root):
    sd = _state_dict(seed=3)
    make_pusher(store, shm_root=shm_root).push(sd, version=1)
    index, rng = store.index(1), random.Random(0)
    for _ in range(60):
        name = rng.choice(sorted(index))
        box = random_box(index[name].shape, rng)
        expected = sd[name][tuple(slice(lo, hi) for lo, hi in box)]
        for verify in (True, False):
            out = torch.empty(expected.shape)
            source = ChunkSource(verify=verify)
            nbytes = read_box(name, index[name], box, out, source)
            assert torch.equal(out, expected)
            assert nbytes == (_tile_bytes(index[name], box) if verify else expected.numel() * 4)
            assert (source.tiles_verified > 0) == verify


QWEN3 = {"hidden": 128, "heads": 4, "kv_heads": 2, "head_dim": 32, "inter": 384, "vocab": 64, "layers": 2}


def _qwen3_state_dict() -> dict[str, torch.Tensor]:
    c, g = QWEN3, torch.Generator().manual_seed(0)
    sd = {"model.embed_tokens.weight": torch.randn(c["vocab"], c["hidden"], generator=g)}
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": (c["heads"] * c["head_dim"], c["hidden"]),
            "self_attn.k_proj.weight": (c["kv_heads"] * c["head_dim"], c["hidden"]),
            "self_attn.v_proj.weight": (c["kv_heads"] * c["head_dim"], c["hidden"]),
            "self_attn.o_proj.weight": (c["hidden"], c["heads"] * c["head_dim"]),
            "self_attn.q_norm.weight": (c["head_dim"],),
            "self_attn.k_norm.weight": (c["head_dim"],),
            "mlp.gate_proj.weight": (c["inter"], c["hidden"]),
            "mlp.up_proj.weight": (c["inter"], c["hidden"]),
            "mlp.down_proj.weight": (c["hidden"], c["inter"]),
            "input_layernorm.weight": (c["hidden"],),
            "post_attention_layernorm.weight": (c["hidden"],),
        }
        sd.update({p + k: torch.randn(s, generator=g) for k, s in shapes.items()})
    sd["model.norm.weight"] = torch.randn(c["hidden"], generator=g)
    return sd


def _tp2_pieces(rank: int) -> list:
    """What a TP=2 vLLM worker reads of the Qwen3 model above (vLLM's layouts, as plain data)."""
    c = QWEN3
    h, hd = c["hidden"], c["head_dim"]
    per = {"tp_rank": rank, "tp_size": 2}
    pieces = plan_pieces(
        "model.embed_tokens.weight",
        (c["vocab"] // 2, h),
        Layout("vocab", vocab_start=rank * c["vocab"] // 2, vocab_end=(rank + 1) * c["vocab"] // 2, **per),
    )
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        q, kv = c["heads"] // 2 * hd, c["kv_heads"] // 2 * hd
        pieces += plan_pieces(
            p + "self_attn.qkv_proj.weight",
            (q + 2 * kv, h),
            Layout("qkv", q_size=q, k_size=kv, v_size=kv, kv_rank=rank, **per),
        )
        pieces += plan_pieces(p + "self_attn.o_proj.weight", (h, c["heads"] * hd // 2), Layout("row", dim=1, **per))
        pieces += plan_pieces(
            p + "mlp.gate_up_proj.weight",
            (c["inter"], h),
            Layout("merged", output_sizes=(c["inter"], c["inter"]), **per),
        )
        pieces += plan_pieces(p + "mlp.down_proj.weight", (h, c["inter"] // 2), Layout("row", dim=1, **per))
        for norm, n in [("self_attn.q_norm.weight", hd), ("self_attn.k_norm.weight", hd)]:
            pieces += plan_pieces(p + norm, (n,), Layout("replicated"))
        for norm in ["input_layernorm.weight", "post_attention_layernorm.weight"]:
            pieces += plan_pieces(p + norm, (h,), Layout("replicated"))
    pieces += plan_pieces("model.norm.weight", (h,), Layout("replicated"))
    return pieces


def test_a_tp2_worker_reads_at_most_055_of_the_model_with_verification(store, shm_root):
    sd = _qwen3_state_dict()
    make_pusher(store, shm_root=shm_root).push(sd, version=1)
    index = store.index(1)
    model_bytes = sum(t.numel() * 4 for t in sd.values())
    for rank in (0, 1):
        source = ChunkSource(version=1)
        nbytes = 0
        for piece in _tp2_pieces(rank):
            expected = sd[piece.hf_name][tuple(slice(lo, hi) for lo, hi in piece.src)]
            out = torch.empty(expected.shape)
            nbytes += read_box(piece.hf_name, index[piece.hf_name], piece.src, out, source)
            assert torch.equal(out, expected)
        assert source.tiles_verified > 0
        assert nbytes <= 0.55 * model_bytes, nbytes / model_bytes
