"""Where the actors run: GPUs or not, the node of the policy and the trainer ranks, the reference
model's GPU, the critic's. ``plan_placement`` decides all of it once Ray is up, before any actor starts.

A run uses GPUs when any node of the Ray cluster has one (not when the launcher's host does: a
cluster's head node often has none). The reference model exchanges episodes, not weights, so it
may go anywhere: a GPU of its own where one is spare beyond the policy's and the trainer ranks'
(``algo.reference_device``), else a CPU.

Two set-ups need the policy and every trainer rank on one machine: the shared-memory data plane
(``weightsync.data_plane=shm``: files in one host's /dev/shm) and the launcher's private Redis
(no ``redis.url``: a Unix socket on the launcher's host). Ray places actors that ask for no CPU
on any node of a cluster, so there the launcher picks one node and pins those actors to it
(``NodeAffinitySchedulingStrategy``, not a placement group: vLLM would take a placement group
for its own and switch to its Ray executor). The node is the launcher's own when it has the
GPUs; otherwise, with a shared Redis, another node that has them (with the private Redis it
must be on the launcher's host). A cluster without such a node stops the run at start, saying
what it needs, rather than leaving the actors pending for ever.

With ``data_plane=redis`` and ``redis.url`` Ray places them freely.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from apps.grpo.config import ConfigError
from apps.grpo.gpu_layout import GpuPlan, plan_gpus, render_plan


def cluster_gpu_count() -> int:
    """GPUs in the whole Ray cluster (Ray's ``GPU`` resource). A run uses GPUs when this is not
    0, whether or not the launcher's host has CUDA: a cluster's head node often has none while
    its workers do, and the actors that use GPUs run there. Call with Ray up."""
    return int(ray.cluster_resources().get("GPU", 0))


def reference_gpus(
    device: str, cluster_gpus: int, policy_gpus: int, trainer_gpus: int, critic_gpus: int = 0
) -> tuple[int, str]:
    """GPUs for the reference model's actor (0 or 1) and, where that is worth saying, why.

    ``algo.reference_device``: ``gpu`` takes a GPU of its own (any node: it exchanges episodes,
    not weights, with the others) and stops the run at start when the cluster has none beyond
    the policy's, the trainer ranks' and the critic ranks'; ``auto`` does so when there is one
    spare and otherwise computes on a CPU; ``cpu`` always does. (Sharing a trainer rank's GPU
    would need fractional GPU requests from every rank; not done.)
    """
    spare = cluster_gpus - policy_gpus - trainer_gpus - critic_gpus
    if device == "cpu":
        return 0, ""
    if spare >= 1:
        return 1, ""
    critic = f" and the critic ranks ({critic_gpus})" if critic_gpus else ""
    counts = (
        f"the cluster's {cluster_gpus} GPUs go to the policy ({policy_gpus}) and the trainer ranks ({trainer_gpus})"
        + critic
    )
    if device == "gpu":
        if cluster_gpus == 0:
            raise ConfigError("algo.reference_device=gpu: the Ray cluster has no GPU; use auto or cpu")
        raise ConfigError(f"algo.reference_device=gpu: {counts}, none is left for the reference model; use auto or cpu")
    return 0, f"the reference model computes on a CPU: {counts}" if cluster_gpus else ""


def needs_one_host(data_plane: str, redis_url: str | None) -> bool:
    """Whether the policy and the trainer ranks must share a node (see the module's doc)."""
    return data_plane == "shm" or not redis_url


def choose_node(nodes: list[dict], launcher_node: str, gpus: int, launcher_host_only: bool, why: str) -> str:
    """The node for the policy and the trainer ranks: ``gpus`` GPUs in all (0 on CPU).

    ``nodes``: ``ray.nodes()``. The launcher's node when it has them, else (unless
    ``launcher_host_only``: then only nodes at the launcher's address) the alive node with the
    most GPUs. ``why``: what makes one node necessary, for the error."""
    alive = [n for n in nodes if n["Alive"]]
    launcher = next((n for n in alive if n["NodeID"] == launcher_node), None)
    if launcher is None:
        raise ValueError(f"the launcher's node {launcher_node} is not among Ray's alive nodes")
    if launcher_host_only:
        alive = [n for n in alive if n["NodeManagerAddress"] == launcher["NodeManagerAddress"]]

    def fits(node: dict) -> bool:
        return node["Resources"].get("GPU", 0) >= gpus

    if fits(launcher):
        return launcher_node
    others = sorted((n for n in alive if fits(n)), key=lambda n: (-n["Resources"].get("GPU", 0), n["NodeID"]))
    if others:
        return others[0]["NodeID"]
    have = ", ".join(
        f"{n['NodeID'][:12]}... at {n['NodeManagerAddress']}: {n['Resources'].get('GPU', 0):g}" for n in alive
    )
    where = "a node on the launcher's host" if launcher_host_only else "one node"
    hint = (
        " A Redis every node reaches (redis.url=redis://<host>:<port>) lets them use other hosts." * launcher_host_only
    )
    raise ConfigError(
        f"{why}: the policy and the trainer ranks need {gpus} GPUs on {where} "
        f"(policy.replicas x policy.tp + trainer.ranks), and no such Ray node has that many "
        f"(GPUs per node: {have}).{hint}"
    )


def weight_sync_actor_options(cfg, gpus: int, nodes: list[dict], launcher_node: str) -> dict:
    """Ray options that put the policy and the trainer ranks where the run's weight sync needs
    them: ``{}`` where any node will do. ``nodes``: ``ray.nodes()``."""
    data_plane, redis_url = cfg.weightsync.data_plane, cfg.redis.url
    if not needs_one_host(data_plane, redis_url):
        return {}
    why = "weightsync.data_plane=shm" if data_plane == "shm" else "without redis.url (a private Redis on a Unix socket)"
    node = choose_node(nodes, launcher_node, gpus, launcher_host_only=not redis_url, why=why)
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}


def pinned_to_launchers_host(options: dict, nodes: list[dict], launcher_node: str) -> bool:
    """Whether Ray ``options`` from ``weight_sync_actor_options`` put their actors on the
    launcher's host (True also where they do not pin them to a node). ``nodes``: ``ray.nodes()``."""
    strategy = options.get("scheduling_strategy")
    if not isinstance(strategy, NodeAffinitySchedulingStrategy):
        return True
    address = {n["NodeID"]: n["NodeManagerAddress"] for n in nodes}
    return address.get(strategy.node_id) == address.get(launcher_node)


@dataclass(frozen=True)
class Placement:
    """Where the actors go, decided before any starts (a cluster that cannot host the run stops
    it before anything is written)."""

    weight_sync: dict  # Ray options for the policy and the trainer ranks
    on_launchers_host: bool  # those actors run on the launcher's host (its /dev/shm is theirs)
    reference_gpus: int  # 0 or 1
    notices: tuple[str, ...] = ()
    replica_gpus: float = 0.0  # Ray's num_gpus for each policy replica
    rank_gpus: float = 0.0  # and for each trainer rank
    policy_memory_fraction: float | None = None  # colocated: vLLM's gpu_memory_utilization


def plan_placement(cfg, use_cuda: bool, uses_reference: bool, critic_ranks: int) -> Placement:
    """Call with Ray up; raises ``ConfigError`` where the cluster has no room for the run.
    ``uses_reference`` / ``critic_ranks``: what the algorithm needs (0: no critic).

    On GPUs the plan of every GPU (``apps.grpo.gpu_layout``) is made and printed: with
    ``placement.layout=separate`` each replica asks Ray for ``policy.tp`` GPUs and each rank for
    one; with ``colocated`` (``policy.tp=1``) a replica asks for ``placement.policy_fraction`` of
    a GPU and each trainer rank for the rest, so Ray puts each replica on a rank's GPU."""
    colocated = cfg.placement.layout == "colocated"
    replicas_gpus = 0 if colocated else cfg.policy.tp * cfg.policy.replicas
    policy_gpus, trainer_gpus, critic_gpus = (replicas_gpus, cfg.trainer.ranks, critic_ranks) if use_cuda else (0, 0, 0)
    nodes, launcher_node = ray.nodes(), ray.get_runtime_context().get_node_id()
    # One node for the shm plane / the private Redis.
    where = weight_sync_actor_options(cfg, policy_gpus + trainer_gpus, nodes, launcher_node)
    cluster_gpus = cluster_gpu_count() if use_cuda else 0
    if critic_gpus and cluster_gpus < policy_gpus + trainer_gpus + critic_gpus:
        raise ConfigError(
            f"algo.critic.ranks={critic_ranks}: each critic rank needs a GPU of its own, and the cluster's "
            f"{cluster_gpus} GPUs go to the policy ({policy_gpus}) and the trainer ranks ({trainer_gpus})"
        )
    ref_gpus, why = 0, ""
    if uses_reference:
        ref_gpus, why = reference_gpus(cfg.algo.reference_device, cluster_gpus, policy_gpus, trainer_gpus, critic_gpus)
    here = pinned_to_launchers_host(where, nodes, launcher_node)
    notices = (why,) if why else ()
    if not use_cuda:
        return Placement(where, here, ref_gpus, notices)
    gpu_plan = plan_gpus_on(cfg, nodes, where, critic_ranks, bool(ref_gpus))
    notices += (render_plan(gpu_plan),)
    if colocated:
        fraction = cfg.placement.policy_fraction
        return Placement(where, here, ref_gpus, notices, fraction, 1 - fraction, fraction)
    return Placement(where, here, ref_gpus, notices, float(cfg.policy.tp), 1.0)


def plan_gpus_on(cfg, nodes: list[dict], where: dict, critic_ranks: int, reference: bool) -> GpuPlan:
    """The GPU plan on Ray's alive ``nodes`` (``ray.nodes()``), with the node ``where`` pins the
    policy and the trainer ranks to, if any."""
    alive = [n for n in nodes if n["Alive"]]
    strategy = where.get("scheduling_strategy")
    pinned = None
    if isinstance(strategy, NodeAffinitySchedulingStrategy):
        pinned = next(i for i, n in enumerate(alive) if n["NodeID"] == strategy.node_id)
    return plan_gpus(
        [int(n["Resources"].get("GPU", 0)) for n in alive],
        trainer_ranks=cfg.trainer.ranks,
        replicas=cfg.policy.replicas,
        tp=cfg.policy.tp,
        critic_ranks=critic_ranks,
        reference=reference,
        layout=cfg.placement.layout,
        policy_fraction=cfg.placement.policy_fraction,
        one_node=pinned is not None,
        pinned_node=pinned,
    )
