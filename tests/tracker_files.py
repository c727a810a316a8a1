"""Read back what the trackers wrote: TensorBoard's scalars (with TensorBoard's own reader) and
the history rows of an offline W&B run's ``run-<id>.wandb`` file.

W&B 0.31 has no Python reader for its own files (its Go core writes them), so this follows the
file's documented layout: a 7-byte ``:W&B`` header, then LevelDB's log format (32 KiB blocks of
records with a 7-byte header: crc32c, length, type FULL/FIRST/MIDDLE/LAST) whose payloads are
W&B's own protobuf ``Record`` messages, parsed with W&B's own generated classes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, payload = 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        payload += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(payload)
            payload = b""
            yield record


def history(run_dir: Path) -> list[dict]:
    """Each logged row of the W&B run in ``run_dir`` (``.../wandb/offline-run-*``), by key."""
    (path,) = run_dir.glob("run-*.wandb")
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def run_ids(wandb_dir: Path) -> list[str]:
    """The W&B run id of each offline run folder under ``wandb_dir``."""
    return [next(p.glob("run-*.wandb")).stem[4:] for p in sorted(wandb_dir.glob("offline-run-*"))]


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Each scalar tag's ``(step, value)`` events in the event files under ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
