"""The tensor store's control plane, on Redis. Metadata is JSON; nothing is ever pickled.

Keys, for a run ``R`` and version ``v``:

- ``ws:R:v{v}:part:{rank}``  one trainer rank's chunk list (JSON), written before the commit
- ``ws:R:v{v}:index``        the committed index (JSON): fqn -> dtype, global shape, chunks
- ``ws:R:versions``          sorted set of committed versions
- ``ws:R:latest``            the newest committed version
- ``ws:R:v{v}:leases``       set of holders (policy replicas) that pin version ``v``
- ``ws:R:v{v}:data``         set of the Redis data-plane keys that hold ``v``'s shard bytes
  (``ws:R:v{v}:data:{rank}:{piece}``, see ``weightsync.redis_data``); registered before they are
  written, deleted with the version (by ``retire``, or by ``abort`` for a failed push)

A version becomes visible only through ``commit``, which writes its index, adds it to
``versions`` and moves ``latest`` in one MULTI/EXEC transaction, and only once every rank's part
is present: a reader can never see a half-written version.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a tensor: ``sizes`` elements at ``offsets`` of the global tensor."""

    offsets: list[int]
    sizes: list[int]
    # {"kind": "shm", "file": "/dev/shm/..."} (the stored name equals the fqn) or
    # {"kind": "redis", "key": "ws:R:v3:data:0", "piece_bytes": ..., "offset": ...}
    location: dict
    checksum: dict | None = None  # tile checksums, see weightsync.checksum


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: list[int]
    chunks: list[Chunk]


def _entry_to_json(entry: TensorEntry) -> dict:
    return {
        "dtype": entry.dtype,
        "shape": entry.shape,
        "chunks": [_chunk_to_json(c) for c in entry.chunks],
    }


def _chunk_to_json(chunk: Chunk) -> dict:
    out = {"offsets": chunk.offsets, "sizes": chunk.sizes, "location": chunk.location}
    if chunk.checksum is not None:
        out["checksum"] = chunk.checksum
    return out


def _entry_from_json(raw: dict) -> TensorEntry:
    return TensorEntry(
        dtype=raw["dtype"],
        shape=list(raw["shape"]),
        chunks=[
            Chunk(list(c["offsets"]), list(c["sizes"]), dict(c["location"]), c.get("checksum")) for c in raw["chunks"]
        ],
    )


class VersionNotFound(KeyError):
    pass


# KEYS: index of v, leases of v, versions zset; ARGV: holder, v, key prefix "ws:<run>:".
_LEASE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
for _, v in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
  if v ~= ARGV[2] then redis.call('SREM', ARGV[3] .. 'v' .. v .. ':leases', ARGV[1]) end
end
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""

# Deletes the data keys registered in the set KEYS[1]... and the set (in batches: Lua's unpack
# has a stack limit).
_DROP_DATA_LUA = """
local function drop_data(set)
  local keys = redis.call('SMEMBERS', set)
  for i = 1, #keys, 1000 do
    redis.call('DEL', unpack(keys, i, math.min(i + 999, #keys)))
  end
  redis.call('DEL', set)
end
"""

# KEYS: versions zset; ARGV: keep_last, key prefix. Returns the dropped versions.
_RETIRE_LUA = (
    _DROP_DATA_LUA
    + """
local versions = redis.call('ZRANGE', KEYS[1], 0, -1)
local dropped = {}
for i = 1, #versions - tonumber(ARGV[1]) do
  local v = versions[i]
  local leases = ARGV[2] .. 'v' .. v .. ':leases'
  if redis.call('SCARD', leases) == 0 then
    redis.call('ZREM', KEYS[1], v)
    redis.call('DEL', ARGV[2] .. 'v' .. v .. ':index', leases)
    drop_data(ARGV[2] .. 'v' .. v .. ':data')
    table.insert(dropped, v)
  end
end
return dropped
"""
)

# KEYS: part keys; ARGV: the version's data set. Forgets an uncommitted version.
_ABORT_LUA = (
    _DROP_DATA_LUA
    + """
if #KEYS > 0 then redis.call('DEL', unpack(KEYS)) end
drop_data(ARGV[1])
return 1
"""
)


class WeightStore:
    """Control-plane client for one run's weight versions."""

    def __init__(self, url: str, run: str) -> None:
        self.url = url
        self.run = run
        self._r = redis.Redis.from_url(url)
        # Server-side scripts keep lease/retire atomic. They build per-version key names from the
        # run prefix, which a single Redis instance allows (Redis Cluster would need hash tags).
        self._lease_script = self._r.register_script(_LEASE_LUA)
        self._retire_script = self._r.register_script(_RETIRE_LUA)
        self._abort_script = self._r.register_script(_ABORT_LUA)

    def _key(self, *parts: object) -> str:
        return ":".join(["ws", self.run, *map(str, parts)])

    # -- writer side ---------------------------------------------------------------------------

    def put_part(self, version: int, rank: int, entries: dict[str, TensorEntry]) -> None:
        """Record one rank's chunks of ``version`` (not visible to readers until ``commit``)."""
        payload = {fqn: _entry_to_json(e) for fqn, e in entries.items()}
        self._r.set(self._key(f"v{version}", f"part:{rank}"), json.dumps(payload))

    def commit(self, version: int, world_size: int) -> dict[str, TensorEntry]:
        """Merge all ranks' parts into the index and publish ``version`` atomically."""
        part_keys = [self._key(f"v{version}", f"part:{rank}") for rank in range(world_size)]
        parts = self._r.mget(part_keys)
        missing = [rank for rank, p in enumerate(parts) if p is None]
        if missing:
            raise RuntimeError(f"cannot commit weight version {version}: ranks {missing} wrote no part")
        merged: dict[str, dict] = {}
        for raw in parts:
            for fqn, entry in json.loads(raw).items():
                if fqn in merged:
                    if merged[fqn]["shape"] != entry["shape"] or merged[fqn]["dtype"] != entry["dtype"]:
                        raise RuntimeError(f"ranks disagree on the shape or dtype of {fqn!r}")
                    merged[fqn]["chunks"].extend(entry["chunks"])
                else:
                    merged[fqn] = entry
        pipe = self._r.pipeline(transaction=True)
        pipe.set(self._key(f"v{version}", "index"), json.dumps(merged))
        pipe.zadd(self._key("versions"), {str(version): version})
        pipe.set(self._key("latest"), version)
        pipe.delete(*part_keys)
        pipe.execute()
        return {fqn: _entry_from_json(e) for fqn, e in merged.items()}

    def abort(self, version: int, world_size: int) -> None:
        """Forget an uncommitted version: its parts and its Redis data keys (files are the caller's)."""
        parts = [self._key(f"v{version}", f"part:{rank}") for rank in range(world_size)]
        self._abort_script(keys=parts, args=[self._key(f"v{version}", "data")])

    # -- Redis data plane ----------------------------------------------------------------------

    def data_prefix(self, version: int, rank: int) -> str:
        """Key prefix of one rank's shard bytes for ``version`` (pieces are ``{prefix}:{i}``)."""
        return self._key(f"v{version}", "data", rank)

    def register_data(self, version: int, keys: list[str]) -> None:
        """Record data keys of ``version`` before writing them, so that retire/abort delete them."""
        if keys:
            self._r.sadd(self._key(f"v{version}", "data"), *keys)

    def drop_data(self, version: int, keys: list[str]) -> None:
        """Delete some of ``version``'s data keys (one rank's, after its push failed)."""
        if keys:
            pipe = self._r.pipeline(transaction=True)
            pipe.delete(*keys)
            pipe.srem(self._key(f"v{version}", "data"), *keys)
            pipe.execute()

    def drop_all_data(self) -> None:
        """Delete every version's Redis data keys of this run (at the end of a run)."""
        for data_set in self._r.scan_iter(match=self._key("v*", "data"), count=1000):
            keys = list(self._r.smembers(data_set))
            for i in range(0, len(keys), 1000):
                self._r.delete(*keys[i : i + 1000])
            self._r.delete(data_set)

    # -- reader side ---------------------------------------------------------------------------

    def latest(self) -> int | None:
        raw = self._r.get(self._key("latest"))
        return None if raw is None else int(raw)

    def versions(self) -> list[int]:
        return [int(v) for v in self._r.zrange(self._key("versions"), 0, -1)]

    def index(self, version: int) -> dict[str, TensorEntry]:
        raw = self._r.get(self._key(f"v{version}", "index"))
        if raw is None:
            raise VersionNotFound(
                f"weight version {version} of run {self.run!r} is not committed in the store "
                f"(committed: {self.versions()})"
            )
        return {fqn: _entry_from_json(e) for fqn, e in json.loads(raw).items()}

    def lease(self, version: int, holder: str) -> None:
        """Pin ``version`` for ``holder`` (releasing its other leases) before reading it.

        Atomic with retirement: a version is either still committed and now pinned, or this
        raises ``VersionNotFound``; it can never be dropped between the check and the pin.
        """
        ok = self._lease_script(
            keys=[self._key(f"v{version}", "index"), self._key(f"v{version}", "leases"), self._key("versions")],
            args=[holder, str(version), self._key("")],
        )
        if not ok:
            raise VersionNotFound(
                f"weight version {version} of run {self.run!r} is not committed (or was already dropped); "
                f"committed: {self.versions()}"
            )

    def holders(self, version: int) -> set[str]:
        return {h.decode() for h in self._r.smembers(self._key(f"v{version}", "leases"))}

    # -- retention -----------------------------------------------------------------------------

    def retire(self, keep_last: int) -> list[int]:
        """Drop committed versions outside the newest ``keep_last`` that no holder pins.

        One atomic script: a lease taken concurrently either lands first (the version stays) or
        finds the version gone. Returns the dropped versions; their data is the caller's to free.
        """
        dropped = self._retire_script(keys=[self._key("versions")], args=[keep_last, self._key("")])
        return [int(v) for v in dropped]

    def close(self) -> None:
        self._r.close()
