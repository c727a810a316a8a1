"""What a failure came from, through the wrappers it arrives in."""

from __future__ import annotations

from collections.abc import Callable


def caused_by(exc: BaseException, test: Callable[[BaseException], bool]) -> bool:
    """Does ``test`` hold for ``exc``, its causes and contexts, or the failures DCP wrapped in it
    (``CheckpointException.failures``: rank -> exception or (exception, traceback))?"""
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if test(e):
            return True
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return False
