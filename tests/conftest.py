"""Shared fixtures: one Redis, one Ray instance, one tiny model and one vLLM engine per session."""

from __future__ import annotations

import pytest

from tests.policies import running_policy


@pytest.fixture(scope="session")
def redis_url():
    from weightsync.redis_server import LocalRedis

    with LocalRedis() as server:
        yield server.url


@pytest.fixture
def store(redis_url):
    """A weight store on the session's Redis, under a fresh run name."""
    import uuid

    from weightsync.store import WeightStore

    s = WeightStore(redis_url, f"t-{uuid.uuid4().hex[:8]}")
    yield s
    s.close()


@pytest.fixture
def shm_root():
    """A private folder in /dev/shm for one test's pushed shards."""
    import shutil
    import tempfile
    from pathlib import Path

    root = Path(tempfile.mkdtemp(prefix="ws-test-", dir="/dev/shm"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_path():
    """The embedded default model, built once (about a minute) and cached by its recipe."""
    from tinymodel.build import ensure_tiny_model

    return str(ensure_tiny_model())


@pytest.fixture(scope="session")
def ray_session():
    import ray

    ray.init(include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def policy(ray_session, redis_url, tiny_model_path):
    """One vLLM policy actor (TP=1, float32) for the whole session; run name 'test-sync'."""
    with running_policy(ray_session, tiny_model_path, redis_url, "test-sync", "test-policy") as actor:
        yield actor


@pytest.fixture(scope="session")
def policy_tp2(ray_session, redis_url, tiny_model_path):
    """A second vLLM policy actor with TP=2; run 'test-sync-tp2'. Its workers' threads are bound
    as a run's are by default (``actors.cpu_binding``: one core each on these 2-core machines)."""
    with running_policy(ray_session, tiny_model_path, redis_url, "test-sync-tp2", "test-policy-tp2", tp=2) as actor:
        yield actor
