"""Run a test's Python script in a process of its own (a Ray cluster apart from the session's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_script(script: str, *args: str, timeout: float = 300) -> dict:
    """``python -c script args...`` in the repository; the JSON object its last output line prints."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
