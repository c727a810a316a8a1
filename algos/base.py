"""What every algorithm is, and how a run finds one by name.

An algorithm is one module ``algos/<name>.py`` with one config file ``configs/algo/<name>.yaml``
(whose ``name`` key is the module's name). The module defines ``Algorithm``, a class with:

- ``Config``: its config dataclass (a subclass of ``AlgoConfig``; ``rules()`` checks its values);
- ``__init__(config, max_tokens)``;
- ``samples_per_prompt``: completions sampled per prompt;
- ``uses_reference`` / ``uses_critic``: which actors the run starts for it;
- ``policy_loss()``: the loss the trainer ranks minimise (``algos.policy_loss.PolicyLoss``);
- ``critic()``: ``(critic TrainerConfig, value loss)`` when it uses a critic, else None;
- ``make_experience(episodes)``: fills each scored episode's per-token ``advantages`` (and
  ``returns`` where it has a critic) in place, from its reward, rollout logprobs, and the
  reference logprobs / critic values the run added; returns metrics for the step's row.

The controller loop and the actors see only this, so adding an algorithm touches no other file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from algos.policy_loss import KL_ESTIMATORS, LOSS_AGGREGATIONS, PolicyLoss
from validation.plugins import available, plugin

KL_MODES = ("loss", "reward")
REFERENCE_DEVICES = ("auto", "cpu", "gpu")


@dataclass
class AlgoConfig:
    """The keys every algorithm has: which module, and the clipped policy loss with its KL term."""

    name: str  # the module in algos/
    clip_eps: float
    clip_eps_high: float | None
    kl_coef: float
    reference_device: str
    kl_estimator: str
    kl_mode: str
    loss_aggregation: str
    length_normalizer: int | None
    tis_cap: float | None
    max_staleness: int

    def rules(self) -> list[tuple[bool, str, str]]:
        return [
            (self.clip_eps > 0, "clip_eps", "a number > 0"),
            (self.clip_eps_high is None or self.clip_eps_high > 0, "clip_eps_high", "null or a number > 0"),
            (self.kl_coef >= 0, "kl_coef", "a number >= 0"),
            (self.reference_device in REFERENCE_DEVICES, "reference_device", f"one of {list(REFERENCE_DEVICES)}"),
            (self.kl_estimator in KL_ESTIMATORS, "kl_estimator", f"one of {list(KL_ESTIMATORS)}"),
            (self.kl_mode in KL_MODES, "kl_mode", f"one of {list(KL_MODES)}"),
            (self.loss_aggregation in LOSS_AGGREGATIONS, "loss_aggregation", f"one of {list(LOSS_AGGREGATIONS)}"),
            (
                self.length_normalizer is None or self.length_normalizer >= 1,
                "length_normalizer",
                "null (policy.max_tokens) or an integer >= 1",
            ),
            (self.tis_cap is None or self.tis_cap > 0, "tis_cap", "null (off) or a number > 0"),
            (self.max_staleness >= 0, "max_staleness", "an integer >= 0"),
        ]

    @property
    def uses_reference(self) -> bool:
        return self.kl_coef > 0

    @property
    def kl_reward_coef(self) -> float:
        """The KL coefficient applied to the rewards (``kl_mode=reward``), else 0."""
        return self.kl_coef if self.kl_mode == "reward" else 0.0

    def policy_loss(self, max_tokens: int) -> PolicyLoss:
        """The clipped policy loss these keys describe (``max_tokens``: Dr. GRPO's default normaliser)."""
        return PolicyLoss(
            clip_eps=self.clip_eps,
            clip_eps_high=self.clip_eps_high,
            kl_coef=self.kl_coef if self.kl_mode == "loss" else 0.0,
            kl_estimator=self.kl_estimator,
            aggregation=self.loss_aggregation,
            length_normalizer=self.length_normalizer or max_tokens,
            tis_cap=self.tis_cap,
        )


class Algorithm(Protocol):
    Config: type[AlgoConfig]
    samples_per_prompt: int
    uses_reference: bool
    uses_critic: bool

    def __init__(self, config: AlgoConfig, max_tokens: int) -> None: ...

    def policy_loss(self) -> PolicyLoss: ...

    def critic(self): ...

    def make_experience(self, episodes: list) -> dict[str, float]: ...


def available_algorithms() -> list[str]:
    """The modules in ``algos/`` that define ``Algorithm``."""
    return available("algos", "Algorithm")


def algorithm_class(name: str) -> type[Algorithm]:
    """``algos.<name>.Algorithm``; a ``ValueError`` naming the ones there are for another name."""
    return plugin("algos", "Algorithm", "algo.name", name)
