"""Which slices of which Hugging Face tensors make up each live vLLM parameter.

Each vLLM layer says its tensor-parallel layout through its class and attributes
(``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``ColumnParallelLinear``,
``RowParallelLinear``, ``VocabParallelEmbedding``, anything else replicated); one mapping table
(``STACKED_PARAMS``, as vLLM's own ``stacked_params_mapping``) says which Hugging Face tensors a
fused vLLM parameter is built from. A new architecture needs a table row, not a code path.

The output is a list of ``Piece``: copy ``src`` (a box in the global Hugging Face tensor) into
``dst`` (a box in the local vLLM parameter). Nothing here reads a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# (fused vLLM module name, Hugging Face module name, shard id)
STACKED_PARAMS: list[tuple[str, str, str | int]] = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]

# vLLM parameter name -> Hugging Face name it is stored under when the model ties embeddings.
TIED_ALIASES = {"lm_head.weight": "model.embed_tokens.weight"}

Box = tuple[tuple[int, int], ...]  # per dim: (start, stop)


@dataclass(frozen=True)
class Piece:
    hf_name: str
    src: Box  # in the global Hugging Face tensor
    dst: Box  # in the local vLLM parameter


def _full(shape: torch.Size | list[int]) -> Box:
    return tuple((0, n) for n in shape)


def _along(shape, dim: int, src: tuple[int, int], dst: tuple[int, int]) -> tuple[Box, Box]:
    """Boxes that span the whole parameter except along ``dim``, where they are ``src``/``dst``."""
    src_box = [(0, n) for n in shape]
    dst_box = list(src_box)
    src_box[dim], dst_box[dim] = src, dst
    return tuple(src_box), tuple(dst_box)


def _split_name(param_name: str) -> tuple[str, str]:
    module, _, leaf = param_name.rpartition(".")
    return module, leaf


def pieces_for(param_name: str, param: torch.Tensor, layer: torch.nn.Module) -> list[Piece]:
    """The pieces that fill ``param`` (named ``param_name``, owned by ``layer``)."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    module, leaf = _split_name(param_name)
    shape = param.shape
    fused = [(hf, shard) for fused_name, hf, shard in STACKED_PARAMS if module.endswith("." + fused_name)]

    if isinstance(layer, QKVParallelLinear) and fused:
        dim = getattr(param, "output_dim", 0)
        q_size = layer.num_heads * layer.head_size
        k_size = layer.num_kv_heads * layer.head_size
        v_size = layer.num_kv_heads * layer.v_head_size
        kv_rank = layer.tp_rank // layer.num_kv_head_replicas
        starts = {"q": layer.tp_rank * q_size, "k": kv_rank * k_size, "v": kv_rank * v_size}
        sizes = {"q": q_size, "k": k_size, "v": v_size}
        offsets = {"q": 0, "k": q_size, "v": q_size + k_size}
        stem = module[: -len("qkv_proj")]
        out = []
        for hf, shard in fused:
            src, dst = _along(
                shape,
                dim,
                (starts[shard], starts[shard] + sizes[shard]),
                (offsets[shard], offsets[shard] + sizes[shard]),
            )
            out.append(Piece(f"{stem}{hf}.{leaf}", src, dst))
        return out

    if isinstance(layer, MergedColumnParallelLinear) and fused:
        dim = getattr(param, "output_dim", 0)
        stem = module[: -len(module.rpartition(".")[2])]
        out, dst_offset = [], 0
        for hf, shard in fused:
            size = layer.output_sizes[shard] // layer.tp_size
            start = layer.tp_rank * size
            src, dst = _along(shape, dim, (start, start + size), (dst_offset, dst_offset + size))
            out.append(Piece(f"{stem}{hf}.{leaf}", src, dst))
            dst_offset += size
        return out

    # vLLM's dense linear layout: weight [out, in], bias [out]. (A weight restored after CPU
    # repacking has lost its output_dim/input_dim attributes, hence the defaults.)
    if isinstance(layer, ColumnParallelLinear):
        dim = getattr(param, "output_dim", 0)
        n = shape[dim]
        src, dst = _along(shape, dim, (layer.tp_rank * n, (layer.tp_rank + 1) * n), (0, n))
        return [Piece(param_name, src, dst)]

    if isinstance(layer, RowParallelLinear) and leaf == "weight":
        dim = getattr(param, "input_dim", 1)
        n = shape[dim]
        src, dst = _along(shape, dim, (layer.tp_rank * n, (layer.tp_rank + 1) * n), (0, n))
        return [Piece(param_name, src, dst)]

    if isinstance(layer, VocabParallelEmbedding):
        idx = layer.shard_indices
        rows = idx.org_vocab_end_index - idx.org_vocab_start_index
        src = ((idx.org_vocab_start_index, idx.org_vocab_end_index), (0, shape[1]))
        return [Piece(param_name, src, ((0, rows), (0, shape[1])))]

    return [Piece(param_name, _full(shape), _full(shape))]
