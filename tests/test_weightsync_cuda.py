"""Weight sync's CUDA paths without vLLM: trainer ranks push from GPU memory (DMA into registered
shard files, checksums on the GPU) and readers fill CUDA tensors by DMA from registered
mappings, verifying on the GPU; checked byte for byte against the trainer's tensors.

Skipped without CUDA. The lent GPU machines have no vLLM, Ray, Hydra or redis-server and cannot
fetch packages: ``scripts/gpu_check.sh`` runs this file there with what ``scripts/gpu_carry.sh``
prepared here (redis-server, its libraries, the redis-py wheel). Nothing here may import more
than torch, transformers, safetensors, numpy and redis-py (``tests/test_gpu_imports.py``).
"""

from __future__ import annotations

import random
import socket
import uuid

import pytest
import torch
import torch.distributed as dist

from tests.boxes import random_box
from tests.chunks import CHUNK_CASES, CHUNK_IDS, flip_stored_bit, random_chunk
from tests.fsdp_push import perturbed_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _sync_config(shm_root, **changes):
    """The ``weightsync`` defaults, built directly: the GPU machines have no Hydra."""
    from weightsync.config import WeightSyncConfig

    values = {
        "data_plane": "shm",
        "shm_root": str(shm_root),
        "keep_last": 1,
        "checksums": True,
        "verify": True,
        "delta": False,
        "delta_max_live": 2.0,
        "delta_elements": False,
    }
    return WeightSyncConfig(**(values | changes))


def _state_dict(seed: int, device="cuda") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {
        "model.embed_tokens.weight": torch.randn(96, 64, generator=g),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(64, 128, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(160, 64, generator=g),
        "model.norm.weight": torch.randn(64, generator=g),
        "odd": torch.randn(3, 5, 7, generator=g),
    }
    return {k: v.to(device) for k, v in sd.items()}


def _read_everything(store, version: int, want: dict[str, torch.Tensor], source, rng: random.Random) -> None:
    """Whole tensors, TP=2 row halves and random boxes into CUDA tensors, equal to ``want``."""
    from weightsync.reader import read_box

    for name, entry in store.index(version).items():
        whole = tuple((0, n) for n in entry.shape)
        boxes = [whole, *[((n // 2, n), *whole[1:]) for n in entry.shape[:1]]]
        boxes += [random_box(entry.shape, rng) for _ in range(4)]
        for box in boxes:
            dst = torch.full([hi - lo for lo, hi in box], float("nan"), dtype=want[name].dtype, device="cuda")
            read_box(name, entry, box, dst, source)
            source.finish()
            assert torch.equal(dst, want[name][tuple(slice(lo, hi) for lo, hi in box)]), (name, box)


@pytest.mark.parametrize(("sizes", "dtype"), CHUNK_CASES, ids=CHUNK_IDS)
def test_gpu_tile_hashes_equal_the_cpu_ones_bit_for_bit(sizes, dtype):
    from weightsync.checksum import Grid, region_hashes, region_hashes_torch

    g = torch.Generator().manual_seed(sum(sizes) + 7)
    t = random_chunk(list(sizes), dtype, g)
    grid = Grid.for_chunk(list(sizes), t.element_size())
    raw = t.reshape(-1).view(torch.uint8).view(grid.rows, grid.cols * grid.elem)
    want = region_hashes(raw, grid)
    assert torch.equal(region_hashes_torch(raw.cuda(), grid).cpu(), want)
    assert torch.equal(region_hashes_torch(raw.cuda(), grid, batch_bytes=1).cpu(), want)
    rows, bands = grid.shape
    k0, m0 = rows // 2, bands // 2
    (r0, r1), (c0, c1) = grid.span(((k0, rows), (m0, bands)))
    region = raw.cuda()[r0:r1, c0 * grid.elem : c1 * grid.elem]  # strided, as a reader hashes it
    assert torch.equal(region_hashes_torch(region, grid).cpu(), want[k0:, m0:])


def test_one_nccl_rank_pushes_from_the_gpu_and_the_reader_fills_cuda_tensors(redis_url, tiny_model_path, shm_root):
    """FSDP2 on one NCCL rank: the push takes the GPU state dict as it is (no host copy), writes
    through a registered mapping, and a reader copies slices into CUDA tensors by DMA."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from weightsync.host_memory import MappedFiles
    from weightsync.push import WeightPusher
    from weightsync.reader import ChunkSource, read_box
    from weightsync.store import WeightStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    store = WeightStore(redis_url, f"cuda-{uuid.uuid4().hex[:8]}")
    try:
        model = perturbed_model(tiny_model_path, seed=5).cuda()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        pusher = WeightPusher(store, _sync_config(shm_root), dtype="bfloat16")
        pusher.reserve(get_model_state_dict(model))  # a MIN all_reduce of the free space over NCCL
        stats = pusher.push(get_model_state_dict(model), 1)
        assert stats["wrote_over_spare"] and stats["bytes_written"] > 0
        assert pusher._mappings is not None and pusher._mappings.register and pusher._mappings.opened == 1
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        mappings = MappedFiles()
        source = ChunkSource(version=1, mappings=mappings)
        for name, entry in store.index(1).items():
            assert all(c.location["pinnable"] for c in entry.chunks)
            want = full[name].to(torch.bfloat16)
            whole = tuple((0, n) for n in entry.shape)
            upper = ((entry.shape[0] // 2, entry.shape[0]), *whole[1:])  # a TP=2 rank's row slice
            for box in (whole, upper):
                dst = torch.full([hi - lo for lo, hi in box], float("nan"), dtype=torch.bfloat16, device="cuda")
                read_box(name, entry, box, dst, source)
                source.finish()
                assert torch.equal(dst.cpu(), want[tuple(slice(lo, hi) for lo, hi in box)]), (name, box)
        assert source.tiles_verified > 0 and mappings.opened == 1 and mappings.register
        source.close()
        mappings.close()
        pusher.remove_all()
    finally:
        store.close()
        dist.destroy_process_group()


def test_steady_pushes_and_updates_register_each_file_once(store, shm_root):
    """Versions cycle through the same files: after the first few, neither the pusher nor the
    reader maps or registers anything new, and every version reads back exactly."""
    from weightsync.host_memory import MappedFiles
    from weightsync.push import WeightPusher
    from weightsync.reader import ChunkSource

    rng = random.Random(0)
    pusher = WeightPusher(store, _sync_config(shm_root), dtype="bfloat16")
    pusher.reserve(_state_dict(0), background=False)
    reader_files = MappedFiles()
    for version in range(1, 8):
        sd = _state_dict(version)
        assert pusher.push(sd, version)["wrote_over_spare"]
        source = ChunkSource(version=version, mappings=reader_files)
        _read_everything(store, version, {k: v.to(torch.bfloat16) for k, v in sd.items()}, source, rng)
        source.close()
        store.lease(version, "policy-0")
    assert pusher._mappings.opened <= 3 and reader_files.opened <= 3
    reader_files.close()
    pusher.remove_all()


def test_a_corrupt_tile_is_caught_by_the_gpu_verification(store, shm_root):
    from weightsync.checksum import ChecksumMismatch
    from weightsync.push import WeightPusher
    from weightsync.reader import ChunkSource, read_box

    sd = _state_dict(3)
    WeightPusher(store, _sync_config(shm_root), dtype="float32").push(sd, 5)
    fqn = "model.layers.0.self_attn.o_proj.weight"
    entry = store.index(5)[fqn]
    path = entry.chunks[0].location["file"]
    flip_stored_bit(path, fqn, 10 * 128 + 120, 4)  # element [10, 120]: last band (112:128)
    clean = ChunkSource(version=5)
    out = torch.empty(64, 64, device="cuda")
    read_box(fqn, entry, ((0, 64), (0, 64)), out, clean)  # a TP=2 row-parallel rank's clean half
    clean.finish()
    assert torch.equal(out, sd[fqn][:, :64])
    source = ChunkSource(version=5)
    read_box(fqn, entry, ((0, 64), (64, 128)), torch.empty(64, 64, device="cuda"), source)
    with pytest.raises(ChecksumMismatch) as err:
        source.finish()
    message = str(err.value)
    assert fqn in message and "weight version 5" in message and path in message and "cols 112:128" in message
    source.close()
    unverified = ChunkSource(version=5, verify=False)
    out = torch.empty(64, 64, device="cuda")
    read_box(fqn, entry, ((0, 64), (64, 128)), out, unverified)
    unverified.finish()  # nothing checked: the corrupt value goes through
    assert not torch.equal(out, sd[fqn][:, 64:])
    unverified.close()


@pytest.mark.parametrize(
    "changes",
    [{"delta": True}, {"delta": True, "delta_elements": True}, {"data_plane": "redis"}],
    ids=["delta", "element-patches", "redis"],
)
def test_delta_sync_patches_and_redis_work_from_and_into_cuda(store, shm_root, changes):
    """Correct before fast: delta pushes and the Redis data plane take the GPU state dict through
    host memory; updates of CUDA tensors skip, patch or read as on the CPU."""
    from weightsync.push import WeightPusher
    from weightsync.reader import ChunkSource, update_box

    pusher = WeightPusher(store, _sync_config(shm_root, keep_last=4, **changes), dtype="bfloat16")
    sd = _state_dict(11)
    held: dict[str, torch.Tensor] = {}
    previous = None
    for version in range(1, 5):
        if version > 1:  # a few elements of some rows move, as in a training step
            sd = {k: v.clone() for k, v in sd.items()}
            sd["model.layers.0.mlp.up_proj.weight"][7:9] += 0.5
            sd["model.norm.weight"][3] -= 1.0
        pusher.push(sd, version)
        index = store.index(version)
        source = ChunkSource(store.url, version)
        for name, entry in index.items():
            box = tuple((0, n) for n in entry.shape)
            dst = held.setdefault(name, torch.zeros(entry.shape, dtype=torch.bfloat16, device="cuda"))
            update_box(name, entry, None if previous is None else previous[name], box, dst, source)
        source.finish()
        source.close()
        for name in index:
            assert torch.equal(held[name], sd[name].to(torch.bfloat16)), (version, name)
        previous = index
    pusher.remove_all()
