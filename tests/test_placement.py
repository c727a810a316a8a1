"""Where the policy and the trainer ranks run (``apps.grpo.placement``)."""

import pytest

from apps.grpo.config import ConfigError
from apps.grpo.placement import choose_node, needs_one_host, pinned_to_launchers_host, plan_gpus_on, reference_gpus
from tests.configs import defaults
from tests.script_run import run_script


def node(node_id: str, address: str = "10.0.0.1", gpus: float = 0, alive: bool = True) -> dict:
    """An entry as ``ray.nodes()`` gives it (the keys ``choose_node`` reads)."""
    resources = {"CPU": 8.0, f"node:{address}": 1.0} | ({"GPU": float(gpus)} if gpus else {})
    return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": address, "Resources": resources}


def test_one_node_is_needed_for_the_shm_plane_or_the_private_redis():
    assert needs_one_host("shm", "redis://10.0.0.9:6379")
    assert needs_one_host("redis", None)  # the private Redis is a Unix socket on the launcher's host
    assert not needs_one_host("redis", "redis://10.0.0.9:6379")


def test_the_launchers_node_is_chosen_when_it_has_the_gpus():
    nodes = [node("b", "10.0.0.2", gpus=8), node("a", gpus=4)]
    assert choose_node(nodes, "a", 0, launcher_host_only=False, why="x") == "a"  # CPU: always the launcher's
    assert choose_node(nodes, "a", 4, launcher_host_only=True, why="x") == "a"
    assert choose_node(nodes, "a", 5, launcher_host_only=False, why="x") == "b"


def test_another_node_is_the_one_with_most_gpus_and_alive():
    nodes = [
        node("a", gpus=1),
        node("b", "10.0.0.2", gpus=8, alive=False),
        node("c", "10.0.0.3", gpus=4),
        node("d", "10.0.0.4", gpus=6),
    ]
    assert choose_node(nodes, "a", 3, launcher_host_only=False, why="x") == "d"


def test_the_private_redis_keeps_them_on_the_launchers_host():
    nodes = [node("a", gpus=1), node("b", "10.0.0.2", gpus=8), node("c", gpus=4)]  # c: same host as a
    assert choose_node(nodes, "a", 3, launcher_host_only=True, why="x") == "c"
    with pytest.raises(
        ConfigError,
        match=r"no redis\.url: .*need 5 GPUs on a node on the launcher's host.*c\.\.\. at 10\.0\.0\.1: 4\)\. "
        r"A Redis every node reaches \(redis\.url=",
    ):
        choose_node(nodes, "a", 5, launcher_host_only=True, why="no redis.url")


def test_a_cluster_without_room_on_one_node_is_refused_naming_what_each_node_has():
    nodes = [node("a", gpus=2), node("b", "10.0.0.2", gpus=2)]
    with pytest.raises(
        ConfigError,
        match=r"^data_plane=shm: .* need 3 GPUs on one node .*a\.\.\. at 10\.0\.0\.1: 2, b\.\.\. at 10\.0\.0\.2: 2",
    ):
        choose_node(nodes, "a", 3, launcher_host_only=False, why="data_plane=shm")


def test_the_gpu_plan_uses_the_alive_nodes_and_the_node_the_weight_sync_is_pinned_to():
    import dataclasses

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cfg = defaults()
    cfg = dataclasses.replace(
        cfg,
        policy=dataclasses.replace(cfg.policy, replicas=2, tp=2),
        trainer=dataclasses.replace(cfg.trainer, ranks=2),
    )
    a, b, x = "aa" * 28, "bb" * 28, "ee" * 28  # Ray checks that node ids are hex
    nodes = [node(a, gpus=2), node(x, "10.0.0.5", gpus=8, alive=False), node(b, "10.0.0.2", gpus=8)]
    pinned = {"scheduling_strategy": NodeAffinitySchedulingStrategy(b, soft=False)}
    plan = plan_gpus_on(cfg, nodes, pinned, critic_ranks=0, reference=True)
    assert plan.gpus_per_node == (2, 8) and plan.weight_sync_node == 1  # the dead node is not counted
    assert [(a.name, a.node, a.gpus) for a in plan.actors] == [
        ("trainer0", 1, (0,)),
        ("trainer1", 1, (1,)),
        ("policy0", 1, (2, 3)),
        ("policy1", 1, (4, 5)),
        ("reference0", 0, (0,)),
    ]
    with pytest.raises(ConfigError, match=r"need 6 GPUs with placement.layout=separate on one node"):
        plan_gpus_on(
            cfg,
            [node(a, gpus=4), node(b, "10.0.0.2", gpus=4)],
            {"scheduling_strategy": NodeAffinitySchedulingStrategy(a, soft=False)},
            0,
            False,
        )


def test_whether_the_pinned_node_is_on_the_launchers_host():
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    a, b, c = "aa" * 28, "bb" * 28, "cc" * 28  # Ray checks that node ids are hex
    nodes = [node(a), node(b, "10.0.0.2", gpus=8), node(c)]  # c: a second Ray node on a's host

    def pinned(node_id):
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}

    assert pinned_to_launchers_host(pinned(a), nodes, a)
    assert pinned_to_launchers_host(pinned(c), nodes, a)
    assert not pinned_to_launchers_host(pinned(b), nodes, a)
    assert pinned_to_launchers_host({}, nodes, a)  # not pinned: nothing to say otherwise


def test_the_reference_model_gets_a_gpu_of_its_own_only_when_one_is_spare():
    assert reference_gpus("auto", 4, 2, 1) == (1, "")
    assert reference_gpus("gpu", 4, 2, 1) == (1, "")
    assert reference_gpus("cpu", 4, 2, 1) == (0, "")
    assert reference_gpus("auto", 0, 0, 0) == (0, "")  # a CPU run: nothing to say
    gpus, why = reference_gpus("auto", 3, 2, 1)  # every GPU taken: on a CPU, and the run says so
    assert (
        gpus == 0
        and why
        == "the reference model computes on a CPU: the cluster's 3 GPUs go to the policy (2) and the trainer ranks (1)"
    )
    with pytest.raises(
        ConfigError, match=r"^algo\.reference_device=gpu: the cluster's 3 GPUs go to the policy \(2\) .* none is left"
    ):
        reference_gpus("gpu", 3, 2, 1)
    with pytest.raises(ConfigError, match=r"^algo\.reference_device=gpu: the Ray cluster has no GPU; use auto or cpu$"):
        reference_gpus("gpu", 0, 0, 0)


# Apart from the test session's one-node Ray: a head node (the launcher's, no GPU) and a second
# node with two (Ray's GPU resource only: nothing here uses a GPU). Ray spreads actors that ask
# for no CPU over both nodes at random (about half on each, seen here).
CLUSTER = r"""
import json, sys
import ray
from omegaconf import OmegaConf
from ray.cluster_utils import Cluster
from tests.configs import trainer_group
from apps.grpo.config import ConfigError
from apps.grpo.placement import cluster_gpu_count, weight_sync_actor_options

model, redis_url, shm_root = sys.argv[1:4]
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False})
ray.init(address=cluster.address, log_to_driver=False)
gpus_head_only = cluster_gpu_count()
cluster.add_node(num_cpus=1, num_gpus=2)
cluster.wait_for_nodes()

def cfg(data_plane, url):
    return OmegaConf.create({"weightsync": {"data_plane": data_plane}, "redis": {"url": url}})

@ray.remote(num_cpus=0)
def node_of_task():
    return ray.get_runtime_context().get_node_id()

head = ray.get_runtime_context().get_node_id()
out = {"head": head, "gpus": [gpus_head_only, cluster_gpu_count()]}
out["free"] = weight_sync_actor_options(cfg("redis", "redis://10.0.0.9:6379"), 2, ray.nodes(), head)
# CPU run, shm plane, private Redis: real trainer ranks (the tiny model), pinned like the launcher's
where = weight_sync_actor_options(cfg("shm", None), 0, ray.nodes(), head)
group = trainer_group(2, model, redis_url, "placement", actor_options=where, sync={"shm_root": shm_root}, lr=1e-3)
tasks = [node_of_task.options(**where).remote() for _ in range(6)]
out["ranks"] = ray.get([r.node_id.remote() for r in group.ranks])
out["tasks"] = ray.get(tasks)
# 2 GPUs for the policy and the ranks: not on the launcher's node, so the other one
where = weight_sync_actor_options(cfg("shm", "redis://10.0.0.9:6379"), 2, ray.nodes(), head)
out["gpu"] = ray.get([node_of_task.options(num_gpus=1, **where).remote() for _ in range(2)])
try:
    weight_sync_actor_options(cfg("shm", None), 3, ray.nodes(), head)
except ConfigError as e:
    out["refused"] = str(e)
print(json.dumps(out))
ray.shutdown()
cluster.shutdown()
"""


def test_on_a_cluster_the_policy_and_trainer_ranks_are_pinned_to_one_node(tiny_model_path, redis_url, shm_root):
    out = run_script(CLUSTER, tiny_model_path, redis_url, str(shm_root))
    # The launcher's host has no GPU (nor CUDA), the cluster's other node has two: a GPU run.
    assert out["gpus"] == [0, 2]
    assert out["free"] == {}  # data_plane=redis with a shared Redis: Ray places them
    assert out["ranks"] == [out["head"]] * 2  # the launcher's node (unpinned: both there 1 time in 4)
    assert out["tasks"] == [out["head"]] * 6
    assert len(set(out["gpu"])) == 1 and out["gpu"][0] != out["head"]
    assert "need 3 GPUs on a node on the launcher's host" in out["refused"]
