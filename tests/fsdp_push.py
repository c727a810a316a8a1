"""Push a perturbed model from N FSDP2 trainer ranks (gloo), as separate processes.

Each rank loads the same model, applies the same seeded perturbation, shards it with
``fully_shard`` (per decoder layer, then the root), and pushes: every rank writes only its own
DCP shard, and rank 0 commits the version.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def perturbed_model(model_path: str, seed: int, scale: float = 0.05):
    from actors.modeling import load_causal_lm

    model = load_causal_lm(model_path)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def _rank_main(rank, world, init_file, model_path, seed, redis_url, run, shm_root, version, dtype, data_plane):
    from torch.distributed.fsdp import fully_shard

    from weightsync.push import WeightPusher
    from weightsync.store import WeightStore

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = perturbed_model(model_path, seed)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        pusher = WeightPusher(WeightStore(redis_url, run), shm_root, dtype=dtype, data_plane=data_plane)
        pusher.push(model.state_dict(), version)
    finally:
        dist.destroy_process_group()


def push_from_ranks(
    world, tmp_path, model_path, seed, redis_url, run, shm_root, version, dtype="float32", data_plane="shm"
):
    init_file = str(tmp_path / f"pg-{version}")
    mp.spawn(
        _rank_main,
        args=(world, init_file, model_path, seed, redis_url, run, str(shm_root), version, dtype, data_plane),
        nprocs=world,
        join=True,
    )
