"""Whether the policy engines on a host are working, for the trainer ranks on its CPUs to train on
the cores the engines leave idle.

On a CPU host the engines and the trainer split the cores: each side keeps its own even while
the other waits (between a batch's last token and the next weight update, the engines do
nothing; in a sync run they wait for the whole train step). Each replica marks its byte of a
shared-memory file while requests are in its engine or a weight update is loading; a trainer
rank reads the file at every decoder layer, forward and backward, and trains with
``trainer.idle_policy_threads`` more threads while every byte is clear.

Only on one host (the file is in the run's shared-memory folder) and only on CPU (GPU ranks do
not train on the host's cores).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

FILE_NAME = "engines-busy"


class EngineActivity:
    """A byte per replica in ``path``: 1 while that replica's engine works."""

    def __init__(self, path: str | Path, slot: int | None = None) -> None:
        """``slot``: the replica's byte (its index), for a replica that marks; None: a reader,
        which sees no engine busy until some replica has made the file."""
        self.path = Path(path)
        self.slot = slot
        self._fd: int | None = None
        if slot is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            self.mark(False)  # a restarted replica clears what its dead predecessor left

    def mark(self, busy: bool) -> None:
        os.pwrite(self._fd, b"\x01" if busy else b"\x00", self.slot)

    def any_busy(self) -> bool:
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return False
        return any(os.pread(self._fd, 4096, 0))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class IdleCoreThreads:
    """Sets the torch threads of a trainer rank before each of ``layers`` runs, forward and
    backward: ``base`` while an engine works, ``base + extra`` once none has for ``settle_s``
    (short pauses, where the engines' other processes and the driver still use the cores, are
    left to them)."""

    def __init__(self, layers, activity: EngineActivity, base: int, extra: int, settle_s: float = 0.1) -> None:
        self.activity, self.base, self.extra, self.settle_s = activity, base, extra, settle_s
        self.threads = torch.get_num_threads()
        self.idle_since: float | None = None
        for layer in layers:
            layer.register_forward_pre_hook(self._pick)
            layer.register_forward_hook(self._before_backward)

    def _pick(self, *_) -> None:
        if self.activity.any_busy():
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = time.monotonic()
        idle = self.idle_since is not None and time.monotonic() - self.idle_since >= self.settle_s
        threads = self.base + self.extra if idle else self.base
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads

    def _before_backward(self, _module, _args, output) -> None:
        """The layer's backward starts once its output's gradient is ready: pick there too."""
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda _grad: self._pick())
