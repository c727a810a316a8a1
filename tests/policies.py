"""A vLLM policy actor for tests, cleaned up like a run's (shared by fixtures in several modules)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path


@contextlib.contextmanager
def running_policy(ray, model_path: str, redis_url: str, run: str, replica: str, tp: int = 1):
    """A vLLM policy actor that lists its engine's shared-memory files as a run's does, closed
    and its files removed afterwards also when its engine died (a test that crashed it would
    otherwise leave ~170 MiB of vLLM queues in /dev/shm)."""
    from actors.engine_shm import remove_recorded
    from actors.policy import Policy
    from tests.configs import policy_config

    record = Path(tempfile.mkdtemp(prefix="engine-record-")) / "engine-files.json"
    config = policy_config(tp=tp)
    actor = Policy.remote(model_path, redis_url, run, config, replica=replica, engine_files_record=str(record))
    try:
        ray.get(actor.__ray_ready__.remote())
        yield actor
    finally:
        try:
            ray.get(actor.close.remote())
        except Exception:  # noqa: BLE001 (a dead engine or actor: its files are removed below)
            ray.kill(actor)
        remove_recorded(record)
        shutil.rmtree(record.parent, ignore_errors=True)
