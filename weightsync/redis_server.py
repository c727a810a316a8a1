"""Start and stop a private ``redis-server`` on a Unix socket, and check a configured Redis URL."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

import redis


class RedisUnavailable(RuntimeError):
    pass


def check_redis(url: str, timeout_s: float = 3.0) -> None:
    """Raise ``RedisUnavailable`` with a clear message when ``url`` does not answer a PING."""
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        client.ping()
        client.close()
    except (redis.RedisError, OSError, ValueError) as e:
        raise RedisUnavailable(
            f"redis.url {url!r} is not reachable ({e}). Start a Redis server there, or leave "
            "redis.url unset (null) so the launcher starts a private one on a Unix socket."
        ) from e


# jemalloc's options, read from the environment at start: Debian's redis-server links the
# system jemalloc (MALLOC_CONF); Redis's bundled copy is built with the je_ prefix (JE_MALLOC_CONF).
REDIS_MALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"

# Looked up here, not in the forked child, which must not take the loader's locks.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the process that started it dies, even by
    SIGKILL or OOM, so that a crashed launcher never leaves a private redis-server behind."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class LocalRedis:
    """A ``redis-server`` on a Unix socket in a private temporary directory, no TCP port.

    Use as a context manager; ``url`` is ``unix:///.../redis.sock``. Persistence is off: the
    store only holds control-plane state (and, with the Redis data plane, the weights) for the
    life of one run.

    The server's jemalloc keeps the pages of freed values (``REDIS_MALLOC_CONF``): with the
    Redis data plane every push stores a model's bytes as new values and a retire frees as many,
    and by default jemalloc hands those pages back to the kernel at once (8 MiB values are past
    its oversize threshold), so the next push faults every page in again. Measured here (1 GiB
    in 8 MiB values, a version freed before each push): 262k page faults and 0.6-0.7 s per push
    by default, none and 0.2 s with the pages kept. Redis's memory then stays at its peak, which
    the run reaches anyway.
    """

    def __init__(self, start_timeout_s: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisUnavailable(
                "redis-server is not installed and no redis.url is configured. Install it "
                "(Debian: apt-get install redis-server; `make setup` does this) or set redis.url."
            )
        self._dir = Path(tempfile.mkdtemp(prefix="rlsys-redis-"))
        self.socket = self._dir / "redis.sock"
        self.url = f"unix://{self.socket}"
        self._proc = subprocess.Popen(
            [
                binary,
                "--port",
                "0",
                "--unixsocket",
                str(self.socket),
                "--unixsocketperm",
                "700",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self._dir),
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, "MALLOC_CONF": REDIS_MALLOC_CONF, "JE_MALLOC_CONF": REDIS_MALLOC_CONF},
            # The death signal follows the thread that forks: start the server from the main thread.
            preexec_fn=_die_with_parent if _prctl is not None else None,
        )
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                self.stop()
                raise RedisUnavailable(f"redis-server exited at start (code {self._proc.returncode}): {err}")
            try:
                check_redis(self.url, timeout_s=0.5)
                break
            except RedisUnavailable:
                if time.monotonic() > deadline:
                    self.stop()
                    raise
                time.sleep(0.05)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
