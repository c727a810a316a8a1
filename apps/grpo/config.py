"""The GRPO run's config schema (Hydra structured config) and its value checks.

The schema gives every knob its name and type; the values and their explanations live in one
place, the YAML under ``configs/`` (a top config plus groups), which Hydra merges onto this
schema. A misspelt key anywhere (YAML or command line) is an error that names the key, and a value
of the wrong type is an error that names the key and the type.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

POLICY_DTYPES = ("auto", "float32", "bfloat16", "float16")
TRAIN_DTYPES = ("float32", "bfloat16", "float16")
KL_MODES = ("loss", "reward")
DATA_PLANES = ("shm", "redis")
REFERENCE_DEVICES = ("auto", "cpu", "gpu")


@dataclass
class ModelConfig:
    path: str | None = MISSING
    tiny_cache_dir: str | None = MISSING


@dataclass
class PolicyConfig:
    tp: int = MISSING
    dtype: str = MISSING
    max_model_len: int = MISSING
    kv_cache_mib: int = MISSING
    enforce_eager: bool = MISSING
    temperature: float = MISSING
    max_tokens: int = MISSING
    omp_threads_bind: str | None = MISSING


@dataclass
class TrainerConfig:
    ranks: int = MISSING
    lr: float = MISSING
    lr_schedule: str = MISSING
    min_lr_ratio: float = MISSING
    warmup_steps: int = MISSING
    weight_decay: float = MISSING
    max_grad_norm: float = MISSING
    micro_batch_size: int | None = MISSING
    param_dtype: str = MISSING
    reduce_dtype: str = MISSING
    torch_threads: int = MISSING


@dataclass
class AlgoConfig:
    group_size: int = MISSING
    advantage_std_norm: bool = MISSING
    clip_eps: float = MISSING
    clip_eps_high: float | None = MISSING
    kl_coef: float = MISSING
    reference_device: str = MISSING
    kl_estimator: str = MISSING
    kl_mode: str = MISSING
    loss_aggregation: str = MISSING
    length_normalizer: int | None = MISSING
    tis_cap: float | None = MISSING
    max_staleness: int = MISSING


@dataclass
class TaskConfig:
    low: int = MISSING
    high: int = MISSING
    ops: list[str] = MISSING
    eval_size: int = MISSING
    format_reward: float = MISSING


@dataclass
class RedisConfig:
    url: str | None = MISSING


@dataclass
class RayConfig:
    address: str | None = MISSING
    log_to_driver: bool = MISSING


@dataclass
class WeightSyncConfig:
    data_plane: str = MISSING
    shm_root: str = MISSING
    keep_last: int = MISSING
    checksums: bool = MISSING
    verify: bool = MISSING
    delta: bool = MISSING
    delta_max_live: float = MISSING
    delta_elements: bool = MISSING


@dataclass
class CheckpointConfig:
    every: int = MISSING
    keep_last: int = MISSING
    async_save: bool = MISSING


@dataclass
class GRPOConfig:
    run_name: str = MISSING
    output_dir: str = MISSING
    overwrite: bool = MISSING
    resume: bool = MISSING
    steps: int = MISSING
    prompts_per_step: int = MISSING
    eval_every: int = MISSING
    seed: int = MISSING
    model: ModelConfig = field(default_factory=ModelConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    weightsync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def register() -> None:
    ConfigStore.instance().store(name="grpo_schema", node=GRPOConfig)


class ConfigError(ValueError):
    pass


def _schema_keys(node: type = None, prefix: str = "") -> dict[str, list[str]]:
    """Each config group path ("" for the top) -> the keys allowed in it."""
    node = node or GRPOConfig
    out = {prefix: []}
    for f in dataclasses.fields(node):
        out[prefix].append(f.name)
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub):
            out.update(_schema_keys(sub, f"{prefix}{f.name}."))
    return out


def check_override_keys(args: list[str]) -> None:
    """Reject command-line overrides of unknown keys, naming the allowed ones and the closest.

    Hydra would reject them too, but without saying what is allowed. Hydra's own flags and
    ``hydra.*``, ``+key``/``~key`` overrides are left to Hydra.
    """
    groups = _schema_keys()
    for arg in args:
        if arg.startswith(("-", "+", "~", "hydra.", "hydra/")) or "=" not in arg:
            continue
        key = arg.split("=", 1)[0]
        parent, _, leaf = key.rpartition(".")
        parent = f"{parent}." if parent else ""
        if parent in groups and leaf in groups[parent]:
            continue
        if parent not in groups:
            allowed = sorted(k.rstrip(".") for k in groups if k)
            group = parent.rstrip(".")
            raise ConfigError(f"unknown config key {key!r}: {group!r} is not a config group; groups: {allowed}")
        close = difflib.get_close_matches(leaf, groups[parent], n=1)
        hint = f" Did you mean {parent + close[0]!r}?" if close else ""
        raise ConfigError(
            f"unknown config key {key!r}; allowed keys{' in ' + parent.rstrip('.') if parent else ''}: "
            f"{sorted(groups[parent])}.{hint}"
        )


def validate(cfg) -> None:
    """Check values that the types alone do not; the message names the key and what is allowed."""
    from algos.grpo import KL_ESTIMATORS, LOSS_AGGREGATIONS  # imports torch: not at module level
    from algos.schedule import LR_SCHEDULES

    checks = [
        (cfg.steps >= 1, "steps", "an integer >= 1"),
        (cfg.prompts_per_step >= 1, "prompts_per_step", "an integer >= 1"),
        (cfg.eval_every >= 0, "eval_every", "an integer >= 0 (0: only before and after training)"),
        (cfg.policy.tp >= 1, "policy.tp", "an integer >= 1"),
        (cfg.policy.dtype in POLICY_DTYPES, "policy.dtype", f"one of {list(POLICY_DTYPES)}"),
        (cfg.policy.temperature > 0, "policy.temperature", "a number > 0"),
        (cfg.policy.max_tokens >= 1, "policy.max_tokens", "an integer >= 1"),
        (cfg.policy.kv_cache_mib >= 1, "policy.kv_cache_mib", "an integer >= 1"),
        (cfg.trainer.ranks >= 1, "trainer.ranks", "an integer >= 1"),
        (cfg.trainer.lr > 0, "trainer.lr", "a number > 0"),
        (cfg.trainer.lr_schedule in LR_SCHEDULES, "trainer.lr_schedule", f"one of {list(LR_SCHEDULES)}"),
        (0 <= cfg.trainer.min_lr_ratio <= 1, "trainer.min_lr_ratio", "a number within [0, 1]"),
        (cfg.trainer.param_dtype in TRAIN_DTYPES, "trainer.param_dtype", f"one of {list(TRAIN_DTYPES)}"),
        (cfg.trainer.reduce_dtype in TRAIN_DTYPES, "trainer.reduce_dtype", f"one of {list(TRAIN_DTYPES)}"),
        (cfg.trainer.warmup_steps >= 0, "trainer.warmup_steps", "an integer >= 0"),
        (cfg.trainer.max_grad_norm > 0, "trainer.max_grad_norm", "a number > 0"),
        (
            cfg.trainer.micro_batch_size is None or cfg.trainer.micro_batch_size >= 1,
            "trainer.micro_batch_size",
            "null (the whole batch) or an integer >= 1",
        ),
        (cfg.trainer.torch_threads >= 1, "trainer.torch_threads", "an integer >= 1"),
        (cfg.algo.group_size >= 2, "algo.group_size", "an integer >= 2 (GRPO compares samples within a group)"),
        (cfg.algo.clip_eps > 0, "algo.clip_eps", "a number > 0"),
        (cfg.algo.kl_coef >= 0, "algo.kl_coef", "a number >= 0"),
        (cfg.algo.reference_device in REFERENCE_DEVICES, "algo.reference_device", f"one of {list(REFERENCE_DEVICES)}"),
        (cfg.algo.clip_eps_high is None or cfg.algo.clip_eps_high > 0, "algo.clip_eps_high", "null or a number > 0"),
        (cfg.algo.kl_estimator in KL_ESTIMATORS, "algo.kl_estimator", f"one of {list(KL_ESTIMATORS)}"),
        (cfg.algo.kl_mode in KL_MODES, "algo.kl_mode", f"one of {list(KL_MODES)}"),
        (cfg.algo.loss_aggregation in LOSS_AGGREGATIONS, "algo.loss_aggregation", f"one of {list(LOSS_AGGREGATIONS)}"),
        (
            cfg.algo.length_normalizer is None or cfg.algo.length_normalizer >= 1,
            "algo.length_normalizer",
            "null (policy.max_tokens) or an integer >= 1",
        ),
        (cfg.algo.tis_cap is None or cfg.algo.tis_cap > 0, "algo.tis_cap", "null (off) or a number > 0"),
        (cfg.algo.max_staleness >= 0, "algo.max_staleness", "an integer >= 0"),
        (cfg.weightsync.keep_last >= 1, "weightsync.keep_last", "an integer >= 1"),
        (cfg.weightsync.data_plane in DATA_PLANES, "weightsync.data_plane", f"one of {list(DATA_PLANES)}"),
        (
            cfg.weightsync.checksums or not cfg.weightsync.verify,
            "weightsync.verify",
            "false when weightsync.checksums=false (there is nothing to verify)",
        ),
        (
            cfg.weightsync.checksums or not cfg.weightsync.delta,
            "weightsync.delta",
            "false when weightsync.checksums=false (delta sync finds changed chunks by their checksums)",
        ),
        (cfg.weightsync.delta_max_live >= 1, "weightsync.delta_max_live", "a number >= 1"),
        (
            cfg.weightsync.delta or not cfg.weightsync.delta_elements,
            "weightsync.delta_elements",
            "false unless weightsync.delta=true (element patches are a form of delta sync)",
        ),
        (cfg.checkpoint.every >= 0, "checkpoint.every", "an integer >= 0 (0: no checkpoints)"),
        (cfg.checkpoint.keep_last >= 1, "checkpoint.keep_last", "an integer >= 1"),
        (
            bool(str(cfg.run_name).strip()) and not {"/", ":"} & set(str(cfg.run_name)),
            "run_name",
            "a non-empty name without '/' or ':'",
        ),
    ]
    for ok, key, allowed in checks:
        if not ok:
            value = cfg
            for part in key.split("."):
                value = value[part]
            raise ConfigError(f"config key {key}={value!r} is invalid: expected {allowed}")
