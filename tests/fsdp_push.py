"""Push a perturbed model from N FSDP2 trainer ranks (gloo), as separate processes.

Each rank loads the same model, applies the same seeded perturbation, shards it with
``fully_shard`` (per decoder layer, then the root), and pushes: every rank writes only its own
DCP shard, and rank 0 commits the version.
"""

from __future__ import annotations

import os
import sys

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


def _leave() -> None:
    """End a rank whose work is done without the interpreter's finalization. There, PyTorch 2.13
    with gloo and FSDP2 now and then aborts the process ("terminate called without an active
    exception", SIGABRT): seen once in a CI run of the 2-rank Redis parity case and once in 50
    local runs of that push while a GRPO run loaded the machine. The rank that finishes first
    (not rank 0, which commits) dies, and mp.spawn reports a failure for work that succeeded.
    Failures before this point still reach mp.spawn as exceptions."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank_main(rank, world, init_file, model_path, seed, redis_url, run, shm_root, version, dtype, data_plane):
    from torch.distributed.fsdp import fully_shard

    from tests.configs import make_pusher
    from weightsync.store import WeightStore

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = perturbed_model(model_path, seed)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        pusher = make_pusher(WeightStore(redis_url, run), shm_root, dtype=dtype, data_plane=data_plane)
        pusher.push(model.state_dict(), version)
    finally:
        dist.destroy_process_group()
    _leave()


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


def edited_model(model_path: str, seed: int, edits: list[tuple[str, int, int, float]]):
    """``perturbed_model`` with ``value`` added to rows ``lo:hi`` of each named parameter."""
    model = perturbed_model(model_path, seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, lo, hi, value in edits:
            params[name][lo:hi] += value
    return model


def _versions_main(
    rank, world, init_file, model_path, seed, redis_url, run, shm_root, pushes, data_plane, out, options
):
    """One pusher per rank for several versions; version ``i`` is the model with the edits of
    pushes ``0..i`` applied. Writes each push's stats to ``{out}-{rank}.json``. ``options``: more
    ``weightsync`` settings."""
    import json

    from torch.distributed.fsdp import fully_shard

    from tests.configs import make_pusher
    from weightsync.store import WeightStore

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        pusher = make_pusher(
            WeightStore(redis_url, run),
            shm_root,
            keep_last=len(pushes),
            data_plane=data_plane,
            delta=True,
            **options,
        )
        edits, stats = [], []
        for version, more in pushes:
            edits += more
            model = edited_model(model_path, seed, edits)
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            stats.append(pusher.push(model.state_dict(), version))
        with open(f"{out}-{rank}.json", "w") as f:
            json.dump(stats, f)
    finally:
        dist.destroy_process_group()
    _leave()


def push_versions_from_ranks(
    world, tmp_path, model_path, seed, redis_url, run, shm_root, pushes, data_plane="shm", **options
):
    """Delta-push ``pushes`` = [(version, [(param, lo, hi, value), ...]), ...] from ``world``
    FSDP2 ranks (``options``: more ``weightsync`` settings); returns each rank's list
    of push stats."""
    import json

    init_file = str(tmp_path / f"pg-delta-{pushes[0][0]}")
    out = str(tmp_path / f"stats-{pushes[0][0]}")
    mp.spawn(
        _versions_main,
        args=(world, init_file, model_path, seed, redis_url, run, str(shm_root), pushes, data_plane, out, options),
        nprocs=world,
        join=True,
    )
    return [json.load(open(f"{out}-{rank}.json")) for rank in range(world)]
