"""Which GPUs of which node each GPU-using actor of a run gets, planned from the GPUs per node
alone before any actor starts: a cluster that cannot host the run stops it with a message that
names the config keys, and the launcher prints where everything goes. Pure (no Ray, no torch):
the launcher turns the plan into Ray options.

Roles: ``trainer`` (FSDP2 ranks), ``critic`` (PPO's critic ranks), ``reference`` (0 or 1 actor),
one GPU each; ``policy`` (vLLM replicas), ``tp`` GPUs each, always on one node (a replica's TP
workers are processes of one engine on one host).

Layouts (``placement.layout``):

- ``separate``: every actor has GPUs of its own.
- ``colocated``: policy replica ``r`` runs on the GPUs of trainer ranks ``r*tp .. r*tp+tp-1``
  (so those ranks are on one node) and gets ``policy_fraction`` of each one's memory, the rank
  the rest; trainer ranks beyond ``replicas*tp``, the critic and the reference keep whole GPUs.

``one_node``: the weight sync needs the policy and every trainer rank on one host (the
shared-memory data plane, the private Redis). They then all go to one node, the one with the
most GPUs (the first of those) unless the caller names one; the critic and the reference take
any GPUs left. Without it nodes are filled in order, larger units (replicas) first so that
single-GPU actors do not leave every node too few GPUs for one.

Within a node, GPU numbers go to the trainer ranks first, then the policy, the critic and the
reference: with ``colocated`` the policy's GPUs are the trainer's first ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from validation.config import ConfigError

ROLES = ("trainer", "policy", "critic", "reference")  # the order of GPU numbers within a node
LAYOUTS = ("separate", "colocated")


@dataclass
class PlacementConfig:
    """The ``placement`` config group."""

    layout: str  # separate | colocated
    policy_fraction: float  # colocated: the policy's share of each GPU it shares with a trainer rank

    def rules(self) -> list[tuple[bool, str, str]]:
        return [
            (self.layout in LAYOUTS, "layout", f"one of {list(LAYOUTS)}"),
            (
                0 < self.policy_fraction < 1,
                "policy_fraction",
                "a number between 0 and 1, both excluded (with layout=colocated, the policy's share of "
                "each GPU's memory it shares with a trainer rank)",
            ),
        ]


@dataclass(frozen=True)
class ActorGpus:
    """One actor's GPUs: ``node`` indexes the GPUs-per-node list the plan was made from, ``gpus``
    are GPU numbers on that node (``tp`` of them for a policy replica), and ``fraction`` is the
    share of each of those GPUs' memory it may use. In a CPU run: node None, no GPUs, fraction 0."""

    role: str
    index: int  # rank or replica number within the role
    node: int | None
    gpus: tuple[int, ...]
    fraction: float

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"


@dataclass(frozen=True)
class GpuPlan:
    gpus_per_node: tuple[int, ...]
    layout: str
    actors: tuple[ActorGpus, ...]  # by role (ROLES order), then index
    weight_sync_node: int | None  # the node of the policy and the trainer ranks with one_node, else None

    @property
    def uses_gpus(self) -> bool:
        return any(a.gpus for a in self.actors)

    def role(self, role: str) -> tuple[ActorGpus, ...]:
        return tuple(a for a in self.actors if a.role == role)

    def actor(self, role: str, index: int) -> ActorGpus:
        return next(a for a in self.actors if a.role == role and a.index == index)

    def on_gpu(self, node: int, gpu: int) -> tuple[ActorGpus, ...]:
        """The actors that use GPU ``gpu`` of node ``node``."""
        return tuple(a for a in self.actors if a.node == node and gpu in a.gpus)


@dataclass
class _Member:
    role: str
    index: int
    offsets: tuple[int, ...]  # which of its unit's GPUs it uses
    fraction: float


@dataclass
class _Unit:
    """GPUs that must be on one node, and the actors that use them."""

    size: int
    members: list[_Member]

    def order(self) -> tuple[int, int]:
        return ROLES.index(self.members[0].role), self.members[0].index


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _nodes(gpus_per_node: tuple[int, ...]) -> str:
    return "GPUs per node: " + (", ".join(f"node {i}: {g}" for i, g in enumerate(gpus_per_node)) or "no nodes")


def plan_gpus(
    gpus_per_node: list[int] | tuple[int, ...],
    *,
    trainer_ranks: int,
    replicas: int,
    tp: int,
    critic_ranks: int = 0,
    reference: bool = False,
    layout: str = "separate",
    policy_fraction: float = 0.4,
    one_node: bool = False,
    pinned_node: int | None = None,
    why_one_node: str = "weightsync.data_plane=shm",
) -> GpuPlan:
    """Where each actor goes. ``gpus_per_node``: GPUs of each node in the order of ``ray.nodes()``.
    ``reference``: the reference model gets a GPU of its own (``reference_gpus`` in placement.py
    decides). ``pinned_node``: with ``one_node``, the node for the policy and the trainer ranks
    (e.g. the launcher's); None: the one with the most GPUs. ``why_one_node``: the reason, for
    the error.

    A cluster without GPUs (``[]`` or all zeros) is a CPU run: every actor is listed with node
    None, no GPUs and fraction 0, and no room is checked (``one_node`` is then ``choose_node``'s
    business). The counts and the layout are checked in any case.

    Raises ``ConfigError`` naming the keys involved where the cluster has no room for the run.
    """
    gpus_per_node = tuple(int(g) for g in gpus_per_node)
    for ok, key, value, allowed in (
        (trainer_ranks >= 1, "trainer.ranks", trainer_ranks, "an integer >= 1"),
        (replicas >= 1, "policy.replicas", replicas, "an integer >= 1"),
        (tp >= 1, "policy.tp", tp, "an integer >= 1"),
        (critic_ranks >= 0, "algo.critic.ranks", critic_ranks, "an integer >= 0"),
        (layout in LAYOUTS, "placement.layout", layout, f"one of {list(LAYOUTS)}"),
        (layout != "colocated" or 0 < policy_fraction < 1, "placement.policy_fraction", policy_fraction, "in (0, 1)"),
    ):
        if not ok:
            raise ConfigError(f"config key {key}={value!r} is invalid: expected {allowed}")
    if min(gpus_per_node, default=0) < 0:
        raise ValueError(f"negative GPU count in {gpus_per_node}")
    if pinned_node is not None and not 0 <= pinned_node < len(gpus_per_node):
        raise ValueError(f"pinned_node={pinned_node} is not a node of {gpus_per_node}")
    policy = f"policy.replicas={replicas} x policy.tp={tp}"
    if layout == "colocated" and replicas * tp > trainer_ranks:
        raise ConfigError(
            f"{policy} need {replicas * tp} GPUs of trainer ranks with placement.layout=colocated (each replica "
            f"runs on the GPUs of policy.tp trainer ranks), and trainer.ranks={trainer_ranks}; use more trainer ranks, "
            "fewer or smaller replicas, or placement.layout=separate"
        )

    units, others = _units(trainer_ranks, replicas, tp, critic_ranks, reference, layout, policy_fraction)
    if not any(gpus_per_node):
        actors = [ActorGpus(m.role, m.index, None, (), 0.0) for u in units + others for m in u.members]
        return GpuPlan(gpus_per_node, layout, tuple(sorted(actors, key=_actor_order)), None)

    # The checks, each with its own message; after them the packing below cannot fail.
    weight_sync_gpus = sum(u.size for u in units)
    where = f"with placement.layout={layout}"
    if tp > max(gpus_per_node):
        raise ConfigError(
            f"policy.tp={tp}: a replica's {tp} GPUs must be on one node, and the largest node has "
            f"{max(gpus_per_node)} ({_nodes(gpus_per_node)})"
        )
    weight_sync_node = None
    if one_node:
        weight_sync_node = gpus_per_node.index(max(gpus_per_node)) if pinned_node is None else pinned_node
        if weight_sync_gpus > gpus_per_node[weight_sync_node]:
            which = "the largest node" if pinned_node is None else "the node they must use"
            raise ConfigError(
                f"{policy} and trainer.ranks={trainer_ranks} need {weight_sync_gpus} GPUs {where} on one node "
                f"({why_one_node}); {which} (node {weight_sync_node}) has {gpus_per_node[weight_sync_node]} "
                f"({_nodes(gpus_per_node)})"
            )
    needed = weight_sync_gpus + len(others)
    if needed > sum(gpus_per_node):
        parts = [policy, f"trainer.ranks={trainer_ranks}"]
        if critic_ranks:
            parts.append(f"algo.critic.ranks={critic_ranks}")
        if reference:
            parts.append("a reference model (algo.reference_device)")
        raise ConfigError(
            f"{_join(parts)} need {needed} GPUs {where}; the cluster has {sum(gpus_per_node)} ({_nodes(gpus_per_node)})"
        )
    room = sum(g // tp for g in gpus_per_node)
    if not one_node and replicas > room:
        raise ConfigError(
            f"{policy}: each replica's {tp} GPUs must be on one node {where}, and the nodes have room for "
            f"{room} such replicas ({_nodes(gpus_per_node)})"
        )

    free = list(gpus_per_node)
    placed: list[tuple[int, _Unit]] = []

    def put(unit: _Unit, node: int | None = None) -> None:
        if node is None:
            node = next(i for i, f in enumerate(free) if f >= unit.size)
        free[node] -= unit.size
        placed.append((node, unit))

    for unit in sorted(units, key=lambda u: -u.size):  # stable: replicas first, in order
        put(unit, weight_sync_node)
    for unit in others:
        put(unit)

    actors = []
    for node in range(len(gpus_per_node)):
        first = 0
        for _, unit in sorted((p for p in placed if p[0] == node), key=lambda p: p[1].order()):
            for m in unit.members:
                actors.append(ActorGpus(m.role, m.index, node, tuple(first + o for o in m.offsets), m.fraction))
            first += unit.size
    return GpuPlan(gpus_per_node, layout, tuple(sorted(actors, key=_actor_order)), weight_sync_node)


def _actor_order(actor: ActorGpus) -> tuple[int, int]:
    return ROLES.index(actor.role), actor.index


def _units(
    trainer_ranks: int,
    replicas: int,
    tp: int,
    critic_ranks: int,
    reference: bool,
    layout: str,
    policy_fraction: float,
) -> tuple[list[_Unit], list[_Unit]]:
    """The units of the policy and the trainer ranks (those that ``one_node`` keeps together),
    and those of the critic and the reference."""
    every_gpu = tuple(range(tp))
    units = []
    shared_ranks = 0
    for r in range(replicas):
        if layout == "colocated":
            ranks = [_Member("trainer", r * tp + k, (k,), 1.0 - policy_fraction) for k in range(tp)]
            units.append(_Unit(tp, [*ranks, _Member("policy", r, every_gpu, policy_fraction)]))
            shared_ranks += tp
        else:
            units.append(_Unit(tp, [_Member("policy", r, every_gpu, 1.0)]))
    units += [_Unit(1, [_Member("trainer", rank, (0,), 1.0)]) for rank in range(shared_ranks, trainer_ranks)]
    others = [_Unit(1, [_Member("critic", rank, (0,), 1.0)]) for rank in range(critic_ranks)]
    if reference:
        others.append(_Unit(1, [_Member("reference", 0, (0,), 1.0)]))
    return units, others


def render_plan(plan: GpuPlan) -> str:
    """The plan as one line per node, e.g. ``node 0 (8 GPUs): GPU0 trainer0(0.6)+policy0.tp0(0.4),
    ..., GPU7 free``; a share below a whole GPU is in parentheses. A CPU run is one line."""
    if not plan.uses_gpus:
        return "no GPUs: " + " ".join(a.name for a in plan.actors) + " run on CPUs"

    def label(actor: ActorGpus, gpu: int) -> str:
        name = f"{actor.name}.tp{actor.gpus.index(gpu)}" if actor.role == "policy" else actor.name
        return name + (f"({actor.fraction:g})" if actor.fraction < 1 else "")

    lines = []
    for node, count in enumerate(plan.gpus_per_node):
        cells = [
            f"GPU{gpu} " + ("+".join(label(a, gpu) for a in plan.on_gpu(node, gpu)) or "free") for gpu in range(count)
        ]
        mark = " [policy and trainer node]" if node == plan.weight_sync_node else ""
        lines.append(f"node {node} ({count} GPU{'s' * (count != 1)}){mark}: " + (", ".join(cells) or "-"))
    return "\n".join(lines)
