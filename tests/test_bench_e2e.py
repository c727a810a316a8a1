"""bench.e2e's own parts (the benchmark itself needs TRL, an optional extra, and minutes)."""

from __future__ import annotations

import subprocess
import sys

from algos.policy_loss import LOSS_AGGREGATIONS
from bench.e2e import TRL_LOSS, PeakRss, table

ROW = {  # a row of bench.e2e's table
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
    lines = table([ROW, ROW | {"system": "trl", "scale": "136m", "heldout_accuracy": None}]).splitlines()
    assert lines[0].startswith("system | scale | median_step_s") and len(lines) == 4
    assert lines[3] == "trl | 136m | 1.000 | 512.000 | 3.500 | 150.000 | 200.000 | - | 5000"


def test_seeds_run_every_system_at_accuracy_scales_from_one_start_model():
    from bench.e2e import Scale, accuracy_over_seeds

    tiny, other = Scale("tiny", 150, [], True), Scale("136m", 6, ["model.path=/m"], False)
    assert tiny.seeds([0, 1, 2]) == [0, 1, 2] and other.seeds([0, 1, 2]) == [0] and tiny.seeds([]) == [None]
    seeded = tiny.ours("rlsys-async", 1, "/tiny")
    assert "seed=1" in seeded and "model.path=/tiny" in seeded and "mode=async" in seeded
    assert not any(o.startswith(("seed=", "model.path=")) for o in tiny.ours("rlsys", None, "/tiny"))
    rows = [
        {"system": s, "scale": "tiny", "seed": seed, "heldout_accuracy": acc}
        for s, seed, acc in [("rlsys", 0, 0.5), ("rlsys", 1, 0.6), ("trl", 0, 0.4), ("trl", 1, 0.4)]
    ]
    lines = accuracy_over_seeds([*rows, {"system": "rlsys", "scale": "136m", "seed": 0, "heldout_accuracy": None}])
    assert lines == [
        "rlsys tiny held-out accuracy over 2 seeds: mean 0.550, sd 0.071 (seed 0: 0.500, seed 1: 0.600)",
        "trl tiny held-out accuracy over 2 seeds: mean 0.400, sd 0.000 (seed 0: 0.400, seed 1: 0.400)",
    ]


def test_table_names_the_seed_of_seeded_rows():
    lines = table([ROW | {"seed": 2}]).splitlines()
    assert lines[0].startswith("system | scale | seed | median_step_s")
    assert lines[2].startswith("rlsys | tiny | 2 | 1.000")
