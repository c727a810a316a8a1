"""The cross-host data plane: the same safetensors shard bytes, stored as Redis string values.

A trainer rank's shard (exactly the bytes ``ShmSafetensorsWriter`` would write to ``/dev/shm``:
header, then each chunk's raw bytes) is cut into pieces of ``PIECE_BYTES`` and stored under
``ws:{run}:v{version}:data:{rank}:{i}``. The keys are registered in the version's data set
before they are written, so ``WeightStore.retire`` (and ``abort`` for a failed push) deletes them
atomically with the version. A chunk's location in the index is
``{"kind": "redis", "key": <prefix>, "piece_bytes": ..., "offset": <first byte in the shard>}``;
a policy on another host needs nothing but the Redis address.

Readers fetch exact byte ranges with ``GETRANGE`` (one range per contiguous run: a whole row
block of a row slice, one row of a column slice), pipelined with a bounded window of bytes in
flight. ``RawRedis`` speaks RESP on the socket of a redis-py connection (which did the connect,
AUTH and SELECT) so that values go out from tensor memory and replies land in the caller's
buffer: no Python ``bytes`` object per value or per range.
"""

from __future__ import annotations

import torch
from redis import ConnectionPool, RedisError

from weightsync.shm_writer import ShmSafetensorsWriter

PIECE_BYTES = 8 * 2**20
WINDOW_BYTES = 16 * 2**20  # replies in flight while reading
_RECV_BUFFER = 1 << 20


class RawRedis:
    """A pipelined RESP connection for bulk bytes: values out from memoryviews, replies into buffers."""

    def __init__(self, url: str) -> None:
        self._pool = ConnectionPool.from_url(url)
        self._conn = self._pool.make_connection()
        self._conn.connect()  # connect, AUTH, SELECT ... as redis-py does for this URL
        self._sock = self._conn._get_socket()
        self._buf = bytearray(_RECV_BUFFER)
        self._view = memoryview(self._buf)
        self._lo = self._hi = 0

    def close(self) -> None:
        self._conn.disconnect()
        self._pool.disconnect()

    # -- replies -------------------------------------------------------------------------------

    def _fill(self) -> None:
        if self._lo == self._hi:
            self._lo = self._hi = 0
        elif self._hi == len(self._buf):
            n = self._hi - self._lo
            self._buf[:n] = self._view[self._lo : self._hi]
            self._lo, self._hi = 0, n
        got = self._sock.recv_into(self._view[self._hi :])
        if not got:
            raise ConnectionError("Redis closed the connection in the middle of a reply")
        self._hi += got

    def _line(self) -> bytes:
        while True:
            end = self._buf.find(b"\r\n", self._lo, self._hi)
            if end >= 0:
                line = bytes(self._view[self._lo : end])
                self._lo = end + 2
                if line[:1] == b"-":
                    raise RedisError(line[1:].decode(errors="replace"))
                return line
            self._fill()

    def _read_ok(self) -> None:
        line = self._line()
        if line != b"+OK":
            raise RedisError(f"unexpected reply {line[:80]!r} (expected +OK)")

    def _read_bulk_into(self, dst: memoryview, key: bytes = b"") -> None:
        line = self._line()
        n = len(dst)
        if line[:1] != b"$" or int(line[1:]) != n:
            raise RedisError(
                f"Redis value {key.decode(errors='replace')!r} is missing or short (wanted {n} bytes, got reply "
                f"{line[:80]!r}): its weight version was dropped, or the key was evicted or overwritten"
            )
        have = min(n, self._hi - self._lo)
        dst[:have] = self._view[self._lo : self._lo + have]
        self._lo += have
        while have < n:
            got = self._sock.recv_into(dst[have:], n - have)
            if not got:
                raise ConnectionError("Redis closed the connection in the middle of a value")
            have += got
        while self._hi - self._lo < 2:
            self._fill()
        self._lo += 2  # the value's trailing CRLF

    # -- commands ------------------------------------------------------------------------------

    def set_pieces(self, keys: list[str], pieces: list[list[memoryview | bytes]]) -> None:
        """``SET keys[i]`` to the concatenation of ``pieces[i]``, pipelined, sent from the buffers."""
        for key, parts in zip(keys, pieces):
            k = key.encode()
            size = sum(len(p) for p in parts)
            self._sock.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, size))
            for part in parts:
                self._sock.sendall(part)
            self._sock.sendall(b"\r\n")
        for _ in keys:
            self._read_ok()

    def getrange_into(self, ranges: list[tuple[bytes, int, int]], dst: memoryview) -> None:
        """Fill ``dst`` with the byte ranges ``(key, start, length)``, in order, pipelined."""
        sent = received = in_flight = pos = 0
        while received < len(ranges):
            if sent < len(ranges) and in_flight <= WINDOW_BYTES // 2:
                batch = bytearray()
                while sent < len(ranges) and in_flight < WINDOW_BYTES:
                    key, start, length = ranges[sent]
                    first, last = b"%d" % start, b"%d" % (start + length - 1)
                    batch += b"*4\r\n$8\r\nGETRANGE\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (
                        len(key),
                        key,
                        len(first),
                        first,
                        len(last),
                        last,
                    )
                    in_flight += length
                    sent += 1
                self._sock.sendall(batch)
            key, _, length = ranges[received]
            self._read_bulk_into(dst[pos : pos + length], key)
            pos += length
            in_flight -= length
            received += 1


def piece_ranges(location: dict, start: int, length: int) -> list[tuple[bytes, int, int]]:
    """``(key, start, length)`` GETRANGE requests for ``length`` bytes at ``start`` of a chunk."""
    size = location["piece_bytes"]
    pos = location["offset"] + start
    end = pos + length
    out = []
    while pos < end:
        piece, within = divmod(pos, size)
        n = min(end - pos, size - within)
        out.append((f"{location['key']}:{piece}".encode(), within, n))
        pos += n
    return out


class RedisSafetensorsWriter(ShmSafetensorsWriter):
    """The shard writer of ``ShmSafetensorsWriter``, storing the shard as Redis values instead.

    ``path`` is only DCP's name for the checkpoint; nothing is written to the file system.
    """

    def __init__(self, path: str, store, version: int, checksums: bool = True) -> None:
        super().__init__(path, checksums=checksums)
        self.store = store
        self.version = version
        self.keys: list[str] = []
        self.prefix: str | None = None

    def prepare_local_plan(self, plan):
        return plan  # no directory to make

    def _emit(self, file_name: str, parts: list[memoryview | bytes]) -> None:
        self.prefix = self.store.data_prefix(self.version, self.shard_index - 1)
        pieces: list[list[memoryview | bytes]] = [[]]
        room = PIECE_BYTES
        for part in parts:
            view = memoryview(part).cast("B")
            while len(view):
                if room == 0:
                    pieces.append([])
                    room = PIECE_BYTES
                take = view[:room]
                pieces[-1].append(take)
                room -= len(take)
                view = view[len(take) :]
        self.keys = [f"{self.prefix}:{i}" for i in range(len(pieces))]
        self.store.register_data(self.version, self.keys)
        client = RawRedis(self.store.url)
        try:
            client.set_pieces(self.keys, pieces)
        finally:
            client.close()

    def location(self, byte_offset: int) -> dict:
        return {"kind": "redis", "key": self.prefix, "piece_bytes": PIECE_BYTES, "offset": byte_offset}


def tensor_view(buf: torch.Tensor, nbytes: int) -> memoryview:
    """A writable memoryview of the first ``nbytes`` of a uint8 tensor."""
    return memoryview(buf[:nbytes].numpy()).cast("B")
