"""The GPU checks run on machines with PyTorch, transformers, safetensors, numpy, pytest and a
carried redis-py, and nothing else of ours: no Ray, vLLM, Hydra, math-verify or W&B. Importing
what ``scripts/gpu_check.sh`` runs must not need them (else the check fails there, where it is
costly to find out)."""

from __future__ import annotations

import subprocess
import sys

ABSENT_THERE = ["ray", "vllm", "hydra", "omegaconf", "math_verify", "wandb", "trl"]
GPU_CHECKED = ["tests.conftest", "tests.test_weightsync_cuda", "bench.weightsync_gpu", "weightsync.vllm_extension"]


def test_what_the_gpu_check_runs_imports_without_ray_vllm_or_hydra():
    code = (
        "import sys\n"
        + "".join(f"sys.modules[{name!r}] = None\n" for name in ABSENT_THERE)
        + "".join(f"import {module}\n" for module in GPU_CHECKED)
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
