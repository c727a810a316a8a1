"""A DCP storage writer that writes each rank's safetensors shard straight from tensor memory.

PyTorch's ``HuggingFaceStorageWriter`` serialises a shard with ``safetensors.torch.save`` into
one Python ``bytes`` object and then writes that: two full copies of the shard, the first into
freshly allocated memory. This writer keeps everything else of it (DCP's planning, the shard
file names of ``save_distributed=True``, the ``DCP_SHARDING_INFO`` / ``DCP_VERSION`` header
metadata that DCP's own reader uses) and writes the safetensors header followed by each
tensor's bytes directly from the tensor: one copy, into the page cache of ``/dev/shm``.
The output is byte-for-byte a safetensors file that ``safe_open`` and DCP's
``HuggingFaceStorageReader`` read.

While writing, it records each chunk it wrote (``written``: offsets, sizes, dtype, byte offset in
the shard, tile checksums from ``weightsync.checksum`` unless ``checksums=False``), from which the
push builds the index. Subclasses send the same shard bytes elsewhere by overriding ``_emit``
(``weightsync.redis_data.RedisSafetensorsWriter`` stores them as Redis values).
"""

from __future__ import annotations

import json
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from weightsync.checksum import chunk_checksums

DCP_SHARDING_INFO_KEY = "DCP_SHARDING_INFO"  # header keys DCP's Hugging Face writer and reader use
DCP_VERSION_KEY = "DCP_VERSION"
HF_DCP_VERSION = "1.0"
SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def shard_file_name(shard_index: int) -> str:
    """DCP's name for rank ``shard_index - 1``'s single file with ``save_distributed=True``."""
    return f"shard-{shard_index:05d}-model-00001-of-00001.safetensors"


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy())


@dataclass(frozen=True)
class WrittenChunk:
    """One chunk as written into a shard: where it sits in the global tensor and in the shard."""

    offsets: list[int]
    sizes: list[int]
    dtype: torch.dtype
    byte_offset: int  # of its first byte in the shard (header included)
    checksum: dict | None


class ShmSafetensorsWriter(HuggingFaceStorageWriter):
    """``HuggingFaceStorageWriter(save_distributed=True)`` with a one-copy write path."""

    def __init__(self, path: str, checksums: bool = True) -> None:
        super().__init__(path=path, save_distributed=True)
        self.checksums = checksums
        self.written: dict[str, WrittenChunk] = {}
        self.shard_name: str | None = None
        self.shard_index = 0
        self.shard_bytes = 0

    def location(self, byte_offset: int) -> dict:
        """The index's location of a chunk that starts at ``byte_offset`` of this rank's shard."""
        return {"kind": "shm", "file": str(self.fs.concat_path(self.path, self.shard_name))}

    def _emit(self, file_name: str, parts: list[memoryview | bytes]) -> None:
        """Store the shard, given as consecutive byte strings."""
        with open(self.fs.concat_path(self.path, file_name), "wb") as f:
            for part in parts:
                f.write(part)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future: Future = Future()
        if not plan.items:
            future.set_result([])
            return future
        if any(item.type == WriteItemType.BYTE_IO for item in plan.items):
            raise ValueError("weight sync pushes tensors only; the state dict holds non-tensor values")
        self.shard_index = plan.storage_data["shard_index"]  # rank + 1
        file_name = shard_file_name(self.shard_index)
        tensors = []
        header: dict[str, dict] = {}
        sharding: dict[str, dict] = {}
        offset = 0
        for item in plan.items:
            tensor = planner.resolve_data(item)
            if not isinstance(tensor, torch.Tensor) or not tensor.is_cpu:
                raise ValueError(f"{item.index.fqn}: weight sync writes CPU tensors only")
            tensor = tensor.detach().contiguous()
            nbytes = tensor.numel() * tensor.element_size()
            header[item.index.fqn] = {
                "dtype": SAFETENSORS_DTYPES[tensor.dtype],
                "shape": list(tensor.shape),
                "data_offsets": [offset, offset + nbytes],
            }
            sharding[item.index.fqn] = {"saved_offsets": list(item.tensor_data.chunk.offsets)}
            tensors.append((item, tensor, offset, nbytes))
            offset += nbytes
        header["__metadata__"] = {
            DCP_SHARDING_INFO_KEY: json.dumps(sharding),
            DCP_VERSION_KEY: HF_DCP_VERSION,
            "format": "pt",
        }
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8-byte alignment
        data_start = 8 + len(raw)
        results = []
        parts: list[memoryview | bytes] = [struct.pack("<Q", len(raw)), raw]
        parts += [_tensor_bytes(tensor) for _, tensor, _, nbytes in tensors if nbytes]
        # The shard goes out on a thread (file writes and socket sends release the GIL) while
        # this one computes the checksums of the same, unchanging tensors.
        with ThreadPoolExecutor(1) as pool:
            emitted = pool.submit(self._emit, file_name, parts)
            for item, tensor, tensor_offset, nbytes in tensors:
                self.written[item.index.fqn] = WrittenChunk(
                    offsets=list(item.tensor_data.chunk.offsets),
                    sizes=list(tensor.shape),
                    dtype=tensor.dtype,
                    byte_offset=data_start + tensor_offset,
                    checksum=chunk_checksums(tensor) if self.checksums else None,
                )
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=nbytes,
                        storage_data=_StorageInfo(file_name, data_start + tensor_offset, nbytes),
                    )
                )
            emitted.result()
        self.shard_name = file_name
        self.shard_bytes = data_start + offset
        future.set_result(results)
        return future
