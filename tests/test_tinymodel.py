"""The embedded tiny model: tokenizer, build, caching, and loading in transformers and vLLM."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tasks.arithmetic import ALPHABET, problem
from tinymodel.build import TinyModelRecipe, build_tokenizer, ensure_tiny_model


def test_tokenizer_is_one_token_per_character_and_round_trips():
    tok = build_tokenizer()
    text = "98-7=91"
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert len({tok.convert_tokens_to_ids(c) for c in ALPHABET}) == len(ALPHABET)
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text


def test_built_directory_is_a_normal_hf_model_that_is_imperfect(tiny_model_path):
    path = Path(tiny_model_path)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file(), name
    report = json.loads((path / "tiny_model_recipe.json").read_text())
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["num_attention_heads"] % 2 == 0 and config["num_key_value_heads"] == 2  # splits for TP=2
    assert 0.1 < report["warm_start_eval_accuracy"] < 0.6  # signal for GRPO, and room to improve
    # The warm start ran until its train probe reached the target, not to the step cap.
    assert report["warm_start_train_probe_accuracy"] >= report["recipe"]["warm_start_target_accuracy"]
    assert report["warm_start_steps"] < report["recipe"]["warm_start_max_steps"]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert tok.decode(tok.encode("12+7=")) == "12+7="
    assert model.config.eos_token_id == tok.eos_token_id


def test_cache_is_keyed_by_recipe_and_reused(tmp_path):
    recipe = TinyModelRecipe(
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=32,
        warm_start_max_steps=2,
        warm_start_batch=8,
        task_eval_size=20,
    )
    first = ensure_tiny_model(recipe, tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(recipe, tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    other = ensure_tiny_model(TinyModelRecipe(**{**recipe.__dict__, "warm_start_max_steps": 3}), tmp_path)
    assert other != first
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftover temp dirs


@pytest.mark.slow
def test_vllm_serves_the_built_model_like_transformers(policy, tiny_model_path, ray_session):
    """vLLM's greedy answers equal transformers' greedy answers on the built directory."""
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    problems = [
        problem(a, op, b) for a, op, b in [(12, "+", 7), (3, "-", 40), (99, "+", 99), (50, "-", 5), (0, "+", 0)]
    ]
    vllm_out = ray_session.get(policy.greedy.remote([p.prompt for p in problems], 6))
    for p, (text, _finished, _tokens) in zip(problems, vllm_out):
        ids = tok(p.prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
        assert text == tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
