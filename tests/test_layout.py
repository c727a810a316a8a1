"""The TP reshard planner against slicing full tensors directly, on random shapes and TP sizes."""

import random

import pytest
import torch

from weightsync.layout import Layout, plan_pieces


def _fill(name, shape, layout, full: dict[str, torch.Tensor]) -> torch.Tensor:
    """Build the local parameter from the planned pieces (padding rows stay NaN)."""
    local = torch.full(shape, float("nan"))
    for piece in plan_pieces(name, shape, layout):
        src = full[piece.hf_name][tuple(slice(a, b) for a, b in piece.src)]
        local[tuple(slice(a, b) for a, b in piece.dst)] = src
    return local


def _qkv_layout(rank, tp, heads, kv_heads, head_dim):
    # vLLM's rule: KV heads are split when there are at least tp of them, else replicated.
    num_kv = max(1, kv_heads // tp)
    replicas = max(1, tp // kv_heads)
    return Layout("qkv", rank, tp, 0, (heads // tp) * head_dim, num_kv * head_dim, num_kv * head_dim, rank // replicas)


CASES = [(tp, heads, kv) for tp in (1, 2, 4) for heads, kv in ((8, 8), (8, 2), (4, 1), (16, 4)) if heads % tp == 0]


@pytest.mark.parametrize("tp, heads, kv_heads", CASES)
def test_qkv_slices_match_direct_head_selection(tp, heads, kv_heads):
    rng = random.Random(tp * 100 + heads + kv_heads)
    head_dim, hidden = rng.choice([2, 4, 8]), rng.choice([6, 10])
    full = {
        "m.l.attn.q_proj.weight": torch.randn(heads * head_dim, hidden),
        "m.l.attn.k_proj.weight": torch.randn(kv_heads * head_dim, hidden),
        "m.l.attn.v_proj.weight": torch.randn(kv_heads * head_dim, hidden),
    }
    for rank in range(tp):
        layout = _qkv_layout(rank, tp, heads, kv_heads, head_dim)
        rows = layout.q_size + layout.k_size + layout.v_size
        got = _fill("m.l.attn.qkv_proj.weight", [rows, hidden], layout, full)
        q = full["m.l.attn.q_proj.weight"].view(heads, head_dim, hidden)
        k = full["m.l.attn.k_proj.weight"].view(kv_heads, head_dim, hidden)
        v = full["m.l.attn.v_proj.weight"].view(kv_heads, head_dim, hidden)
        q_heads = list(range(rank * heads // tp, (rank + 1) * heads // tp))
        if tp >= kv_heads:
            kv = [rank * kv_heads // tp]  # each KV head serves tp / kv_heads consecutive ranks
        else:
            kv = list(range(rank * kv_heads // tp, (rank + 1) * kv_heads // tp))
        expected = torch.cat([q[q_heads].reshape(-1, hidden), k[kv].reshape(-1, hidden), v[kv].reshape(-1, hidden)])
        assert torch.equal(got, expected)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_merged_column_row_and_replicated_slices(tp):
    g = torch.Generator().manual_seed(tp)
    inter, hidden = 8 * tp, 6
    full = {
        "m.mlp.gate_proj.weight": torch.randn(inter, hidden, generator=g),
        "m.mlp.up_proj.weight": torch.randn(inter, hidden, generator=g),
        "m.mlp.down_proj.weight": torch.randn(hidden, inter, generator=g),
        "m.attn.o_proj.bias": torch.randn(hidden, generator=g),
        "m.norm.weight": torch.randn(hidden, generator=g),
        "m.c.weight": torch.randn(4 * tp, hidden, generator=g),
    }
    for rank in range(tp):
        gate_up = _fill(
            "m.mlp.gate_up_proj.weight",
            [2 * inter // tp, hidden],
            Layout("merged", rank, tp, 0, output_sizes=(inter, inter)),
            full,
        )
        expected = torch.cat(
            [full["m.mlp.gate_proj.weight"].chunk(tp)[rank], full["m.mlp.up_proj.weight"].chunk(tp)[rank]]
        )
        assert torch.equal(gate_up, expected)
        down = _fill("m.mlp.down_proj.weight", [hidden, inter // tp], Layout("row", rank, tp, dim=1), full)
        assert torch.equal(down, full["m.mlp.down_proj.weight"].chunk(tp, dim=1)[rank])
        column = _fill("m.c.weight", [4, hidden], Layout("column", rank, tp, dim=0), full)
        assert torch.equal(column, full["m.c.weight"].chunk(tp)[rank])
        for name in ("m.attn.o_proj.bias", "m.norm.weight"):  # row-parallel bias, norms: whole on every rank
            assert torch.equal(_fill(name, [hidden], Layout("replicated"), full), full[name])


@pytest.mark.parametrize("vocab, tp", [(15, 1), (15, 2), (100, 2), (130, 4)])
def test_vocab_slices_with_padding(vocab, tp):
    hidden, pad_to = 4, 64
    padded = -(-vocab // pad_to) * pad_to
    full = {"emb.weight": torch.randn(vocab, hidden)}
    per_rank = padded // tp
    for rank in range(tp):
        start, end = min(rank * per_rank, vocab), min((rank + 1) * per_rank, vocab)  # vLLM's org_vocab indices
        got = _fill("emb.weight", [per_rank, hidden], Layout("vocab", rank, tp, vocab_start=start, vocab_end=end), full)
        padded_full = torch.cat([full["emb.weight"], torch.full((padded - vocab, hidden), float("nan"))])
        assert torch.equal(got[: end - start], padded_full[rank * per_rank : rank * per_rank + end - start])
        assert torch.isnan(got[end - start :]).all()  # padding rows are not written
