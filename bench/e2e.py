"""End-to-end benchmark: ``python -m bench.e2e [--steps 150] [--systems rlsys,rlsys-async,trl] [--seeds 0,1,2]``.

Our GRPO (``python -m apps.grpo``) against TRL's ``GRPOTrainer`` (``bench/trl_grpo.py``), one
after the other in one run on this machine, on the embedded tiny model and the arithmetic task
with the same settings: prompts per step, group size, max tokens, temperature, learning rate
(constant), gradient clipping, loss aggregation (``token_mean`` = TRL's ``dapo``), clip epsilon,
group-std advantage scaling, no KL, one optimizer step per generated batch, the same prompts in
the same order, the same number of steps. Each system runs in a process of its own; for each:

- ``median_step_s``: median wall seconds of a training step (ours: ``step_s`` of
  ``metrics.jsonl``, which includes the weight sync; TRL: its trainer's step, generation included);
- ``completions_per_s``: completions per step / ``median_step_s``;
- ``wall_s``: the whole process, start-up included (ours: Ray, Redis and the vLLM engine; TRL:
  loading the model), and ``train_s``: the training steps alone;
- ``heldout_accuracy``: greedy accuracy of the final model on the task's held-out problems,
  scored for both by the same code (``apps.eval``: vLLM greedy, the task's verdict);
- ``peak_rss_mib``: the peak of the summed RSS of the process and all its children (ours: Ray's
  processes, the vLLM engine, Redis), sampled every 0.2 s;
- ours also: the median of each phase (``gen_s``, ``reward_s``, ``train_s``, ``push_s``,
  ``update_s``), which says where a step's time goes, and how busy each side is (median over
  steps of the policy's generation + update time, and of the trainer's train + push time, over
  the step's wall time).

Systems: ``rlsys`` (``mode=sync``), ``rlsys-async`` (``mode=async algo.max_staleness=1``: the
next batch is sampled while a step trains; at 136m also ``trainer.idle_policy_threads=1``),
``rlsys-async-bf16`` (the same with ``policy.dtype=bfloat16``: the engine samples in bfloat16
while the trainer keeps float32, as GPU runs do by default; the loss's importance ratio corrects
for the rollout logprobs being bfloat16's) and ``trl``. Each row records the overrides its run
used.

``--seeds``: at the scales that measure accuracy each system runs once per seed (the run's
``seed``: its prompts' order and sampling, on both sides; every seed starts from the same model,
the one the config's seed builds), a row each, and the table is followed by each system's mean
held-out accuracy over the seeds and its spread (one seed's accuracy is within the run-to-run
spread of a comparison); other scales run the first seed only. Without it: the config's seed,
once.

Needs the ``bench`` extra (TRL): ``pip install -e '.[bench]'``. Prints a table and writes
``bench/results/e2e.json`` (a list, one object per system and scale).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "e2e.json"
PHASES = ("gen_s", "gen_engine_s", "reward_s", "train_s", "push_s", "update_s")
TRL_LOSS = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum_norm": "dr_grpo"}


class PeakRss:
    """The peak summed RSS of a process and its descendants, sampled in a thread."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        self.root = psutil.Process(pid)
        self.peak = 0
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0
            for p in procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    total += p.memory_info().rss
            self.peak = max(self.peak, total)
            self._stop.wait(self.every_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_measured(cmd: list[str], log: Path) -> tuple[float, int]:
    """Run ``cmd`` from the repository root, its output into ``log``; returns its wall seconds
    and peak RSS in bytes. A failed command stops the benchmark, naming its log."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"}
        )
        rss = PeakRss(proc.pid)
        code = proc.wait()
    peak = rss.stop()
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-20:])
        raise SystemExit(f"bench.e2e: {' '.join(cmd[:3])} failed (exit {code}); its log: {log}\n{tail}")
    return time.perf_counter() - t0, peak


@dataclass
class Scale:
    name: str
    steps: int
    settings: list[str]  # apps.grpo overrides beyond the defaults
    accuracy: bool  # held-out accuracy means something (a trained model, not random weights)
    async_settings: tuple[str, ...] = ()  # what rlsys-async adds at this scale

    def overrides(self, seed: int | None = None) -> list[str]:
        seeded = [] if seed is None else [f"seed={seed}"]
        return [f"steps={self.steps}", "eval_every=0", "checkpoint.every=0", *self.settings, *seeded]

    def ours(self, system: str, seed: int | None = None, model_path: str | None = None) -> list[str]:
        """apps.grpo overrides of one of our systems at this scale (``model_path``: the model the
        run starts from where a seed would otherwise build a tiny model of its own)."""
        async_settings = self.async_settings if system.startswith("rlsys-async") else ()
        start = [] if seed is None or model_path is None else [f"model.path={model_path}"]
        return [*self.overrides(seed), *OURS[system], *async_settings, *start]

    def seeds(self, seeds: list[int] | None) -> list[int | None]:
        """The seeds this scale runs: all of them where it measures accuracy, else the first."""
        if not seeds:
            return [None]
        return list(seeds) if self.accuracy else seeds[:1]


def run_name(system: str, scale: Scale, seed: int | None) -> str:
    return f"{system}-{scale.name}" + ("" if seed is None else f"-seed{seed}")


def scales(names: list[str], steps: int, steps_136m: int) -> list[Scale]:
    """``tiny``: the default run's settings (64 prompts x 8 samples, <= 6 tokens, lr 2e-4,
    temperature 1, no KL). ``136m``: bench.rollout's synthetic Qwen3-shaped model (random
    weights, EOS rare, so completions run to the limit on both sides), 8 prompts x 4 samples,
    16 tokens: throughput only."""
    out = []
    for name in names:
        if name == "tiny":
            out.append(Scale("tiny", steps, [], True))
        elif name == "136m":
            from bench.rollout import synthetic_136m_dir

            model = f"model.path={synthetic_136m_dir()}"
            out.append(
                Scale(
                    "136m",
                    steps_136m,
                    [model, "prompts_per_step=8", "algo.group_size=4", "policy.max_tokens=16"],
                    False,
                    # The trainer's step is long next to the engine's sampling here: it takes the
                    # engine's core while the engine waits (actors.engine_activity).
                    ("trainer.idle_policy_threads=1",),
                )
            )
        else:
            raise SystemExit(f"bench.e2e: unknown scale {name!r}; scales: tiny, 136m")
    return out


OURS = {  # system -> apps.grpo overrides
    "rlsys": [],
    "rlsys-async": ["mode=async", "algo.max_staleness=1"],
    "rlsys-async-bf16": ["mode=async", "algo.max_staleness=1", "policy.dtype=bfloat16"],
}


def run_ours(
    work: Path, scale: Scale, system: str = "rlsys", seed: int | None = None, model_path: str | None = None
) -> dict:
    out = work / "outputs"
    name = run_name(system, scale, seed)
    wall_s, peak = run_measured(
        [
            sys.executable,
            "-m",
            "apps.grpo",
            *scale.ours(system, seed, model_path),
            f"output_dir={out}",
            f"run_name={name}",
        ],
        work / f"{name}.log",
    )
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if not r.get("final")]
    step_s = [r["step_s"] for r in steps_rows]
    busy = {
        "policy": statistics.median((r["gen_engine_s"] + r.get("update_s", 0.0)) / r["step_s"] for r in steps_rows),
        "trainer": statistics.median((r["train_s"] + r["push_s"]) / r["step_s"] for r in steps_rows),
    }
    return {
        "mode": ("async, max_staleness 1" if system.startswith("rlsys-async") else "sync")
        + (", vLLM generation in bfloat16" if system.endswith("-bf16") else ", vLLM generation"),
        "step_s": step_s,
        "completion_len_mean": statistics.mean(r["completion_len_mean"] for r in steps_rows),
        "phases": {k: statistics.median(r[k] for r in steps_rows if k in r) for k in PHASES},
        "busy": busy,
        "wall_s": wall_s,
        "train_s": sum(step_s),
        "peak_rss": peak,
        "model_dir": out / name / "hf",
    }


def run_trl(work: Path, scale: Scale, model_path: str, seed: int | None = None) -> dict:
    from apps.grpo.config import compose_config

    cfg = compose_config(*scale.overrides(seed))
    name = run_name("trl", scale, seed)
    settings = {
        "output_dir": str(work / name),
        "model_path": model_path,
        "overrides": scale.overrides(seed),
        "threads": os.cpu_count(),
        "loss_type": TRL_LOSS[cfg.algo.loss_aggregation],
    }
    (work / f"{name}.json").write_text(json.dumps(settings))
    cmd = [sys.executable, "-m", "bench.trl_grpo", str(work / f"{name}.json")]
    wall_s, peak = run_measured(cmd, work / f"{name}.log")
    times = json.loads((work / name / "steps.json").read_text())
    return {
        "mode": "GRPOTrainer, transformers generate (use_vllm=False), one process",
        "step_s": times["step_s"],
        "completion_len_mean": times["completion_len_mean"],
        "phases": {},
        "wall_s": wall_s,
        "train_s": times["train_s"],
        "peak_rss": peak,
        "model_dir": work / name / "hf",
    }


def heldout_accuracy(model_dir: Path) -> float:
    """Greedy held-out accuracy by ``apps.eval``: the same code scores every system."""
    from rich.console import Console

    from apps.eval.__main__ import evaluate_model
    from apps.grpo.config import compose_config

    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115
    return evaluate_model(compose_config(f"model.path={model_dir}"), quiet)["accuracy"]


def _cell(value) -> str:
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def table(rows: list[dict]) -> str:
    seeded = ["seed"] if any(r.get("seed") is not None for r in rows) else []
    cols = ["system", "scale", *seeded, "median_step_s", "completions_per_s", "completion_len_mean", "train_s"]
    cols += ["wall_s", "heldout_accuracy", "peak_rss_mib"]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for r in rows:
        lines.append(" | ".join(_cell(r[c]) for c in cols))
    return "\n".join(lines)


def accuracy_over_seeds(rows: list[dict]) -> list[str]:
    """Per system and scale run with several seeds: the mean held-out accuracy, its spread
    (sample standard deviation) and the seeds' own."""
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if r.get("seed") is not None and r["heldout_accuracy"] is not None:
            runs.setdefault((r["system"], r["scale"]), []).append(r)
    lines = []
    for (system, scale), group in runs.items():
        if len(group) < 2:
            continue
        accs = [r["heldout_accuracy"] for r in group]
        each = ", ".join(f"seed {r['seed']}: {r['heldout_accuracy']:.3f}" for r in group)
        lines.append(
            f"{system} {scale} held-out accuracy over {len(accs)} seeds: mean {statistics.mean(accs):.3f}, "
            f"sd {statistics.stdev(accs):.3f} ({each})"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--scales", default="tiny,136m")
    parser.add_argument("--steps", type=int, default=150, help="steps at the tiny scale")
    parser.add_argument("--steps-136m", type=int, default=6)
    parser.add_argument("--systems", default="rlsys,rlsys-async,rlsys-async-bf16,trl")
    parser.add_argument(
        "--seeds", default="", help="comma-separated run seeds (accuracy scales run each); default: the config's"
    )
    parser.add_argument("--work", default=str(REPO / "outputs" / "bench-e2e"), help="logs and models (replaced)")
    args = parser.parse_args(argv)
    systems = args.systems.split(",")
    try:
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else []
    except ValueError:
        print(f"bench.e2e: --seeds takes comma-separated integers, not {args.seeds!r}", file=sys.stderr)
        return 2
    unknown = set(systems) - {*OURS, "trl"}
    if unknown:
        print(f"bench.e2e: unknown systems {sorted(unknown)}; systems: {', '.join([*OURS, 'trl'])}", file=sys.stderr)
        return 2
    if "trl" in systems:
        try:
            import trl  # noqa: F401
        except ImportError:
            print("bench.e2e needs TRL: pip install -e '.[bench]'", file=sys.stderr)
            return 2
    from apps.grpo.config import compose_config
    from apps.grpo.inputs import resolve_model_path

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rows = []
    for scale in scales(args.scales.split(","), args.steps, args.steps_136m):
        cfg = compose_config(*scale.overrides())
        model_path = resolve_model_path(cfg)  # the tiny model is built once, untimed
        per_step = cfg.prompts_per_step * cfg.algo.group_size
        for seed, system in itertools.product(scale.seeds(seeds), systems):
            seeded = "" if seed is None else f", seed {seed}"
            print(f"bench.e2e: {system} at {scale.name} scale, {scale.steps} steps{seeded}...", flush=True)
            if system in OURS:
                result = run_ours(work, scale, system, seed, model_path)
            else:
                result = run_trl(work, scale, model_path, seed)
            median = statistics.median(result["step_s"])
            rows.append(
                {
                    "system": system,
                    "scale": scale.name,
                    "seed": seed,
                    "mode": result["mode"],
                    "overrides": scale.ours(system, seed, model_path) if system in OURS else scale.overrides(seed),
                    "steps": scale.steps,
                    "completions_per_step": per_step,
                    "max_tokens": cfg.policy.max_tokens,
                    "completion_len_mean": result["completion_len_mean"],
                    "median_step_s": median,
                    "completions_per_s": per_step / median,
                    "train_s": result["train_s"],
                    "wall_s": result["wall_s"],
                    "heldout_accuracy": heldout_accuracy(result["model_dir"]) if scale.accuracy else None,
                    "peak_rss_mib": round(result["peak_rss"] / 2**20),
                    "median_phase_s": result["phases"],
                    "busy_fraction": result.get("busy"),
                    "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                }
            )
    print(table(rows))
    for r in rows:
        if r["median_phase_s"]:
            busy = ", ".join(f"{side} {share:.0%}" for side, share in r["busy_fraction"].items())
            phases = ", ".join(f"{k} {v:.3f}" for k, v in r["median_phase_s"].items())
            print(f"{r['system']} {r['scale']} median phases (s): {phases}; busy: {busy}")
    for line in accuracy_over_seeds(rows):
        print(line)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
