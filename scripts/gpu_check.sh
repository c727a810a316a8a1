#!/usr/bin/env bash
# The weight-sync checks for a lent GPU machine (no vLLM there: see tests/test_weightsync_cuda.py).
# Prepare with scripts/gpu_carry.sh here; then the device tool's run, with carry
# [".gpu-carry", ".cache/tiny-model"], command "bash scripts/gpu_check.sh", timeout_s 300.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu-carry/whl/*.whl \
    || exit 1
export PYTHONPATH="/tmp/site:$PWD" PATH="$PWD/.gpu-carry/bin:$PATH" PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -m pytest -q -p no:cacheprovider -rs tests/test_weightsync_cuda.py 2>&1 | tee "${OUT:-/tmp}/gpu_check.log"
