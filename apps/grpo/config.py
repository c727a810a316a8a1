"""The run's config: its schema (Hydra structured config), loading it into typed groups, checks.

The schema gives every knob its name and type; the values and their explanations live in one
place, the YAML under ``configs/`` (a top config plus groups), which Hydra merges onto this
schema. ``algo`` and ``task`` are chosen by name (``algo=ppo``, ``task=dataset``): their keys are
those of the chosen module's ``Config`` (``algos/<name>.py``, ``tasks/<name>.py``).

``load_config`` turns Hydra's config into typed dataclasses (each group passed whole to the
actors that use it) and checks every value once (``validation.config``). A misspelt key anywhere
(YAML or command line), a value of the wrong type or an invalid value is an error that names the
key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from actors.config import PolicyConfig
from algos.base import AlgoConfig, algorithm_class
from algos.train_config import TrainerConfig
from apps.grpo.gpu_layout import PlacementConfig
from apps.grpo.trackers import WandbConfig, logger_names
from tasks.base import TaskConfig, task_class
from validation.config import ConfigError, check_config
from weightsync.config import WeightSyncConfig

__all__ = ["ConfigError", "RunConfig", "check_override_keys", "compose_config", "load_config", "register"]

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


@dataclass
class ModelConfig:
    path: str | None
    tiny_cache_dir: str | None


@dataclass
class RedisConfig:
    url: str | None


@dataclass
class RayConfig:
    address: str | None
    log_to_driver: bool


@dataclass
class CheckpointConfig:
    every: int
    keep_last: int
    async_save: bool

    def rules(self) -> list[tuple[bool, str, str]]:
        return [
            (self.every >= 0, "every", "an integer >= 0 (0: no checkpoints)"),
            (self.keep_last >= 1, "keep_last", "an integer >= 1"),
        ]


MODES = ("sync", "async")


@dataclass
class RunConfig:
    run_name: str
    output_dir: str
    overwrite: bool
    resume: bool
    steps: int
    prompts_per_step: int
    mode: str  # sync | async (see configs/grpo.yaml)
    eval_every: int
    seed: int
    model: ModelConfig
    policy: PolicyConfig
    trainer: TrainerConfig
    algo: Any  # the chosen algorithm's Config (algos/<algo.name>.py)
    task: Any  # the chosen task's Config (tasks/<task.name>.py)
    redis: RedisConfig
    ray: RayConfig
    weightsync: WeightSyncConfig
    checkpoint: CheckpointConfig
    placement: PlacementConfig
    logger: Any  # [], a name or a list of names (apps/grpo/trackers.py)
    wandb: WandbConfig

    def rules(self) -> list[tuple[bool, str, str]]:
        return [
            (self.steps >= 1, "steps", "an integer >= 1"),
            (self.prompts_per_step >= 1, "prompts_per_step", "an integer >= 1"),
            (self.mode in MODES, "mode", f"one of {list(MODES)}"),
            (
                self.mode != "async" or self.algo.max_staleness >= 1,
                "algo.max_staleness",
                "an integer >= 1 with mode=async (the batch generated while a step trains is sampled by weights "
                "at least one version old)",
            ),
            (
                self.mode != "async" or self.weightsync.keep_last >= self.algo.max_staleness,
                "weightsync.keep_last",
                f"at least algo.max_staleness ({self.algo.max_staleness}) with mode=async (the versions the "
                "policy has yet to load stay in the store)",
            ),
            (
                self.placement.layout != "colocated" or self.policy.tp == 1,
                "placement.layout",
                "separate with policy.tp > 1 (a colocated replica shares one GPU with a trainer rank, "
                "through Ray's fractional GPUs, which exist only below one GPU)",
            ),
            (self.eval_every >= 0, "eval_every", "an integer >= 0 (0: only before and after training)"),
            (
                bool(str(self.run_name).strip()) and not {"/", ":"} & set(str(self.run_name)),
                "run_name",
                "a non-empty name without '/' or ':'",
            ),
        ]


def register() -> None:
    ConfigStore.instance().store(name="grpo_schema", node=RunConfig)


def _group_class(group: str, name: Any) -> type:
    """The Config dataclass of the chosen algorithm or task (``ConfigError`` for an unknown name)."""
    find = algorithm_class if group == "algo" else task_class
    try:
        return find(str(name)).Config
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _typed(node: Any, cls: type, key: str):
    """``node`` (a config group's values) as an instance of ``cls``, type-checked by OmegaConf."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), node))
    except OmegaConfBaseException as e:
        where = ".".join(k for k in (key, getattr(e, "full_key", None)) if k)
        raise ConfigError(f"config key {where}: {str(e.msg).splitlines()[0]}") from None


def load_config(cfg: DictConfig) -> RunConfig:
    """Hydra's composed config as a checked ``RunConfig`` whose ``algo`` and ``task`` are the
    chosen modules' ``Config`` instances; ``ConfigError`` names the first bad key."""
    groups = {}
    for group, base in (("algo", AlgoConfig), ("task", TaskConfig)):
        node = cfg[group]
        if not isinstance(node, DictConfig) or "name" not in node:
            raise ConfigError(f"config group {group} needs a 'name' key: the module in {group}s/ (e.g. {group}=...)")
        groups[group] = _typed(node, _group_class(group, node.name), group)
        assert isinstance(groups[group], base)
    run = dataclasses.replace(_typed(cfg, RunConfig, ""), **groups)
    check_config(run)
    logger_names(run.logger)
    return run


def compose_config(*overrides: str) -> RunConfig:
    """The checked config of ``configs/grpo.yaml`` with command-line style ``overrides`` (for
    tests and benchmarks; a run gets its config from Hydra's ``main``)."""
    from hydra import compose, initialize_config_dir

    register()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        return load_config(compose("grpo", overrides=list(overrides)))


def _default_choice(group: str) -> str:
    for item in OmegaConf.load(CONFIG_DIR / "grpo.yaml").defaults:
        if isinstance(item, DictConfig) and group in item:
            return str(item[group])
    raise ConfigError(f"configs/grpo.yaml chooses no {group}")


def _schema_keys(node: type, prefix: str = "") -> dict[str, list[str]]:
    """Each config group path ("" for the top) -> the keys allowed in it."""
    out = {prefix: []}
    types = typing.get_type_hints(node)
    for f in dataclasses.fields(node):
        out[prefix].append(f.name)
        if dataclasses.is_dataclass(types[f.name]):
            out.update(_schema_keys(types[f.name], f"{prefix}{f.name}."))
    return out


def check_override_keys(args: list[str]) -> None:
    """Reject command-line overrides of unknown keys, naming the allowed ones and the closest.

    Hydra would reject them too, but without saying what is allowed. ``algo.*`` and ``task.*``
    keys are those of the algorithm and task the arguments choose (``algo=ppo``), or of the
    defaults. Hydra's own flags and ``hydra.*``, ``+key``/``~key`` overrides are left to Hydra.
    """
    groups = _schema_keys(RunConfig)
    for group in ("algo", "task"):
        chosen = next((a.split("=", 1)[1] for a in args if a.startswith(f"{group}=")), None)
        groups.update(_schema_keys(_group_class(group, chosen or _default_choice(group)), f"{group}."))
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
