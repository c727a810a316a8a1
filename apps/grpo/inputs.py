"""The inputs a run or an evaluation checks before anything starts: the model directory (or the
embedded tiny model, built on first use) and the task's data and reward function."""

from __future__ import annotations

from apps.grpo.config import RunConfig
from validation.config import ConfigError


def resolve_model_path(cfg: RunConfig) -> str:
    """``model.path``, checked, or the embedded tiny model's (built on first use), and checked
    against the policy's settings: ``ConfigError`` names what does not fit."""
    from actors.modeling import check_model_dir, check_policy_fits
    from tinymodel.build import TinyModelRecipe, ensure_tiny_model

    if cfg.model.path is None:
        path = str(ensure_tiny_model(TinyModelRecipe.for_task(cfg.task, cfg.seed), cfg.model.tiny_cache_dir))
    else:
        try:
            path = str(check_model_dir(cfg.model.path))
        except ValueError as e:
            raise ConfigError(str(e)) from e
    try:
        check_policy_fits(path, cfg.policy.tp, cfg.policy.max_model_len)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return path


def load_task(cfg: RunConfig, tokenizer):
    """The task's data and scorer, and the user's reward function checked (``ConfigError`` for
    bad data, a bad file or a reward function that cannot be used)."""
    from tasks.base import load_reward_fn, task_class

    try:
        task = task_class(cfg.task.name)(cfg.task, cfg.seed, tokenizer)
        if cfg.task.reward_fn:
            load_reward_fn(cfg.task.reward_fn)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return task
