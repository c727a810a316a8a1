"""bench.weightsync_gpu's code paths on the CPU (``--device cpu``): the same pushes through
mapped files and mapped reads into the workers' tensors, checked against the trainer's values,
and the JSON the GPU runs commit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

REQUIRED = {"case", "gpu", "model_bytes", "floor_s", "push_s", "update_s", "update_tp2_s", "baseline_s"}


def test_the_benchmark_runs_on_the_cpu_and_writes_its_json(tmp_path):
    out = tmp_path / "weightsync_gpu.json"
    cmd = [sys.executable, "-m", "bench.weightsync_gpu", "--device", "cpu", "--cases", "tiny", "--repeats", "1"]
    done = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row.keys() >= REQUIRED and row["case"] == "tiny" and row["gpu"] == "cpu"
    assert row["model_bytes"] > 0 and all(row[k] > 0 for k in ("floor_s", "push_s", "update_s", "update_tp2_s"))
    # A TP=2 rank reads about half the model (verified: whole tiles, so a little more).
    assert 0.45 < row["bytes_read_tp2"] / row["model_bytes"] < 0.8
    assert "x floor" in done.stdout


def test_unknown_cases_and_a_missing_gpu_are_one_line_errors():
    done = subprocess.run(
        [sys.executable, "-m", "bench.weightsync_gpu", "--cases", "70b", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "unknown cases ['70b']" in done.stderr


@pytest.mark.parametrize("tp", [1, 2])
def test_the_tp_pieces_cover_each_fused_parameter_exactly_once(tp):
    """The plain-data layouts the benchmark reads by: every element of each rank's fused
    parameters is written by exactly one piece, from a box inside the Hugging Face tensor."""
    import torch

    from bench.weightsync_gpu import CASES, _fused, _param_of, state_dict_shapes, tp_pieces

    shapes = state_dict_shapes("tiny")
    for rank in range(tp):
        pieces = tp_pieces("tiny", rank, tp)
        counts = {name: torch.zeros(shape, dtype=torch.int32) for name, shape in _fused(pieces).items()}
        for piece in pieces:
            assert all(0 <= lo < hi <= n for (lo, hi), n in zip(piece.src, shapes[piece.hf_name]))
            counts[_param_of(piece)][tuple(slice(lo, hi) for lo, hi in piece.dst)] += 1
        assert all(bool((c == 1).all()) for c in counts.values())
        read = sum(
            torch.Size([hi - lo for lo, hi in piece.src]).numel() for piece in pieces if "norm" not in piece.hf_name
        )
        total = sum(torch.Size(s).numel() for name, s in shapes.items() if "norm" not in name)
        assert read * tp == total, (CASES["tiny"], read, total)
