"""Chunks of every dtype a push stores and the shapes the tests' models have, for checksum tests
(imported by the CUDA tests too: nothing here needs more than torch)."""

from __future__ import annotations

import json
import math

import torch

CHUNK_CASES = [  # (sizes, dtype): every dtype a push stores, and the shapes the tests' models have
    ((64, 48), torch.float32),
    ((40, 128), torch.bfloat16),
    ((33, 10), torch.float32),
    ((300, 64), torch.float32),
    ((256, 96), torch.float16),
    ((1000,), torch.float32),
    ((7,), torch.bfloat16),
    ((9, 7), torch.float32),
    ((5, 3, 11), torch.float32),
    ((4096, 64), torch.bfloat16),  # many row blocks per batch
    ((17, 2, 8), torch.bfloat16),
    ((), torch.float32),
    ((513,), torch.int64),
    ((31, 5), torch.int32),
    ((64, 24), torch.int8),
    ((12, 33), torch.uint8),
    ((10, 16), torch.bool),
    ((6, 4), torch.float64),
]


def random_chunk(sizes, dtype, g) -> torch.Tensor:
    raw = torch.randint(0, 256, (max(1, math.prod(sizes)) * torch.empty(0, dtype=dtype).element_size(),), generator=g)
    t = raw.to(torch.uint8).view(dtype)[: math.prod(sizes)].view(sizes)
    return t if dtype != torch.bool else t.view(torch.uint8).bool()


CHUNK_IDS = [f"{s}-{d}".replace("torch.", "") for s, d in CHUNK_CASES]


def flip_stored_bit(path: str, name: str, element: int, elem: int) -> None:
    """Flip a bit of element ``element`` (flat index) of the tensor ``name`` stored in the
    safetensors file at ``path``, where its values are ``elem`` bytes each."""
    with open(path, "r+b") as f:
        header = int.from_bytes(f.read(8), "little")
        start = json.loads(f.read(header))[name]["data_offsets"][0]
        offset = 8 + header + start + element * elem
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
