"""Helpers shared by the actors that load the model (policy, trainer, reference)."""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from algos.episodes import Episode, collate
from algos.grpo import token_logprobs

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def _in_actor() -> bool:
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def check_model_dir(path: str | Path) -> Path:
    """Raise a clear ``ValueError`` unless ``path`` is a Hugging Face causal-LM directory.

    The launcher checks the path on its own host; each actor that loads the model checks it
    again where Ray placed it, since on a cluster that may be another host, where the path must
    hold the same model (vLLM, given a path that is not there, takes it for a hub repo id and
    fails with a message about repo names). Inside an actor the error names the host.
    """
    p = Path(path)
    where = ""
    if _in_actor():
        where = (
            f" on host {socket.gethostname()} (on a Ray cluster, every node that runs the policy, a trainer "
            "rank or the reference model needs the model at this path: a shared file system, or a copy)"
        )
    if not p.is_dir():
        raise ValueError(f"model.path {str(path)!r} does not exist or is not a directory{where}")
    if not (p / "config.json").is_file():
        raise ValueError(f"model.path {str(path)!r} has no config.json{where}; expected a Hugging Face model directory")
    if not any((p / f).is_file() for f in WEIGHT_FILES):
        raise ValueError(
            f"model.path {str(path)!r} has no safetensors weights ({' or '.join(WEIGHT_FILES)}){where}; "
            "expected a Hugging Face model directory saved with safe_serialization"
        )
    if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
        raise ValueError(
            f"model.path {str(path)!r} has no tokenizer files (tokenizer.json / tokenizer_config.json){where}"
        )
    return p


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(check_model_dir(path)), dtype=dtype)


def sequence_token_logprobs(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token log-probabilities of ``batch["input_ids"]`` under ``model`` (see ``token_logprobs``)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return token_logprobs(logits.float(), batch["input_ids"])


@torch.no_grad()
def completion_logprobs(model, episodes: list[Episode], pad_id: int) -> list[list[float]]:
    """Each episode's completion-token log-probabilities under ``model`` (on the model's device)."""
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in collate(episodes, pad_id).items()}
    logp = sequence_token_logprobs(model, batch).cpu()
    return [
        logp[b, len(e.prompt_ids) : len(e.prompt_ids) + len(e.completion_ids)].tolist() for b, e in enumerate(episodes)
    ]
