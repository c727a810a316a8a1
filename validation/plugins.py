"""Plug-ins chosen by name in the config: the modules of a package that define a given class
(``algos.<name>.Algorithm``, ``tasks.<name>.Task``)."""

from __future__ import annotations

import importlib
import pkgutil


def available(package: str, attribute: str) -> list[str]:
    """The names of ``package``'s modules (``base`` aside) that define ``attribute``, sorted."""
    path = importlib.import_module(package).__path__
    return [
        m.name
        for m in sorted(pkgutil.iter_modules(path), key=lambda m: m.name)
        if m.name != "base" and hasattr(importlib.import_module(f"{package}.{m.name}"), attribute)
    ]


def plugin(package: str, attribute: str, key: str, name: str) -> type:
    """``<package>.<name>.<attribute>``; a ``ValueError`` naming config ``key`` and the choices otherwise."""
    choices = available(package, attribute)
    if name not in choices:
        raise ValueError(f"{key}={name!r}: no module {package}/{name}.py defines {attribute}; available: {choices}")
    return getattr(importlib.import_module(f"{package}.{name}"), attribute)
