"""Pushes through shared mappings of the shard files (the path a GPU trainer rank takes, here with
CPU tensors and no CUDA registration): the same bytes as plain file writes, files of a fixed
size reused across versions, mappings kept per file and dropped once the file is gone."""

from __future__ import annotations

import os
import random

import pytest
import torch
from safetensors import safe_open

from tests.boxes import random_box
from tests.chunks import flip_stored_bit
from tests.configs import make_pusher
from weightsync.checksum import ChecksumMismatch
from weightsync.host_memory import MappedFiles
from weightsync.push import run_dir, spare_dir, version_dir
from weightsync.reader import ChunkSource, read_box
from weightsync.shm_writer import RESERVED_PREFIX, claim_spare, shard_file_name


def _state_dict(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(40, 16, generator=g),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(16, 32, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(48, 16, generator=g),
        "model.norm.weight": torch.randn(16, generator=g),
        "odd": torch.randn(3, 5, 7, generator=g),
    }


def _shard(shm_root, run: str, version: int):
    return version_dir(shm_root, run, version) / shard_file_name(1)


def test_mapped_writes_store_the_same_bytes_and_index_as_file_writes(store, redis_url, shm_root):
    from weightsync.store import WeightStore

    plain_store = WeightStore(redis_url, store.run + "-plain")
    try:
        for dtype in ("float32", "bfloat16"):
            version = 1 if dtype == "float32" else 2
            mapped = make_pusher(store, shm_root=shm_root, dtype=dtype)
            mapped.mapped_writes = True
            plain = make_pusher(plain_store, shm_root=shm_root, dtype=dtype)
            sd = _state_dict(version)
            mapped.push(sd, version)
            plain.push(sd, version)
            a = _shard(shm_root, store.run, version).read_bytes()
            b = _shard(shm_root, plain_store.run, version).read_bytes()
            assert a == b
            got, want = store.index(version), plain_store.index(version)
            assert got.keys() == want.keys()
            for name in got:
                for c, d in zip(got[name].chunks, want[name].chunks, strict=True):
                    assert (c.offsets, c.sizes, c.checksum) == (d.offsets, d.sizes, d.checksum)
                    assert c.location["pinnable"] and "pinnable" not in d.location
            with safe_open(str(_shard(shm_root, store.run, version)), "pt") as f:
                assert torch.equal(f.get_tensor("odd"), sd["odd"].to(getattr(torch, dtype)))
            mapped.remove_all()
            plain.remove_all()
    finally:
        plain_store.close()


def test_steady_pushes_reuse_the_same_files_and_mappings(store, shm_root):
    """Reserved files are cut to size once; later pushes write over retired files of exactly
    their size, through the mappings made the first time (none made again); a file removed
    from shared memory has its mapping dropped."""
    pusher = make_pusher(store, shm_root=shm_root, keep_last=1)
    pusher.mapped_writes = True
    pusher.reserve(_state_dict(0), background=False)
    reserved = {f.stat().st_ino for f in spare_dir(shm_root, store.run).iterdir()}
    assert len(reserved) == 3
    inodes = []
    for version in range(1, 9):
        stats = pusher.push(_state_dict(version), version)
        assert stats["wrote_over_spare"], version
        inodes.append(_shard(shm_root, store.run, version).stat().st_ino)
        source = ChunkSource(version=version)
        for name, entry in store.index(version).items():
            dst = torch.empty(entry.shape)
            read_box(name, entry, tuple((0, n) for n in entry.shape), dst, source)
            assert torch.equal(dst, _state_dict(version)[name]), (version, name)
        source.close()
        store.lease(version, "policy-0")
    assert set(inodes) <= reserved  # never a fresh file
    mappings = pusher._mappings
    assert mappings.opened == len(set(inodes)) <= 3 and len(mappings) == mappings.opened
    sizes = {os.path.getsize(p) for p in run_dir(shm_root, store.run).rglob("*.safetensors")}
    assert len(sizes) == 1  # every file holds exactly one shard
    victim = _shard(shm_root, store.run, 8)
    os.unlink(victim)
    mappings.prune()
    assert len(mappings) == mappings.opened - 1
    pusher.remove_all()
    assert len(mappings) == 0


def test_a_fixed_size_spare_is_an_exact_one_or_a_reserved_one(tmp_path):
    spare = tmp_path / "spare"
    spare.mkdir()
    (spare / "v1-r0.safetensors").write_bytes(b"x" * 1000)  # published once: readers may pin it
    (spare / "v2-r0.safetensors").write_bytes(b"x" * 500)
    (spare / f"{RESERVED_PREFIX}t-0.safetensors").write_bytes(b"x" * 2000)
    assert claim_spare(spare, str(tmp_path / "a"), 500, fixed_size=True)
    assert (tmp_path / "a").stat().st_size == 500
    assert claim_spare(spare, str(tmp_path / "b"), 600, fixed_size=True)  # the reserved one
    assert (tmp_path / "b").stat().st_size == 2000
    assert not claim_spare(spare, str(tmp_path / "c"), 600, fixed_size=True)  # 1000 bytes: not exact
    assert claim_spare(spare, str(tmp_path / "c"), 1000, fixed_size=True)


def test_a_mapping_is_found_again_after_the_file_is_renamed_and_remade_when_resized(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 16)
    files = MappedFiles(register=False)
    first = files.get(str(path))
    assert torch.equal(first.bytes[:4], torch.tensor([0, 1, 2, 3], dtype=torch.uint8))
    first.bytes[0] = 7  # shared: the file sees it
    assert path.read_bytes()[0] == 7
    moved = tmp_path / "g"
    path.rename(moved)
    assert files.get(str(moved)) is first and files.opened == 1
    os.truncate(moved, 1024)
    again = files.get(str(moved))
    assert again is not first and files.opened == 2 and again.bytes.numel() == 1024 and len(files) == 1
    files.close()


def test_mapped_reads_equal_plain_reads_for_random_boxes(store, shm_root):
    """Every box shape a TP worker asks for (row slices, column slices, N-D sub-boxes, 0-/1-D),
    verified and not, whole pushes (pinnable files) and delta pushes (stitched pieces in other
    files): the mapped path reads exactly what the plain path does, counting whole rows read."""
    rng = random.Random(3)
    sd = _state_dict(1)
    sd["scalar"] = torch.tensor(2.5)
    pusher = make_pusher(store, shm_root=shm_root, keep_last=3)
    pusher.mapped_writes = True
    pusher.push(sd, 1)
    delta = make_pusher(store, shm_root=shm_root, keep_last=3, delta=True)
    delta.push(sd, 2)
    sd3 = {k: v.clone() for k, v in sd.items()}
    sd3["model.layers.0.mlp.up_proj.weight"][5:9] += 1  # a delta: other rows stay in version 2's file
    delta.push(sd3, 3)
    mappings = MappedFiles(register=False)
    for version, want in ((1, sd), (3, sd3)):
        index = store.index(version)
        for verify in (True, False):
            mapped = ChunkSource(version=version, verify=verify, mappings=mappings, mapped_reads=True)
            plain = ChunkSource(version=version, verify=verify)
            for name, entry in index.items():
                whole = tuple((0, n) for n in entry.shape)
                halves = [((n // 2, n), *whole[1:]) for n in entry.shape[:1]]  # a TP=2 rank's rows
                for box in [whole, *halves, *(random_box(entry.shape, rng) for _ in range(8))]:
                    a = torch.full([hi - lo for lo, hi in box], float("nan"))
                    b = a.clone()
                    read_mapped = read_box(name, entry, box, a, mapped)
                    read_plain = read_box(name, entry, box, b, plain)
                    mapped.finish()
                    assert torch.equal(a, b) and torch.equal(a, want[name][tuple(slice(*r) for r in box)])
                    assert read_mapped >= read_plain
            assert (mapped.tiles_verified > 0) == verify
            mapped.close()
            plain.close()
    assert 0 < len(mappings) == mappings.opened  # version 1's pinnable file, kept
    mappings.close()


def test_a_corrupt_tile_read_by_mapped_reads_is_caught_at_finish(store, shm_root):
    sd = _state_dict(2)
    pusher = make_pusher(store, shm_root=shm_root)
    pusher.mapped_writes = True
    pusher.push(sd, 4)
    fqn = "model.layers.0.self_attn.o_proj.weight"
    entry = store.index(4)[fqn]
    path = entry.chunks[0].location["file"]
    flip_stored_bit(path, fqn, 3 * 32 + 30, 4)  # element [3, 30]: the last band of a 16-wide TP=2 half
    clean = ChunkSource(version=4, mapped_reads=True)
    out = torch.empty(16, 16)
    read_box(fqn, entry, ((0, 16), (0, 16)), out, clean)  # the other column half: clean tiles
    clean.finish()
    assert torch.equal(out, sd[fqn][:, :16])
    source = ChunkSource(version=4, mapped_reads=True)
    read_box(fqn, entry, ((0, 16), (16, 32)), torch.empty(16, 16), source)
    with pytest.raises(ChecksumMismatch) as err:
        source.finish()
    message = str(err.value)
    assert fqn in message and "weight version 4" in message and path in message and "cols 28:32" in message
    source.close()
