"""The launcher's interrupt handling: a signal whose KeyboardInterrupt a library swallowed
still stops the run at the next check."""

import signal
import threading
import time

import pytest

from apps.grpo import interrupts


@pytest.fixture
def handlers():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    interrupts.install()
    yield
    signal.signal(signal.SIGINT, before[0])
    signal.signal(signal.SIGTERM, before[1])
    interrupts._received.clear()


def _swallowing_library_call() -> None:
    """What a library that catches the KeyboardInterrupt and carries on does."""
    try:
        signal.raise_signal(signal.SIGINT)
        time.sleep(0.01)  # the handler runs here, in the main thread
    except KeyboardInterrupt:
        pass


def test_a_swallowed_interrupt_is_raised_again_at_the_next_check(handlers):
    interrupts.check()  # nothing received yet
    _swallowing_library_call()
    assert interrupts.received()
    with pytest.raises(KeyboardInterrupt):
        interrupts.check()


def test_sigterm_raises_keyboard_interrupt(handlers):
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGTERM)
        time.sleep(0.01)


def test_waiting_for_actors_stops_on_a_swallowed_interrupt(handlers, ray_session):
    @ray_session.remote(num_cpus=0)
    def slow(seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    assert interrupts.ready([slow.remote(0.1), slow.remote(0.3)], poll_s=0.05) == [0.1, 0.3]
    ref = slow.remote(60)
    # While the launcher waits, a signal arrives and (as if in a library) its exception is lost.
    threading.Timer(0.3, interrupts._received.set).start()
    with pytest.raises(KeyboardInterrupt):
        interrupts.ready([ref], poll_s=0.05)
    ray_session.cancel(ref, force=True)
