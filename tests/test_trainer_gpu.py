"""The trainer group on GPUs: two NCCL ranks train like one (skipped without two CUDA devices)."""

from __future__ import annotations

import pytest
import torch

from tests.test_trainer_group import OPTIONS, _assert_same_weights, episodes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL trainer ranks)"),
]


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_two_nccl_ranks_train_like_one(ray_session, redis_url, tiny_model_path, shm_root, param_dtype):
    from tests.configs import trainer_group

    options = {**OPTIONS, "param_dtype": param_dtype, "reduce_dtype": "float32", "sync": {"shm_root": shm_root}}
    one = trainer_group(1, tiny_model_path, redis_url, "gpu-one", use_cuda=True, **options).start()
    two = trainer_group(2, tiny_model_path, redis_url, "gpu-two", use_cuda=True, micro_batch_size=2, **options).start()
    try:
        start = one.full_state_dict()
        for step in range(3):
            batch = episodes(11, seed=step)
            m1, m2 = one.train_step(batch), two.train_step(batch)
            tol = 1e-4 if param_dtype == "float32" else 2e-2  # bf16 compute: rounding differs by split
            assert m2["loss"] == pytest.approx(m1["loss"], rel=tol, abs=tol), step
        w1, w2 = one.full_state_dict(), two.full_state_dict()
        _assert_same_weights(w1, w2, atol=5e-5 if param_dtype == "float32" else 5e-3, adam_lr=OPTIONS["lr"])
        assert max((w1[k] - start[k]).abs().max().item() for k in w1) > 1e-3
        push = two.push_weights(1)
        assert push["bytes_written"] > 0  # NCCL ranks push from CPU copies of their shards
        assert push["ranks_wrote_over_spare"] == 2  # into the files reserved at start
    finally:
        for group in (one, two):
            for actor in group.ranks:
                ray_session.kill(actor)
