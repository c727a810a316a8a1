"""Config groups for tests: the YAML defaults of ``configs/`` with a test's changes."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from actors.config import PolicyConfig
from actors.rank_groups import TrainerGroup
from algos.policy_loss import PolicyLoss
from algos.train_config import TrainerConfig
from apps.grpo.config import RunConfig, compose_config
from weightsync.config import WeightSyncConfig
from weightsync.push import WeightPusher
from weightsync.store import WeightStore


@functools.cache
def defaults() -> RunConfig:
    return compose_config()


def trainer_config(**changes) -> TrainerConfig:
    return dataclasses.replace(defaults().trainer, **changes)


def policy_config(**changes) -> PolicyConfig:
    """The ``policy`` group with ``dtype`` resolved as on CPU (float32)."""
    return dataclasses.replace(defaults().policy, **{"dtype": "float32", **changes})


def sync_config(**changes) -> WeightSyncConfig:
    if "shm_root" in changes:
        changes["shm_root"] = str(changes["shm_root"])
    return dataclasses.replace(defaults().weightsync, **changes)


def make_pusher(
    store: WeightStore | None, shm_root: str | Path = "/dev/shm", dtype: str = "float32", keep_last: int = 2, **changes
) -> WeightPusher:
    """A ``WeightPusher`` with the ``weightsync`` defaults and these changes."""
    return WeightPusher(store, sync_config(shm_root=shm_root, keep_last=keep_last, **changes), dtype)


def default_policy_loss() -> PolicyLoss:
    """The default algorithm's policy loss."""
    return defaults().algo.policy_loss(defaults().policy.max_tokens)


def trainer_group(
    ranks: int,
    model_path: str,
    redis_url: str,
    run: str,
    *,
    loss: PolicyLoss | None = None,
    sync: dict | None = None,
    sync_dtype: str = "float32",
    use_cuda: bool = False,
    actor_options: dict | None = None,
    **trainer_changes,
) -> TrainerGroup:
    """A trainer group (not started) with the ``trainer`` defaults and ``trainer_changes``, the
    ``weightsync`` defaults and ``sync`` changes, and the default policy loss unless given."""
    return TrainerGroup(
        trainer_config(ranks=ranks, **trainer_changes),
        model_path,
        redis_url,
        run,
        loss=loss or default_policy_loss(),
        weightsync=sync_config(**(sync or {})),
        sync_dtype=sync_dtype,
        use_cuda=use_cuda,
        actor_options=actor_options,
    )
