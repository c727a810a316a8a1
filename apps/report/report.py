"""A finished (or running) run's report from its folder: ``report.png`` (reward, eval accuracy,
KL, the policy's logprob agreement with the trainer, and where each step's time went) and
``report.md`` (what ran, both ends of the eval, median phase times). Reads ``metrics.jsonl`` and
``config.yaml`` only, so it works on any run folder, also one copied from another machine."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

# The phases of a step, in the order they run, by metric key; "other" is the rest of step_s.
PHASES = {
    "eval": "eval_s",
    "generate": "gen_s",
    "reward": "reward_s",
    "reference / critic values": "experience_s",
    "train": "train_s",
    "weight sync": "weight_sync_s",
}


@dataclass
class Run:
    folder: Path
    rows: list[dict]  # one per finished step, in step order
    final: dict | None  # the closing row (final eval), None while the run goes on or if it stopped early
    config: dict  # the resolved config.yaml, {} if missing

    @property
    def name(self) -> str:
        return self.folder.name

    def evals(self) -> list[tuple[int, float]]:
        """(step, held-out accuracy) at every eval, the final one included."""
        points = [(r["step"], r["eval_accuracy"]) for r in self.rows if "eval_accuracy" in r]
        if self.final is not None:
            points.append((self.final["step"], self.final["eval_accuracy"]))
        return points


def load_run(folder: str | Path) -> Run:
    """The run in ``folder``; a ``ValueError`` saying what is missing if it is not a run folder."""
    folder = Path(folder)
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file():
        where = "no such folder" if not folder.is_dir() else "it has no metrics.jsonl"
        raise ValueError(f"{folder} is not a run folder ({where}); pass outputs/<run_name>")
    rows, final = [], None
    lines = metrics.read_text().splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines):
                break  # a last line cut off by a crash while it was written
            raise ValueError(f"{metrics}:{i} is not JSON: {e}") from e
        if row.get("final"):
            final = row
        else:
            rows.append(row)
    if not rows:
        raise ValueError(f"{metrics} holds no finished step yet")
    config = {}
    if (folder / "config.yaml").is_file():
        from omegaconf import OmegaConf

        config = OmegaConf.to_container(OmegaConf.load(folder / "config.yaml"))
    return Run(folder, rows, final, config)


def step_phases(row: dict) -> dict[str, float]:
    """A step's seconds by phase (only those it has), plus ``other``: the rest of ``step_s``."""
    out = {}
    for name, key in PHASES.items():
        if key == "experience_s":
            value = max(row.get("reference_s", 0.0), row.get("critic_s", 0.0))  # they run side by side
        else:
            value = row.get(key, 0.0)
        out[name] = value
    out["other"] = max(row["step_s"] - sum(out.values()), 0.0)
    return out


def median_phases(run: Run) -> dict[str, float]:
    """Each phase's median seconds per step over the run (eval: over eval steps only)."""
    per_step = [step_phases(r) for r in run.rows]
    out = {}
    for name in [*PHASES, "other"]:
        values = [p[name] for p, r in zip(per_step, run.rows) if name != "eval" or "eval_s" in r]
        if values and any(values):
            out[name] = statistics.median(values)
    return out


def plot(run: Run, path: Path) -> Path:
    """``report.png``: six panels over the run's steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in run.rows]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5), constrained_layout=True)
    algo = run.config.get("algo", {}).get("name", "?")
    task = run.config.get("task", {}).get("name", "?")
    fig.suptitle(f"run {run.name}: {algo} on {task}, {len(steps)} steps", fontsize=14)

    ax = axes[0, 0]
    ax.plot(steps, [r["reward_mean"] for r in run.rows], lw=1, label="reward (mean of samples)")
    ax.plot(steps, [r["accuracy_sampled"] for r in run.rows], lw=1, alpha=0.7, label="sampled accuracy")
    _label(ax, "Reward", "per step")

    ax = axes[0, 1]
    evals = run.evals()
    ax.plot([s for s, _ in evals], [a for _, a in evals], marker="o", lw=1.5)
    for s, a in (evals[0], evals[-1]) if evals else ():
        ax.annotate(f"{a:.3f}", (s, a), textcoords="offset points", xytext=(0, 8), ha="center")
    ax.set_ylim(0, 1)
    _label(ax, "Held-out accuracy (greedy)", "accuracy")

    ax = axes[0, 2]
    ax.plot(steps, [r["kl"] for r in run.rows], lw=1, label="KL to the reference")
    ax.plot(steps, [r.get("entropy", float("nan")) for r in run.rows], lw=1, alpha=0.7, label="entropy")
    _label(ax, "KL and entropy", "nats per token")

    ax = axes[1, 0]
    ax.semilogy(steps, [max(r["logprob_diff_mean"], 1e-12) for r in run.rows], lw=1, label="mean")
    ax.semilogy(steps, [max(r.get("logprob_diff_max", 0.0), 1e-12) for r in run.rows], lw=1, alpha=0.6, label="max")
    _label(ax, "|vLLM - trainer| logprob of sampled tokens", "absolute difference")

    ax = axes[1, 1]
    phases = [step_phases(r) for r in run.rows]
    names = [n for n in [*PHASES, "other"] if any(p[n] for p in phases)]
    ax.stackplot(steps, *[[p[n] for p in phases] for n in names], labels=names)
    _label(ax, "Where each step's time went", "seconds")
    totals = sorted(sum(p.values()) for p in phases)
    typical = totals[int(0.95 * (len(totals) - 1))]
    if totals[-1] > 2 * typical > 0:  # a slow first step (warm-up) or eval would flatten the rest
        ax.set_ylim(0, 2 * typical)
        ax.set_xlabel(f"step (the slowest, {totals[-1]:.1f} s, is cut off)")

    ax = axes[1, 2]
    if "value_loss" in run.rows[0]:
        ax.plot(steps, [r["explained_variance"] for r in run.rows], lw=1, label="critic explained variance")
        ax.plot(steps, [r["value_loss"] for r in run.rows], lw=1, label="value loss")
        _label(ax, "Critic", "")
    else:
        ax.plot(steps, [r["grad_norm"] for r in run.rows], lw=1, label="grad norm (before clipping)")
        ax.plot(steps, [r["clip_frac"] for r in run.rows], lw=1, label="ratio clip fraction")
        _label(ax, "Policy update", "")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _label(ax, title: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("step")
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")


def summary(run: Run) -> str:
    """``report.md``'s text."""
    cfg = run.config
    algo, task, policy = cfg.get("algo", {}), cfg.get("task", {}), cfg.get("policy", {})
    samples = algo.get("group_size", algo.get("samples_per_prompt", "?"))
    lines = [
        f"# Run {run.name}",
        "",
        f"- algorithm: {algo.get('name', '?')}; task: {task.get('name', '?')}; "
        f"model: {cfg.get('model', {}).get('path', '?')}",
        f"- {len(run.rows)} of {cfg.get('steps', '?')} steps; {cfg.get('prompts_per_step', '?')} prompts x "
        f"{samples} samples per step; lr {cfg.get('trainer', {}).get('lr', '?')}; "
        f"policy TP {policy.get('tp', '?')}, trainer ranks {cfg.get('trainer', {}).get('ranks', '?')}",
    ]
    evals = run.evals()
    if evals:
        (s0, a0), (s1, a1) = evals[0], evals[-1]
        state = "final" if run.final is not None else "last so far"
        lines.append(
            f"- held-out accuracy: {a0:.3f} at step {s0} -> {a1:.3f} at step {s1} "
            f"({state}, {(a1 - a0) * 100:+.1f} points)"
        )
    errors = sum(r.get("reward_errors", 0) for r in run.rows)
    skipped = run.rows[-1].get("skipped_updates", 0)
    lines.append(f"- reward errors: {errors}; skipped updates: {skipped}")
    lines += ["", "| phase | median s per step |", "| --- | --- |"]
    medians = median_phases(run)
    for name, seconds in medians.items():
        note = " (eval steps)" if name == "eval" else ""
        lines.append(f"| {name}{note} | {seconds:.3f} |")
    lines += [f"| **step** | **{statistics.median(r['step_s'] for r in run.rows):.3f}** |", ""]
    rates = [
        ("completions_per_s", "completions / s (generation)"),
        ("gen_tokens_per_s", "generated tokens / s"),
        ("train_tokens_per_s", "trained tokens / s"),
    ]
    for key, label in rates:
        values = [r[key] for r in run.rows if key in r]
        if values:
            lines.append(f"- {label}: {statistics.median(values):.0f} (median)")
    lines += ["", "![report](report.png)", ""]
    return "\n".join(lines)


def write_report(folder: str | Path) -> tuple[Path, Path]:
    """``report.png`` and ``report.md`` in the run's folder; their paths."""
    run = load_run(folder)
    png = plot(run, run.folder / "report.png")
    md = run.folder / "report.md"
    md.write_text(summary(run))
    return png, md
