"""Removing a run's shared memory on the Ray nodes other than the launcher's.

The launcher removes what a run leaves in shared memory on its own host after ``ray.shutdown``:
the run's folder ``{shm_root}/ws-{run}`` (the shm data plane's weight shards, the policy's
engine-files record) and the vLLM engine files that record lists. On a Ray cluster the trainer
ranks and the policy usually run on other nodes, whose /dev/shm that is: every run would leave
``keep_last`` copies of the model there, and an engine's 160-400 MiB of message queues when it
died starting. So, while Ray is still up, the launcher kills the actors that write there (the
policy and the trainer ranks: nothing can add files after) and runs a task pinned to each other
live node that removes the same things there.
"""

from __future__ import annotations

import logging
import shutil
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


@ray.remote(num_cpus=0, max_retries=0)
def _remove_on_node(shm_dir: str, record: str) -> tuple[str, int]:
    return ray.get_runtime_context().get_node_id(), remove_run_files(shm_dir, record)


def other_nodes() -> list[str]:
    """The live Ray nodes other than this process's."""
    here = ray.get_runtime_context().get_node_id()
    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]


def clean_other_nodes(
    writers: list, shm_dir: str | Path, record: str | Path, timeout_s: float = 60.0
) -> dict[str, int]:
    """Kill ``writers`` (the actors that write under ``shm_dir``), then ``remove_run_files`` on
    every other live node. Returns node id -> bytes freed, for the nodes that answered within
    ``timeout_s``; failures are logged, never raised (this runs while a run unwinds). Nothing is
    killed on a one-node cluster: ``ray.shutdown`` ends the actors there."""
    nodes = other_nodes()
    if not nodes:
        return {}
    for actor in writers:
        ray.kill(actor, no_restart=True)
    if writers:  # a call on a killed actor fails once it is dead: wait for that (kill is asynchronous)
        ray.wait([actor.__ray_ready__.remote() for actor in writers], num_returns=len(writers), timeout=timeout_s)
    tasks = [
        _remove_on_node.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            str(shm_dir), str(record)
        )
        for node in nodes
    ]
    done, late = ray.wait(tasks, num_returns=len(tasks), timeout=timeout_s)
    freed = {}
    for task in done:
        try:
            node, n = ray.get(task)
            freed[node] = n
        except ray.exceptions.RayError as e:
            log.warning("could not remove the run's shared memory on a node: %s", e)
    if late:
        log.warning("%d node(s) did not remove the run's shared memory within %.0f s", len(late), timeout_s)
    return freed
