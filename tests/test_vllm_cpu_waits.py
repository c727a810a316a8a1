"""The vLLM plugin that makes an engine's processes sleep, not spin, while they wait for each
other's messages on CPU (``actors.vllm_cpu_waits``), on vLLM's own shared-memory queue: a reader
in its busy window waits 0.3 s for the next message."""

from __future__ import annotations

import threading
import time

import pytest

from actors import vllm_cpu_waits

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")


def _wait_for_a_late_message(delay_s: float = 0.3) -> tuple[str, float, float]:
    """(message, CPU seconds the reader used while it waited, seconds it got it after it was sent)."""
    writer = shm_broadcast.MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4)
    reader = shm_broadcast.MessageQueue.create_from_handle(writer.export_handle(), 0)
    ready = threading.Thread(target=writer.wait_until_ready)
    ready.start()
    reader.wait_until_ready()
    ready.join()
    got = {}

    def read() -> None:
        reader.dequeue()  # the first message: the reader is then in its busy window
        cpu = time.thread_time()
        got["message"] = reader.dequeue()
        got["at"], got["cpu"] = time.perf_counter(), time.thread_time() - cpu

    thread = threading.Thread(target=read)
    thread.start()
    writer.enqueue("first")
    time.sleep(delay_s)
    sent = time.perf_counter()
    writer.enqueue("second")
    thread.join(timeout=10)
    return got["message"], got["cpu"], got["at"] - sent


@pytest.fixture
def vllm_wait(monkeypatch):
    """Restores vLLM's wait after the test."""
    monkeypatch.setattr(shm_broadcast.SpinCondition, "wait", shm_broadcast.SpinCondition.wait)


def test_a_waiting_reader_sleeps_and_still_gets_the_message_promptly(vllm_wait, monkeypatch):
    monkeypatch.setenv(vllm_cpu_waits.ENV, "1")
    original = shm_broadcast.SpinCondition.wait
    vllm_cpu_waits.install()
    patched = shm_broadcast.SpinCondition.wait
    assert patched is not original
    vllm_cpu_waits.install()  # vLLM may call it again in the same process: no double wrapping
    assert shm_broadcast.SpinCondition.wait is patched
    message, cpu_s, late_s = _wait_for_a_late_message()
    assert message == "second"
    assert cpu_s < 0.1  # vLLM's own wait spins the whole 0.3 s (the test below)
    assert late_s < 0.05  # at most 5% of the time waited (15 ms) plus scheduling


def test_without_the_setting_vllm_keeps_its_spinning_wait(vllm_wait, monkeypatch):
    monkeypatch.delenv(vllm_cpu_waits.ENV, raising=False)
    vllm_cpu_waits.install()
    message, cpu_s, _ = _wait_for_a_late_message()
    assert message == "second"
    assert cpu_s > 0.1  # what the plugin saves (and what would tell that vLLM stopped spinning)


def test_naps_grow_with_the_wait_within_bounds():
    assert vllm_cpu_waits.nap_s(0.0) == vllm_cpu_waits.MIN_SLEEP_S
    assert vllm_cpu_waits.nap_s(0.01) == pytest.approx(0.0005)
    assert vllm_cpu_waits.nap_s(0.9) == vllm_cpu_waits.MAX_SLEEP_S
