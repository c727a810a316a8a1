"""The tensor store's control plane, on Redis. Metadata is JSON; nothing is ever pickled.

Keys, for a run ``R``, version ``v`` and trainer rank ``r``:

- ``ws:R:v{v}:part:{r}``     one trainer rank's chunk list (JSON), written before the commit
- ``ws:R:v{v}:index``        the committed index (JSON): fqn -> dtype, global shape, chunks
- ``ws:R:versions``          sorted set of committed versions
- ``ws:R:latest``            the newest committed version
- ``ws:R:v{v}:leases``       set of holders (policy replicas) that pin version ``v``
- ``ws:R:unit:{v}:{r}``      set of the Redis data-plane keys that hold the bytes rank ``r``
  wrote for version ``v`` (``ws:R:v{v}:data:{r}:{piece}``, see ``weightsync.redis_data``);
  registered before they are written. Empty for the shared-memory plane, whose unit is the
  file ``ws-R/v{v}/shard-{r+1}-...``.
- ``ws:R:v{v}:uses``         the storage units (``"{v}:{r}"``) whose bytes version ``v``'s index
  points into: its own, and with delta sync older versions' (chunks that did not change)
- ``ws:R:refs``              hash: unit -> number of committed versions that use it

A version becomes visible only through ``commit``, which writes its index, adds it to
``versions``, moves ``latest`` and counts its uses in one MULTI/EXEC transaction, and only once
every rank's part is present: a reader can never see a half-written version. ``retire`` drops a
version and frees the units no remaining version uses (reference counting), so a chunk that a
newer version reuses outlives the version that wrote it.
"""

from __future__ import annotations

import json
import re
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

# KEYS: versions zset, refs hash; ARGV: keep_last, key prefix. Returns {dropped versions, freed
# units}: a dropped version releases its uses, and a unit no committed version uses any more is
# freed (its Redis data keys deleted here; its shared-memory file is the caller's to remove).
_RETIRE_LUA = (
    _DROP_DATA_LUA
    + """
local versions = redis.call('ZRANGE', KEYS[1], 0, -1)
local dropped, freed = {}, {}
for i = 1, #versions - tonumber(ARGV[1]) do
  local v = versions[i]
  local leases = ARGV[2] .. 'v' .. v .. ':leases'
  if redis.call('SCARD', leases) == 0 then
    redis.call('ZREM', KEYS[1], v)
    redis.call('DEL', ARGV[2] .. 'v' .. v .. ':index', leases)
    local uses = ARGV[2] .. 'v' .. v .. ':uses'
    for _, unit in ipairs(redis.call('SMEMBERS', uses)) do
      if redis.call('HINCRBY', KEYS[2], unit, -1) <= 0 then
        redis.call('HDEL', KEYS[2], unit)
        drop_data(ARGV[2] .. 'unit:' .. unit)
        table.insert(freed, unit)
      end
    end
    redis.call('DEL', uses)
    table.insert(dropped, v)
  end
end
return {dropped, freed}
"""
)

# KEYS: part keys; ARGV: the version's unit sets. Forgets an uncommitted version.
_ABORT_LUA = (
    _DROP_DATA_LUA
    + """
if #KEYS > 0 then redis.call('DEL', unpack(KEYS)) end
for _, set in ipairs(ARGV) do drop_data(set) end
return 1
"""
)


def unit_name(version: int, rank: int) -> str:
    """The storage unit of the bytes trainer rank ``rank`` wrote for ``version``."""
    return f"{version}:{rank}"


def parse_unit(unit: str) -> tuple[int, int]:
    version, rank = unit.split(":")
    return int(version), int(rank)


@dataclass(frozen=True)
class Retired:
    dropped: list[int]  # versions removed from the store
    freed: list[str]  # storage units no committed version uses any more


def _glob_escaped(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern (SCAN MATCH)."""
    return re.sub(r"([*?\[\]\\^])", r"\\\1", text)


class WeightStore:
    """Control-plane client for one run's weight versions."""

    def __init__(self, url: str, run: str) -> None:
        if not run or ":" in run:
            # Keys are "ws:<run>:...": with ':' in names, run "a" and run "a:v1" would share keys.
            raise ValueError(f"run name {run!r} must be non-empty and hold no ':'")
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
        """Merge all ranks' parts into the index and publish ``version`` atomically.

        The storage units its chunks point into (its own, and older versions' that delta sync
        reuses) are counted as used by it; a reused unit must still be in use by a committed
        version (the pusher reuses only chunks of the version it committed last).
        """
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
        own = {unit_name(version, rank) for rank in range(world_size)}
        reused = {c["location"]["unit"] for e in merged.values() for c in e["chunks"] if "unit" in c["location"]} - own
        if reused:
            counts = self._r.hmget(self._key("refs"), sorted(reused))
            gone = [u for u, n in zip(sorted(reused), counts) if n is None]
            if gone:
                raise RuntimeError(
                    f"cannot commit weight version {version}: it reuses chunks of storage units {gone}, "
                    "which were already freed"
                )
        pipe = self._r.pipeline(transaction=True)
        pipe.set(self._key(f"v{version}", "index"), json.dumps(merged))
        pipe.zadd(self._key("versions"), {str(version): version})
        pipe.set(self._key("latest"), version)
        pipe.delete(*part_keys)
        pipe.sadd(self._key(f"v{version}", "uses"), *sorted(own | reused))
        for unit in sorted(own | reused):
            pipe.hincrby(self._key("refs"), unit, 1)
        pipe.execute()
        return {fqn: _entry_from_json(e) for fqn, e in merged.items()}

    def abort(self, version: int, world_size: int) -> None:
        """Forget an uncommitted version: its parts and its Redis data keys (files are the caller's)."""
        parts = [self._key(f"v{version}", f"part:{rank}") for rank in range(world_size)]
        units = [self._key("unit", unit_name(version, rank)) for rank in range(world_size)]
        self._abort_script(keys=parts, args=units)

    # -- Redis data plane ----------------------------------------------------------------------

    def reserve_prefix(self, tag: str) -> str:
        """Key prefix of values written only to make Redis allocate memory, then deleted
        (``WeightPusher.reserve``); no version refers to them."""
        return self._key("reserve", tag)

    def drop_reserved(self, keys: list[str]) -> None:
        """Delete values written under ``reserve_prefix`` (those that exist)."""
        self._delete(keys)

    def _delete(self, keys: list) -> None:
        """Delete ``keys``, a thousand per command."""
        for i in range(0, len(keys), 1000):
            self._r.delete(*keys[i : i + 1000])

    def data_prefix(self, version: int, rank: int) -> str:
        """Key prefix of one rank's shard bytes for ``version`` (pieces are ``{prefix}:{i}``)."""
        return self._key(f"v{version}", "data", rank)

    def register_data(self, version: int, rank: int, keys: list[str]) -> None:
        """Record data keys of rank ``rank``'s unit of ``version`` before writing them, so that
        retire/abort delete them."""
        if keys:
            self._r.sadd(self._key("unit", unit_name(version, rank)), *keys)

    def drop_data(self, version: int, rank: int, keys: list[str]) -> None:
        """Delete some of a unit's data keys (one rank's, after its push failed)."""
        if keys:
            pipe = self._r.pipeline(transaction=True)
            pipe.delete(*keys)
            pipe.srem(self._key("unit", unit_name(version, rank)), *keys)
            pipe.execute()

    def drop_all_data(self) -> None:
        """Delete every unit's Redis data keys of this run and the use counts (at the end of a run)."""
        for data_set in self._r.scan_iter(match=_glob_escaped(self._key("unit", "")) + "*", count=1000):
            self._delete(list(self._r.smembers(data_set)))
            self._r.delete(data_set)
        self._r.delete(self._key("refs"))

    def run_keys(self) -> list[bytes]:
        """Every key this run has in Redis: versions, leases, parts, data, reservations."""
        return list(self._r.scan_iter(match=_glob_escaped(self._key("")) + "*", count=1000))

    def clear_run(self, keys: list[bytes] | None = None) -> tuple[int, int]:
        """Delete every key of this run (between runs, never while one runs); ``keys``: what
        ``run_keys`` just returned, to spare a second SCAN of the whole keyspace. Returns the keys
        deleted and the bytes Redis reported for them (``MEMORY USAGE``; 0 where a server does
        not allow that command: the keys go all the same)."""
        keys = self.run_keys() if keys is None else keys
        pipe = self._r.pipeline(transaction=False)
        for key in keys:
            pipe.memory_usage(key, samples=0)
        held = sum(n for n in pipe.execute(raise_on_error=False) if isinstance(n, int)) if keys else 0
        self._delete(keys)
        return len(keys), held

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

    def retire(self, keep_last: int) -> Retired:
        """Drop committed versions outside the newest ``keep_last`` that no holder pins.

        One atomic script: a lease taken concurrently either lands first (the version stays) or
        finds the version gone. Returns the dropped versions and the storage units no remaining
        version uses; their Redis data is deleted, their shared-memory files are the caller's.
        """
        dropped, freed = self._retire_script(
            keys=[self._key("versions"), self._key("refs")], args=[keep_last, self._key("")]
        )
        return Retired([int(v) for v in dropped], sorted((u.decode() for u in freed), key=parse_unit))

    def uses(self, version: int) -> set[str]:
        """The storage units a committed version's index points into."""
        return {u.decode() for u in self._r.smembers(self._key(f"v{version}", "uses"))}

    def use_counts(self) -> dict[str, int]:
        """Storage unit -> number of committed versions that use it."""
        return {k.decode(): int(n) for k, n in self._r.hgetall(self._key("refs")).items()}

    def close(self) -> None:
        self._r.close()
