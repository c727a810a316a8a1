"""Removing a run's shared memory on the Ray nodes other than the launcher's.

The launcher removes what a run leaves in shared memory on its own host after ``ray.shutdown``:
the run's folder ``{shm_root}/ws-{run}`` (the shm data plane's weight shards, the policy's
engine-files record) and the vLLM engine files that record lists. On a Ray cluster the trainer
ranks and the policy usually run on other nodes, whose /dev/shm that is: every run would leave
``keep_last`` copies of the model there, and an engine's 160-400 MiB of message queues when it
died starting. So, while Ray is still up, the launcher kills the actors that write there (the
policy and the trainer ranks: nothing can add files after) and runs a task pinned to each other
live node that removes the same things there, once the killed actors' processes on that node
have exited. (``ray.kill`` is asynchronous: a call on the actor fails within milliseconds of it,
while the process lives on for tens of milliseconds, time enough for a push in progress to write
a file after the removal; a call made just before the kill even succeeds. So the task waits for
the processes themselves, by the pids Ray's actor table holds.)
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.engine_shm import remove_recorded

log = logging.getLogger(__name__)


def remove_run_files(shm_dir: str | Path, record: str | Path) -> int:
    """Remove the engine files ``record`` lists, then the run's folder ``shm_dir``; bytes freed."""
    freed = remove_recorded(record)
    shm_dir = Path(shm_dir)
    if shm_dir.is_dir() and not shm_dir.is_symlink():
        for path in shm_dir.rglob("*"):
            if path.is_file() and not path.is_symlink():
                freed += path.stat().st_size
        shutil.rmtree(shm_dir, ignore_errors=True)
    return freed


def wait_for_exit(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until the processes ``pids`` (on this host) have exited; returns those still alive
    after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive:
        alive = [pid for pid in alive if _exists(pid)]
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    return alive


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


@ray.remote(num_cpus=0, max_retries=0)
def _remove_on_node(shm_dir: str, record: str, pids: list[int], timeout_s: float) -> tuple[str, int, list[int]]:
    alive = wait_for_exit(pids, timeout_s)
    return ray.get_runtime_context().get_node_id(), remove_run_files(shm_dir, record), alive


def _actor_processes(actors: list) -> dict[str, list[int]]:
    """Node id -> pids of the worker processes of ``actors`` (those that started), from Ray's
    actor table in the GCS (the state API would need the dashboard, which runs do not start)."""
    from ray._private import state

    out: dict[str, list[int]] = {}
    for actor in actors:
        try:
            info = state.actors(actor._actor_id.hex())
        except (AttributeError, KeyError, TypeError, ray.exceptions.RayError) as e:  # a private API: removal
            # still runs then, without waiting for that actor's process
            log.warning("could not read the actor table for %s: %s", actor, e)
            continue
        pid, node = info.get("Pid", 0), (info.get("Address") or {}).get("NodeID")
        if pid and node:
            out.setdefault(node, []).append(int(pid))
    return out


def other_nodes() -> list[str]:
    """The live Ray nodes other than this process's."""
    here = ray.get_runtime_context().get_node_id()
    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]


def clean_other_nodes(
    writers: list, shm_dir: str | Path, record: str | Path, timeout_s: float = 60.0
) -> dict[str, int]:
    """Kill ``writers`` (the actors that write under ``shm_dir``), then ``remove_run_files`` on
    every other live node once their processes there have exited (waiting at most
    ``timeout_s / 2``). Returns node id -> bytes freed, for the nodes that answered within
    ``timeout_s``; failures are logged, never raised (this runs while a run unwinds). Nothing is
    killed on a one-node cluster: ``ray.shutdown`` ends the actors there."""
    nodes = other_nodes()
    if not nodes:
        return {}
    pids = _actor_processes(writers)
    for actor in writers:
        ray.kill(actor, no_restart=True)
    tasks = [
        _remove_on_node.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            str(shm_dir), str(record), pids.get(node, []), timeout_s / 2
        )
        for node in nodes
    ]
    done, late = ray.wait(tasks, num_returns=len(tasks), timeout=timeout_s)
    freed = {}
    for task in done:
        try:
            node, n, alive = ray.get(task)
            freed[node] = n
            if alive:
                log.warning(
                    "killed actor processes %s on node %s had not exited; removed their files anyway", alive, node
                )
        except ray.exceptions.RayError as e:
            log.warning("could not remove the run's shared memory on a node: %s", e)
    if late:
        log.warning("%d node(s) did not remove the run's shared memory within %.0f s", len(late), timeout_s)
    return freed
