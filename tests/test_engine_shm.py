"""Recording and removing a vLLM engine's shared-memory files (without vLLM: a child process
that holds shared memory the way vLLM's message queues do)."""

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from actors.engine_shm import (
    IPC_PREFIX,
    EngineFileRecord,
    engine_files,
    private_ipc_dir,
    private_ipc_env,
    remove_ipc_dir,
    remove_recorded,
)

HOLDER = """
import mmap, sys, time
from multiprocessing import resource_tracker, shared_memory
queue = shared_memory.SharedMemory(create=True, size=1 << 20)  # psm_*: vLLM's kind
resource_tracker.unregister(queue._name, "shared_memory")  # as vLLM does: nobody removes it on exit
other = open(sys.argv[1], "w+b"); other.truncate(4096)  # a weight shard: not the engine's
mapped = mmap.mmap(other.fileno(), 4096)
print(queue.name, flush=True)
time.sleep(60)
"""


def _holder(tmp_name: str) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, tmp_name], stdout=subprocess.PIPE, text=True)
    return proc, Path("/dev/shm") / proc.stdout.readline().strip()


def test_a_child_process_s_engine_files_are_found_and_recorded_but_not_other_shm_files(tmp_path):
    other = Path("/dev/shm") / f"ws-test-{time.monotonic_ns()}"
    proc, queue = _holder(str(other))
    try:
        assert queue.exists() and queue.name.startswith("psm_")
        assert engine_files([proc.pid]) == {queue}  # the mapped weight-like file is not listed
        record = EngineFileRecord(tmp_path / "engine-files.json", period=0.05)
        record.started()
        assert json.loads((tmp_path / "engine-files.json").read_text()) == [str(queue)]
    finally:
        proc.kill()
        proc.wait()
    # The holder died without removing its queue, as an engine killed with its parent does; the
    # run folder holding the record may be gone already: the record object still knows the files.
    assert queue.exists()
    (tmp_path / "engine-files.json").unlink()
    assert record.remove() == 1 << 20
    assert not queue.exists()
    assert other.exists()
    other.unlink()


def test_a_record_can_only_remove_engine_files(tmp_path):
    keep = [tmp_path / "psm_not_in_dev_shm", Path("/dev/shm") / f"ws-test-{time.monotonic_ns()}"]
    for path in keep:
        path.write_bytes(b"x")
    gone = Path("/dev/shm") / f"psm_test_{time.monotonic_ns()}"
    gone.write_bytes(b"y" * 10)
    record = tmp_path / "record.json"
    record.write_text(json.dumps([*map(str, keep), str(gone), "/dev/shm/psm_missing", "/dev/shm/../etc/x", 7]))
    assert remove_recorded(record) == 10
    assert all(path.exists() for path in keep) and not gone.exists()
    keep[1].unlink()
    assert remove_recorded(tmp_path / "no-such-record.json") == 0


def test_a_folder_of_records_removes_each_replicas_files_and_then_itself(tmp_path):
    folder = tmp_path / "engine-files"
    folder.mkdir()
    files = [Path("/dev/shm") / f"psm_test_{i}_{time.monotonic_ns()}" for i in range(2)]
    for i, path in enumerate(files):
        path.write_bytes(b"z" * (3 + i))
        (folder / f"policy-{i}.json").write_text(json.dumps([str(path)]))
    assert remove_recorded(folder) == 7
    assert not any(path.exists() for path in files) and not folder.exists()


def _bound_socket(folder: Path) -> Path:
    """A Unix socket file in ``folder``, named and left behind as vLLM's ZeroMQ sockets are."""
    path = folder / str(uuid.uuid4())
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))  # closing a Python socket does not unlink its file
    return path


def test_an_engine_socket_folder_is_listed_from_the_start_and_removed_by_the_record(tmp_path):
    ipc = private_ipc_dir()
    assert ipc.parent == Path(tempfile.gettempdir()) and ipc.name.startswith(IPC_PREFIX)
    assert stat.S_IMODE(ipc.stat().st_mode) == 0o700
    sockets = [_bound_socket(ipc) for _ in range(3)]
    record = EngineFileRecord(tmp_path / "engine-files.json", period=60, ipc_dir=ipc)
    assert json.loads((tmp_path / "engine-files.json").read_text()) == [str(ipc)]  # before any scan
    record.started()
    assert all(path.exists() for path in sockets)
    assert remove_recorded(tmp_path / "engine-files.json") == 0  # sockets hold no bytes
    assert not ipc.exists()


def test_removing_a_socket_folder_removes_only_sockets_in_our_folders(tmp_path):
    ipc = private_ipc_dir()
    sock = _bound_socket(ipc)
    kept = ipc / "not-a-socket"
    kept.write_text("x")
    assert remove_ipc_dir(ipc) == 1
    assert not sock.exists() and kept.exists() and ipc.exists()  # a folder with other files stays
    kept.unlink()
    assert remove_ipc_dir(ipc) == 0 and not ipc.exists()

    # Our prefix, but not directly in the temp folder (a short path: socket paths are limited).
    outer = Path(tempfile.mkdtemp())
    elsewhere = outer / f"{IPC_PREFIX}nested"
    elsewhere.mkdir()
    other_sock = _bound_socket(elsewhere)
    link = Path(tempfile.gettempdir()) / f"{IPC_PREFIX}link-{uuid.uuid4().hex[:8]}"
    link.symlink_to(elsewhere)
    try:
        record = tmp_path / "record.json"
        record.write_text(json.dumps([str(elsewhere), str(link)]))
        assert remove_recorded(record) == 0
        assert other_sock.exists() and link.is_symlink()
    finally:
        link.unlink()
        shutil.rmtree(outer)


def test_a_socket_folder_environment_is_set_inside_and_undone_after(monkeypatch):
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/somewhere/else")
    with private_ipc_env() as ipc:
        assert os.environ["VLLM_RPC_BASE_PATH"] == str(ipc) and ipc.name.startswith(IPC_PREFIX)
        sock = _bound_socket(ipc)  # left behind, as vLLM's are
    assert os.environ["VLLM_RPC_BASE_PATH"] == "/somewhere/else"
    assert not sock.exists() and not ipc.exists()
