"""A causal LM's logits for a batch of episodes, each prompt's forward pass run once for all the
samples that share it (a GRPO group's ``group_size`` completions of one prompt).

The plain way runs every episode's ``prompt + completion`` through the model: a group of ``G``
samples pays for its prompt ``G`` times. Here the distinct prompts of the batch run once, with
their keys and values kept (``past_key_values``); each episode's completion then runs on its
prompt's cache, at the positions that follow its prompt. Attention, positions and masks are those
of the full sequence, so the logits are the plain pass's (to float rounding) and so is the
gradient: autograd carries each completion's gradient back through the cache it attended to, and
the prompt pass sums them.

No Ray, no vLLM: a model and a collated batch (``algos.episodes.collate``) in, logits out.
"""

from __future__ import annotations

import torch


def causal_lm_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], shared_prefix: bool) -> torch.Tensor:
    """``[B, T, V]`` logits of a collated batch: position ``t`` holds the logits that predict token
    ``t + 1`` (as a plain forward pass's). ``shared_prefix``: only the positions that predict a
    completion token are computed (the rest are 0), each distinct prompt run once."""
    if not shared_prefix:
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return _shared_prefix_logits(model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])


def _shared_prefix_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor
) -> torch.Tensor:
    device = input_ids.device
    B, T = input_ids.shape
    in_completion = completion_mask > 0
    lengths = attention_mask.sum(dim=1)
    completion_lens = in_completion.sum(dim=1)
    prompt_lens = lengths - completion_lens  # right-padded prompt + completion (collate's layout)

    # The distinct prompts, each once, right-padded; ``group[b]``: episode b's prompt.
    prompts: dict[tuple[int, ...], int] = {}
    rows = input_ids.tolist()
    group = [prompts.setdefault(tuple(row[:p]), len(prompts)) for row, p in zip(rows, prompt_lens.tolist())]
    width = max(len(p) for p in prompts)
    prompt_ids = torch.zeros((len(prompts), width), dtype=input_ids.dtype)
    prompt_mask = torch.zeros((len(prompts), width), dtype=attention_mask.dtype)
    for ids, i in prompts.items():
        prompt_ids[i, : len(ids)] = torch.tensor(ids, dtype=input_ids.dtype)
        prompt_mask[i, : len(ids)] = 1
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    group_t = torch.tensor(group, device=device)
    prompt_out = model(input_ids=prompt_ids, attention_mask=prompt_mask, use_cache=True)

    # Logits that predict each episode's first completion token: its prompt's last position.
    first = prompt_out.logits[group_t, prompt_lens - 1]  # [B, V]
    c_width = int(completion_lens.max())
    logits = prompt_out.logits.new_zeros((B, T, first.shape[-1]))
    b_idx = torch.arange(B, device=device)
    logits = logits.index_put((b_idx, prompt_lens - 1), first)
    if c_width <= 1:
        return logits  # no completion has a second token to predict

    # Each episode's completion tokens (all but the last, which predicts nothing) on its prompt's
    # cache, at the positions after its prompt; the prompt's padding is masked out.
    steps = torch.arange(c_width - 1, device=device)
    take = steps[None, :] < (completion_lens - 1)[:, None]  # [B, c_width - 1]
    src = (prompt_lens[:, None] + steps[None, :]).clamp(max=T - 1)
    completion_ids = torch.where(take, input_ids.gather(1, src), torch.zeros_like(src))
    cache = prompt_out.past_key_values
    cache.batch_select_indices(group_t)
    mask = torch.cat([prompt_mask[group_t], take.to(prompt_mask.dtype)], dim=1)
    out = model(
        input_ids=completion_ids,
        attention_mask=mask,
        position_ids=prompt_lens[:, None] + steps[None, :],
        past_key_values=cache,
        use_cache=True,
    )
    b_take, s_take = take.nonzero(as_tuple=True)
    return logits.index_put((b_take, prompt_lens[b_take] + s_take), out.logits[b_take, s_take])
