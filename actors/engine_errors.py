"""The reason a vLLM engine did not start, for the error the policy raises.

When vLLM's engine core or one of its workers fails while starting, the policy's ``LLM(...)``
raises only "Engine core initialization failed. See root cause above": the root cause went to
those processes' output, which in a Ray actor is the actor's log files in Ray's session folder
(vLLM's logger writes to stdout, tracebacks go to stderr), not the launcher's terminal unless
``ray.log_to_driver=true``. The policy reads what its logs gained while the engine started and
names the first exception there that is not one of vLLM's summaries of it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# An exception line, raw ("AssertionError: ...") or logged by vLLM at ERROR level, with the
# process prefix: "(EngineCore pid=1) ERROR 12-03 21:16:19 [core.py:1510] AssertionError: ..."
_EXCEPTION_LINE = re.compile(
    r"^(?:\([^)]*\) )?(?:ERROR [^\]]*\] )?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit)): (.+)$"
)
# vLLM's own summaries of a failure in another process, not the cause
_WRAPPERS = ("Engine core initialization failed", "initialization failed due to an exception in a background process")
_TAIL_BYTES = 4 * 2**20


class EngineStartError(RuntimeError):
    """The policy's vLLM engine did not start; the message holds the engine's own error."""


def is_engine_start_failure(error: BaseException) -> bool:
    """Whether ``error`` is vLLM's summary of an engine core that died starting."""
    return isinstance(error, Exception) and any(w in str(error) for w in _WRAPPERS)


def own_logs() -> list[Path]:
    """The files this process's stdout and stderr go to (in a Ray actor: its logs)."""
    logs = []
    for fd in (1, 2):
        try:
            path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
        if path.is_file() and path not in logs:
            logs.append(path)
    return logs


def log_sizes(logs: list[Path]) -> dict[Path, int]:
    sizes = {}
    for log in logs:
        try:
            sizes[log] = log.stat().st_size
        except OSError:
            sizes[log] = 0
    return sizes


def root_cause(text: str) -> str | None:
    """The first exception line in ``text`` (a log) that is not a vLLM summary of another."""
    for line in text.splitlines():
        m = _EXCEPTION_LINE.match(line.rstrip())
        if m and not any(w in m.group(2) for w in _WRAPPERS):
            return f"{m.group(1)}: {m.group(2)}"
    return None


def engine_start_error(since: dict[Path, int]) -> EngineStartError | None:
    """An ``EngineStartError`` naming the root cause that the logs gained after the offsets in
    ``since`` (``log_sizes`` before the start); None when they hold no exception."""
    for log, start in since.items():
        try:
            with open(log, "rb") as f:
                f.seek(max(start, log.stat().st_size - _TAIL_BYTES))  # what the engine wrote last
                text = f.read().decode(errors="replace")
        except OSError:
            continue
        cause = root_cause(text)
        if cause is not None:
            return EngineStartError(f"the vLLM engine did not start: {cause} (its log: {log})")
    return None
