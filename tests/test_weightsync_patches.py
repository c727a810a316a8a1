"""Delta sync with element patches: a bf16 version stores only the elements that changed since
its base; every read is checked against slicing the true tensors of that version."""

import json
import math
import random

import pytest
import torch

from tests.boxes import random_box
from tests.configs import make_pusher
from tests.test_weightsync_delta import BIG, _read_all, _state_dict
from weightsync.checksum import ChecksumMismatch
from weightsync.patch import scatter_into_box
from weightsync.push import version_dir
from weightsync.reader import ChunkSource, read_box, update_box
from weightsync.shm_writer import shard_file_name

EMBED = "model.embed_tokens.weight"


def _bf16(sd):
    return {k: v.to(torch.bfloat16) for k, v in sd.items()}


def _bump(t: torch.Tensor, flat_indices: list[int]) -> None:
    """Move single elements far enough that their bf16 values change."""
    view = t.view(-1)
    for i in flat_indices:
        view[i] = view[i] * 1.5 + 0.25


def _patch_of(store, version, fqn):
    pieces = store.index(version)[fqn].chunks
    patches = [c for c in pieces if c.location["kind"] == "patch"]
    return [c for c in pieces if c.location["kind"] != "patch"], (patches[0] if patches else None)


@pytest.mark.parametrize("data_plane", ["shm", "redis"])
def test_patches_hold_the_changed_elements_since_the_base_and_read_back_exactly(store, shm_root, data_plane):
    sd = _state_dict()
    pusher = make_pusher(
        store, shm_root, dtype="bfloat16", keep_last=3, data_plane=data_plane, delta=True, delta_elements=True
    )
    pusher.push(sd, 1)
    base_pieces, patch = _patch_of(store, 1, BIG)
    assert patch is None

    rng = random.Random(0)
    first = rng.sample(range(256 * 64), 40)  # spread over every row block of BIG
    _bump(sd[BIG], first)
    sd["model.layers.0.conv.weight"].view(-1)[7] += 1.0  # an N-D chunk
    stats = pusher.push(sd, 2)
    pieces, patch = _patch_of(store, 2, BIG)
    assert pieces == base_pieces  # the base's pieces, and the patch over them
    assert patch.location["count"] == 40 and patch.location["step"] == 2
    assert stats["bytes_written"] < (40 + 1) * 6 + 4096  # indices + values, plus the header
    _read_all(store, 2, _bf16(sd), random.Random(1))

    # Version 3: new elements change, and one of version 2's returns to its base value. The
    # patch is the union since the base, so a reader holding version 2 can apply it alone.
    back = first[0]
    original = _state_dict()[BIG].view(-1)[back].item()
    second = rng.sample(sorted(set(range(256 * 64)) - set(first)), 30)
    _bump(sd[BIG], second)
    sd[BIG].view(-1)[back] = original
    pusher.push(sd, 3)
    pieces, patch = _patch_of(store, 3, BIG)
    assert pieces == base_pieces and patch.location["count"] == 70 and patch.location["step"] == 3
    _read_all(store, 3, _bf16(sd), random.Random(2))
    # The conv chunk did not change since version 2: its patch piece is reused, not rewritten.
    assert _patch_of(store, 3, "model.layers.0.conv.weight")[1] == _patch_of(store, 2, "model.layers.0.conv.weight")[1]
    assert _patch_of(store, 3, "model.norm.weight") == _patch_of(store, 1, "model.norm.weight")  # untouched
    if data_plane == "shm":
        assert store.uses(3) == {"1:0", "2:0", "3:0"}


def test_update_box_reads_only_the_patch_over_an_earlier_version_of_the_same_base(store, shm_root):
    sd = _state_dict()
    pusher = make_pusher(store, shm_root, dtype="bfloat16", keep_last=5, delta=True, delta_elements=True)
    truths = {}
    rng = random.Random(3)
    for version in range(1, 5):
        if version > 1:
            _bump(sd[BIG], rng.sample(range(256 * 64), 25))
        pusher.push(sd, version)
        truths[version] = _bf16(sd)[BIG]
    index = {v: store.index(v)[BIG] for v in truths}
    assert all(_patch_of(store, v, BIG)[1] is not None for v in (2, 3, 4))
    source = ChunkSource(store.url)
    try:
        for _ in range(6):
            box = random_box([256, 64], rng)
            cut = tuple(slice(lo, hi) for lo, hi in box)
            box_bytes = truths[1][cut].numel() * 2
            for held, target in ((1, 4), (2, 4), (3, 4), (2, 3)):
                dst = truths[held][cut].clone()
                read, kept = update_box(BIG, index[target], index[held], box, dst, source)
                assert torch.equal(dst, truths[target][cut]), (held, target, box)
                assert kept == box_bytes and read <= index[target].chunks[-1].location["count"] * 6 + 8192
            # Going back to an older step (or from nothing) reads the whole box.
            for held, target in ((4, 2), (None, 3)):
                dst = torch.zeros_like(truths[target][cut])
                read, kept = update_box(BIG, index[target], index.get(held), box, dst, source)
                assert torch.equal(dst, truths[target][cut]) and kept == 0 and read >= box_bytes
            dst = truths[3][cut].clone()
            assert update_box(BIG, index[3], index[3], box, dst, source) == (0, box_bytes)
    finally:
        source.close()


def test_a_row_cut_reads_only_its_rows_part_of_the_patch(store, shm_root):
    """A TP worker's row cut (half the rows) reads about half the patch; a column cut spans
    every row and reads all of it. Both write exactly the new values."""
    sd = _state_dict()
    pusher = make_pusher(store, shm_root, dtype="bfloat16", keep_last=3, delta=True, delta_elements=True)
    pusher.push(sd, 1)
    before = _bf16(sd)[BIG]
    _bump(sd[BIG], random.Random(5).sample(range(256 * 64), 1200))
    pusher.push(sd, 2)
    after = _bf16(sd)[BIG]
    _, patch = _patch_of(store, 2, BIG)
    assert patch.location["row_marks"]["rows"] == 4  # 256 rows in 64 runs
    patch_bytes = patch.location["count"] * (4 + 2)  # about 1200 (a bump may keep a bf16 value)
    index = {v: store.index(v)[BIG] for v in (1, 2)}
    source = ChunkSource(store.url, 2)
    try:
        reads = {}
        for name, box in (("rows", ((128, 256), (0, 64))), ("cols", ((0, 256), (32, 64)))):
            cut = tuple(slice(lo, hi) for lo, hi in box)
            dst = before[cut].clone()
            reads[name], _ = update_box(BIG, index[2], index[1], box, dst, source)
            assert torch.equal(dst, after[cut]), name
    finally:
        source.close()
    assert reads["rows"] < 0.6 * patch_bytes  # its half, the marks' neighbours and partial tiles
    assert reads["cols"] >= patch_bytes


@pytest.mark.parametrize("shift", [-3, 3])
def test_row_marks_that_do_not_match_the_patch_are_refused(store, shm_root, shift):
    """A mark moved either way would drop elements of the rows it starts: the neighbours read
    with the part show it."""
    sd = _state_dict()
    pusher = make_pusher(store, shm_root, dtype="bfloat16", delta=True, delta_elements=True)
    pusher.push(sd, 1)
    _bump(sd[BIG], random.Random(6).sample(range(256 * 64), 400))
    pusher.push(sd, 2)
    entry = store.index(2)[BIG]
    starts = entry.chunks[-1].location["row_marks"]["starts"]
    starts[32] += shift  # where rows 128 on start
    source = ChunkSource(store.url, 2)
    try:
        with pytest.raises(ValueError, match="row marks that do not match"):
            read_box(BIG, entry, ((128, 256), (0, 64)), torch.empty(128, 64, dtype=torch.bfloat16), source)
        starts[-1] += 1  # and marks that do not end at the patch's count
        with pytest.raises(ValueError, match="do not fit a chunk"):
            read_box(BIG, entry, ((128, 256), (0, 64)), torch.empty(128, 64, dtype=torch.bfloat16), source)
    finally:
        source.close()


def test_patches_give_way_to_a_new_base_as_they_grow(store, shm_root):
    """4% of the elements change per version at random: the patches grow until a new base is
    cheaper per version, then start again; every version reads back exactly, and the bytes
    written stay well under whole versions."""
    g = torch.Generator().manual_seed(7)
    sd = {EMBED: torch.randn(128, 64, generator=g), BIG: torch.randn(256, 64, generator=g)}
    total = sum(t.numel() * 2 for t in sd.values())
    pusher = make_pusher(store, shm_root, dtype="bfloat16", keep_last=2, delta=True, delta_elements=True)
    pusher.push(sd, 1)
    steps, written = [], []
    for version in range(2, 14):
        for t in sd.values():
            mask = torch.rand(t.shape, generator=g) < 0.04
            t[mask] *= 1.5
        stats = pusher.push(sd, version)
        written.append(stats["bytes_written"])
        steps.append(_patch_of(store, version, BIG)[1])
        _read_all(store, version, _bf16(sd), random.Random(version), boxes=2)
    kinds = ["patch" if p is not None else "base" for p in steps]
    assert "base" in kinds and kinds[:2] == ["patch", "patch"]
    for p, q in zip(steps, steps[1:]):  # a patch grows (union) until the chunk is based again
        if p is not None and q is not None:
            assert q.location["count"] > p.location["count"] and q.location["step"] == p.location["step"] + 1
    assert sum(written) < 0.6 * total * len(written)


def test_a_corrupt_patch_value_is_a_checksum_error(store, shm_root):
    sd = _state_dict()
    pusher = make_pusher(store, shm_root, dtype="bfloat16", delta=True, delta_elements=True)
    pusher.push(sd, 1)
    _bump(sd[BIG], [5, 900, 4000])
    pusher.push(sd, 2)
    _, patch = _patch_of(store, 2, BIG)
    path = version_dir(shm_root, store.run, 2) / shard_file_name(1)
    assert patch.location["values"]["location"]["file"] == str(path)
    header = int.from_bytes(path.read_bytes()[:8], "little")
    start = 8 + header + json.loads(path.read_bytes()[8 : 8 + header])[f"{BIG}#patch-values"]["data_offsets"][0]
    with open(path, "r+b") as f:
        f.seek(start + 2)
        byte = f.read(1)
        f.seek(start + 2)
        f.write(bytes([byte[0] ^ 0x40]))
    entry = store.index(2)[BIG]
    source = ChunkSource(store.url, 2)
    try:
        with pytest.raises(ChecksumMismatch, match="patch values"):
            read_box(BIG, entry, ((0, 256), (0, 64)), torch.empty(256, 64, dtype=torch.bfloat16), source)
    finally:
        source.close()
    # Indices out of order, unverified: refused before anything is written.
    start = 8 + header + json.loads(path.read_bytes()[8 : 8 + header])[f"{BIG}#patch-indices"]["data_offsets"][0]
    with open(path, "r+b") as f:
        f.seek(start)
        f.write((10**6).to_bytes(4, "little"))
    source = ChunkSource(store.url, 2, verify=False)
    try:
        with pytest.raises(ValueError, match="not strictly increasing"):
            read_box(BIG, entry, ((0, 256), (0, 64)), torch.empty(256, 64, dtype=torch.bfloat16), source)
    finally:
        source.close()


def test_delta_elements_needs_delta():
    from tests.configs import sync_config
    from validation.config import ConfigError, check_config

    with pytest.raises(ConfigError, match="weightsync.delta_elements=True is invalid.*delta=true"):
        check_config(sync_config(delta_elements=True), "weightsync")


def test_scatter_into_box_matches_indexing_the_full_tensor():
    """The patch scatter against plain indexing, on random N-D chunks of a global tensor and
    random boxes (including boxes that miss the chunk)."""
    rng = random.Random(11)
    g = torch.Generator().manual_seed(11)
    for _ in range(40):
        shape = [rng.randint(1, 9) for _ in range(rng.randint(1, 3))]
        chunk = random_box(shape, rng)
        offsets, sizes = [lo for lo, _ in chunk], [hi - lo for lo, hi in chunk]
        numel = math.prod(sizes)
        indices = torch.tensor(sorted(rng.sample(range(numel), rng.randint(0, numel))), dtype=torch.int32)
        values = torch.randn(indices.numel(), generator=g)
        full = torch.zeros(shape)
        patched = full.clone()
        region = patched[tuple(slice(lo, hi) for lo, hi in chunk)].clone().view(-1)
        region[indices.long()] = values
        patched[tuple(slice(lo, hi) for lo, hi in chunk)] = region.view(sizes)
        box = random_box(shape, rng)
        cut = tuple(slice(lo, hi) for lo, hi in box)
        dst = full[cut].clone()
        scatter_into_box(indices, values, offsets, sizes, box, dst)
        assert torch.equal(dst, patched[cut])
        # Into a strided view of a bigger tensor: the view gets the patch, nothing else changes.
        holder = torch.zeros([n + 3 for n in shape])
        scatter_into_box(indices, values, offsets, sizes, box, holder[cut])
        expected = torch.zeros_like(holder)
        expected[cut] = patched[cut]
        assert torch.equal(holder, expected)


@pytest.mark.slow
def test_two_fsdp_ranks_patch_their_own_chunks(store, shm_root, tmp_path, tiny_model_path):
    """Two FSDP2 ranks (gloo), bf16 with element patches: a version edits one row that only
    rank 0 holds, the next one row that only rank 1 holds. Each rank patches its own chunk,
    an unchanged patch is reused, and every version reads back as the edited model."""
    from tests.fsdp_push import edited_model, push_versions_from_ranks
    from weightsync.push import without_aliases

    q = "model.layers.0.self_attn.q_proj.weight"
    down = "model.layers.1.mlp.down_proj.weight"
    shapes = {k: list(v.shape) for k, v in edited_model(tiny_model_path, 3, []).named_parameters()}
    rows = shapes[down][0]
    pushes = [(1, []), (2, [(q, 0, 1, 0.5)]), (3, [(down, rows - 1, rows, -0.5)])]
    push_versions_from_ranks(
        2, tmp_path, tiny_model_path, 3, store.url, store.run, shm_root, pushes, dtype="bfloat16", delta_elements=True
    )
    edits = []
    for version, more in pushes:
        edits += more
        model = edited_model(tiny_model_path, 3, edits)
        truth = {k: v.detach().to(torch.bfloat16) for k, v in without_aliases(model.state_dict()).items()}
        _read_all(store, version, truth, random.Random(version), boxes=1)

    def patches(version, fqn):
        return {c.offsets[0]: c for c in store.index(version)[fqn].chunks if c.location["kind"] == "patch"}

    assert patches(1, q) == {} and patches(1, down) == {}
    assert list(patches(2, q)) == [0] and patches(2, q)[0].location["count"] == shapes[q][1]  # rank 0's chunk
    assert patches(2, down) == {}
    assert patches(3, q) == patches(2, q)  # unchanged since: the same piece
    assert list(patches(3, down)) == [rows // 2] and patches(3, down)[rows // 2].location["count"] == shapes[down][1]
