"""Persistent FSDP2 trainer ranks for the weight-sync benchmark (gloo, one process per rank).

Each rank loads the benchmark's synthetic model, shards it with ``fully_shard`` (per decoder
layer, then the root), as ``tests/fsdp_push.py`` does, and then serves commands from the driver
over a pipe, so that the ranks are started once per model size and reused across vLLM engines:

- ``reserve``: the rank's pusher for a run reserves its first pushes' shard files in a
  background thread (as ``TrainerRank`` does at start) and answers at once;
- ``push``: barrier, then ``pusher.push(model.state_dict(), version)`` on every rank (rank 0
  commits; one pusher per run and data plane, kept across pushes); returns each rank's wall time
  of the push call (which includes waiting for a reservation still running);
- ``gather``: barrier, then the full state dict gathered onto rank 0 (CPU), as baseline (a)
  of the issue starts; returns each rank's wall time.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from pathlib import Path


def _rank_main(rank: int, world: int, init_file: str, model_path: str, conn) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from actors.modeling import load_causal_lm
    from tests.configs import make_pusher
    from weightsync.store import WeightStore

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    pushers = {}  # (redis_url, run, shm_root, dtype, data_plane) -> WeightPusher, kept across pushes
    try:
        model = load_causal_lm(model_path)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        conn.send(("ready", None))

        def pusher_for(redis_url, run, shm_root, dtype, data_plane):
            key = (redis_url, run, shm_root, dtype, data_plane)
            if key not in pushers:
                store = WeightStore(redis_url, run)
                pushers[key] = make_pusher(store, shm_root, dtype=dtype, keep_last=1, data_plane=data_plane)
            return pushers[key]

        while True:
            cmd, args = conn.recv()
            if cmd == "stop":
                break
            try:
                if cmd == "reserve":
                    pusher_for(*args).reserve(model.state_dict(), background=True)
                    conn.send(("ok", None))
                elif cmd == "push":
                    redis_url, run, shm_root, dtype, version, data_plane = args
                    pusher = pusher_for(redis_url, run, shm_root, dtype, data_plane)
                    dist.barrier()
                    t = time.perf_counter()
                    pusher.push(model.state_dict(), version)
                    elapsed = time.perf_counter() - t
                    conn.send(("ok", elapsed))
                elif cmd == "gather":
                    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

                    dist.barrier()
                    t = time.perf_counter()
                    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
                    elapsed = time.perf_counter() - t
                    nbytes = sum(v.numel() * v.element_size() for v in full.values())
                    del full
                    conn.send(("ok", (elapsed, nbytes)))
                else:
                    conn.send(("error", f"unknown command {cmd!r}"))
            except Exception as e:  # report, keep serving (the driver decides)
                conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        for pusher in pushers.values():
            pusher.store.close()
        dist.destroy_process_group()
        conn.close()


class FsdpRanks:
    """``world`` FSDP2 trainer ranks holding the model at ``model_path``, driven from this process."""

    def __init__(self, world: int, model_path: str | Path, tmp_dir: str | Path, timeout_s: float = 900) -> None:
        ctx = mp.get_context("spawn")
        init_file = Path(tmp_dir) / f"pg-{time.monotonic_ns()}"
        self.timeout_s = timeout_s
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, world, str(init_file), str(model_path), child))
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self._collect()

    def _collect(self) -> list:
        out = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(self.timeout_s):
                raise TimeoutError(f"trainer rank {rank} did not answer within {self.timeout_s} s")
            status, value = conn.recv()
            if status == "error":
                raise RuntimeError(f"trainer rank {rank}: {value}")
            out.append(value)
        return out

    def push(
        self, redis_url: str, run: str, shm_root: str, dtype: str, version: int, data_plane: str = "shm"
    ) -> list[float]:
        """Every rank pushes ``version``; each rank's seconds in the push call (after a barrier)."""
        for conn in self.conns:
            conn.send(("push", (redis_url, run, str(shm_root), dtype, version, data_plane)))
        return self._collect()

    def reserve(self, redis_url: str, run: str, shm_root: str, dtype: str, data_plane: str = "shm") -> None:
        """Every rank starts reserving the shard files of its first pushes of ``run`` (in the
        background: the next ``push`` waits for it)."""
        for conn in self.conns:
            conn.send(("reserve", (redis_url, run, str(shm_root), dtype, data_plane)))
        self._collect()

    def gather(self) -> list[tuple[float, int]]:
        """Full state dict onto rank 0 (CPU); each rank's (seconds, bytes it ended up holding)."""
        for conn in self.conns:
            conn.send(("gather", None))
        return self._collect()

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(("stop", None))
        for proc in self.procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()

    def __enter__(self) -> FsdpRanks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
