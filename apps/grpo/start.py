"""Starting the run's actors: which ones the algorithm needs, each given its config group whole,
and a failed start said in one line."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import ray

from actors.engine_activity import FILE_NAME
from actors.policy import Policy
from actors.policy_replicas import PolicyReplicas
from actors.rank_groups import CriticGroup, TrainerGroup
from actors.reference import Reference
from actors.replay import ReplayBuffer
from actors.reward import Reward
from algos.base import Algorithm
from apps.grpo import interrupts
from apps.grpo.config import RunConfig
from apps.grpo.placement import Placement
from tasks.base import Scorer
from weightsync.push import run_dir


@dataclass
class Actors:
    policy: PolicyReplicas
    trainer: TrainerGroup
    reward: ray.actor.ActorHandle
    replay: ray.actor.ActorHandle
    reference: ray.actor.ActorHandle | None  # when the algorithm has a KL term
    critic: CriticGroup | None  # when the algorithm has a critic


class ActorStartError(RuntimeError):
    """An actor's constructor raised: a bad model, a vLLM engine that did not start, ..."""


_EXCEPTION_START = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*: ")


def final_exception(traceback_text: str) -> str:
    """The exception a Ray error's traceback ends with ("ValueError: ...", all its lines; the
    class without its module)."""
    lines = traceback_text.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if _EXCEPTION_START.match(lines[i]):
            return "\n".join([re.sub(r"^(?:[A-Za-z_]\w*\.)+", "", lines[i]), *lines[i + 1 :]])
    return lines[-1] if lines else traceback_text


def engine_files_record(cfg: RunConfig) -> Path:
    """The folder where each policy replica lists its vLLM engine's shared-memory files
    (``<replica>.json``, see ``actors.engine_shm``): in the run's shared-memory folder, which the
    launcher removes at the end."""
    return run_dir(cfg.weightsync.shm_root, cfg.run_name) / "engine-files"


def start_actors(
    cfg: RunConfig,
    algorithm: Algorithm,
    scorer: Scorer,
    model_path: str,
    redis_url: str,
    policy_dtype: str,
    use_cuda: bool,
    placement: Placement,
    writers: list | None = None,
) -> Actors:
    """``placement``: from ``plan_placement``. ``writers``: gets the actors that write to shared
    memory (the policy, the trainer ranks) as they are made, so that the launcher can end them
    even if this start is interrupted."""
    writers = [] if writers is None else writers
    where = placement.weight_sync
    replicas, names = [], [f"policy-{i}" for i in range(cfg.policy.replicas)]
    # On one CPU host the trainer ranks borrow the cores the engines leave idle.
    activity = None
    if not use_cuda and cfg.weightsync.data_plane == "shm":
        activity = str(run_dir(cfg.weightsync.shm_root, cfg.run_name) / FILE_NAME)
    for i, name in enumerate(names):
        replica = Policy.options(num_gpus=placement.replica_gpus, max_restarts=cfg.policy.max_restarts, **where).remote(
            model_path,
            redis_url,
            cfg.run_name,
            dataclasses.replace(cfg.policy, dtype=policy_dtype),
            replica=name,
            cpu_share=(i, cfg.policy.replicas),
            seed=cfg.seed + i,  # replicas' engines differ where a request brings no seed of its own
            verify=cfg.weightsync.verify,
            engine_files_record=str(engine_files_record(cfg) / f"{name}.json"),
            gpu_memory_fraction=placement.policy_memory_fraction,
            engine_activity=activity,
        )
        replicas.append(replica)
        writers.append(replica)
    policy = PolicyReplicas(replicas, names, max_restarts=cfg.policy.max_restarts, in_flight=cfg.policy.in_flight)
    trainer = TrainerGroup(
        cfg.trainer,
        model_path,
        redis_url,
        cfg.run_name,
        loss=dataclasses.replace(
            algorithm.policy_loss(),
            shared_prefix=cfg.trainer.shared_prefix,
            completion_passes=cfg.trainer.completion_passes,
        ),
        weightsync=cfg.weightsync,
        sync_dtype=policy_dtype,
        total_steps=cfg.steps,
        seed=cfg.seed,
        use_cuda=use_cuda,
        actor_options=where | ({"num_gpus": placement.rank_gpus} if use_cuda else {}),
        engine_activity=activity,
    )
    writers.extend(trainer.ranks)
    named = {"the policy" if len(names) == 1 else f"policy replica {n}": r for n, r in zip(names, replicas)}
    named |= {f"trainer rank {i}": r for i, r in enumerate(trainer.ranks)}
    critic = None
    if algorithm.uses_critic:
        critic_config, value_loss = algorithm.critic()
        critic = CriticGroup(
            critic_config, model_path, loss=value_loss, total_steps=cfg.steps, seed=cfg.seed, use_cuda=use_cuda
        )
        named |= {f"critic rank {i}": r for i, r in enumerate(critic.ranks)}
    reference = None
    if algorithm.uses_reference:
        # On a GPU at the trainer's compute dtype, so that the KL compares like with like.
        device, dtype = ("cuda", cfg.trainer.param_dtype) if placement.reference_gpus else ("cpu", "float32")
        reference = Reference.options(num_gpus=placement.reference_gpus).remote(
            model_path,
            cfg.trainer.torch_threads,
            device=device,
            dtype=dtype,
            completion_passes=cfg.trainer.completion_passes,
        )
        named["the reference model"] = reference
    actors = Actors(
        policy, trainer, Reward.remote(scorer, cfg.task), ReplayBuffer.remote(cfg.algo.max_staleness), reference, critic
    )
    # Surface a failed start (bad model, vLLM error) here rather than at the first call. The
    # engine's start takes a minute: wait so that Ctrl-C stops it (see apps.grpo.interrupts).
    try:
        interrupts.ready([a.__ray_ready__.remote() for a in named.values()])
    except ray.exceptions.RayActorError as e:
        if not getattr(e, "actor_init_failed", False):
            raise
        who = next((name for name, a in named.items() if a._actor_id.hex() == e.actor_id), "an actor")
        raise ActorStartError(f"{who} did not start: {final_exception(e.error_msg)}") from e
    trainer.start()
    if critic is not None:
        critic.start()
    return actors
