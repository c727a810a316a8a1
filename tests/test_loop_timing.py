"""The loop's phase timer: each named group of Ray refs gets its own finish time, also while the
groups run side by side."""

from __future__ import annotations


def test_each_group_is_timed_until_its_last_ref(ray_session):
    import time

    from apps.grpo.loop import gather_timed

    @ray_session.remote(num_cpus=0)
    def after(seconds: float, value: int) -> int:
        time.sleep(seconds)
        return value

    ray_session.get([after.remote(0.0, 0) for _ in range(3)])  # workers started beforehand
    results, seconds = gather_timed(
        {"quick": [after.remote(0.0, 1)], "slow": [after.remote(0.0, 2), after.remote(3.0, 3)]}
    )
    assert results == {"quick": [1], "slow": [2, 3]}
    assert set(seconds) == {"quick_s", "slow_s"}
    assert seconds["slow_s"] >= 3.0 > seconds["quick_s"]  # the slow group waits for its last ref
