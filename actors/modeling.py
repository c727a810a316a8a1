"""Helpers shared by the actors that load the model (policy, trainer, critic, reference)."""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from algos.episodes import Episode, collate
from algos.policy_loss import token_logprobs
from algos.ppo import token_values
from algos.shared_prefix import causal_lm_logits

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def _in_actor() -> bool:
    try:
        import ray
    except ImportError:  # the GPU check machines have no Ray; nothing runs in an actor there
        return False
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


def check_policy_fits(path: str | Path, tp: int, max_model_len: int) -> None:
    """A ``ValueError`` naming the key unless the model at ``path`` (its ``config.json``) can be
    served with ``policy.tp`` workers and ``policy.max_model_len`` and synced by the update
    method: an architecture the layout table knows, attention heads and MLP rows that split
    evenly, and KV heads that split evenly or are replicated evenly (vLLM's rules)."""
    import json

    from weightsync.layout import ARCHITECTURES

    config = json.loads((Path(path) / "config.json").read_text())
    architectures = config.get("architectures") or []
    known = [a for a in architectures if a in ARCHITECTURES]
    if not known:
        raise ValueError(
            f"model.path {str(path)!r} is a {architectures or 'model without architectures in config.json'}; "
            f"the weight update knows {list(ARCHITECTURES)} (a new one needs a row in weightsync/layout.py and a test)"
        )
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    split = {"attention heads": heads, "MLP rows (intermediate_size)": config["intermediate_size"]}
    for what, n in split.items():
        if n % tp:
            raise ValueError(f"policy.tp={tp} does not divide the model's {n} {what}; use a divisor of {n}")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(
            f"policy.tp={tp}: the model's {kv_heads} KV heads neither split evenly over {tp} workers nor "
            "replicate evenly onto them (one of the two numbers must divide the other)"
        )
    longest = config.get("max_position_embeddings")
    if longest is not None and max_model_len > longest:
        raise ValueError(
            f"policy.max_model_len={max_model_len} is more than the model's max_position_embeddings={longest}"
        )


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(check_model_dir(path)), dtype=dtype)


class ValueModel(torch.nn.Module):
    """A critic: a causal LM's body (``model``, as in ``...ForCausalLM``) with a scalar head that
    maps each position's last hidden state to a value. ``forward`` returns ``[B, T]``."""

    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.model = body
        self.config = body.config
        # A fresh head: zero, so that every state starts at value 0 (a neutral baseline).
        self.value_head = torch.nn.Linear(body.config.hidden_size, 1, dtype=body.dtype)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.value_head(hidden).squeeze(-1)


def load_value_model(path: str | Path, dtype: torch.dtype = torch.float32) -> ValueModel:
    """A ``ValueModel`` whose body holds the weights of the causal LM at ``path`` (its LM head
    is not used) and whose head is fresh."""
    from transformers import AutoModel

    return ValueModel(AutoModel.from_pretrained(str(check_model_dir(path)), dtype=dtype))


@torch.no_grad()
def completion_values(model: ValueModel, episodes: list[Episode], pad_id: int) -> list[list[float]]:
    """Each episode's per-completion-token values under ``model`` (see ``algos.ppo.token_values``)."""
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in collate(episodes, pad_id).items()}
    values = token_values(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).float()).cpu()
    return [
        values[b, len(e.prompt_ids) : len(e.prompt_ids) + len(e.completion_ids)].tolist()
        for b, e in enumerate(episodes)
    ]


def sequence_token_logprobs(
    model, batch: dict[str, torch.Tensor], shared_prefix: bool = False, completion_passes: int = 1
) -> torch.Tensor:
    """Per-token log-probabilities of ``batch["input_ids"]`` under ``model`` (see ``token_logprobs``).
    ``shared_prefix``: only the completion tokens' (``algos.shared_prefix``; the batch needs its
    ``completion_mask``), each distinct prompt run once and the completions in up to
    ``completion_passes`` passes grouped by length."""
    logits = causal_lm_logits(model, batch, shared_prefix, completion_passes)
    return token_logprobs(logits.float(), batch["input_ids"])


@torch.no_grad()
def completion_logprobs(model, episodes: list[Episode], pad_id: int, completion_passes: int = 1) -> list[list[float]]:
    """Each episode's completion-token log-probabilities under ``model`` (on the model's device):
    each group's prompt run once, the completions in up to ``completion_passes`` passes
    (``trainer.completion_passes``)."""
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in collate(episodes, pad_id).items()}
    logp = sequence_token_logprobs(model, batch, True, completion_passes).cpu()
    return [
        logp[b, len(e.prompt_ids) : len(e.prompt_ids) + len(e.completion_ids)].tolist() for b, e in enumerate(episodes)
    ]
