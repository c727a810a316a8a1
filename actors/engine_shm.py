"""Which shared-memory files a vLLM engine uses, recorded so that they can be removed after it dies.

vLLM's engine core and TP workers talk through files in /dev/shm (``psm_*`` message queues of
160-400 MiB per engine, ``vllm_*`` TP buffers, ``sem.mp-*`` semaphores). vLLM removes them only
when a fully started engine shuts down. Ray ends an actor with SIGTERM and SIGKILL within about
0.1 s (``ray.shutdown`` after a failed start, Ctrl-C or a scheduler's SIGTERM during the
engine's minute-long start), too soon for a signal handler in a main thread busy starting the
engine: the engine processes die with their parent and the files stay until reboot (measured:
160 MiB per interrupted start of the embedded model's engine).

So the process that starts the engine records the files (``EngineFileRecord``: a thread reads
/proc/<pid>/maps and fds of its descendants every ``period`` s while the engine starts, and
rewrites a JSON list whenever it grows), and whoever outlives it (the launcher, after
``ray.shutdown``) calls ``remove_recorded``. Unlinking a file that a live process still maps is
safe: the mapping stays until the process exits. Only /dev/shm files with vLLM's prefixes are
ever touched, never the weight shards the workers read (those belong to the store).

ZeroMQ sockets: vLLM's processes also talk through Unix sockets named ``<VLLM_RPC_BASE_PATH>/<uuid>``
(the temp folder by default), and leave them there even after a clean shutdown: 7 per start of
a TP=1 engine here, thousands on a machine after a few days of test runs. So each engine gets a
private folder for them (``private_ipc_dir``, set as ``VLLM_RPC_BASE_PATH`` before the engine
starts), removed when it stops and listed in the record for the launcher otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
import threading
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIXES = ("psm_", "vllm_", "sem.mp-")
IPC_PREFIX = "rlsys-vllm-ipc-"
_SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path holds 108 with the NUL)
_SOCKET_NAME = 36  # vLLM names each socket with a uuid4


def _is_engine_file(path: Path) -> bool:
    return path.parent == SHM_DIR and path.name.startswith(PREFIXES) and "/" not in path.name


def _ipc_parents() -> set[Path]:
    return {Path(tempfile.gettempdir()), Path("/tmp")}


def private_ipc_dir() -> Path:
    """A new folder (mode 700) for one engine's ZeroMQ sockets: set it as ``VLLM_RPC_BASE_PATH``
    before the engine starts and ``remove_ipc_dir`` it after the engine stops. In the temp
    folder, or in /tmp where the temp folder's path would make the sockets' paths too long."""
    parent = tempfile.gettempdir()
    if len(parent) + 1 + len(IPC_PREFIX) + 8 + 1 + _SOCKET_NAME > _SOCKET_PATH_MAX:
        parent = "/tmp"
    return Path(tempfile.mkdtemp(prefix=IPC_PREFIX, dir=parent))


@contextlib.contextmanager
def private_ipc_env():
    """A ``private_ipc_dir`` as ``VLLM_RPC_BASE_PATH`` for the engines this process starts
    inside (the bench, tests); the variable restored and the folder removed after."""
    ipc_dir = private_ipc_dir()
    before = os.environ.get("VLLM_RPC_BASE_PATH")
    os.environ["VLLM_RPC_BASE_PATH"] = str(ipc_dir)
    try:
        yield ipc_dir
    finally:
        if before is None:
            os.environ.pop("VLLM_RPC_BASE_PATH", None)
        else:
            os.environ["VLLM_RPC_BASE_PATH"] = before
        remove_ipc_dir(ipc_dir)


def _is_ipc_dir(path: Path) -> bool:
    return path.parent in _ipc_parents() and path.name.startswith(IPC_PREFIX) and "/" not in path.name


def remove_ipc_dir(path: str | Path) -> int:
    """Remove an engine's socket folder (``private_ipc_dir``): the sockets in it, then the folder
    if nothing else is left. Returns the sockets removed. Paths that are not such a folder (in
    the temp folder, with our prefix, not a link) are left alone."""
    path = Path(path)
    if not _is_ipc_dir(path) or path.is_symlink() or not path.is_dir():
        return 0
    removed = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(path):
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    os.unlink(entry.path)
                    removed += 1
        path.rmdir()
    return removed


def engine_files(pids: list[int]) -> set[Path]:
    """The files in /dev/shm with vLLM's prefixes that the processes ``pids`` map or hold open
    (read from /proc/<pid>/maps and /proc/<pid>/fd: a few ms)."""
    found = set()
    for pid in pids:
        paths = []
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            paths += [line.split(maxsplit=5)[5].strip() for line in maps if " /dev/shm/" in line]
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    paths.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        found.update(path for path in map(Path, paths) if _is_engine_file(path))
    return found


def _descendants() -> list[int]:
    import psutil

    with contextlib.suppress(psutil.Error):
        return [proc.pid for proc in psutil.Process().children(recursive=True)]
    return []


class EngineFileRecord:
    """Records the engine files of this process's descendants in ``path`` (a JSON list).

    Create it before starting the engine; call ``started()`` once it is up (vLLM makes no new
    files after its start) and ``remove()`` after shutting it down. ``ipc_dir``: the engine's
    socket folder (``private_ipc_dir``), listed from the start.
    """

    def __init__(self, path: str | Path, period: float = 0.5, ipc_dir: Path | None = None) -> None:
        self.path = Path(path)
        self.files: set[Path] = set()
        self._period = period
        self._stop = threading.Event()
        self._lock = threading.Lock()
        if ipc_dir is not None:
            self._add({Path(ipc_dir)})
        self._thread = threading.Thread(target=self._watch, name="engine-file-record", daemon=True)
        self._thread.start()

    def scan(self) -> None:
        """Add the files the descendants use now; rewrite the record if there are new ones."""
        self._add(engine_files(_descendants()))

    def _add(self, found: set[Path]) -> None:
        with self._lock:
            if found <= self.files:
                return
            self.files |= found
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(sorted(str(p) for p in self.files)))
            tmp.replace(self.path)  # a reader sees the old list or the new one, never half

    def _watch(self) -> None:
        while not self._stop.wait(self._period):
            with contextlib.suppress(OSError):
                self.scan()

    def started(self) -> None:
        self._stop.set()
        self._thread.join()
        self.scan()

    def remove(self) -> int:
        """Remove the files seen (those still there) and the record; returns the bytes freed."""
        self._stop.set()
        with self._lock:
            files = list(self.files)
        self.path.unlink(missing_ok=True)
        return _remove(files)


def _remove(paths) -> int:
    """Unlink those of ``paths`` that are /dev/shm files with vLLM's prefixes, and remove engine
    socket folders (``remove_ipc_dir``); bytes freed (sockets hold none)."""
    freed = 0
    for path in map(Path, paths):
        if _is_ipc_dir(path):
            remove_ipc_dir(path)
        if not _is_engine_file(path):
            continue
        with contextlib.suppress(OSError):
            size = path.stat().st_size
            path.unlink()
            freed += size
    return freed


def remove_recorded(record: str | Path) -> int:
    """Remove the engine files listed in ``record`` (those that still exist) and the record
    itself; returns the bytes freed. ``record`` may also be a folder of records (one per policy
    replica), each acted on, then the folder removed. Entries that are neither /dev/shm files
    with vLLM's prefixes nor engine socket folders are ignored (the record is data, not a list of
    things to delete at will)."""
    record = Path(record)
    if record.is_dir() and not record.is_symlink():
        freed = sum(remove_recorded(one) for one in sorted(record.glob("*.json")))
        with contextlib.suppress(OSError):
            record.rmdir()
        return freed
    try:
        names = json.loads(record.read_text())
    except (OSError, ValueError):
        return 0
    record.unlink(missing_ok=True)
    return _remove(str(name) for name in names) if isinstance(names, list) else 0
