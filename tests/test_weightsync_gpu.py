"""Weight sync on GPUs: N NCCL trainer ranks push, a vLLM engine with TP=N updates in place.

N = 1 (one GPU) and N = 2 (two GPUs; skipped with fewer). The trainer ranks are Ray actors with
one GPU each; the vLLM engine runs in the test process on the same GPUs (a small share of their
memory), so N GPUs hold both sides, as on a single box. The trainer starts from a perturbed copy of the tiny model and
takes one real training step; after the sync, vLLM's bf16 prompt logprobs equal those of the
trainer's weights (rounded to bf16, computed by ``transformers`` in float32) within bf16
tolerance, while before the sync they were far from them.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from tests.fsdp_push import perturbed_model
from tests.test_trainer_group import OPTIONS, episodes
from tests.test_weight_update import SEQUENCES, _hf_logprobs, _max_diff

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA devices (NCCL ranks, vLLM on GPU)"),
]
BF16_TOL = 0.1  # bf16 weights on both sides; bf16 activations in vLLM only (the weights' rounding
# alone moves these logprobs by up to 0.04; the perturbation by ~10)


def _vllm_logprobs(llm) -> list[list[float]]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in SEQUENCES], params, use_tqdm=False)
    return [[step[tok].logprob for tok, step in zip(ids[1:], o.prompt_logprobs[1:])] for ids, o in zip(SEQUENCES, outs)]


@pytest.fixture(scope="module", params=[1, 2], ids=["1gpu", "2gpus"])
def llm_gpu(request, tiny_model_path):
    """(a vLLM engine, its TP = the number of GPUs of the case and of trainer ranks)."""
    from vllm import LLM

    from actors.engine_shm import private_ipc_env
    from actors.policy import EXTENSION

    tp = request.param
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA devices")
    with private_ipc_env():  # the engine's ZeroMQ sockets, as the Policy actor does
        llm = LLM(
            model=tiny_model_path,
            tensor_parallel_size=tp,
            dtype="bfloat16",
            gpu_memory_utilization=0.15,
            max_model_len=64,
            enforce_eager=True,
            worker_extension_cls=EXTENSION,
        )
        yield llm, tp
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("delta", [False, True])
def test_nccl_ranks_sync_into_vllm(delta, llm_gpu, ray_session, redis_url, tiny_model_path, tmp_path, shm_root):
    from actors.modeling import load_causal_lm
    from tests.configs import trainer_group
    from weightsync.store import WeightStore

    start = tmp_path / "perturbed"
    shutil.copytree(tiny_model_path, start)
    perturbed_model(tiny_model_path, seed=41, scale=0.1).save_pretrained(start)
    llm, ranks = llm_gpu
    run = f"gpu-sync-{ranks}-{int(delta)}"
    group = trainer_group(
        ranks,
        str(start),
        redis_url,
        run,
        use_cuda=True,
        sync_dtype="bfloat16",
        sync={"shm_root": shm_root, "delta": delta},
        **OPTIONS,
    ).start()
    store = WeightStore(redis_url, run)
    try:
        group.train_step(episodes(8, seed=0))
        trained = group.full_state_dict()
        reference = load_causal_lm(tiny_model_path)
        reference.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in trained.items()}, strict=False)
        expected = _hf_logprobs(reference)
        before = _vllm_logprobs(llm)
        assert _max_diff(before, expected) > 10 * BF16_TOL

        push = group.push_weights(1)
        store.lease(1, "gpu-test")
        stats = llm.collective_rpc("update_weights_from_store", args=(redis_url, run, 1))
        assert _max_diff(_vllm_logprobs(llm), expected) < BF16_TOL
        model_bytes = sum(math.prod(e.shape) * 2 for e in store.index(1).values())  # bf16, tied stored once
        assert push["bytes_written"] >= model_bytes
        assert push["ranks_wrote_over_spare"] == ranks  # into the files reserved at start
        share = 0.6 if ranks == 2 else 1.05  # each worker reads its share (+ partly covered tiles)
        assert max(s["bytes_read"] for s in stats) <= share * model_bytes

        if delta:  # nothing changed since: nothing written, nothing read, same logprobs
            again = group.push_weights(2)
            assert again["bytes_written"] == 0 and again["bytes_reused"] == model_bytes
            store.lease(2, "gpu-test")
            stats = llm.collective_rpc("update_weights_from_store", args=(redis_url, run, 2))
            assert all(s["bytes_read"] == 0 for s in stats)
            assert _max_diff(_vllm_logprobs(llm), expected) < BF16_TOL
    finally:
        # Back to the engine's starting weights for the next case.
        for actor in group.ranks:
            ray_session.kill(actor)
        from tests.configs import make_pusher

        pusher = make_pusher(store, shm_root, dtype="bfloat16")
        pusher.push(load_causal_lm(tiny_model_path).state_dict(), 99)
        store.lease(99, "gpu-test")
        llm.collective_rpc("update_weights_from_store", args=(redis_url, run, 99))
        pusher.remove_all()
        store.close()
