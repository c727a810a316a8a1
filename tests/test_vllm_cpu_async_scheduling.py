"""vLLM's async scheduling on CPU: the plugin that keeps it (``actors.vllm_cpu_async_scheduling``),
checked on vLLM's own engine-config resolution, and the worker's logprob capture under it
(``actors.sampled_logprobs``: a step sampled past a stop, after its request was taken). That the
sampled tokens and logprobs are right with it on is what the policy tests check (their engine runs
with the default ``policy.async_scheduling: true``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from actors import vllm_cpu_async_scheduling
from actors.sampled_logprobs import SampledLogprobsCapture

cpu_platform = pytest.importorskip("vllm.platforms.cpu")


@pytest.fixture
def vllm_check(monkeypatch):
    """Restores vLLM's CPU config check after the test."""
    platform = cpu_platform.CpuPlatform
    monkeypatch.setattr(platform, "check_and_update_config", platform.__dict__["check_and_update_config"])


def _async_scheduling(model_path: str, **args) -> bool:
    from vllm import EngineArgs

    engine_args = EngineArgs(
        model=model_path, dtype="float32", max_model_len=64, kv_cache_memory_bytes=1 << 26, enforce_eager=True, **args
    )
    return engine_args.create_engine_config().scheduler_config.async_scheduling


def test_vllm_turns_async_scheduling_off_on_cpu_and_the_plugin_keeps_it(vllm_check, monkeypatch, tiny_model_path):
    monkeypatch.delenv(vllm_cpu_async_scheduling.ENV, raising=False)
    vllm_cpu_async_scheduling.install()
    assert _async_scheduling(tiny_model_path) is False  # vLLM's CPU platform: what the plugin is for
    monkeypatch.setenv(vllm_cpu_async_scheduling.ENV, "1")
    vllm_cpu_async_scheduling.install()
    patched = cpu_platform.CpuPlatform.check_and_update_config
    vllm_cpu_async_scheduling.install()  # vLLM may call it again in the same process: no double wrapping
    assert cpu_platform.CpuPlatform.check_and_update_config.__func__ is patched.__func__
    assert _async_scheduling(tiny_model_path) is True
    assert _async_scheduling(tiny_model_path, async_scheduling=False) is False  # asked off: stays off


class _AsyncOutput:
    """What a vLLM worker's ``sample_tokens`` returns under async scheduling: the output is made
    later, by ``get_output`` (in the worker's output thread)."""

    def __init__(self, output) -> None:
        self.output = output

    def get_output(self):
        return self.output


def _step(req_ids: list[str], tokens: list[int], logprobs: list[float]) -> _AsyncOutput:
    lists = SimpleNamespace(
        cu_num_generated_tokens=None,
        logprob_token_ids=np.array(tokens)[:, None],
        logprobs=np.array(logprobs)[:, None],
    )
    return _AsyncOutput(SimpleNamespace(req_ids=req_ids, sampled_token_ids=[[t] for t in tokens], logprobs=lists))


def test_a_sample_past_a_stop_that_comes_after_the_take_is_not_kept():
    """Under async scheduling the worker samples one step past a request's stop token before the
    scheduler sees the stop; that step's output can reach the capture after the request's
    logprobs were taken. It must not be kept for nobody (and the taken lists are the stepped
    ones)."""
    samples = ["0_req-1-0123abcd", "1_req-1-0123abcd"]
    steps = iter(
        [
            _step(samples, [5, 6], [-0.5, -0.6]),
            _step(samples, [1, 1], [-0.1, -0.2]),  # both stop (EOS is 1)
            _step(samples, [9, 4], [-0.9, -0.4]),  # already scheduled: sampled past the stop
        ]
    )
    runner = SimpleNamespace(input_batch=SimpleNamespace(num_logprobs=dict.fromkeys(samples, 0)))
    runner.sample_tokens = lambda *args, **kwargs: next(steps)
    worker = SampledLogprobsCapture()
    worker.model_runner = runner
    assert worker.capture_sampled_logprobs()
    first, second, past_the_stop = (runner.sample_tokens() for _ in range(3))
    first.get_output(), second.get_output()
    assert worker.take_sampled_logprobs(["req-1"], 2) == [[[[5, 1], [-0.5, -0.1]], [[6, 1], [-0.6, -0.2]]]]
    assert past_the_stop.get_output().logprobs is None  # sent on without them, as for every step
    assert worker.kept_sampled_logprobs() == 0
