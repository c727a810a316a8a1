"""The ``weightsync`` config group: how trainer ranks push weights and policies read them.

The values and what each means are in ``configs/grpo.yaml``; this is their schema and checks.
"""

from __future__ import annotations

from dataclasses import dataclass

DATA_PLANES = ("shm", "redis")


@dataclass
class WeightSyncConfig:
    data_plane: str  # shm: shard files in shm_root (one host); redis: shard bytes as Redis values
    shm_root: str
    keep_last: int
    checksums: bool
    verify: bool
    delta: bool
    delta_max_live: float
    delta_elements: bool

    def rules(self) -> list[tuple[bool, str, str]]:
        return [
            (self.data_plane in DATA_PLANES, "data_plane", f"one of {list(DATA_PLANES)}"),
            (self.keep_last >= 1, "keep_last", "an integer >= 1"),
            (self.checksums or not self.verify, "verify", "false when weightsync.checksums=false (nothing to verify)"),
            (
                self.checksums or not self.delta,
                "delta",
                "false when weightsync.checksums=false (delta sync finds changed chunks by their checksums)",
            ),
            (self.delta_max_live >= 1, "delta_max_live", "a number >= 1 (1: one shard's bytes)"),
            (
                self.delta or not self.delta_elements,
                "delta_elements",
                "false unless weightsync.delta=true (element patches are a form of delta sync)",
            ),
        ]
