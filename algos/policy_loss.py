"""The clipped policy-gradient objective that GRPO and PPO share, its KL estimators and
aggregations, and the per-token quantities it is built from.

Pure tensor functions, no Ray or vLLM. Shapes: ``B`` sequences, ``T`` token positions; per-token
tensors are aligned so that position ``t`` holds the quantity of token ``t`` of the sequence
(``token_logprobs``), and ``mask`` is 1 exactly on completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algos.shared_prefix import causal_lm_logits, forward_passes

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1 (token-mean over the whole batch)."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): ``exp(ref - logp) - (ref - logp) - 1`` (>= 0)."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1, k2, k3).

    With ``r = ref - logp``: ``k1 = -r`` (unbiased, can be negative), ``k2 = r^2 / 2``,
    ``k3 = exp(r) - r - 1`` (unbiased and >= 0).
    """
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k2":
        return 0.5 * (ref_logprobs - logprobs) ** 2
    if estimator == "k3":
        return kl_k3(logprobs, ref_logprobs)
    raise ValueError(f"unknown KL estimator {estimator!r}; allowed: {list(KL_ESTIMATORS)}")


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, length_normalizer: float | None = None):
    """Reduce per-token ``values`` to a scalar.

    - ``token_mean``: mean over all completion tokens of the batch;
    - ``seq_mean_token_mean``: mean over each sequence's tokens, then over sequences;
    - ``seq_mean_token_sum_norm`` (Dr. GRPO): each sequence's token sum divided by the constant
      ``length_normalizer`` (e.g. the generation length limit), then mean over sequences.
    """
    if mode == "token_mean":
        return masked_mean(values, mask)
    per_seq_sum = (values * mask).sum(dim=-1)
    if mode == "seq_mean_token_mean":
        return (per_seq_sum / mask.sum(dim=-1).clamp(min=1)).mean()
    if mode == "seq_mean_token_sum_norm":
        if not length_normalizer or length_normalizer <= 0:
            raise ValueError("seq_mean_token_sum_norm needs a positive length_normalizer")
        return (per_seq_sum / length_normalizer).mean()
    raise ValueError(f"unknown loss aggregation {mode!r}; allowed: {list(LOSS_AGGREGATIONS)}")


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    clip_eps_high: float | None = None,
    kl_estimator: str = "k3",
    aggregation: str = "token_mean",
    length_normalizer: float | None = None,
    tis_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-ratio policy loss with an optional KL penalty (GRPO's and PPO's).

    ``ratio_t = exp(logp_t - old_logp_t)``;
    ``L = -agg_t[w_t min(ratio_t A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) A_t) - beta KL_t]``,
    with ``A_t`` the per-token advantage (``advantages`` ``[B, T]``; a ``[B]`` tensor is one
    advantage per sequence, broadcast over its tokens), ``eps_high`` defaulting to
    ``eps_low = clip_eps`` (asymmetric clipping when they differ), ``KL_t`` the chosen estimator
    and ``agg`` the chosen aggregation (see ``aggregate``). ``old_logprobs`` are those the
    rollout was sampled with (vLLM's).

    Truncated importance sampling (``tis_cap``): vLLM's logprobs differ slightly from the
    trainer's. With a cap, the ratio is taken against the trainer's own (detached) logprobs and
    each token is weighted by ``w_t = min(exp(logp_t - old_logp_t), tis_cap)``, the truncated
    correction from the sampler's distribution to the trainer's; without it ``w_t = 1``.
    Returns the loss and detached metrics.
    """
    mask = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if tis_cap is None:
        ratio = torch.exp(logprobs - old_logprobs)
        weight = torch.ones_like(logprobs)
    else:
        ratio = torch.exp(logprobs - logprobs.detach())
        weight = torch.clamp(torch.exp(logprobs.detach() - old_logprobs), max=tis_cap)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + eps_high) * adv
    objective = weight * torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(logprobs)
    if kl_coef:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl = kl_estimate(logprobs, ref_logprobs, kl_estimator)
    loss = -aggregate(objective - kl_coef * kl, mask, aggregation, length_normalizer)
    with torch.no_grad():
        metrics = {
            "loss": loss.item(),
            "kl": masked_mean(kl, mask).item(),
            "clip_frac": masked_mean((unclipped != clipped).to(mask.dtype), mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "tis_weight_mean": masked_mean(weight, mask).item(),
        }
    return loss, metrics


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the distribution that predicts token ``t``, aligned like ``token_logprobs``.

    ``out[b, t] = -sum_v p log p`` with ``p = softmax(logits[b, t - 1])``, and 0 at ``t = 0``.
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return torch.nn.functional.pad(entropy, (1, 0))


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``out[b, t] = log softmax(logits[b, t - 1])[input_ids[b, t]]``, and 0 at ``t = 0``.

    ``logits`` is the causal LM output ``[B, T, V]`` for ``input_ids`` ``[B, T]``: position
    ``t - 1`` predicts token ``t``.
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


@dataclass(frozen=True)
class PolicyLoss:
    """The policy's loss for ``algos.train.backward``: a forward pass of the causal LM over a
    collated batch, ``clipped_policy_loss`` with the batch's per-token advantages, and how far
    the rollout's logprobs (vLLM's) are from the trainer's for the same tokens."""

    clip_eps: float
    clip_eps_high: float | None
    kl_coef: float  # 0 unless the KL is a loss term
    kl_estimator: str
    aggregation: str
    length_normalizer: float
    tis_cap: float | None
    # Each distinct prompt's forward pass once for the samples that share it (algos.shared_prefix):
    # the same logits and gradient, less work (trainer.shared_prefix).
    shared_prefix: bool = True
    # With shared_prefix, the completions run in up to this many passes grouped by length, each
    # padded to its longest (algos.shared_prefix.length_buckets).
    completion_passes: int = 1

    metric_names = ("kl", "clip_frac", "ratio_mean", "tis_weight_mean", "logprob_diff_mean", "entropy")
    max_metric_names = ("logprob_diff_max",)

    @property
    def per_sequence(self) -> bool:
        return self.aggregation != "token_mean"

    @property
    def forward_passes(self) -> int:
        """Forward passes per micro-batch on data-parallel ranks (``algos.shared_prefix``)."""
        return forward_passes(self.shared_prefix, self.completion_passes)

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        if "advantages" not in batch:
            raise ValueError("the policy loss needs every episode's advantages (set by the algorithm)")
        mask = batch["completion_mask"]
        logits = causal_lm_logits(model, batch, self.shared_prefix, self.completion_passes).float()
        logprobs = token_logprobs(logits, batch["input_ids"])
        loss, metrics = clipped_policy_loss(
            logprobs,
            batch["rollout_logprobs"],
            batch["advantages"],
            mask,
            clip_eps=self.clip_eps,
            kl_coef=self.kl_coef,
            ref_logprobs=batch.get("ref_logprobs"),
            clip_eps_high=self.clip_eps_high,
            kl_estimator=self.kl_estimator,
            aggregation=self.aggregation,
            length_normalizer=self.length_normalizer,
            tis_cap=self.tis_cap,
        )
        with torch.no_grad():
            diff = (logprobs.detach() - batch["rollout_logprobs"]).abs()
            metrics["logprob_diff_mean"] = masked_mean(diff, mask).item()
            metrics["logprob_diff_max"] = (diff * mask).max().item()
            metrics["entropy"] = masked_mean(token_entropy(logits.detach()), mask).item()
        return loss, metrics
