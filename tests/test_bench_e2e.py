"""bench.e2e's own parts (the benchmark itself needs TRL, an optional extra, and minutes)."""

from __future__ import annotations

import subprocess
import sys

from algos.policy_loss import LOSS_AGGREGATIONS
from bench.e2e import TRL_LOSS, PeakRss, table


def test_every_loss_aggregation_has_its_trl_loss_type():
    assert set(TRL_LOSS) == set(LOSS_AGGREGATIONS)


def test_peak_rss_counts_the_children_of_the_process():
    # A parent that holds little and a child that holds 300 MiB for a second.
    child = "import time; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.0)"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    proc = subprocess.Popen([sys.executable, "-c", parent])
    rss = PeakRss(proc.pid, every_s=0.05)
    proc.wait()
    assert rss.stop() > 300 * 2**20


def test_table_has_a_row_per_system():
    row = {
        "system": "rlsys",
        "scale": "tiny",
        "median_step_s": 1.0,
        "completions_per_s": 512.0,
        "completion_len_mean": 3.5,
        "train_s": 150.0,
        "wall_s": 200.0,
        "heldout_accuracy": 0.56,
        "peak_rss_mib": 5000,
    }
    lines = table([row, row | {"system": "trl", "scale": "136m", "heldout_accuracy": None}]).splitlines()
    assert lines[0].startswith("system | scale | median_step_s") and len(lines) == 4
    assert lines[3] == "trl | 136m | 1.000 | 512.000 | 3.500 | 150.000 | 200.000 | - | 5000"
