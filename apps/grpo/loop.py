"""The controller loop, for any algorithm and task: generate, score, make experience, train,
push, update. The machinery each phase needs is below the loop; the run's plumbing (actors,
checkpoints, metrics, progress) lives in the modules it imports."""

from __future__ import annotations

import time
from pathlib import Path

import ray

from actors.reward import Scores
from algos.base import Algorithm
from algos.episodes import Episode
from apps.grpo import interrupts
from apps.grpo.checkpoints import Checkpointer, LoopState
from apps.grpo.config import RunConfig
from apps.grpo.rollouts import Rollouts
from apps.grpo.run_log import RunLog
from apps.grpo.start import Actors
from apps.grpo.trackers import Trackers
from tasks.base import Problem, Task


class TrainingStopped(RuntimeError):
    """The trainer skipped ``max_skipped_steps`` updates in a row: the run cannot go on."""


def train(
    cfg: RunConfig,
    algorithm: Algorithm,
    task: Task,
    actors: Actors,
    out_dir: Path,
    console,
    resume: LoopState | None = None,
    trackers: Trackers | None = None,
) -> dict:
    """Train up to step ``cfg.steps`` (from ``resume``'s step, else from 0 after a first eval);
    one row per step in ``metrics.jsonl``. Returns the held-out accuracy at both ends."""
    n = algorithm.samples_per_prompt
    health = TrainingHealth(cfg, console)
    if resume is None:
        first_eval = evaluate(actors, task.heldout, health)
        console.print(f"eval accuracy before training: {first_eval:.3f} on {len(task.heldout)} held-out problems")
        resume = LoopState(0, 0, 0, first_eval, first_eval)
    state = resume
    batches = task.train_batches(cfg.prompts_per_step, start=state.data_cursor)
    rollouts = Rollouts(
        actors.policy,
        batches,
        lambda step, prompts: (cfg.seed * 1_000_003 + step) * prompts * n,  # disjoint seed ranges per step
        n,
        cfg.steps,
        ahead=cfg.algo.max_staleness if cfg.mode == "async" else 0,
    )
    checkpointer = Checkpointer(cfg.checkpoint, out_dir, actors, console)
    title = cfg.algo.name.upper()
    with RunLog(out_dir, console, title, cfg.steps, state.step, state.last_eval, trackers) as log:
        for step in range(state.step, cfg.steps):
            interrupts.check()  # a Ctrl-C that a library call swallowed during the last step
            t0 = time.perf_counter()
            row: dict = {"step": step}
            if step == 0:
                row["eval_accuracy"] = state.eval_accuracy_start
            elif cfg.eval_every and step % cfg.eval_every == 0:
                row["eval_accuracy"] = state.last_eval = evaluate(actors, task.heldout, health)
                row["eval_s"] = time.perf_counter() - t0

            # 1-2. Prompts -> n completions each, with their logprobs and the policy version
            # (in async mode requested steps ahead, sampled while earlier steps trained).
            rollout = rollouts.take(step)
            problems, generation, gen_s = rollout.problems, rollout.generation, rollout.wait_s
            state.data_cursor += 1

            # 3. Rewards.
            t = time.perf_counter()
            scores = score(actors, problems, generation.samples)
            reward_s = time.perf_counter() - t
            health.reward_errors(scores)

            # 4. Experience: what the algorithm's actors add, then its advantages (and returns).
            episodes = to_episodes(generation, scores.rewards)
            row.update(add_reference_and_values(actors, episodes))
            row.update(algorithm.make_experience(episodes))

            # 5. Through the replay buffer, which drops episodes older than max_staleness.
            ray.get(actors.replay.add.remote(episodes))
            batch = ray.get(actors.replay.take.remote(state.policy_version))
            if not batch:
                raise RuntimeError(
                    f"step {step}: every episode was older than algo.max_staleness={cfg.algo.max_staleness} "
                    f"versions (sampled by version {generation.version}, trainer at {state.policy_version})"
                )

            # 6. Train the policy (and the critic, at the same time).
            trained = train_step(actors, batch)
            health.updates(step, trained)

            # 7-8. Push the new weights through the store; the policy loads them in place.
            staleness = state.policy_version - generation.version
            state.policy_version += 1
            row.update(sync_weights(actors, rollouts, state.policy_version))

            gen_tokens = sum(len(e.completion_ids) for e in episodes)
            row.update(
                reward_mean=sum(scores.rewards) / len(episodes),
                accuracy_sampled=sum(scores.correct) / len(episodes),
                reward_errors=scores.errors,
                **trained,
                skipped_updates=health.skipped,
                policy_version=generation.version,
                staleness=staleness,
                replica_failures=actors.policy.failures,
                resampled=generation.resampled,
                dropped_stale=len(episodes) - len(batch),
                gen_s=gen_s,
                gen_engine_s=generation.seconds,
                reward_s=reward_s,
                completions_per_s=len(episodes) / generation.seconds,
                gen_tokens_per_s=gen_tokens / generation.seconds,
                completion_len_mean=gen_tokens / len(episodes),
                step_s=time.perf_counter() - t0,
            )
            log.step(row)
            state.step = step + 1
            if checkpointer.due(state.step, last=state.step == cfg.steps):
                checkpointer.save(state)
            else:
                checkpointer.poll()
        rollouts.finish()
        checkpointer.finish()
        final_eval = evaluate(actors, task.heldout, health)
        log.final(final_eval, state.policy_version)
    return {
        "eval_accuracy_start": state.eval_accuracy_start,
        "eval_accuracy_final": final_eval,
        "policy_version": state.policy_version,
    }


def evaluate(actors: Actors, problems: list[Problem], health: TrainingHealth) -> float:
    """Greedy accuracy on ``problems``, by the task's own verdict (no reward is computed)."""
    outputs = actors.policy.greedy([p.prompt for p in problems])
    completions, finished = [c.text for c in outputs], [c.finished for c in outputs]
    scores: Scores = ray.get(actors.reward.score.remote(problems, completions, finished, with_rewards=False))
    health.reward_errors(scores)
    return sum(scores.correct) / len(problems)


def score(actors: Actors, problems: list[Problem], samples: list[list]) -> Scores:
    """Every sample's reward (and verdict), in order: each problem's samples together."""
    flat_problems = [p for p, group in zip(problems, samples, strict=True) for _ in group]
    flat = [s for group in samples for s in group]
    return ray.get(actors.reward.score.remote(flat_problems, [s.text for s in flat], [s.finished for s in flat]))


def to_episodes(generation, rewards: list[float]) -> list[Episode]:
    """One episode per sample, each prompt's samples together, stamped with the version that
    sampled it (replicas may differ: one that came back after dying holds the newest)."""
    flat = [
        (ids, s, v)
        for ids, group, v in zip(generation.prompt_ids, generation.samples, generation.versions, strict=True)
        for s in group
    ]
    return [Episode(ids, s.token_ids, s.logprobs, r, v) for (ids, s, v), r in zip(flat, rewards, strict=True)]


def add_reference_and_values(actors: Actors, episodes: list[Episode]) -> dict[str, float]:
    """The reference model's logprobs and the critic's values, where the algorithm uses them
    (the two compute at the same time). Returns ``reference_s`` / ``critic_s`` for those that ran."""
    pending = {}
    if actors.reference is not None:
        pending["reference"] = [actors.reference.logprobs.remote(episodes)]
    if actors.critic is not None:
        pending["critic"] = actors.critic.submit_values(episodes)
    results, seconds = gather_timed(pending)
    for e, lp in zip(episodes, results.get("reference", [[None] * len(episodes)])[0], strict=True):
        e.ref_logprobs = lp
    for e, v in zip(episodes, results.get("critic", [[None] * len(episodes)])[0], strict=True):
        e.values = v
    return seconds


def train_step(actors: Actors, batch: list[Episode]) -> dict[str, float]:
    """One optimizer step of the policy's trainer and, at the same time, of the critic. The
    trainer's metrics, with ``train_s`` and ``train_tokens_per_s``; the critic's as
    ``value_loss``, ``value_*`` and ``critic_*`` (its time: ``critic_train_s``)."""
    pending = {"train": actors.trainer.submit_train_step(batch)}
    if actors.critic is not None:
        pending["critic_train"] = actors.critic.submit_train_step(batch)
    results, seconds = gather_timed(pending)
    metrics = results["train"][0]
    metrics["train_s"] = seconds["train_s"]
    metrics["train_tokens_per_s"] = metrics.pop("train_tokens") / seconds["train_s"]
    if "critic_train" in results:
        c = results["critic_train"][0]
        c.pop("train_tokens")
        metrics["value_loss"] = c.pop("loss")
        metrics.update({k if k.startswith("value_") else f"critic_{k}": v for k, v in c.items()})
        metrics["critic_train_s"] = seconds["critic_train_s"]
    return metrics


def gather_timed(pending: dict[str, list[ray.ObjectRef]]) -> tuple[dict[str, list], dict[str, float]]:
    """Every named group of refs' results, and ``<name>_s``: the seconds from now until its last
    ref was done (seen from here, so each group's own time even while they run side by side)."""
    start = time.perf_counter()
    names = {ref: name for name, refs in pending.items() for ref in refs}
    left = {name: len(refs) for name, refs in pending.items()}
    seconds, waiting = {}, list(names)
    while waiting:
        done, waiting = ray.wait(waiting, num_returns=1)
        for ref in done:
            left[names[ref]] -= 1
            if left[names[ref]] == 0:
                seconds[f"{names[ref]}_s"] = time.perf_counter() - start
    return {name: ray.get(refs) for name, refs in pending.items()}, seconds


def sync_weights(actors: Actors, rollouts: Rollouts, version: int) -> dict:
    """Push the trainer's weights as ``version`` and have the policy load them in place (in
    async mode queued behind its requests: ``update_s`` is then the last finished update's, and
    ``update_wait_s`` what the loop waited for the policy to keep within its lag)."""
    t = time.perf_counter()
    waited = rollouts.before_push()
    push = actors.trainer.push_weights(version)
    update = rollouts.update(version)
    row = {
        "weight_sync_s": time.perf_counter() - t,
        "push_s": push["push_s"],
        "push_bytes": push["bytes_written"],
        "push_bytes_reused": push["bytes_reused"],
        **update,
    }
    if rollouts.ahead:
        row["update_wait_s"] = waited
    return row


class TrainingHealth:
    """Reward errors (the first one said once) and skipped updates (too many in a row stop the run)."""

    def __init__(self, cfg: RunConfig, console) -> None:
        self.console = console
        self.limits = {"trainer": cfg.trainer.max_skipped_steps}
        critic = getattr(cfg.algo, "critic", None)
        if critic is not None:
            self.limits["critic"] = critic.max_skipped_steps
        self.in_a_row = dict.fromkeys(self.limits, 0)
        self.skipped = 0  # steps where any update was skipped, in this process

    def reward_errors(self, scores: Scores) -> None:
        if scores.first_error is not None:
            self.console.print(
                "[yellow]warning:[/] a reward call failed; the run goes on (a failed call scores "
                "task.reward_fallback and counts as not correct; each step's reward_errors counts them; this is "
                f"the first): {scores.first_error}"
            )

    def updates(self, step: int, trained: dict[str, float]) -> None:
        flags = {"trainer": trained["update_skipped"], "critic": trained.get("critic_update_skipped", 0.0)}
        self.skipped += any(flags.values())
        for who, limit in self.limits.items():
            self.in_a_row[who] = self.in_a_row[who] + 1 if flags[who] else 0
            if flags[who]:
                loss = trained["loss" if who == "trainer" else "value_loss"]
                norm = trained["grad_norm" if who == "trainer" else "critic_grad_norm"]
                self.console.print(
                    f"[yellow]warning:[/] step {step}: the {who}'s loss ({loss}) or gradient norm ({norm}) is not "
                    "finite: its update was skipped"
                )
            if self.in_a_row[who] >= limit:
                key = "trainer" if who == "trainer" else "algo.critic"
                raise TrainingStopped(
                    f"the {who} skipped {limit} updates in a row (a non-finite loss or gradient norm; "
                    f"{key}.max_skipped_steps={limit}); the weights are those of its last good step. Check the "
                    f"rewards, lower {key}.lr, or raise {key}.max_skipped_steps"
                )
