"""The store's control plane (real redis-server) and the shared-memory data plane, without vLLM."""

import errno
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint import HuggingFaceStorageReader

from tests.boxes import random_box
from tests.configs import make_pusher
from weightsync.push import run_dir, spare_dir, version_dir
from weightsync.reader import ChunkSource, read_box
from weightsync.redis_server import LocalRedis, RedisUnavailable, check_redis
from weightsync.shm_space import HEADER_SLACK, NotEnoughSharedMemory
from weightsync.shm_writer import claim_spare, shard_file_name
from weightsync.store import Chunk, TensorEntry, VersionNotFound


def _state_dict(seed=0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(15, 8, generator=g)
    return {
        "model.embed_tokens.weight": emb,
        "model.layers.0.mlp.up_proj.weight": torch.randn(12, 8, generator=g),
        "model.norm.weight": torch.randn(8, generator=g),
        "lm_head.weight": emb,  # tied: same tensor, stored once
    }


def test_push_writes_real_dcp_output_and_commits(store, tmp_path):
    sd = _state_dict()
    stats = make_pusher(store, shm_root=tmp_path).push(sd, version=1)
    assert store.latest() == 1 and store.versions() == [1]
    index = store.index(1)
    assert set(index) == {"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"}
    assert index["model.layers.0.mlp.up_proj.weight"].shape == [12, 8]
    files = list(version_dir(tmp_path, store.run, 1).glob("*.safetensors"))
    assert len(files) == 1 and stats["bytes_written"] == files[0].stat().st_size
    with safe_open(str(files[0]), framework="pt") as f:
        header = f.metadata()
    assert "DCP_VERSION" in header and "DCP_SHARDING_INFO" in header
    # DCP's own reader loads what we wrote.
    loaded = {k: torch.zeros_like(v) for k, v in sd.items() if k != "lm_head.weight"}
    dcp.load(loaded, storage_reader=HuggingFaceStorageReader(str(version_dir(tmp_path, store.run, 1))), no_dist=True)
    for k, v in loaded.items():
        assert torch.equal(v, sd[k])


def test_push_casts_to_the_sync_dtype(store, tmp_path):
    sd = _state_dict()
    make_pusher(store, shm_root=tmp_path, dtype="bfloat16").push(sd, version=1)
    entry = store.index(1)["model.norm.weight"]
    assert entry.dtype == "bfloat16"
    out = torch.empty(8, dtype=torch.bfloat16)
    read_box("model.norm.weight", entry, ((0, 8),), out, ChunkSource())
    assert torch.equal(out, sd["model.norm.weight"].to(torch.bfloat16))


def test_read_box_equals_slicing_the_full_tensor(store, tmp_path):
    sd = _state_dict(seed=1)
    make_pusher(store, shm_root=tmp_path).push(sd, version=1)
    # Unverified reads touch exactly the box (verified ones: tests/test_weightsync_integrity.py).
    index, files, rng = store.index(1), ChunkSource(verify=False), random.Random(0)
    for _ in range(50):
        name = rng.choice(sorted(index))
        box = random_box(index[name].shape, rng)
        out = torch.empty([hi - lo for lo, hi in box])
        nbytes = read_box(name, index[name], tuple(box), out, files)
        assert torch.equal(out, sd[name][tuple(slice(lo, hi) for lo, hi in box)])
        assert nbytes == out.numel() * 4


def test_read_box_stitches_several_chunks_and_reads_only_the_overlap(tmp_path):
    full = torch.arange(10 * 6, dtype=torch.float32).view(10, 6)
    # Three chunks as three ranks would store them: rows 0-3, rows 4-9 x cols 0-2, rows 4-9 x cols 3-5.
    pieces = [((0, 0), full[0:4]), ((4, 0), full[4:10, 0:3]), ((4, 3), full[4:10, 3:6])]
    chunks = []
    for i, (offsets, t) in enumerate(pieces):
        file = tmp_path / f"shard{i}.safetensors"
        save_file({"w": t.contiguous()}, str(file))
        chunks.append(Chunk(list(offsets), list(t.shape), {"kind": "shm", "file": str(file)}))
    entry = TensorEntry("float32", [10, 6], chunks)
    for box in [((2, 7), (1, 5)), ((0, 10), (0, 6)), ((5, 6), (4, 5)), ((0, 4), (0, 6))]:
        out = torch.empty([hi - lo for lo, hi in box])
        nbytes = read_box("w", entry, box, out, ChunkSource())
        assert torch.equal(out, full[tuple(slice(lo, hi) for lo, hi in box)])
        assert nbytes == out.numel() * 4  # only the wanted bytes
    with pytest.raises(RuntimeError, match="cover"):
        read_box("w", TensorEntry("float32", [10, 6], chunks[:2]), ((0, 10), (0, 6)), torch.empty(10, 6), ChunkSource())


def test_nothing_is_visible_before_commit_and_missing_parts_refuse_to_commit(store):
    entry = {"w": TensorEntry("float32", [2], [Chunk([0], [2], {"kind": "shm", "file": "/x"})])}
    store.put_part(5, 0, entry)
    assert store.latest() is None and store.versions() == []
    with pytest.raises(VersionNotFound):
        store.index(5)
    with pytest.raises(RuntimeError, match=r"ranks \[1\]"):
        store.commit(5, world_size=2)
    store.put_part(5, 1, entry)
    merged = store.commit(5, world_size=2)
    assert len(merged["w"].chunks) == 2 and store.latest() == 5


def test_a_failed_push_leaves_no_version_and_no_files(store, tmp_path, monkeypatch):
    """The shard is on disk when the commit path fails: it must be removed, and nothing committed."""

    def fail(*args, **kwargs):
        assert any(version_dir(tmp_path, store.run, 1).glob("*.safetensors"))  # written by then
        raise ConnectionError("redis went away")

    monkeypatch.setattr(store, "put_part", fail)
    with pytest.raises(ConnectionError):
        make_pusher(store, shm_root=tmp_path).push(_state_dict(), version=1)
    assert store.versions() == [] and store.latest() is None
    assert not version_dir(tmp_path, store.run, 1).exists()


def test_retention_keeps_last_k_and_leased_versions(store, tmp_path):
    pusher = make_pusher(store, shm_root=tmp_path, keep_last=2)
    pusher.push(_state_dict(), 1)
    store.lease(1, "policy-0")
    for v in (2, 3, 4):
        pusher.push(_state_dict(v), v)
    assert store.versions() == [1, 3, 4]  # 2 dropped; 1 is held by policy-0
    with pytest.raises(VersionNotFound):
        store.lease(2, "policy-1")  # a dropped version cannot be pinned
    assert not version_dir(tmp_path, store.run, 2).exists() and version_dir(tmp_path, store.run, 1).exists()
    store.lease(4, "policy-0")  # moving the lease releases version 1
    pusher.push(_state_dict(5), 5)
    assert store.versions() == [4, 5]
    assert sorted(p.name for p in run_dir(tmp_path, store.run).iterdir()) == ["spare", "v4", "v5"]
    assert len(list(spare_dir(tmp_path, store.run).iterdir())) == 1  # one per trainer rank, to write over


def test_freed_shard_files_are_written_over_by_later_pushes(store, shm_root):
    """A retired version's file becomes the next version's (same inode, no fresh tmpfs pages),
    cut to its new length; DCP's own reader and ours read it as the new version."""
    pusher = make_pusher(store, shm_root=shm_root, keep_last=1)
    big = {"a": torch.randn(64, 64), "b": torch.randn(256)}
    small = {"a": torch.randn(8, 64)}
    pusher.push(big, 1)
    first = version_dir(shm_root, store.run, 1) / shard_file_name(1)
    inode, big_size = first.stat().st_ino, first.stat().st_size
    pusher.push(big, 2)  # version 1 is freed: its file becomes the spare
    assert not first.exists()
    pusher.push(small, 3)  # written into the spare (version 2's file is the next spare)
    third = version_dir(shm_root, store.run, 3) / shard_file_name(1)
    assert third.stat().st_ino == inode and third.stat().st_size < big_size
    loaded = {"a": torch.zeros(8, 64)}
    dcp.load(loaded, storage_reader=HuggingFaceStorageReader(str(third.parent)), no_dist=True)
    assert torch.equal(loaded["a"], small["a"])
    assert torch.equal(_read_all(store, 3)["a"], small["a"])
    assert not version_dir(shm_root, store.run, 1).exists() and not version_dir(shm_root, store.run, 2).exists()


@pytest.mark.parametrize("background", [False, True])
def test_the_first_pushes_write_over_files_reserved_at_start(store, shm_root, background):
    """keep_last=1 with a policy that leases each version after it is pushed: three files live
    at once before retired ones come back, so three are reserved; every push writes over one."""
    pusher = make_pusher(store, shm_root=shm_root, keep_last=1)
    sd = _state_dict()
    pusher.reserve(sd, background=background)
    pusher._wait_reserved()
    spares = sorted(spare_dir(shm_root, store.run).iterdir())
    assert len(spares) == pusher.reserve_count() == 3
    inodes = {f.stat().st_ino for f in spares}
    assert not list(run_dir(shm_root, store.run).glob("reserving-*"))  # moved in whole
    for version in range(1, 6):
        stats = pusher.push(_state_dict(version), version)
        assert stats["wrote_over_spare"], version
        shard = version_dir(shm_root, store.run, version) / shard_file_name(1)
        if version <= 3:
            assert shard.stat().st_ino in inodes
        assert torch.equal(_read_all(store, version)["model.norm.weight"], _state_dict(version)["model.norm.weight"])
        store.lease(version, "policy-0")
    assert store.versions() == [4, 5]
    # Never more files than the reservation: 2 live versions + 1 spare.
    assert len(list(run_dir(shm_root, store.run).rglob("*.safetensors"))) == 3


def test_a_push_waits_for_a_background_reservation_and_delta_reserves_one(store, shm_root):
    pusher = make_pusher(store, shm_root=shm_root, keep_last=3, delta=True)
    assert pusher.reserve_count() == 1  # later delta shards are small
    pusher.reserve(_state_dict(), background=True)
    assert pusher.push(_state_dict(), 1)["wrote_over_spare"]  # waited for the file
    assert not spare_dir(shm_root, store.run).exists() or not list(spare_dir(shm_root, store.run).iterdir())


def test_a_failed_reservation_is_reported_and_pushes_still_work(store, shm_root, monkeypatch, caplog):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("weightsync.push.os.posix_fallocate", full)
    pusher = make_pusher(store, shm_root=shm_root, keep_last=1)
    pusher.reserve(_state_dict(), background=False)
    assert isinstance(pusher.reserve_error, OSError) and "No space left" in caplog.text
    assert not list(run_dir(shm_root, store.run).glob("reserving-*"))  # no partial file left
    stats = pusher.push(_state_dict(), 1)
    assert not stats["wrote_over_spare"] and store.latest() == 1


def _free_space(monkeypatch, nbytes: int) -> None:
    """``os.statvfs`` reports ``nbytes`` free (the subject is the check, not the filesystem)."""
    monkeypatch.setattr("weightsync.shm_space.os.statvfs", lambda path: SimpleNamespace(f_bavail=nbytes, f_frsize=1))


def test_too_little_shared_memory_for_the_kept_versions_stops_the_start(store, shm_root, monkeypatch):
    pusher = make_pusher(store, shm_root=shm_root, keep_last=2)
    sd = _state_dict()
    shard = (15 * 8 + 12 * 8 + 8) * 4  # float32, the tied head stored once
    _free_space(monkeypatch, 2 * shard)  # keep_last=2 needs 3 files (2 kept + 1 being written)
    with pytest.raises(NotEnoughSharedMemory, match=r"keep_last=2.*--shm-size.*data_plane=redis"):
        pusher.reserve(sd, background=False)
    assert not spare_dir(shm_root, store.run).exists()


def test_room_for_the_kept_versions_only_reserves_fewer_files_and_warns(store, shm_root, monkeypatch, caplog):
    pusher = make_pusher(store, shm_root=shm_root, keep_last=2)
    sd = _state_dict()
    per_file = (15 * 8 + 12 * 8 + 8) * 4 + HEADER_SLACK + 3 * 512  # data + the header's room
    _free_space(monkeypatch, 3 * per_file + 1)  # 3 of the 4 files a lagging policy needs
    pusher.reserve(sd, background=False)
    assert len(list(spare_dir(shm_root, store.run).iterdir())) == 3 < pusher.reserve_count()
    assert "room for 3 of the 4 shard files" in caplog.text
    assert all(stats["wrote_over_spare"] for stats in (pusher.push(sd, v) for v in (1, 2, 3)))


def test_a_full_shared_memory_during_a_push_is_a_clear_error_and_leaves_nothing(store, shm_root, monkeypatch):
    def full(self, file_name, parts):
        with open(self.fs.concat_path(self.path, file_name), "wb") as f:
            f.write(b"x" * 100)  # part of the shard made it to disk
        raise OSError(errno.ENOSPC, "No space left on device")

    pusher = make_pusher(store, shm_root=shm_root, keep_last=1)
    pusher.push(_state_dict(), 1)
    monkeypatch.setattr("weightsync.shm_writer.ShmSafetensorsWriter._emit", full)
    with pytest.raises(NotEnoughSharedMemory, match=r"weight version 2: .* ran out of space.*keep_last=1.*--shm-size"):
        pusher.push(_state_dict(2), 2)
    assert store.versions() == [1] and not version_dir(shm_root, store.run, 2).exists()


def test_a_spare_is_the_smallest_that_fits_else_the_largest(tmp_path):
    spare = tmp_path / "spare"
    spare.mkdir()
    for n in (100, 1000, 10000):
        (spare / f"s{n}").write_bytes(b"x" * n)
    assert claim_spare(spare, str(tmp_path / "a"), 500) and (tmp_path / "a").stat().st_size == 1000
    assert claim_spare(spare, str(tmp_path / "b"), 20000) and (tmp_path / "b").stat().st_size == 10000
    assert claim_spare(spare, str(tmp_path / "c"), 0) and (tmp_path / "c").stat().st_size == 100
    assert not claim_spare(spare, str(tmp_path / "d"), 0)
    assert not claim_spare(tmp_path / "none", str(tmp_path / "e"), 0)


def test_a_spare_claimed_by_another_rank_while_listing_is_skipped(tmp_path, monkeypatch):
    """Two ranks claim at once: a file listed by one may be gone before it is looked at."""
    spare = tmp_path / "spare"
    spare.mkdir()
    for name in ("a", "b"):
        (spare / name).write_bytes(b"x" * 10)
    real_scandir = os.scandir

    def listing_then_other_rank_claims(path):
        entries = list(real_scandir(path))
        (spare / "a").rename(tmp_path / "taken-by-rank-1")
        return iter(entries)

    monkeypatch.setattr("weightsync.shm_writer.os.scandir", listing_then_other_rank_claims)
    assert claim_spare(spare, str(tmp_path / "mine"), 10)
    assert (tmp_path / "mine").exists() and not (spare / "b").exists()


def _read_all(store, version) -> dict[str, torch.Tensor]:
    files = ChunkSource()
    out = {}
    for name, entry in store.index(version).items():
        t = torch.empty(entry.shape)
        read_box(name, entry, tuple((0, n) for n in entry.shape), t, files)
        out[name] = t
    return out


def test_a_pinned_reader_keeps_reading_its_version_while_newer_ones_are_pushed(store, tmp_path):
    pusher = make_pusher(store, shm_root=tmp_path, keep_last=1)
    pusher.push(_state_dict(1), 1)
    store.lease(1, "reader")
    done = threading.Event()

    def push_more():
        for v in range(2, 12):
            pusher.push(_state_dict(v), v)
        done.set()

    writer = threading.Thread(target=push_more)
    writer.start()
    reads = 0
    while not done.is_set() or reads < 3:
        got = _read_all(store, 1)
        for name, t in got.items():
            assert torch.equal(t, _state_dict(1)[name])
        reads += 1
    writer.join()
    assert store.versions() == [1, 11] and store.latest() == 11
    assert torch.equal(_read_all(store, 11)["model.norm.weight"], _state_dict(11)["model.norm.weight"])


def test_lease_and_retire_never_race(store, tmp_path):
    """A lease that succeeds always finds its version whole, however retirement interleaves."""
    pusher = make_pusher(store, shm_root=tmp_path, keep_last=1)
    pusher.push(_state_dict(0), 0)
    stop = threading.Event()
    errors = []

    def reader():
        leased = attempt = 0
        while not stop.is_set():
            attempt += 1
            v = store.latest() - attempt % 2  # the newest, or the one being retired right now
            try:
                store.lease(v, "reader")
            except VersionNotFound:
                continue
            try:
                _read_all(store, v)  # must not find missing index or files
                leased += 1
            except Exception as e:
                errors.append(e)
        errors.append(leased)

    thread = threading.Thread(target=reader)
    thread.start()
    for v in range(1, 40):
        pusher.push(_state_dict(v % 3), v)
    stop.set()
    thread.join()
    *failures, leased = errors
    assert not failures
    assert leased > 0  # the race was exercised


def test_index_is_plain_json(store, tmp_path, redis_url):
    import redis

    make_pusher(store, shm_root=tmp_path).push(_state_dict(), 1)
    raw = redis.Redis.from_url(redis_url).get(f"ws:{store.run}:v1:index")
    parsed = json.loads(raw)
    assert parsed["model.norm.weight"]["chunks"][0]["offsets"] == [0]


def test_unreachable_redis_is_a_clear_error(tmp_path):
    with pytest.raises(RedisUnavailable, match="not reachable"):
        check_redis(f"unix://{tmp_path}/nothing.sock", timeout_s=0.5)
    with pytest.raises(RedisUnavailable, match="redis.url"):
        check_redis("redis://127.0.0.1:1", timeout_s=0.5)


def test_local_redis_listens_on_a_private_unix_socket():
    with LocalRedis() as server:
        assert server.url.startswith("unix://")
        check_redis(server.url)
        path = server.socket
    assert not path.exists()


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's prctl")
def test_private_redis_dies_with_the_process_that_started_it():
    """A launcher killed by SIGKILL (or the OOM killer) runs no cleanup: its redis-server must
    still go, or every crashed run would leave one behind."""
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from weightsync.redis_server import LocalRedis; "
            "s = LocalRedis(); print(s._proc.pid, s.socket.parent, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    pid, folder = launcher.stdout.readline().split()
    server_pid = int(pid)
    assert Path(f"/proc/{server_pid}").exists()
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while _alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(server_pid)
    shutil.rmtree(folder)  # the killed launcher's (now empty) socket folder


@pytest.mark.skipif(sys.platform != "linux", reason="reads the server's page faults from /proc")
def test_private_redis_keeps_the_pages_of_freed_values():
    """A push to the Redis data plane stores a model's bytes as new values after a retire freed
    as many: the server must reuse the freed pages, not fault every page in again."""
    from weightsync.redis_data import RawRedis

    piece = 8 * 2**20
    data = memoryview(torch.randn(8 * piece // 4).numpy()).cast("B")
    with LocalRedis() as server:
        client = RawRedis(server.url)
        faults = []
        for round_ in range(2):
            keys = [f"v{round_}:{i}" for i in range(8)]
            before = _minor_faults(server._proc.pid)
            client.set_pieces(keys, [[data[i * piece : (i + 1) * piece]] for i in range(8)])
            faults.append(_minor_faults(server._proc.pid) - before)
            redis.Redis.from_url(server.url).delete(*keys)  # the retire of that version
            time.sleep(1.0)
        client.close()
    pages = len(data) // 4096
    assert faults[0] > pages // 2  # the first store does fault its pages in (the count is real)
    assert faults[1] < pages // 10, faults


def _minor_faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def test_only_true_aliases_are_stored_once(store, tmp_path):
    flat = torch.arange(12, dtype=torch.float32)
    sd = {"a.weight": flat[:6].view(2, 3), "b.weight": flat[6:].view(2, 3), "c.weight": flat[:6].view(2, 3)}
    make_pusher(store, shm_root=tmp_path).push(sd, 1)
    index = store.index(1)
    assert set(index) == {"a.weight", "b.weight"}  # c is a; b shares a's buffer but not its data
    out = torch.empty(2, 3)
    read_box("b.weight", index["b.weight"], ((0, 2), (0, 3)), out, ChunkSource())
    assert torch.equal(out, sd["b.weight"])
