"""Ctrl-C and SIGTERM that stop the run even when a library swallows the KeyboardInterrupt.

Python turns a signal into a KeyboardInterrupt raised wherever the main thread checks for
signals next. When that is inside a library call that catches it and carries on, the run
continues as if nothing had happened: seen once in a dozen Ctrl-Cs sent while the launcher
waited in ``ray.get`` for the vLLM engine to start (the run went on training). So the handler
also remembers the signal, ``check`` raises KeyboardInterrupt again wherever the launcher
calls it (between steps, after each wait), and ``ready`` waits in short ``ray.wait`` rounds
that check in between instead of one blocking ``ray.get``.
"""

from __future__ import annotations

import signal
import threading

import ray

_received = threading.Event()


def _handle(signum, frame) -> None:
    _received.set()
    raise KeyboardInterrupt


def install() -> None:
    """Handle SIGINT and SIGTERM (main thread; after ``ray.init``, which installs its own
    SIGTERM handler that aborts the process)."""
    _received.clear()
    signal.signal(signal.SIGINT, _handle)
    signal.signal(signal.SIGTERM, _handle)


def received() -> bool:
    return _received.is_set()


def check() -> None:
    """Raise KeyboardInterrupt if a signal came, whether or not its first one was swallowed."""
    if _received.is_set():
        raise KeyboardInterrupt


def ready(refs: list, poll_s: float = 0.5) -> list:
    """``ray.get(refs)``, waiting in rounds of ``poll_s`` with a ``check`` after each."""
    pending = list(refs)
    while pending:
        check()
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=poll_s, fetch_local=False)
    check()
    return ray.get(refs)
