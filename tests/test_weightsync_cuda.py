"""Weight sync's CUDA paths without vLLM: one NCCL trainer rank (FSDP2 on a GPU) reserves and
pushes (its collectives on CUDA tensors, its shards copied to the host), and the reader copies
stored slices straight into CUDA tensors, checked against the model's own weights in bf16.

Skipped without CUDA. The lent GPU machines have no vLLM, Ray or redis-server and cannot fetch
packages: ``scripts/gpu_check.sh`` runs this file there with what ``scripts/gpu_carry.sh``
prepared here (redis-server, its libraries, the redis-py wheel).
"""

from __future__ import annotations

import socket
import uuid

import pytest
import torch
import torch.distributed as dist

from tests.fsdp_push import perturbed_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_one_nccl_rank_pushes_and_the_reader_fills_cuda_tensors(redis_url, tiny_model_path, shm_root):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from weightsync.config import WeightSyncConfig
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
        # Built directly: the GPU machines have no Hydra to compose the YAML defaults with.
        sync = WeightSyncConfig("shm", str(shm_root), 1, True, True, False, 2.0, False)
        pusher = WeightPusher(store, sync, dtype="bfloat16")
        pusher.reserve(get_model_state_dict(model))  # a MIN all_reduce of the free space over NCCL
        stats = pusher.push(get_model_state_dict(model, options=StateDictOptions(cpu_offload=True)), 1)
        assert stats["wrote_over_spare"] and stats["bytes_written"] > 0
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        source = ChunkSource(version=1)
        for name, entry in store.index(1).items():
            want = full[name].to(torch.bfloat16)
            whole = tuple((0, n) for n in entry.shape)
            upper = ((entry.shape[0] // 2, entry.shape[0]), *whole[1:])  # a TP=2 rank's row slice
            for box in (whole, upper):
                dst = torch.full([hi - lo for lo, hi in box], float("nan"), dtype=torch.bfloat16, device="cuda")
                read_box(name, entry, box, dst, source)
                assert torch.equal(dst.cpu(), want[tuple(slice(lo, hi) for lo, hi in box)]), (name, box)
        assert source.tiles_verified > 0
        source.close()
        pusher.remove_all()
    finally:
        store.close()
        dist.destroy_process_group()
