"""A causal LM's logits for a batch of episodes, each prompt's forward pass run once for all the
samples that share it (a GRPO group's ``group_size`` completions of one prompt).

The plain way runs every episode's ``prompt + completion`` through the model: a group of ``G``
samples pays for its prompt ``G`` times. Here the distinct prompts of the batch run once, with
their keys and values kept (``past_key_values``); each episode's completion then runs on its
prompt's cache, at the positions that follow its prompt. Attention, positions and masks are those
of the full sequence, so the logits are the plain pass's (to float rounding) and so is the
gradient: autograd carries each completion's gradient back through the cache it attended to, and
the prompt pass sums them.

Data-parallel ranks (FSDP2) must all make the same forward passes, since each gathers the
parameters: there every micro-batch makes exactly ``forward_passes`` (a prompt pass and
``completion_passes`` completion passes, those its batch did not need one-token passes that add
zero), whatever its lengths.

No Ray, no vLLM: a model and a collated batch (``algos.episodes.collate``) in, logits out.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
import torch.distributed as dist
from transformers import DynamicCache


def causal_lm_logits(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], shared_prefix: bool, completion_passes: int = 1
) -> torch.Tensor:
    """``[B, T, V]`` logits of a collated batch: position ``t`` holds the logits that predict token
    ``t + 1`` (as a plain forward pass's). ``shared_prefix``: only the positions that predict a
    completion token are computed (the rest are 0), each distinct prompt run once, and the
    completions in up to ``completion_passes`` passes grouped by length (``length_buckets``)."""
    if not shared_prefix:
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return _shared_prefix_logits(
        model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"], completion_passes
    )


# What one more completion pass costs, in padded positions: a split into another pass is made only
# where it saves more positions than this.
PASS_COST_POSITIONS = 64


def forward_passes(shared_prefix: bool, completion_passes: int) -> int:
    """The forward passes ``causal_lm_logits`` makes per batch on data-parallel ranks."""
    return 1 + completion_passes if shared_prefix else 1


def data_parallel() -> bool:
    """Whether this process is one of several ranks of a process group (FSDP2's data parallelism)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def zero_pass(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """A one-token forward pass, summed and times zero: added to a loss it changes no value but
    puts the pass in the autograd graph (so that its backward pass, and the collectives FSDP2
    makes in both, run too). ``model`` returns a causal LM's output or a tensor (a value model)."""
    out = model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device))
    return getattr(out, "logits", out).float().sum() * 0.0


def length_buckets(widths: list[int], passes: int, pass_cost: int | None = None) -> list[int]:
    """The widths of at most ``passes`` passes that run sequences of the given ``widths`` (0: no
    pass needed), each sequence in the narrowest pass that holds it, with the fewest positions
    computed (each pass padded to its width) plus ``pass_cost`` per pass (default
    ``PASS_COST_POSITIONS``). Ascending."""
    pass_cost = PASS_COST_POSITIONS if pass_cost is None else pass_cost
    counts = Counter(w for w in widths if w > 0)
    distinct = sorted(counts)
    if not distinct:
        return []
    n = len(distinct)
    width = np.array(distinct, dtype=np.float64)
    rows_below = np.concatenate([[0.0], np.cumsum([counts[w] for w in distinct], dtype=np.float64)])
    # best[k, i]: the cost of covering distinct[:i] with k passes, the last one distinct[i - 1]
    # wide; it takes distinct[start[k, i]:i].
    best = np.full((passes + 1, n + 1), np.inf)
    best[0, 0] = 0.0
    start = np.zeros((passes + 1, n + 1), dtype=np.int64)
    for k in range(1, passes + 1):
        for i in range(1, n + 1):
            costs = best[k - 1, :i] + (rows_below[i] - rows_below[:i]) * width[i - 1] + pass_cost
            start[k, i] = np.argmin(costs)
            best[k, i] = costs[start[k, i]]
    k, i, out = int(np.argmin(best[1:, n])) + 1, n, []
    while k > 0:
        out.append(distinct[i - 1])
        i, k = int(start[k, i]), k - 1
    return out[::-1]


def _shared_prefix_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    completion_passes: int,
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
    logits = prompt_out.logits.new_zeros((B, T, first.shape[-1]))
    b_idx = torch.arange(B, device=device)
    logits = logits.index_put((b_idx, prompt_lens - 1), first)

    # Each episode's completion tokens (all but the last, which predicts nothing) on its prompt's
    # cache, at the positions after its prompt; the prompt's padding is masked out. Episodes of
    # similar length share a pass, padded to its longest.
    widths = (completion_lens - 1).clamp(min=0)
    cached = list(prompt_out.past_key_values)  # per layer: keys, values (and a sliding window)
    narrower = 0
    buckets = length_buckets(widths.tolist(), completion_passes)
    for pass_width in buckets:
        members = ((widths > narrower) & (widths <= pass_width)).nonzero(as_tuple=True)[0]
        narrower = pass_width
        rows_group = group_t[members]
        cache = DynamicCache(
            ddp_cache_data=[(k[rows_group], v[rows_group], *rest) for k, v, *rest in cached], config=model.config
        )
        steps = torch.arange(pass_width, device=device)
        p_lens = prompt_lens[members]
        take = steps[None, :] < widths[members][:, None]  # [rows, pass_width]
        src = (p_lens[:, None] + steps[None, :]).clamp(max=T - 1)
        completion_ids = torch.where(take, input_ids[members].gather(1, src), torch.zeros_like(src))
        mask = torch.cat([prompt_mask[rows_group], take.to(prompt_mask.dtype)], dim=1)
        out = model(
            input_ids=completion_ids,
            attention_mask=mask,
            position_ids=p_lens[:, None] + steps[None, :],
            past_key_values=cache,
            use_cache=True,
        )
        r_take, s_take = take.nonzero(as_tuple=True)
        logits = logits.index_put((members[r_take], p_lens[r_take] + s_take), out.logits[r_take, s_take])
    missing = completion_passes - len(buckets)
    if data_parallel() and missing > 0:  # as many passes as every other rank (module docstring)
        zero = torch.zeros(1, dtype=torch.long, device=device)
        padding = sum(zero_pass(model, device) for _ in range(missing))
        logits = logits.index_put((zero, zero), logits[0, 0] + padding)
    return logits
