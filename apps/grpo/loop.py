"""The GRPO controller loop: generate, score, advantage, reference logprobs, train, push, update."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from actors.policy import Policy, Sample
from actors.reference import Reference
from actors.replay import ReplayBuffer
from actors.reward import Reward
from actors.trainer_group import TrainerGroup
from algos.episodes import Episode, assign_advantages
from apps.grpo import interrupts
from apps.grpo.placement import Placement
from checkpointing import folders
from tasks.arithmetic import ArithmeticTask, Problem
from weightsync.push import run_dir


@dataclass
class Actors:
    policy: ray.actor.ActorHandle
    trainer: TrainerGroup
    reward: ray.actor.ActorHandle
    replay: ray.actor.ActorHandle
    reference: ray.actor.ActorHandle | None


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


def engine_files_record(cfg) -> Path:
    """Where the policy lists its vLLM engine's shared-memory files (``actors.engine_shm``): in
    the run's shared-memory folder, which the launcher removes at the end."""
    return run_dir(cfg.weightsync.shm_root, cfg.run_name) / "engine-files.json"


def start_actors(
    cfg,
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
    run = cfg.run_name
    writers = [] if writers is None else writers
    where = placement.weight_sync
    policy = Policy.options(num_gpus=cfg.policy.tp if use_cuda else 0, **where).remote(
        model_path,
        redis_url,
        run,
        tp=cfg.policy.tp,
        dtype=policy_dtype,
        max_model_len=cfg.policy.max_model_len,
        kv_cache_mib=cfg.policy.kv_cache_mib,
        enforce_eager=cfg.policy.enforce_eager,
        seed=cfg.seed,
        omp_threads_bind=cfg.policy.omp_threads_bind,
        verify=cfg.weightsync.verify,
        engine_files_record=str(engine_files_record(cfg)),
    )
    writers.append(policy)
    trainer = TrainerGroup(
        cfg.trainer.ranks,
        model_path,
        redis_url,
        run,
        use_cuda=use_cuda,
        actor_options=where,
        micro_batch_size=cfg.trainer.micro_batch_size,
        lr=cfg.trainer.lr,
        lr_schedule=cfg.trainer.lr_schedule,
        total_steps=cfg.steps,
        warmup_steps=cfg.trainer.warmup_steps,
        min_lr_ratio=cfg.trainer.min_lr_ratio,
        weight_decay=cfg.trainer.weight_decay,
        max_grad_norm=cfg.trainer.max_grad_norm,
        loss=loss_options(cfg.algo, cfg.policy.max_tokens),
        param_dtype=cfg.trainer.param_dtype,
        reduce_dtype=cfg.trainer.reduce_dtype,
        seed=cfg.seed,
        torch_threads=cfg.trainer.torch_threads,
        shm_root=cfg.weightsync.shm_root,
        sync_dtype=policy_dtype,
        keep_last=cfg.weightsync.keep_last,
        data_plane=cfg.weightsync.data_plane,
        checksums=cfg.weightsync.checksums,
        delta=cfg.weightsync.delta,
        delta_max_live=cfg.weightsync.delta_max_live,
        delta_elements=cfg.weightsync.delta_elements,
    )
    writers.extend(trainer.ranks)
    reference = None
    if cfg.algo.kl_coef > 0:
        # On a GPU at the trainer's compute dtype, so that the KL compares like with like.
        device, dtype = ("cuda", cfg.trainer.param_dtype) if placement.reference_gpus else ("cpu", "float32")
        reference = Reference.options(num_gpus=placement.reference_gpus).remote(
            model_path, cfg.trainer.torch_threads, device=device, dtype=dtype
        )
    actors = Actors(
        policy, trainer, Reward.remote(cfg.task.format_reward), ReplayBuffer.remote(cfg.algo.max_staleness), reference
    )
    # Surface a failed start (bad model, vLLM error) here rather than at the first call. The
    # engine's start takes a minute: wait so that Ctrl-C stops it (see apps.grpo.interrupts).
    named = {"the policy": policy} | {f"trainer rank {i}": r for i, r in enumerate(trainer.ranks)}
    if reference is not None:
        named["the reference model"] = reference
    try:
        interrupts.ready([a.__ray_ready__.remote() for a in named.values()])
    except ray.exceptions.RayActorError as e:
        if not getattr(e, "actor_init_failed", False):
            raise
        who = next((name for name, a in named.items() if a._actor_id.hex() == e.actor_id), "an actor")
        raise ActorStartError(f"{who} did not start: {final_exception(e.error_msg)}") from e
    trainer.start()
    return actors


@dataclass
class LoopState:
    """The controller's part of a checkpoint: where the run is (the trainer saves its own part).

    The replay buffer is empty between steps (each step takes all it added) and rollout seeds
    derive from ``seed`` and the step, so these few numbers are all the controller needs.
    """

    step: int  # the next step to run
    data_cursor: int  # train batches consumed
    policy_version: int
    eval_accuracy_start: float
    last_eval: float

    @staticmethod
    def load(folder: Path) -> LoopState:
        try:
            return LoopState(**json.loads((folder / folders.LOOP_STATE).read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise folders.CheckpointError(f"checkpoint {folder} has no valid {folders.LOOP_STATE}: {e}") from e


class Checkpointer:
    """Saves checkpoints every ``checkpoint.every`` steps into ``<out>/checkpoints``; keeps the last K.

    Each is written under a temporary name and published by a rename once the trainer ranks'
    shards and the loop state are on disk (with ``async_save``, at a later step boundary).
    """

    def __init__(self, cfg, out_dir: Path, trainer: TrainerGroup, console) -> None:
        self.every, self.keep_last, self.async_save = cfg.every, cfg.keep_last, cfg.async_save
        self.root = out_dir / "checkpoints"
        self.trainer = trainer
        self.console = console
        self.pending: tuple[Path, Path] | None = None

    def due(self, step_done: int, last: bool) -> bool:
        return self.every > 0 and (step_done % self.every == 0 or last)

    def save(self, state: LoopState) -> None:
        self.finish()
        tmp, final = folders.tmp_dir(self.root, state.step), folders.final_dir(self.root, state.step)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        t0 = time.perf_counter()
        self.trainer.save_checkpoint(str(tmp.resolve()), self.async_save)
        (tmp / folders.LOOP_STATE).write_text(json.dumps(dataclasses.asdict(state)))
        self.pending = (tmp, final)
        if not self.async_save:
            self.finish()
        what = "staged (written in the background)" if self.async_save else "saved"
        self.console.print(f"checkpoint {final} {what} in {time.perf_counter() - t0:.1f}s")

    def poll(self) -> None:
        """Publish a pending async save as soon as every rank has written it (never blocks)."""
        if self.pending is not None and self.trainer.checkpoint_written():
            self.finish()

    def finish(self) -> None:
        """Wait for a pending save, publish it, and drop checkpoints beyond ``keep_last``."""
        if self.pending is None:
            return
        tmp, final = self.pending
        self.pending = None
        self.trainer.wait_for_checkpoint()
        folders.publish(tmp, final)
        folders.prune(self.root, self.keep_last)


def evaluate(actors: Actors, problems: list[Problem], max_tokens: int) -> float:
    """Greedy exact-match accuracy on ``problems``."""
    outputs = ray.get(actors.policy.greedy.remote([p.prompt for p in problems], max_tokens))
    rewards = ray.get(actors.reward.score.remote(problems, [t for t, _ in outputs], [f for _, f in outputs]))
    return sum(r == 1.0 for r in rewards) / len(problems)


def to_episodes(
    prompt_ids: list[list[int]], samples: list[list[Sample]], rewards: list[float], version: int
) -> list[Episode]:
    """One episode per sample, in group order; advantages are filled in by ``assign_advantages``."""
    flat = [(ids, s) for ids, group in zip(prompt_ids, samples) for s in group]
    return [Episode(ids, s.token_ids, s.logprobs, r, 0.0, version) for (ids, s), r in zip(flat, rewards, strict=True)]


def loss_options(algo, max_tokens: int) -> dict:
    """The trainer's ``grpo_loss`` keyword arguments from the ``algo`` config group."""
    return {
        "clip_eps": algo.clip_eps,
        "clip_eps_high": algo.clip_eps_high,
        "kl_coef": algo.kl_coef if algo.kl_mode == "loss" else 0.0,
        "kl_estimator": algo.kl_estimator,
        "aggregation": algo.loss_aggregation,
        "length_normalizer": algo.length_normalizer or max_tokens,
        "tis_cap": algo.tis_cap,
    }


def resume_from_checkpoint(actors: Actors, out_dir: Path, console) -> LoopState:
    """Load the newest complete checkpoint into the trainer and give the policy its weights."""
    root = out_dir / "checkpoints"
    for partial in folders.remove_partial(root):
        console.print(f"removed unfinished checkpoint {partial}")
    step, folder = folders.newest_checkpoint(root)
    state = LoopState.load(folder)
    actors.trainer.load_checkpoint(str(folder.resolve()))
    actors.trainer.push_weights(state.policy_version)
    ray.get(actors.policy.update_weights.remote(state.policy_version))
    console.print(f"resumed from {folder} (step {step}, policy version {state.policy_version})")
    return state


def _keep_metrics_before(path: Path, step: int) -> None:
    """Drop the metric rows of steps a resumed run will redo (and a previous final line)."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line, row in zip(lines, map(json.loads, lines)) if not row.get("final") and row["step"] < step]
    path.write_text("".join(line + "\n" for line in kept))


def run_grpo(
    cfg, actors: Actors, task: ArithmeticTask, tokenizer, out_dir: Path, console, resume: LoopState | None = None
) -> dict:
    """Train up to step ``cfg.steps``; append one JSON line per step to ``metrics.jsonl``."""
    G = cfg.algo.group_size
    eval_problems = task.eval_problems
    checkpointer = Checkpointer(cfg.checkpoint, out_dir, actors.trainer, console)
    if resume is None:
        start, cursor, version = 0, 0, 0
        first_eval = evaluate(actors, eval_problems, cfg.policy.max_tokens)
        console.print(f"eval accuracy before training: {first_eval:.3f} on {len(eval_problems)} held-out problems")
        last_eval = first_eval
    else:
        start, cursor, version = resume.step, resume.data_cursor, resume.policy_version
        first_eval, last_eval = resume.eval_accuracy_start, resume.last_eval
    batches = task.train_batches(cfg.prompts_per_step, start=cursor)
    metrics_path = out_dir / "metrics.jsonl"
    _keep_metrics_before(metrics_path, start)
    columns = [
        TextColumn("[bold]GRPO"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("reward {task.fields[reward]:.3f}  eval {task.fields[eval]:.3f}  Δlogp {task.fields[diff]:.1e}"),
    ]
    with open(metrics_path, "a") as metrics_file, Progress(*columns, console=console) as progress:
        bar = progress.add_task("grpo", total=cfg.steps, completed=start, reward=0.0, eval=last_eval, diff=0.0)
        for step in range(start, cfg.steps):
            interrupts.check()  # a Ctrl-C that a library call swallowed during the last step
            t0 = time.perf_counter()
            row: dict = {"step": step}
            if step == 0:
                row["eval_accuracy"] = first_eval
            elif cfg.eval_every and step % cfg.eval_every == 0:
                row["eval_accuracy"] = last_eval = evaluate(actors, eval_problems, cfg.policy.max_tokens)

            # 1-2. Prompts -> G completions each, with their logprobs and the policy version.
            problems = next(batches)
            cursor += 1
            t_gen = time.perf_counter()
            sample_seed = (cfg.seed * 1_000_003 + step) * len(problems) * G  # disjoint seed ranges per step
            samples, rollout_version = ray.get(
                actors.policy.generate.remote(
                    [p.prompt for p in problems], G, cfg.policy.temperature, cfg.policy.max_tokens, sample_seed
                )
            )
            gen_s = time.perf_counter() - t_gen
            gen_tokens = sum(len(s.token_ids) for group in samples for s in group)

            # 3. Rewards.
            flat_problems = [p for p in problems for _ in range(G)]
            flat = [s for group in samples for s in group]
            rewards = ray.get(
                actors.reward.score.remote(flat_problems, [s.text for s in flat], [s.finished for s in flat])
            )

            # 4. Reference logprobs for the KL term; group advantages (of the KL-penalised reward
            #    when algo.kl_mode=reward).
            prompt_ids = [tokenizer.encode(p.prompt) for p in problems]
            episodes = to_episodes(prompt_ids, samples, rewards, rollout_version)
            if actors.reference is not None:
                for e, ref in zip(episodes, ray.get(actors.reference.logprobs.remote(episodes))):
                    e.ref_logprobs = ref
            assign_advantages(
                episodes,
                G,
                normalize_std=cfg.algo.advantage_std_norm,
                kl_reward_coef=cfg.algo.kl_coef if cfg.algo.kl_mode == "reward" else 0.0,
                kl_estimator=cfg.algo.kl_estimator,
            )

            # 5. Through the replay buffer, which drops episodes older than max_staleness.
            ray.get(actors.replay.add.remote(episodes))
            batch = ray.get(actors.replay.take.remote(version))

            # 6. Train.
            train = actors.trainer.train_step(batch)

            # 7-8. Push the new weights through the store; the policy loads them in place.
            t_sync = time.perf_counter()
            version += 1
            push = actors.trainer.push_weights(version)
            update = ray.get(actors.policy.update_weights.remote(version))
            sync_s = time.perf_counter() - t_sync

            row.update(
                reward_mean=sum(rewards) / len(rewards),
                accuracy_sampled=sum(r == 1.0 for r in rewards) / len(rewards),
                loss=train["loss"],
                kl=train["kl"],
                entropy=train["entropy"],
                clip_frac=train["clip_frac"],
                grad_norm=train["grad_norm"],
                lr=train["lr"],
                policy_version=rollout_version,
                logprob_diff_mean=train["logprob_diff_mean"],
                logprob_diff_max=train["logprob_diff_max"],
                weight_sync_s=sync_s,
                push_s=push["push_s"],
                push_bytes=push["bytes_written"],
                push_bytes_reused=push["bytes_reused"],
                update_s=update["update_s"],
                gen_tokens_per_s=gen_tokens / gen_s,
                completion_len_mean=gen_tokens / len(flat),
                step_s=time.perf_counter() - t0,
            )
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()
            if checkpointer.due(step + 1, last=step + 1 == cfg.steps):
                checkpointer.save(LoopState(step + 1, cursor, version, first_eval, last_eval))
            else:
                checkpointer.poll()
            progress.update(bar, advance=1, reward=row["reward_mean"], eval=last_eval, diff=row["logprob_diff_mean"])
            if not console.is_terminal and (step % 10 == 0 or step == cfg.steps - 1):
                # No live bar without a terminal (CI, a log file): a line every 10 steps instead.
                console.print(
                    f"step {step + 1}/{cfg.steps}: reward {row['reward_mean']:.3f}, eval {last_eval:.3f}, "
                    f"logprob diff {row['logprob_diff_mean']:.1e}, step {row['step_s']:.2f}s"
                )

        checkpointer.finish()
        final_eval = evaluate(actors, eval_problems, cfg.policy.max_tokens)
        metrics_file.write(
            json.dumps({"step": cfg.steps, "final": True, "eval_accuracy": final_eval, "policy_version": version})
            + "\n"
        )
    return {"eval_accuracy_start": first_eval, "eval_accuracy_final": final_eval, "policy_version": version}
