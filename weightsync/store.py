"""The tensor store's control plane, on Redis. Metadata is JSON; nothing is ever pickled.

Keys, for a run ``R`` and version ``v``:

- ``ws:R:v{v}:part:{rank}``  one trainer rank's chunk list (JSON), written before the commit
- ``ws:R:v{v}:index``        the committed index (JSON): fqn -> dtype, global shape, chunks
- ``ws:R:versions``          sorted set of committed versions
- ``ws:R:latest``            the newest committed version
- ``ws:R:v{v}:leases``       set of holders (policy replicas) that pin version ``v``

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
    location: dict  # {"kind": "shm", "file": "/dev/shm/..."}; the stored name equals the fqn


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: list[int]
    chunks: list[Chunk]


def _entry_to_json(entry: TensorEntry) -> dict:
    return {
        "dtype": entry.dtype,
        "shape": entry.shape,
        "chunks": [{"offsets": c.offsets, "sizes": c.sizes, "location": c.location} for c in entry.chunks],
    }


def _entry_from_json(raw: dict) -> TensorEntry:
    return TensorEntry(
        dtype=raw["dtype"],
        shape=list(raw["shape"]),
        chunks=[Chunk(list(c["offsets"]), list(c["sizes"]), dict(c["location"])) for c in raw["chunks"]],
    )


class VersionNotFound(KeyError):
    pass


class WeightStore:
    """Control-plane client for one run's weight versions."""

    def __init__(self, url: str, run: str) -> None:
        self.url = url
        self.run = run
        self._r = redis.Redis.from_url(url)

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
        """Forget an uncommitted version's parts (the data plane cleans up its own files)."""
        self._r.delete(*[self._key(f"v{version}", f"part:{rank}") for rank in range(world_size)])

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
        """Pin ``version`` for ``holder`` and release that holder's other leases."""
        for v in self.versions():
            if v != version:
                self._r.srem(self._key(f"v{v}", "leases"), holder)
        self._r.sadd(self._key(f"v{version}", "leases"), holder)

    def holders(self, version: int) -> set[str]:
        return {h.decode() for h in self._r.smembers(self._key(f"v{version}", "leases"))}

    # -- retention -----------------------------------------------------------------------------

    def droppable(self, keep_last: int) -> list[int]:
        """Committed versions outside the newest ``keep_last`` that no holder pins."""
        versions = self.versions()
        old = versions[: max(0, len(versions) - keep_last)]
        return [v for v in old if not self.holders(v)]

    def drop(self, version: int) -> None:
        pipe = self._r.pipeline(transaction=True)
        pipe.zrem(self._key("versions"), str(version))
        pipe.delete(self._key(f"v{version}", "index"), self._key(f"v{version}", "leases"))
        pipe.execute()

    def close(self) -> None:
        self._r.close()
