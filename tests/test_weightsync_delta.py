"""Delta sync: only changed row blocks are pushed; versions reuse older storage, counted by use.

Every read is checked against slicing the true tensors of that version, with checksums verified.
"""

import math
import random

import pytest
import torch
from safetensors import safe_open

from tests.boxes import random_box
from tests.configs import make_pusher
from weightsync.checksum import Grid
from weightsync.push import run_dir, version_dir
from weightsync.reader import ChunkSource, read_box
from weightsync.shm_writer import shard_file_name

BIG = "model.layers.0.mlp.up_proj.weight"


def _state_dict(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(96, 32, generator=g),
        BIG: torch.randn(256, 64, generator=g),  # 16 row blocks of 16 rows
        "model.layers.0.conv.weight": torch.randn(48, 4, 6, generator=g),  # N-D: rows of 24
        "model.norm.weight": torch.randn(64, generator=g),
    }


def _nbytes(sd) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def _read_all(store, version, sd, rng, boxes=6):
    """Read every tensor whole and a few random boxes of each; compare with ``sd``."""
    index = store.index(version)
    source = ChunkSource(store.url, version)
    try:
        for fqn, truth in sd.items():
            entry = index[fqn]
            out = torch.empty_like(truth)
            read_box(fqn, entry, tuple((0, n) for n in truth.shape), out, source)
            assert torch.equal(out, truth), fqn
            for _ in range(boxes):
                box = random_box(list(truth.shape), rng)
                part = torch.empty([hi - lo for lo, hi in box], dtype=truth.dtype)
                read_box(fqn, entry, box, part, source)
                assert torch.equal(part, truth[tuple(slice(lo, hi) for lo, hi in box)]), (fqn, box)
        assert source.tiles_verified > 0
    finally:
        source.close()


@pytest.mark.parametrize("data_plane", ["shm", "redis"])
def test_a_delta_push_writes_only_the_changed_row_blocks(store, shm_root, data_plane):
    sd = _state_dict()
    pusher = make_pusher(store, shm_root, keep_last=3, data_plane=data_plane, delta=True)
    first = pusher.push(sd, 1)
    assert first["bytes_reused"] == 0 and first["bytes_written"] > _nbytes(sd)  # the first is whole

    sd[BIG][40:50] += 1.0  # row blocks 2 and 3 (rows 32:64)
    sd["model.norm.weight"][3] = 7.0  # a 1-D chunk is one row: written whole
    second = pusher.push(sd, 2)
    changed = 32 * 64 * 4 + 64 * 4
    assert second["bytes_reused"] == _nbytes(sd) - changed
    assert changed < second["bytes_written"] < changed + 4096  # plus the header
    pieces = store.index(2)[BIG].chunks
    assert [(c.offsets[0], c.sizes[0], c.location["unit"]) for c in pieces] == [
        (0, 32, "1:0"),
        (32, 32, "2:0"),
        (64, 192, "1:0"),
    ]
    # Each piece's checksums are its rows' tiles of the whole chunk's.
    whole = store.index(1)[BIG].chunks[0].checksum
    _, tiles = Grid.from_json(whole, [256, 64], 4)
    _, tail = Grid.from_json(pieces[2].checksum, [192, 64], 4)
    assert torch.equal(tail, tiles[4:])
    if data_plane == "shm":  # the changed rows are a tensor of their own in the new shard
        with safe_open(str(version_dir(shm_root, store.run, 2) / shard_file_name(1)), framework="pt") as f:
            assert set(f.keys()) == {f"{BIG}[32:64]", "model.norm.weight"}
            assert torch.equal(f.get_tensor(f"{BIG}[32:64]"), sd[BIG][32:64])
    _read_all(store, 2, sd, random.Random(0))

    third = pusher.push(sd, 3)  # nothing changed: nothing written, everything reused
    assert third["bytes_written"] == 0 and third["bytes_reused"] == _nbytes(sd)
    _read_all(store, 3, sd, random.Random(1), boxes=2)
    assert store.uses(3) == {"1:0", "2:0", "3:0"}


def test_random_edits_over_many_versions_read_back_exactly(store, shm_root):
    """Pieces cut from pieces cut from pieces: every version reads back as its true tensors."""
    rng = random.Random(5)
    g = torch.Generator().manual_seed(5)
    sd = _state_dict(5)
    pusher = make_pusher(store, shm_root, keep_last=2, delta=True, delta_max_live=100.0)
    pusher.push(sd, 1)
    for version in range(2, 9):
        for fqn in rng.sample(sorted(sd), 2):
            t = sd[fqn]
            lo = rng.randrange(t.shape[0])
            hi = rng.randrange(lo + 1, min(t.shape[0], lo + 40) + 1)
            t[lo:hi] = torch.randn(t[lo:hi].shape, generator=g)
        stats = pusher.push(sd, version)
        assert 0 < stats["bytes_reused"] < _nbytes(sd)
        _read_all(store, version, sd, rng, boxes=4)
    assert store.versions() == [7, 8]


def test_retired_versions_keep_the_storage_that_newer_ones_reuse(store, shm_root):
    sd = _state_dict()
    pusher = make_pusher(store, shm_root, keep_last=1, delta=True)
    pusher.push(sd, 1)
    sd[BIG][0:3] *= 2
    pusher.push(sd, 2)
    # Version 1 is dropped, but version 2 points into its shard: the file stays.
    assert store.versions() == [2]
    assert store.use_counts() == {"1:0": 1, "2:0": 1}
    assert (version_dir(shm_root, store.run, 1) / shard_file_name(1)).exists()
    _read_all(store, 2, sd, random.Random(2))

    for t in sd.values():
        t.add_(1.0)  # everything changes: version 3 reuses nothing
    stats = pusher.push(sd, 3)
    assert stats["bytes_reused"] == 0 and stats["dropped_versions"] == [2]
    assert store.use_counts() == {"3:0": 1}
    assert sorted(p.name for p in run_dir(shm_root, store.run).iterdir()) == ["spare", "v3"]
    _read_all(store, 3, sd, random.Random(3))


def test_delta_max_live_bounds_what_reuse_keeps_alive(store, shm_root):
    """Small edits, each in a new version: once the reused units would exceed 1.5 shards, the
    rank writes its whole shard again and the old units are freed."""
    sd = _state_dict()
    total = _nbytes(sd)
    pusher = make_pusher(store, shm_root, keep_last=1, delta=True, delta_max_live=1.5)
    pusher.push(sd, 1)
    kinds = []
    for version in range(2, 12):
        sd["model.embed_tokens.weight"][version * 8 % 96 : version * 8 % 96 + 8] += 1.0
        sd[BIG][version * 16 % 256 : version * 16 % 256 + 16] -= 1.0
        stats = pusher.push(sd, version)
        kinds.append("delta" if stats["bytes_reused"] else "whole")
        live = sum(f.stat().st_size for f in run_dir(shm_root, store.run).glob("v*/*.safetensors"))  # (+ 1 spare)
        assert live <= 1.5 * total + 4096 * len(store.use_counts())  # (headers)
        _read_all(store, version, sd, random.Random(version), boxes=1)
    assert "delta" in kinds and "whole" in kinds
    assert kinds[0] == "delta"


def test_delta_needs_checksums():
    from tests.configs import sync_config
    from validation.config import ConfigError, check_config

    with pytest.raises(ConfigError, match="weightsync.delta=True is invalid.*checksums"):
        check_config(sync_config(delta=True, checksums=False, verify=False), "weightsync")


def test_a_failed_delta_push_keeps_the_base(store, shm_root, monkeypatch):
    """A push that fails leaves no trace, and the next push still deltas against the last commit."""
    sd = _state_dict()
    pusher = make_pusher(store, shm_root, delta=True)
    pusher.push(sd, 1)
    sd[BIG][100:101] += 3
    monkeypatch.setattr(store, "commit", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        pusher.push(sd, 2)
    monkeypatch.undo()
    assert store.versions() == [1] and not version_dir(shm_root, store.run, 2).exists()
    stats = pusher.push(sd, 3)
    assert stats["bytes_reused"] == _nbytes(sd) - 16 * 64 * 4
    _read_all(store, 3, sd, random.Random(4))
    assert math.isclose(stats["bytes_written"], 16 * 64 * 4, abs_tol=4096)


@pytest.mark.slow
def test_two_fsdp_ranks_push_deltas_of_their_own_shards(store, shm_root, tmp_path, tiny_model_path):
    """Two FSDP2 ranks (gloo), each with its own pusher: a version edits rows that only rank 0
    holds, the next rows that only rank 1 holds; each version reads back as the edited model."""
    from tests.fsdp_push import edited_model, push_versions_from_ranks
    from weightsync.push import without_aliases

    q = "model.layers.0.self_attn.q_proj.weight"
    down = "model.layers.1.mlp.down_proj.weight"
    rows = dict(edited_model(tiny_model_path, 3, []).named_parameters())[down].shape[0]
    pushes = [(1, []), (2, [(q, 0, 4, 0.5)]), (3, [(down, rows - 2, rows, -0.5)])]
    stats = push_versions_from_ranks(2, tmp_path, tiny_model_path, 3, store.url, store.run, shm_root, pushes)

    edits = []
    for i, (version, more) in enumerate(pushes):
        edits += more
        truth = {
            k: v.detach() for k, v in without_aliases(edited_model(tiny_model_path, 3, edits).state_dict()).items()
        }
        _read_all(store, version, truth, random.Random(version), boxes=1)
        if i:
            edited_rank = 0 if version == 2 else 1  # FSDP2 shards dim 0: the first rows on rank 0
            assert stats[edited_rank][i]["bytes_written"] < 0.1 * stats[edited_rank][0]["bytes_written"]
            assert stats[1 - edited_rank][i]["bytes_written"] == 0  # nothing of its own changed
            assert stats[1 - edited_rank][i]["bytes_reused"] > 0.9 * stats[1 - edited_rank][0]["bytes_written"]
    # Version 3: rank 0's chunks from versions 1 and 2, rank 1's from 1 and 3 (it wrote nothing in 2).
    assert store.uses(3) == {"1:0", "2:0", "1:1", "3:0", "3:1"}
