"""The ``policy`` config group: the vLLM engine that samples rollouts (``actors/policy.py``)."""

from __future__ import annotations

from dataclasses import dataclass

POLICY_DTYPES = ("auto", "float32", "bfloat16", "float16")
# What a weight update does to the requests in flight (actors.policy.Policy.update_weights).
IN_FLIGHT_MODES = ("finish", "resample")


@dataclass
class PolicyConfig:
    tp: int
    replicas: int  # independent engines, each with its own tp workers
    max_restarts: int  # times Ray restarts a replica whose process died
    dtype: str  # auto: float32 on CPU, bfloat16 on GPUs (the launcher resolves it)
    max_model_len: int
    kv_cache_mib: int
    max_num_seqs: int  # sequences the engine runs in one step
    max_num_batched_tokens: int  # tokens the engine runs in one step (prefill chunks + decodes)
    enforce_eager: bool
    async_scheduling: bool  # vLLM schedules a step while its worker computes the one before
    temperature: float
    max_tokens: int
    in_flight: str  # what a weight update does to the requests in flight: finish | resample
    omp_threads_bind: str | None

    def rules(self) -> list[tuple[bool, str, str]]:
        return [
            (self.tp >= 1, "tp", "an integer >= 1"),
            (self.replicas >= 1, "replicas", "an integer >= 1"),
            (self.max_restarts >= 0, "max_restarts", "an integer >= 0"),
            (self.dtype in POLICY_DTYPES, "dtype", f"one of {list(POLICY_DTYPES)}"),
            (self.max_model_len >= 2, "max_model_len", "an integer >= 2"),
            (self.kv_cache_mib >= 1, "kv_cache_mib", "an integer >= 1"),
            (self.max_num_seqs >= 1, "max_num_seqs", "an integer >= 1"),
            (
                self.max_num_batched_tokens >= self.max_num_seqs,
                "max_num_batched_tokens",
                f"at least policy.max_num_seqs={self.max_num_seqs} (one token per sequence in a step)",
            ),
            (self.temperature > 0, "temperature", "a number > 0"),
            (self.max_tokens >= 1, "max_tokens", "an integer >= 1"),
            (self.in_flight in IN_FLIGHT_MODES, "in_flight", f"one of {list(IN_FLIGHT_MODES)}"),
            (
                self.max_tokens < self.max_model_len,
                "max_tokens",
                f"less than policy.max_model_len={self.max_model_len}",
            ),
        ]

    def engine_dtype(self, use_cuda: bool) -> str:
        """``dtype`` with ``auto`` resolved: bfloat16 on GPUs, float32 on CPU."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if use_cuda else "float32"
