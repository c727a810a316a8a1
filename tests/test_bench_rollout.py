"""The rollout benchmark's pure helpers (no vLLM, no weights: models are built on the meta device)."""

from __future__ import annotations

import pytest

from bench.rollout import (
    SHAPE_136M,
    TARGET_136M_PARAMS,
    ceiling_tokens_per_s,
    count_generated,
    kv_cache_mib,
    matmul_flops,
    omp_binding,
    parameter_counts,
    scales_for,
)
from bench.weightsync import qwen3_config


def test_synthetic_model_has_about_136m_parameters():
    total, matmul = parameter_counts(qwen3_config(SHAPE_136M))
    assert abs(total - TARGET_136M_PARAMS) / TARGET_136M_PARAMS < 0.05
    hidden, vocab = SHAPE_136M[0], SHAPE_136M[3]
    assert total - matmul == hidden * vocab  # untied: only the input embedding table is a lookup


def test_tied_embeddings_count_as_matmul_parameters():
    config = qwen3_config((64, 1, 128, 100, 2, 1, 32))
    config.tie_word_embeddings = True
    total, matmul = parameter_counts(config)
    assert total == matmul


def test_ceiling_is_flops_over_two_per_parameter():
    flops = matmul_flops(seconds=0.5, n=1000)  # 2e9 FLOP in 0.5 s
    assert flops == pytest.approx(4e9)
    assert ceiling_tokens_per_s(flops, matmul_params=1_000_000) == pytest.approx(2000)


def test_generated_tokens_stop_at_the_first_eos():
    eos = 1
    assert count_generated([5, 6, eos, 0, 0], eos) == 3
    assert count_generated([5, 6, 7], eos) == 3


def test_batch_and_length_overrides():
    tiny, big = scales_for(["tiny", "136m"], batch=None, max_tokens=None)
    assert (tiny.batch, tiny.max_tokens, big.batch, big.max_tokens) == (512, 6, 128, 32)
    (one,) = scales_for(["136m"], batch=12, max_tokens=16)
    assert (one.prompts, one.samples, one.max_tokens) == (12, 1, 16)


def test_kv_cache_holds_whole_blocks_of_the_batch():
    config = qwen3_config(SHAPE_136M)
    per_token = 12 * 2 * 4 * 64 * 4
    assert kv_cache_mib(config, sequences=128, model_len=64) >= 128 * 128 * per_token / 2**20


def test_omp_binding_all_is_every_core_auto_is_vllms_own():
    assert omp_binding("all", [0, 1]) == "0-1"
    assert omp_binding("all", [0, 2, 3]) == "0,2,3"
    assert omp_binding("auto", [0, 1]) is None
    assert omp_binding("1", [0, 1]) == "1"
