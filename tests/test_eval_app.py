"""``python -m apps.eval``: bad input is one line on stderr and exit 2, before Ray or vLLM start.
(A real evaluation of an export is in tests/test_grpo_app.py's short run.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "apps.eval", *args], cwd=REPO, capture_output=True, text=True)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["model.path=/no/such/dir"], "error: model.path '/no/such/dir' does not exist or is not a directory"),
        (["task=nope"], "error: task.name='nope': no module tasks/nope.py defines Task; available: ['arithmetic'"),
        (["task=dataset", "task.path=/no/such.jsonl"], "/no/such.jsonl"),
        (["taks=dataset"], "error: unknown config key 'taks'"),
    ],
)
def test_bad_model_or_task_is_one_line_and_exit_2(args, message):
    proc = _eval(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "Ray" not in proc.stdout + proc.stderr  # nothing started


def test_help_names_the_command_and_its_keys():
    proc = _eval("--help")
    assert proc.returncode == 0 and "python -m apps.eval model.path=<dir> task=<task>" in proc.stdout
