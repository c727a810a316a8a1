"""The Redis data plane (real redis-server): shard bytes as Redis values, read by byte ranges."""

import random
import uuid
from pathlib import Path

import pytest
import redis
import torch

from tests.boxes import random_box
from tests.configs import make_pusher
from weightsync import reader, redis_data
from weightsync.checksum import ChecksumMismatch
from weightsync.push import run_dir
from weightsync.reader import ChunkSource, read_box
from weightsync.redis_data import RawRedis


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def _state_dict(seed=0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(40, 64, generator=g)
    return {
        "model.embed_tokens.weight": emb,
        "model.layers.0.self_attn.o_proj.weight": torch.randn(48, 128, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(96, 64, generator=g),
        "model.norm.weight": torch.randn(64, generator=g),
        "odd.weight": torch.randn(5, 3, generator=g),
        "lm_head.weight": emb,
    }


def _keys(client, run) -> set[str]:
    return {k.decode() for k in client.scan_iter(match=f"ws:{run}:*", count=1000)}


def _data_keys(client, run, version) -> set[str]:
    return {k for k in _keys(client, run) if k.startswith(f"ws:{run}:v{version}:data:")}


def test_redis_push_stores_the_shard_bytes_and_reads_equal_slicing(store, client, shm_root, monkeypatch, redis_url):
    # Small pieces, ranges and slabs, so that ranges cross piece boundaries everywhere and boxes
    # are read in many prefetched slabs.
    monkeypatch.setattr(redis_data, "PIECE_BYTES", 1000)
    monkeypatch.setattr(redis_data, "RANGE_BYTES", 300)
    monkeypatch.setattr(reader, "SLAB_BYTES", 2048)
    sd = _state_dict()
    stats = make_pusher(store, shm_root=shm_root, data_plane="redis").push(sd, version=1)
    assert not run_dir(shm_root, store.run).exists()  # nothing in shared memory
    index = store.index(1)
    locations = [c.location for e in index.values() for c in e.chunks]
    assert {loc["kind"] for loc in locations} == {"redis"} and all(loc["piece_bytes"] == 1000 for loc in locations)
    pieces = sorted(_data_keys(client, store.run, 1), key=lambda k: int(k.rsplit(":", 1)[1]))
    assert len(pieces) == -(-stats["bytes_written"] // 1000)
    assert all(client.strlen(k) <= 1000 for k in pieces)
    # The values are the shard file's bytes: the same push through shared memory gives them.
    make_pusher(store, shm_root=shm_root).push(sd, version=2)
    file = store.index(2)["odd.weight"].chunks[0].location["file"]
    assert b"".join(client.get(k) for k in pieces) == Path(file).read_bytes()

    source, rng = ChunkSource(redis_url, version=1), random.Random(0)
    for _ in range(80):
        name = rng.choice(sorted(index))
        box = random_box(index[name].shape, rng)
        expected = sd[name][tuple(slice(lo, hi) for lo, hi in box)]
        out = torch.empty(expected.shape)
        read_box(name, index[name], tuple(box), out, source)
        assert torch.equal(out, expected)
    source.close()


def test_a_corrupt_redis_value_is_a_clear_error(store, client, shm_root, redis_url, monkeypatch):
    monkeypatch.setattr(reader, "SLAB_BYTES", 4096)  # several slabs, the next one requested ahead
    sd = _state_dict()
    make_pusher(store, shm_root=shm_root, data_plane="redis").push(sd, version=3)
    fqn = "model.layers.0.mlp.up_proj.weight"
    chunk = store.index(3)[fqn].chunks[0]
    offset = chunk.location["offset"] + (50 * 64 + 10) * 4  # element [50, 10]
    key = f"{chunk.location['key']}:{offset // chunk.location['piece_bytes']}"
    within = offset % chunk.location["piece_bytes"]
    byte = client.getrange(key, within, within)
    client.setrange(key, within, bytes([byte[0] ^ 0x01]))
    source = ChunkSource(redis_url, 3)
    with pytest.raises(ChecksumMismatch) as err:
        read_box(fqn, store.index(3)[fqn], ((0, 96), (0, 64)), torch.empty(96, 64), source)
    assert fqn in str(err.value) and "weight version 3" in str(err.value) and key in str(err.value)
    # The same source still reads other tensors correctly (the slab requested ahead is dropped).
    other = "model.layers.0.self_attn.o_proj.weight"
    out = torch.empty(48, 64)
    read_box(other, store.index(3)[other], ((0, 48), (64, 128)), out, source)
    assert torch.equal(out, sd[other][:, 64:])
    source.close()


def test_retire_deletes_the_data_keys_with_the_version(store, client, shm_root):
    pusher = make_pusher(store, shm_root=shm_root, keep_last=1, data_plane="redis")
    pusher.push(_state_dict(1), 1)
    store.lease(1, "policy-0")
    pusher.push(_state_dict(2), 2)
    pusher.push(_state_dict(3), 3)
    assert store.versions() == [1, 3]  # 2 retired; 1 is leased
    assert not _data_keys(client, store.run, 2) and not client.exists(f"ws:{store.run}:v2:data")
    assert _data_keys(client, store.run, 1) and _data_keys(client, store.run, 3)
    store.lease(3, "policy-0")  # releases 1
    pusher.push(_state_dict(4), 4)
    assert store.versions() == [3, 4] and not _data_keys(client, store.run, 1)
    pusher.remove_all()
    assert not any(":data" in k for k in _keys(client, store.run))


def test_removing_a_runs_data_leaves_runs_its_name_matches_as_a_pattern(redis_url, shm_root):
    from weightsync.store import WeightStore

    tag = uuid.uuid4().hex[:6]
    stores = [WeightStore(redis_url, name) for name in (f"a*{tag}", f"ab{tag}")]
    try:
        pushers = [make_pusher(s, shm_root=shm_root, keep_last=1, data_plane="redis") for s in stores]
        for pusher in pushers:
            pusher.push(_state_dict(1), 1)
        pushers[0].remove_all()
        assert not any(b":data:" in k for k in stores[0].run_keys())
        assert any(b":data:" in k for k in stores[1].run_keys()) and stores[1].use_counts() == {"1:0": 1}
    finally:
        for store in stores:
            store.clear_run()
            store.close()


def test_clearing_a_run_deletes_all_its_keys_and_no_other_runs(redis_url, client, shm_root):
    """Between runs of one name on a shared Redis: versions, leases, data and reservations go;
    runs whose names match the first one's as a glob pattern keep theirs."""
    from weightsync.store import WeightStore

    tag = uuid.uuid4().hex[:6]
    stores = {name: WeightStore(redis_url, name) for name in (f"a*{tag}", f"ab{tag}", f"a*{tag}-2")}
    try:
        for store in stores.values():
            pusher = make_pusher(store, shm_root=shm_root, keep_last=2, data_plane="redis")
            pusher.push(_state_dict(1), 1)
            pusher.push(_state_dict(2), 2)
            store.lease(2, "policy-0")
            client.set(store.reserve_prefix("x") + ":0", b"\0" * 100)
        target = stores[f"a*{tag}"]
        before = {k for k in _keys(client, target.run) if k.startswith(f"ws:{target.run}:")}
        assert {k for k in before if ":data:" in k} and f"ws:{target.run}:v2:leases" in before
        data_bytes = sum(client.strlen(k) for k in before if ":data:" in k)
        keys, held = target.clear_run()
        assert keys == len(before) and held >= data_bytes
        assert not client.keys(f"ws:a\\*{tag}:*") and target.run_keys() == []
        for name in (f"ab{tag}", f"a*{tag}-2"):  # "a*" as a pattern would have matched these
            assert stores[name].versions() == [1, 2] and any(":data:" in k.decode() for k in stores[name].run_keys())
    finally:
        for store in stores.values():
            store.clear_run()
            store.close()


def test_run_names_with_a_colon_are_refused(redis_url):
    from weightsync.store import WeightStore

    with pytest.raises(ValueError, match="hold no ':'"):
        WeightStore(redis_url, "a:v1")  # its keys would be run "a"'s


def test_a_failed_redis_push_leaves_no_keys(store, client, shm_root, monkeypatch):
    def fail(*args, **kwargs):
        assert _data_keys(client, store.run, 1)  # the values are written by then
        raise ConnectionError("control plane went away")

    monkeypatch.setattr(store, "put_part", fail)
    with pytest.raises(ConnectionError):
        make_pusher(store, shm_root=shm_root, data_plane="redis").push(_state_dict(), version=1)
    assert _keys(client, store.run) == set()
    assert store.versions() == [] and store.latest() is None


def test_a_push_that_redis_refuses_for_memory_is_a_clear_error_and_leaves_no_keys(shm_root):
    from weightsync.redis_server import LocalRedis
    from weightsync.redis_space import NotEnoughRedisMemory
    from weightsync.store import WeightStore

    big = {"w": torch.randn(1024, 1024)}  # 4 MiB
    with LocalRedis() as server:
        client = redis.Redis.from_url(server.url)
        client.config_set("maxmemory", client.info("memory")["used_memory"] + 2**20)
        store = WeightStore(server.url, "capped")
        with pytest.raises(NotEnoughRedisMemory, match=r"lack of memory \(maxmemory .* MiB in use.*keep_last"):
            make_pusher(store, shm_root=shm_root, data_plane="redis").push(big, version=1)
        assert store.run_keys() == [] and store.versions() == []
        store.close()
        client.close()


def test_redis_holds_a_pushed_shard_in_about_its_own_bytes(shm_root):
    """Values of exactly 8 MiB would take 10 MiB each of a capped Redis's maxmemory."""
    from weightsync.redis_server import LocalRedis
    from weightsync.store import WeightStore

    state = {f"w{i}": torch.randn(1024, 1024) for i in range(12)}  # 48 MiB
    with LocalRedis() as server:
        client = redis.Redis.from_url(server.url)
        before = client.info("memory")["used_memory"]
        store = WeightStore(server.url, "footprint")
        make_pusher(store, shm_root=shm_root, data_plane="redis").push(state, version=1)
        grown = client.info("memory")["used_memory"] - before
        assert grown < 1.05 * 48 * 2**20, grown / 2**20
        store.close()
        client.close()


def _redis_rss(server) -> int:
    import psutil

    return psutil.Process(server.pid).memory_info().rss


@pytest.mark.parametrize("reserve", [True, False])
def test_the_first_redis_pushes_write_into_memory_reserved_at_start(shm_root, reserve):
    """With keep_last=1 a run holds two versions' values while it pushes: reserved at start, the
    first two pushes find Redis's pages there; unreserved, Redis allocates them then."""
    from weightsync.redis_server import LocalRedis
    from weightsync.store import WeightStore

    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(1000, 2048, generator=g) for i in range(4)}  # 31.25 MiB: 4 values
    shard = sum(t.numel() * t.element_size() for t in sd.values())
    with LocalRedis() as server:  # its own: the session's Redis has pages freed by other tests
        store = WeightStore(server.url, "first")
        pusher = make_pusher(store, shm_root=shm_root, keep_last=1, data_plane="redis")
        start = _redis_rss(server)
        if reserve:
            pusher.reserve(sd)
        pusher.push(sd, 1)  # waits for the reservation
        assert pusher.reserve_error is None
        after_first = _redis_rss(server)
        pusher.push(sd, 2)
        grown = _redis_rss(server) - start
        assert 1.9 * shard < grown < 2.3 * shard  # the two versions' values, whether reserved or not
        if reserve:
            assert after_first - start > 1.9 * shard  # both versions' pages were there before push 1
            with redis.Redis.from_url(server.url) as client:
                assert not _keys(client, "first:reserve")  # deleted once reserved
        else:
            assert after_first - start < 1.2 * shard
        pusher.remove_all()


def test_a_redis_reservation_beyond_maxmemory_is_logged_and_leaves_no_keys(shm_root, caplog):
    from weightsync.redis_server import LocalRedis
    from weightsync.store import WeightStore

    sd = {"w": torch.zeros(4096, 4096)}  # 64 MiB
    with LocalRedis() as server, redis.Redis.from_url(server.url) as client:
        client.config_set("maxmemory", 40 * 2**20)
        pusher = make_pusher(WeightStore(server.url, "full"), shm_root=shm_root, keep_last=1, data_plane="redis")
        pusher.reserve(sd, background=False)
        assert isinstance(pusher.reserve_error, redis.RedisError) and "OOM" in str(pusher.reserve_error)
        assert "could not reserve 144 MiB of Redis memory" in caplog.text  # 2 x 9 values of 8 MiB
        assert client.dbsize() == 0


def test_reading_a_retired_version_from_redis_is_a_clear_error(store, shm_root, redis_url):
    pusher = make_pusher(store, shm_root=shm_root, keep_last=1, data_plane="redis")
    pusher.push(_state_dict(1), 1)
    entry = store.index(1)["model.norm.weight"]
    pusher.push(_state_dict(2), 2)  # retires 1
    source = ChunkSource(redis_url, 1)
    with pytest.raises(redis.RedisError, match="is missing or short.*was dropped"):
        read_box("model.norm.weight", entry, ((0, 64),), torch.empty(64), source)
    # The source drops the connection that still had replies in flight and reads on correctly.
    name = "model.layers.0.self_attn.o_proj.weight"
    out = torch.empty(48, 64)
    read_box(name, store.index(2)[name], ((0, 48), (0, 64)), out, source)
    assert torch.equal(out, _state_dict(2)[name][:, :64])
    source.close()


def test_raw_redis_round_trips_pipelined_values_into_buffers(redis_url, client):
    rng = random.Random(0)
    values = [bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 7, 3000, 70000]))) for _ in range(30)]
    keys = [f"rawtest:{uuid.uuid4().hex}:{i}" for i in range(len(values))]
    raw = RawRedis(redis_url)
    try:
        raw.set_pieces(keys, [[v[: len(v) // 2], memoryview(v)[len(v) // 2 :]] for v in values])
        assert [client.get(k) for k in keys] == values
        ranges, expected = [], b""
        for k, v in zip(keys, values):
            if v:
                lo = rng.randrange(len(v))
                hi = rng.randrange(lo + 1, len(v) + 1)
                ranges.append((k.encode(), lo, hi - lo))
                expected += v[lo:hi]
        out = bytearray(len(expected))
        raw.getrange_into(ranges, memoryview(out))
        assert bytes(out) == expected
        with pytest.raises(redis.RedisError):
            raw.getrange_into([(b"rawtest:missing", 0, 10)], memoryview(bytearray(10)))
    finally:
        raw.close()
        client.delete(*keys)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("missing_at", [None, 0, 17, 39])
def test_raw_redis_reads_runs_of_equal_ranges_and_never_waits_on_a_missing_value(redis_url, client, missing_at):
    """Column slices are runs of equal ranges, parsed as fixed-size records; a missing value
    anywhere in a run (first, middle, last) is an error, not a read that waits forever."""
    value = bytes(random.Random(1).randrange(256) for _ in range(40 * 64))
    key = f"rawtest:{uuid.uuid4().hex}"
    client.set(key, value)
    ranges = [(key.encode(), row * 64 + 16, 32) for row in range(40)]  # the middle half of 40 rows
    if missing_at is not None:
        ranges[missing_at] = (b"rawtest:missing", 0, 32)
    raw = RawRedis(redis_url)
    try:
        out = bytearray(40 * 32)
        if missing_at is None:
            raw.getrange_into(ranges, memoryview(out))
            assert bytes(out) == b"".join(value[row * 64 + 16 : row * 64 + 48] for row in range(40))
        else:
            with pytest.raises(redis.RedisError, match="missing or short"):
                raw.getrange_into(ranges, memoryview(out))
    finally:
        raw.close()
        client.delete(key)
