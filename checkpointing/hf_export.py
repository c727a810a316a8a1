"""Export the trainer's weights as a consolidated Hugging Face model directory, written by all ranks.

Each rank writes its own shards with DCP's ``HuggingFaceStorageWriter``; the ranks then
consolidate them together with DCP's ``consolidate_safetensors_files_on_every_rank`` (each rank
assembles some of the output files) into ``model-0000i-of-0000N.safetensors`` plus
``model.safetensors.index.json`` mapping every weight to its file. Rank 0 adds ``config.json``
and the tokenizer files and renames the folder into place, so a reader never sees half an export.
Tied weights (a tied LM head) are stored once, as ``transformers`` itself saves them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank

from checkpointing.dcp_io import CachingSavePlanner, gc_paused

# Files copied from the source model directory beside the weights.
SIDE_FILES = ("generation_config.json", "special_tokens_map.json", "chat_template.jinja")
SIDE_PREFIXES = ("tokenizer", "vocab", "merges")


def file_index_mapping(shapes_and_sizes: dict[str, int], max_shard_bytes: int) -> dict[str, int]:
    """Assign tensors (in order) to files 1..N so that each file holds at most ``max_shard_bytes``
    (a tensor larger than that gets a file of its own)."""
    mapping, index, used = {}, 1, 0
    for fqn, nbytes in shapes_and_sizes.items():
        if used and used + nbytes > max_shard_bytes:
            index, used = index + 1, 0
        mapping[fqn] = index
        used += nbytes
    return mapping


def _global_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()  # a DTensor's numel is the global one


def export_hf(
    state_dict: dict[str, torch.Tensor],
    out_dir: str | Path,
    model_config,
    source_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 2 << 30,
) -> Path:
    """Write ``state_dict`` (this rank's FSDP2 shards, or whole tensors) as a HF model directory.

    Every rank of the process group must call this with its own shards.
    """
    from weightsync.push import without_aliases

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.export-tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if distributed:
        dist.barrier()
    try:
        tensors = {k: (v.detach().to(dtype) if dtype else v.detach()) for k, v in without_aliases(state_dict).items()}
        mapping = file_index_mapping({k: _global_nbytes(v) for k, v in tensors.items()}, max_shard_bytes)
        sharded = tmp / "sharded"
        with gc_paused():
            dcp.save(
                tensors,
                storage_writer=HuggingFaceStorageWriter(
                    str(sharded), fqn_to_index_mapping=mapping, save_distributed=True
                ),
                planner=CachingSavePlanner("hf-export"),
                no_dist=not distributed,
            )
        consolidate_safetensors_files_on_every_rank(str(sharded), str(tmp), mapping)
        if rank == 0:
            shutil.rmtree(sharded)
            config = model_config.to_dict()
            if dtype is not None:
                config["dtype"] = str(dtype).removeprefix("torch.")
            model_config.__class__.from_dict(config).save_pretrained(tmp)
            for name in os.listdir(source_dir):
                if name in SIDE_FILES or name.startswith(SIDE_PREFIXES):
                    shutil.copy(Path(source_dir) / name, tmp / name)
            if out.exists():
                shutil.rmtree(out)
            os.rename(tmp, out)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if distributed:
        dist.barrier()
    return out
