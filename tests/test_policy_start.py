"""How the policy's vLLM engine starts on CPU: its TP workers' threads, and why it did not start."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import psutil
import pytest

from actors.cpu_binding import engine_process_cpus, tp_thread_binding
from actors.engine_errors import engine_start_error, is_engine_start_failure, root_cause
from actors.engine_shm import remove_recorded
from tests.configs import default_policy_loss, policy_config, sync_config, trainer_config


@dataclass
class CPU:
    id: int
    physical_core: int
    numa_node: int = 0


def test_one_numa_node_is_split_among_the_workers():
    two = [CPU(0, 0), CPU(1, 1)]
    assert tp_thread_binding(2, two, [0]) == "0|1"  # this machine: nothing to keep back
    assert tp_thread_binding(2, [CPU(i, i) for i in range(3)], [0]) == "0|1"  # the odd core left over
    eight = [CPU(i, i) for i in range(8)]
    assert tp_thread_binding(2, eight, [0]) == "0-2|4-6"  # a core of each share for vLLM's scheduler
    assert tp_thread_binding(4, eight, [0]) == "0|2|4|6"


def test_smt_siblings_are_left_out():
    smt = [CPU(i, i % 4) for i in range(8)]  # cores 0-3, their siblings 4-7
    assert tp_thread_binding(2, smt, [0]) == "0|2"
    assert tp_thread_binding(4, smt, [0]) == "0|1|2|3"


def test_shares_stay_within_numa_nodes():
    interleaved = [CPU(i, i, numa_node=i % 2) for i in range(8)]  # node 0: 0,2,4,6; node 1: 1,3,5,7
    assert tp_thread_binding(4, interleaved, [0, 1]) == "0|4|1|5"


def test_vllms_own_binding_is_kept_where_it_works():
    cpus = [CPU(i, i, numa_node=i // 4) for i in range(8)]
    assert tp_thread_binding(1, cpus, [0]) is None
    assert tp_thread_binding(2, cpus, [0, 1]) is None  # vLLM's auto: a NUMA node per worker


def test_replicas_on_one_host_bind_their_workers_to_shares_of_their_own():
    two = [CPU(0, 0), CPU(1, 1)]
    assert [tp_thread_binding(1, two, [0], r, 2) for r in (0, 1)] == ["0", "1"]  # this machine
    eight = [CPU(i, i) for i in range(8)]
    assert [tp_thread_binding(2, eight, [0], r, 2) for r in (0, 1)] == ["0|2", "4|6"]
    assert [tp_thread_binding(1, eight, [0, 1], r, 2) for r in (0, 1)] == ["0-2", "4-6"]  # not auto's shared node
    with pytest.raises(ValueError, match=r"policy.replicas=3 x policy.tp=1 needs a CPU core for each of its 3"):
        tp_thread_binding(1, two, [0], 0, 3)


def test_engine_processes_get_the_cpus_no_worker_computes_on():
    two, eight = {0, 1}, set(range(8))
    assert engine_process_cpus(two, [{0}, two, two], set()) == {1}  # this machine: worker on 0, its other threads free
    assert engine_process_cpus(eight, [{0}, {1}, {2}, {4}, {5}, {6}], set()) == {3, 7}  # tp=2, "0-2|4-6"
    assert engine_process_cpus(eight, [{0}, {1}], {4, 5}) == {2, 3, 6, 7}  # another replica's workers on 4-5


def test_engine_processes_stay_put_where_no_cpu_is_free_or_nothing_is_bound():
    assert engine_process_cpus({0, 1}, [{0}, {1}], set()) is None  # tp=2 on two cores
    assert engine_process_cpus({0, 1}, [{0}], {1}) is None  # two replicas on two cores
    assert engine_process_cpus({0, 1}, [{0, 1}, set()], set()) is None  # "nobind"; a thread that ended


def test_the_engine_core_runs_off_the_cores_its_workers_compute_on(policy, policy_tp2, ray_session):
    allowed = os.sched_getaffinity(0)  # the test's CPUs, which the actors were started with
    for actor in (policy, policy_tp2):
        front_end = psutil.Process(ray_session.get(actor.status.remote())["pid"])
        processes = [front_end, *front_end.children(recursive=True)]
        workers = [p for p in processes if p.name().startswith("VLLM::Worker")]
        others = [p for p in processes if p not in workers]
        assert workers and any(p.name().startswith("VLLM::EngineCore") for p in others)
        threads = [os.sched_getaffinity(t.id) for w in workers for t in w.threads()]
        bound = set().union(*(cpus for cpus in threads if cpus < allowed))
        assert bound, "the workers' threads are bound"
        on = {frozenset(os.sched_getaffinity(t.id)) for p in others for t in p.threads()}
        # tp=1 here: its worker on one core, the rest for the engine core; tp=2 on two cores: none left.
        assert on == {frozenset(allowed - bound or allowed)}


def test_more_workers_than_cores_is_refused_with_the_way_out():
    with pytest.raises(
        ValueError, match=r"policy.tp=3 needs a CPU core for each of its 3 workers.*may use 2 \(0,2\).*omp_threads_bind"
    ):
        tp_thread_binding(3, [CPU(0, 0), CPU(1, 0), CPU(2, 1), CPU(3, 1)], [0])


# Lines as vLLM 0.32 and Python write them to a Ray actor's log when the engine dies starting.
CORE = "(EngineCore pid=30370) ERROR 12-03 21:16:19 [core.py:1510] "
NUMA = "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers."
NUMA_LOG = f"""\
(EngineCore pid=30370) INFO 12-03 21:16:18 [core.py:100] Initializing a V1 LLM engine
(EngineCore pid=30370) WARNING 12-03 21:16:18 [x.py:1] Cannot use FlashAttention: ImportError: no module
{CORE}EngineCore failed to start.
{CORE}Traceback (most recent call last):
{CORE}    len(allowed_numa_nodes) >= local_world_size or self.simulate_multi_node
{CORE}AssertionError: {NUMA}
Traceback (most recent call last):
AssertionError: {NUMA}
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {{'EngineCore': 1}}
"""
WORKER = "(Worker pid=3917) ERROR 12-03 21:28:13 [multiproc_executor.py:953] "
LOAD = "start (0) + length (768) exceeds dimension size (384)."
WORKER_LOG = f"""\
{WORKER}WorkerProc failed to start.
{WORKER}    self.worker.load_model()
{WORKER}RuntimeError: {LOAD}
{CORE}Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace.
"""


def test_the_root_cause_is_the_first_error_that_is_not_vllms_summary():
    assert (
        root_cause(NUMA_LOG) == "AssertionError: Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers."
    )
    assert root_cause(WORKER_LOG) == f"RuntimeError: {LOAD}"
    assert root_cause(NUMA_LOG.splitlines()[-1]) is None  # only vLLM's summary: nothing to add
    assert root_cause(WORKER_LOG.splitlines()[-1]) is None
    assert root_cause(NUMA_LOG.splitlines()[1]) is None  # a warning that mentions an error


def test_only_what_the_logs_gained_during_the_start_is_read(tmp_path):
    out, err = tmp_path / "worker.out", tmp_path / "worker.err"
    out.write_text("ValueError: from an earlier engine of this actor\n")
    err.write_text("")
    since = {out: out.stat().st_size, err: 0}
    assert engine_start_error(since) is None
    with out.open("a") as f:
        f.write(WORKER_LOG)
    error = engine_start_error(since)
    assert str(error) == f"the vLLM engine did not start: RuntimeError: {LOAD} (its log: {out})"
    assert is_engine_start_failure(RuntimeError(NUMA_LOG.splitlines()[-1].split(": ", 1)[1]))
    assert not is_engine_start_failure(ValueError("Total number of attention heads (4) must be divisible"))


def test_a_policy_whose_engine_dies_starting_names_the_cause(ray_session, redis_url, tiny_model_path, tmp_path):
    """A model whose config does not match its weights: vLLM's worker fails loading them, in a
    process of its own; the actor's error says so rather than 'see root cause above'."""
    from actors.policy import Policy

    broken = tmp_path / "model"
    shutil.copytree(tiny_model_path, broken)
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] *= 2
    (broken / "config.json").write_text(json.dumps(config))
    record = tmp_path / "engine-files.json"  # the dead engine's queues, removed as the launcher does
    actor = Policy.remote(
        str(broken), redis_url, "broken-start", policy_config(), replica="broken", engine_files_record=str(record)
    )
    try:
        with pytest.raises(ray_session.exceptions.RayActorError) as failed:
            ray_session.get(actor.__ray_ready__.remote())
    finally:
        remove_recorded(record)
    message = failed.value.error_msg
    assert "EngineStartError: the vLLM engine did not start: RuntimeError: start (0) + length" in message, message
    assert "exceeds dimension size (384)" in message and "(its log: /" in message


def test_actors_started_where_the_model_is_missing_name_the_path_and_the_host(ray_session, redis_url, tmp_path):
    """On a cluster the launcher's host may have the model and an actor's host not: each actor
    that loads it checks the path where it runs (vLLM would take a missing path for a hub repo
    id and fail about repo names)."""
    import socket

    from actors.policy import Policy
    from actors.reference import Reference
    from actors.trainer import TrainerRank

    missing = str(tmp_path / "not-here")
    actors = {
        "policy": Policy.remote(missing, redis_url, "missing-model", policy_config()),
        "trainer": TrainerRank.remote(
            0, 1, missing, redis_url, "missing-model", trainer_config(), default_policy_loss(), sync_config()
        ),
        "reference": Reference.remote(missing),
    }
    for name, actor in actors.items():
        with pytest.raises(ray_session.exceptions.RayActorError) as failed:
            ray_session.get(actor.__ray_ready__.remote())
        message = failed.value.error_msg
        assert f"model.path {missing!r} does not exist or is not a directory on host {socket.gethostname()}" in (
            message
        ), (name, message)
        assert "every node that runs the policy" in message, (name, message)
