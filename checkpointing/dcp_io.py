"""Save and load a rank's training state with DCP, as safetensors shards (nothing is pickled).

Every rank writes its own shard of every tensor (FSDP2 DTensors, optimizer moments) with
PyTorch's ``HuggingFaceStorageWriter(save_distributed=True)``; the reader rebuilds the layout
from the shards' safetensors headers (``DCP_SHARDING_INFO``), so loading needs no pickled
``.metadata`` file and can reshard. Non-tensor state travels as JSON beside the shards.

Two knobs that matter for large models:

- Save plans are cached between saves (``DefaultSavePlanner(enable_plan_caching=True)``): the
  state dict's layout does not change during a run, so the ranks skip re-planning.
- Python's garbage collector is paused while DCP plans and while ``async_save`` stages the state
  (a full GC pass over millions of plan objects costs seconds). Set ``RLSYS_DCP_DISABLE_GC=0`` to
  leave the collector alone (default ``1``: paused).
"""

from __future__ import annotations

import gc
import os
import threading
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

GC_ENV = "RLSYS_DCP_DISABLE_GC"

_gc_lock = threading.Lock()
_gc_depth = 0
_gc_was_enabled = False


def gc_pause_enabled() -> bool:
    """Whether DCP work runs with Python's GC paused (environment variable ``RLSYS_DCP_DISABLE_GC``)."""
    value = os.environ.get(GC_ENV, "1").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{GC_ENV}={value!r}: expected 1 (pause the GC during DCP work) or 0")


@contextmanager
def gc_paused():
    """Pause the garbage collector for the duration (re-entrant, across threads) if enabled by env."""
    global _gc_depth, _gc_was_enabled
    if not gc_pause_enabled():
        yield
        return
    with _gc_lock:
        if _gc_depth == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_was_enabled:
                gc.enable()


class CachingSavePlanner(DefaultSavePlanner):
    """DCP's default planner with plan caching on and the GC paused while it plans.

    DCP keys its plan cache by ``cache_key`` (the class name by default); each kind of save
    (training state, HF export) gets its own so that they do not evict each other's plans.
    """

    def __init__(self, cache_key: str = "training-state") -> None:
        super().__init__(enable_plan_caching=True)
        self._cached_plans_key = cache_key

    def create_local_plan(self):
        with gc_paused():
            return super().create_local_plan()

    def create_global_plan(self, all_plans):
        with gc_paused():
            return super().create_global_plan(all_plans)

    def finish_plan(self, new_plan):
        with gc_paused():
            return super().finish_plan(new_plan)


def save(state: dict, path: str | Path, *, async_save: bool = False, process_group=None):
    """Write this rank's shard of ``state`` (tensors only) under ``path``.

    Returns ``None`` when done, or with ``async_save`` a future that completes when the shards are
    written (the call itself returns once the state is staged in memory, so training can go on).
    """
    distributed = dist.is_available() and dist.is_initialized()
    writer = HuggingFaceStorageWriter(str(path), save_distributed=True)
    with gc_paused():
        if async_save:
            return dcp.async_save(
                state,
                storage_writer=writer,
                planner=CachingSavePlanner(),
                process_group=process_group,
                no_dist=not distributed,
            )
        dcp.save(
            state,
            storage_writer=writer,
            planner=CachingSavePlanner(),
            process_group=process_group,
            no_dist=not distributed,
        )
    return None


def load(state: dict, path: str | Path, *, process_group=None) -> None:
    """Fill ``state``'s tensors in place from the shards under ``path`` (resharding as needed)."""
    distributed = dist.is_available() and dist.is_initialized()
    with gc_paused():
        dcp.load(
            state,
            storage_reader=HuggingFaceStorageReader(str(path)),
            process_group=process_group,
            no_dist=not distributed,
        )


def stored_shapes(path: str | Path) -> dict[str, list[int]]:
    """Each stored tensor's global shape, read from the shards' headers (no tensor data)."""
    metadata = HuggingFaceStorageReader(str(path)).read_metadata()
    return {fqn: list(md.size) for fqn, md in metadata.state_dict_metadata.items()}
