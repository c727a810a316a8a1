"""Room in the Redis data plane: what a run needs, what a capped Redis has left, and a clear error.

With ``data_plane=redis`` a run keeps ``keep_last`` versions of every trainer rank's shard as
Redis values plus the one being written. A shared Redis usually has ``maxmemory`` set (with
``noeviction``, as weights must not be evicted): without a check, the first push that does not
fit fails deep inside DCP with Redis's "OOM command not allowed". The launcher checks before
starting any actor (from the checkpoint's tensor sizes, against ``maxmemory`` minus what Redis
already uses), and a push that Redis still refuses fails with ``NotEnoughRedisMemory`` saying
what to change. A Redis without ``maxmemory`` (the private one) has no limit to check against.
"""

from __future__ import annotations

import redis

from weightsync.failures import caused_by
from weightsync.redis_data import PIECE_BYTES

REDIS_REMEDIES = (
    "Raise the Redis server's maxmemory (CONFIG SET maxmemory ...), lower weightsync.keep_last, or, "
    "with the trainer ranks and the policy on one host, push through shared memory (weightsync.data_plane=shm)."
)
_VALUE_OVERHEAD = 64  # bytes Redis needs per value beyond its data (key, object; the 8 MiB class fits)


class NotEnoughRedisMemory(RuntimeError):
    """The Redis server cannot hold the weight versions a run keeps (found at start from its
    ``maxmemory``, or by a push that Redis refused for lack of memory)."""


def redis_memory(url: str) -> tuple[int, int] | None:
    """``(maxmemory, used_memory)`` of the Redis at ``url``, or None when it sets no limit or does
    not say (managed services may refuse ``CONFIG GET``)."""
    client = redis.Redis.from_url(url)
    try:
        limit = int(client.config_get("maxmemory").get("maxmemory", 0))
        used = int(client.info("memory")["used_memory"])
    except (redis.RedisError, KeyError, ValueError):
        return None
    finally:
        client.close()
    return (limit, used) if limit > 0 else None


def stored_bytes(shard_bytes: int) -> int:
    """Redis memory that one shard of ``shard_bytes`` takes as ``PIECE_BYTES`` values."""
    return shard_bytes + -(-shard_bytes // PIECE_BYTES) * _VALUE_OVERHEAD


def check_redis_room(
    url: str, maxmemory: int, used: int, ranks: int, shard_bytes: int, keep_last: int, delta: bool
) -> None:
    """Raise ``NotEnoughRedisMemory`` unless ``maxmemory - used`` holds the shards a run keeps:
    ``keep_last + 1`` per rank (1 with delta sync, whose later shards are small)."""
    needed = 1 if delta else keep_last + 1
    total = needed * ranks * stored_bytes(shard_bytes)
    free = max(0, maxmemory - used)
    if free >= total:
        return
    kept = "" if delta else f": weightsync.keep_last={keep_last} + the one being written"
    raise NotEnoughRedisMemory(
        f"weight sync needs {total / 2**20:.1f} MiB of Redis memory at {url} ({ranks} trainer rank(s) x "
        f"{needed} shard(s) of {shard_bytes / 2**20:.1f} MiB{kept}), but its maxmemory is "
        f"{maxmemory / 2**20:.1f} MiB with {used / 2**20:.1f} MiB in use. " + REDIS_REMEDIES
    )


def out_of_memory(exc: BaseException) -> bool:
    """Was ``exc`` (or a failure DCP wrapped in it, or its cause) Redis refusing a write for lack of memory?"""
    return caused_by(
        exc,
        lambda e: (
            isinstance(e, redis.exceptions.OutOfMemoryError)  # redis-py's commands
            or (isinstance(e, redis.RedisError) and str(e).startswith("OOM "))
        ),  # RawRedis's replies
    )
