"""The cross-host data plane: the same safetensors shard bytes, stored as Redis string values.

A trainer rank's shard (exactly the bytes ``ShmSafetensorsWriter`` would write to ``/dev/shm``:
header, then each chunk's raw bytes) is cut into pieces of ``PIECE_BYTES`` and stored under
``ws:{run}:v{version}:data:{rank}:{i}``. The keys are registered in the set of their storage
unit (version, rank) before they are written, so ``WeightStore.retire`` deletes them atomically
once no committed version uses the unit (and ``abort`` for a failed push). A chunk's location in the index is
``{"kind": "redis", "key": <prefix>, "piece_bytes": ..., "offset": <first byte in the shard>}``;
a policy on another host needs nothing but the Redis address.

Readers fetch exact byte ranges with ``GETRANGE`` (one range per contiguous run: a whole row
block of a row slice, one row of a column slice; runs longer than ``RANGE_BYTES`` are split),
pipelined with a bounded window of bytes in flight. Measured here, Redis serves 1 MiB ranges
with an 8 MiB window 2-3x faster than whole 8 MiB values (it copies each reply into freshly
allocated reply buffers, and writes a client at most 64 KiB per event-loop turn). The reader
asks for the next slab before it verifies and copies the current one, so Redis works meanwhile.

``RawRedis`` speaks RESP on the socket of a redis-py connection (which did the connect, AUTH and
SELECT) so that values go out from tensor memory and replies land in the caller's buffer: no
Python ``bytes`` object per value or per range.
"""

from __future__ import annotations

import torch
from redis import ConnectionPool, RedisError

from weightsync.shm_writer import ShmSafetensorsWriter

# Bytes per stored value. Not 8 MiB: Redis allocates a value with its string header (and, for a
# large SET, the protocol's CRLF), which pushes exactly 8 MiB past jemalloc's 8 MiB size class into
# the next one, 10 MiB, and maxmemory counts allocations: a quarter of a capped Redis would go to
# waste. 64 bytes less fits the class (used_memory per value measured 7.9 vs 10.6 MiB).
PIECE_BYTES = 8 * 2**20 - 64
RANGE_BYTES = 2**20  # longest single GETRANGE
WINDOW_BYTES = 8 * 2**20  # replies in flight while reading
SMALL_RANGE_BYTES = 2**16  # runs of equal ranges up to this size are parsed as fixed-size records
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
        self._scratch = torch.empty(0, dtype=torch.uint8)

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

    def set_pieces(self, keys: list[str], pieces: list[list[memoryview | bytes]], expire_ms: int | None = None) -> None:
        """``SET keys[i]`` to the concatenation of ``pieces[i]``, pipelined, sent from the buffers
        (``expire_ms``: each key expires that long after it is set)."""
        expiry = b"" if expire_ms is None else b"$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(expire_ms)), expire_ms)
        for key, parts in zip(keys, pieces):
            k = key.encode()
            size = sum(len(p) for p in parts)
            head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 if not expiry else 5, len(k), k, size)
            self._sock.sendall(head)
            for part in parts:
                self._sock.sendall(part)
            self._sock.sendall(b"\r\n" + expiry)
        for _ in keys:
            self._read_ok()

    def send_getranges(self, ranges: list[tuple[bytes, int, int]]) -> None:
        """Send ``GETRANGE`` for each ``(key, start, length)``; read the replies with ``recv_ranges_into``."""
        batch = bytearray()
        for key, start, length in ranges:
            first, last = b"%d" % start, b"%d" % (start + length - 1)
            batch += b"*4\r\n$8\r\nGETRANGE\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (
                len(key),
                key,
                len(first),
                first,
                len(last),
                last,
            )
        self._sock.sendall(batch)

    def recv_ranges_into(self, ranges: list[tuple[bytes, int, int]], dst: memoryview) -> None:
        """Read the replies to ``send_getranges(ranges)`` into ``dst``, in order."""
        pos = i = 0
        while i < len(ranges):
            length = ranges[i][2]
            j = i + 1
            while j < len(ranges) and ranges[j][2] == length:
                j += 1
            if j - i > 1 and length <= SMALL_RANGE_BYTES:
                self._recv_equal_run(j - i, length, dst[pos : pos + (j - i) * length])
                pos += (j - i) * length
            else:
                for key, _, n in ranges[i:j]:
                    self._read_bulk_into(dst[pos : pos + n], key)
                    pos += n
            i = j

    def _recv_equal_run(self, count: int, length: int, dst: memoryview) -> None:
        """``count`` replies of ``length`` bytes each (the rows of a column slice), parsed at once.

        The replies are fixed-size records ``$<length>CRLF<bytes>CRLF``: they are received into
        a scratch buffer in large reads, their framing checked with vectorised compares as they
        arrive (so a short or error reply is caught at once, never waited on), and their bytes
        copied out with one strided copy.
        """
        header = b"$%d\r\n" % length
        record = len(header) + length + 2
        total = count * record
        if self._scratch.numel() < total:
            self._scratch = torch.empty(total, dtype=torch.uint8)
        scratch = self._scratch[:total]
        view = memoryview(scratch.numpy())
        got = min(total, self._hi - self._lo)
        view[:got] = self._view[self._lo : self._lo + got]
        self._lo += got
        head = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        crlf = torch.frombuffer(bytearray(b"\r\n"), dtype=torch.uint8)
        checked = 0
        while True:
            done = got // record
            if done > checked:
                recs = scratch[checked * record : done * record].view(-1, record)
                if not (
                    torch.equal(recs[:, : len(header)], head.expand(done - checked, -1))
                    and torch.equal(recs[:, -2:], crlf.expand(done - checked, -1))
                ):
                    raise RedisError(self._bad_reply(view, checked, done, record, header))
                checked = done
            if got == total:
                break
            partial = bytes(view[done * record : min(got, done * record + len(header))])
            if partial != header[: len(partial)]:  # a short or error reply: no more bytes will come
                raise RedisError(self._bad_reply(view, done, done + 1, record, header))
            n = self._sock.recv_into(view[got:], total - got)
            if not n:
                raise ConnectionError("Redis closed the connection in the middle of a reply")
            got += n
        out = torch.frombuffer(dst, dtype=torch.uint8).view(count, length)
        out.copy_(scratch.view(count, record)[:, len(header) : len(header) + length])

    @staticmethod
    def _bad_reply(view: memoryview, first: int, stop: int, record: int, header: bytes) -> str:
        for k in range(first, stop):
            head = bytes(view[k * record : k * record + len(header)])
            if head != header[: len(head)]:
                return (
                    f"reply {k} of a batch of GETRANGE starts {head!r}, expected {header!r}: a Redis value "
                    "is missing or short (its weight version was dropped, or the key was evicted)"
                )
        return f"reply framing broken in replies {first}..{stop} (expected {header!r} records)"

    def getrange_into(self, ranges: list[tuple[bytes, int, int]], dst: memoryview) -> None:
        """Fill ``dst`` with the byte ranges ``(key, start, length)``, in order: batches of half
        ``WINDOW_BYTES``, the next one requested before the current one is read."""
        batches, size = [[]], 0
        for r in ranges:
            if size >= WINDOW_BYTES // 2:
                batches.append([])
                size = 0
            batches[-1].append(r)
            size += r[2]
        self.send_getranges(batches[0])
        pos = 0
        for k, batch in enumerate(batches):
            if k + 1 < len(batches):
                self.send_getranges(batches[k + 1])
            n = sum(length for _, _, length in batch)
            self.recv_ranges_into(batch, dst[pos : pos + n])
            pos += n


def piece_ranges(location: dict, start: int, length: int) -> list[tuple[bytes, int, int]]:
    """``(key, start, length)`` GETRANGE requests for ``length`` bytes at ``start`` of a chunk."""
    size = location["piece_bytes"]
    pos = location["offset"] + start
    end = pos + length
    out = []
    while pos < end:
        piece, within = divmod(pos, size)
        n = min(end - pos, size - within, RANGE_BYTES)
        out.append((f"{location['key']}:{piece}".encode(), within, n))
        pos += n
    return out


class RedisSafetensorsWriter(ShmSafetensorsWriter):
    """The shard writer of ``ShmSafetensorsWriter``, storing the shard as Redis values instead.

    ``path`` is only DCP's name for the checkpoint; nothing is written to the file system.
    """

    def __init__(self, path: str, store, version: int, checksums: bool = True, **delta) -> None:
        super().__init__(path, checksums=checksums, **delta)
        self.store = store
        self.version = version
        self.keys: list[str] = []

    @property
    def prefix(self) -> str:
        return self.store.data_prefix(self.version, self.shard_index - 1)

    def prepare_local_plan(self, plan):
        return plan  # no directory to make

    def _emit(self, file_name: str, parts: list[memoryview | bytes]) -> None:
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
        self.store.register_data(self.version, self.shard_index - 1, self.keys)
        client = RawRedis(self.store.url)
        try:
            client.set_pieces(self.keys, pieces)
        finally:
            client.close()

    def location(self, name: str, byte_offset: int) -> dict:
        return {
            "kind": "redis",
            "key": self.prefix,
            "piece_bytes": PIECE_BYTES,
            "offset": byte_offset,
            "unit": self.unit,
            "push": self.push_id,
        }


def tensor_view(buf: torch.Tensor, nbytes: int) -> memoryview:
    """A writable memoryview of the first ``nbytes`` of a uint8 tensor."""
    return memoryview(buf[:nbytes].numpy()).cast("B")
