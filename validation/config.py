"""Config errors and the one place each config value is checked.

Every config group is a dataclass (``PolicyConfig``, ``TrainerConfig``, an algorithm's or a
task's ``Config``, ...) next to the code that uses it. A group that restricts its values beyond
their types has a ``rules()`` method: ``(ok, key, allowed)`` for each of its keys. The launcher
calls ``check_config`` once on the whole typed config tree, before anything is written or
started; the actors and pushers that receive a group trust it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

Rule = tuple[bool, str, str]  # (the value is valid, its key within the group, what is allowed)


class ConfigError(ValueError):
    """A config value, a model or an input file that the run cannot use; the message names it."""


def check_config(node: Any, path: str = "") -> None:
    """Apply ``rules()`` of every dataclass in the tree under ``node`` (``path``: its key).

    Raises ``ConfigError("config key <path.key>=<value> is invalid: expected <allowed>")`` for
    the first value that breaks a rule.
    """
    if not dataclasses.is_dataclass(node):
        return
    prefix = f"{path}." if path else ""
    for ok, key, allowed in node.rules() if hasattr(node, "rules") else ():
        if not ok:
            value = node
            for part in key.split("."):
                value = getattr(value, part)
            raise ConfigError(f"config key {prefix}{key}={value!r} is invalid: expected {allowed}")
    for f in dataclasses.fields(node):
        check_config(getattr(node, f.name), f"{prefix}{f.name}")
