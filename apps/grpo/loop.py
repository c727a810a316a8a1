"""The GRPO controller loop: generate, score, advantage, reference logprobs, train, push, update."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from actors.policy import Policy, Sample
from actors.reference import Reference
from actors.replay import ReplayBuffer
from actors.reward import Reward
from actors.trainer import Trainer
from algos.episodes import Episode, assign_advantages
from tasks.arithmetic import ArithmeticTask, Problem


@dataclass
class Actors:
    policy: ray.actor.ActorHandle
    trainer: ray.actor.ActorHandle
    reward: ray.actor.ActorHandle
    replay: ray.actor.ActorHandle
    reference: ray.actor.ActorHandle | None


def start_actors(cfg, model_path: str, redis_url: str, policy_dtype: str, use_cuda: bool) -> Actors:
    run = cfg.run_name
    policy = Policy.options(num_gpus=cfg.policy.tp if use_cuda else 0).remote(
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
    )
    trainer = Trainer.remote(
        model_path,
        redis_url,
        run,
        lr=cfg.trainer.lr,
        warmup_steps=cfg.trainer.warmup_steps,
        weight_decay=cfg.trainer.weight_decay,
        max_grad_norm=cfg.trainer.max_grad_norm,
        loss=loss_options(cfg.algo, cfg.policy.max_tokens),
        micro_batch_size=cfg.trainer.micro_batch_size,
        seed=cfg.seed,
        torch_threads=cfg.trainer.torch_threads,
        shm_root=cfg.weightsync.shm_root,
        sync_dtype=policy_dtype,
        keep_last=cfg.weightsync.keep_last,
    )
    reference = Reference.remote(model_path, cfg.trainer.torch_threads) if cfg.algo.kl_coef > 0 else None
    actors = Actors(
        policy, trainer, Reward.remote(cfg.task.format_reward), ReplayBuffer.remote(cfg.algo.max_staleness), reference
    )
    # Surface a failed start (bad model, vLLM error) here rather than at the first call.
    ray.get([a.__ray_ready__.remote() for a in (policy, trainer, reference) if a is not None])
    return actors


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


def run_grpo(cfg, actors: Actors, task: ArithmeticTask, tokenizer, out_dir: Path, console) -> dict:
    """Train for ``cfg.steps`` steps; append one JSON line per step to ``metrics.jsonl``."""
    G = cfg.algo.group_size
    batches = task.train_batches(cfg.prompts_per_step)
    version = 0
    eval_problems = task.eval_problems
    first_eval = evaluate(actors, eval_problems, cfg.policy.max_tokens)
    console.print(f"eval accuracy before training: {first_eval:.3f} on {len(eval_problems)} held-out problems")
    last_eval = first_eval
    columns = [
        TextColumn("[bold]GRPO"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("reward {task.fields[reward]:.3f}  eval {task.fields[eval]:.3f}  Δlogp {task.fields[diff]:.1e}"),
    ]
    with open(out_dir / "metrics.jsonl", "w") as metrics_file, Progress(*columns, console=console) as progress:
        bar = progress.add_task("grpo", total=cfg.steps, reward=0.0, eval=first_eval, diff=0.0)
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            row: dict = {"step": step}
            if step == 0:
                row["eval_accuracy"] = first_eval
            elif cfg.eval_every and step % cfg.eval_every == 0:
                row["eval_accuracy"] = last_eval = evaluate(actors, eval_problems, cfg.policy.max_tokens)

            # 1-2. Prompts -> G completions each, with their logprobs and the policy version.
            problems = next(batches)
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
            train = ray.get(actors.trainer.train_step.remote(batch))

            # 7-8. Push the new weights through the store; the policy loads them in place.
            t_sync = time.perf_counter()
            version += 1
            push = ray.get(actors.trainer.push_weights.remote(version))
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
                update_s=update["update_s"],
                gen_tokens_per_s=gen_tokens / gen_s,
                completion_len_mean=gen_tokens / len(flat),
                step_s=time.perf_counter() - t0,
            )
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()
            progress.update(bar, advance=1, reward=row["reward_mean"], eval=last_eval, diff=row["logprob_diff_mean"])
            if not console.is_terminal and (step % 10 == 0 or step == cfg.steps - 1):
                # No live bar without a terminal (CI, a log file): a line every 10 steps instead.
                console.print(
                    f"step {step + 1}/{cfg.steps}: reward {row['reward_mean']:.3f}, eval {last_eval:.3f}, "
                    f"logprob diff {row['logprob_diff_mean']:.1e}, step {row['step_s']:.2f}s"
                )

        final_eval = evaluate(actors, eval_problems, cfg.policy.max_tokens)
        metrics_file.write(
            json.dumps({"step": cfg.steps, "final": True, "eval_accuracy": final_eval, "policy_version": version})
            + "\n"
        )
    return {"eval_accuracy_start": first_eval, "eval_accuracy_final": final_eval, "policy_version": version}
