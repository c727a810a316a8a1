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

# The Hugging Face architectures whose vLLM layers this table covers, each checked by a test that
# syncs weights into a TP=2 engine and compares logprobs with transformers'.
ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")

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


@dataclass(frozen=True)
class Layout:
    """How one local vLLM parameter is cut from Hugging Face tensors; plain data.

    ``kind`` is one of ``qkv``, ``merged`` (gate/up), ``column``, ``row``, ``vocab``,
    ``replicated``. Sizes are per TP partition, along ``dim`` (vLLM's ``output_dim`` for column
    kinds, ``input_dim`` for ``row``).
    """

    kind: str
    tp_rank: int = 0
    tp_size: int = 1
    dim: int = 0
    q_size: int = 0  # qkv: rows of q, k and v in this partition ...
    k_size: int = 0
    v_size: int = 0
    kv_rank: int = 0  # ... and which KV partition this rank holds (GQA heads replicated when tp > kv heads)
    output_sizes: tuple[int, ...] = ()  # merged: global sizes of the fused outputs (gate, up)
    vocab_start: int = 0  # vocab: the rows of the real (unpadded) vocabulary this rank holds
    vocab_end: int = 0


def layout_of(param_name: str, param: torch.Tensor, layer: torch.nn.Module) -> Layout:
    """Read ``param``'s layout off its vLLM layer class and attributes."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    module, leaf = _split_name(param_name)
    fused = any(module.endswith("." + fused_name) for fused_name, _, _ in STACKED_PARAMS)
    # vLLM's dense linear layout: weight [out, in], bias [out]. (A weight restored after CPU
    # repacking has lost its output_dim/input_dim attributes, hence the defaults.)
    out_dim = getattr(param, "output_dim", 0)
    tp = {"tp_rank": getattr(layer, "tp_rank", 0), "tp_size": getattr(layer, "tp_size", 1)}
    if isinstance(layer, QKVParallelLinear) and fused:
        return Layout(
            "qkv",
            dim=out_dim,
            q_size=layer.num_heads * layer.head_size,
            k_size=layer.num_kv_heads * layer.head_size,
            v_size=layer.num_kv_heads * layer.v_head_size,
            kv_rank=layer.tp_rank // layer.num_kv_head_replicas,
            **tp,
        )
    if isinstance(layer, MergedColumnParallelLinear) and fused:
        return Layout("merged", dim=out_dim, output_sizes=tuple(layer.output_sizes), **tp)
    if isinstance(layer, ColumnParallelLinear):
        return Layout("column", dim=out_dim, **tp)
    if isinstance(layer, RowParallelLinear) and leaf == "weight":
        return Layout("row", dim=getattr(param, "input_dim", 1), **tp)
    if isinstance(layer, VocabParallelEmbedding):
        idx = layer.shard_indices
        return Layout("vocab", vocab_start=idx.org_vocab_start_index, vocab_end=idx.org_vocab_end_index, **tp)
    return Layout("replicated")


def plan_pieces(param_name: str, shape: torch.Size | list[int], layout: Layout) -> list[Piece]:
    """The pieces that fill a local parameter of ``shape`` laid out as ``layout``."""
    module, leaf = _split_name(param_name)
    shape = list(shape)
    dim, rank = layout.dim, layout.tp_rank
    if layout.kind == "qkv":
        stem = module.rpartition(".")[0]
        sizes = {"q": layout.q_size, "k": layout.k_size, "v": layout.v_size}
        starts = {"q": rank * layout.q_size, "k": layout.kv_rank * layout.k_size, "v": layout.kv_rank * layout.v_size}
        offsets = {"q": 0, "k": layout.q_size, "v": layout.q_size + layout.k_size}
        return [
            Piece(
                f"{stem}.{hf}.{leaf}",
                *_along(shape, dim, (starts[s], starts[s] + sizes[s]), (offsets[s], offsets[s] + sizes[s])),
            )
            for fused_name, hf, s in STACKED_PARAMS
            if fused_name == "qkv_proj"
        ]
    if layout.kind == "merged":
        stem, _, fused = module.rpartition(".")
        out, dst_offset = [], 0
        for fused_name, hf, shard in STACKED_PARAMS:
            if fused_name != fused:
                continue
            size = layout.output_sizes[shard] // layout.tp_size
            out.append(
                Piece(
                    f"{stem}.{hf}.{leaf}",
                    *_along(shape, dim, (rank * size, (rank + 1) * size), (dst_offset, dst_offset + size)),
                )
            )
            dst_offset += size
        return out
    if layout.kind in ("column", "row"):
        n = shape[dim]
        return [Piece(param_name, *_along(shape, dim, (rank * n, (rank + 1) * n), (0, n)))]
    if layout.kind == "vocab":
        rows = layout.vocab_end - layout.vocab_start
        return [Piece(param_name, *_along(shape, 0, (layout.vocab_start, layout.vocab_end), (0, rows)))]
    return [Piece(param_name, _full(shape), _full(shape))]


def pieces_for(param_name: str, param: torch.Tensor, layer: torch.nn.Module) -> list[Piece]:
    """The pieces that fill ``param`` (named ``param_name``, owned by the vLLM ``layer``)."""
    return plan_pieces(param_name, param.shape, layout_of(param_name, param, layer))
