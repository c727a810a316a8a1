#!/usr/bin/env bash
# The weight-sync checks for a lent GPU machine (no vLLM, Ray or Hydra there): the CUDA tests
# (tests/test_weightsync_cuda.py), then the GPU benchmark (bench.weightsync_gpu), whose JSON comes
# back in $OUT to be committed as bench/results/weightsync_gpu.json. Prepare with
# scripts/gpu_carry.sh here; then the device tool's run, with carry [".gpu-carry", ".cache/tiny-model"],
# command "bash scripts/gpu_check.sh", timeout_s 480.
set -uo pipefail
out=${OUT:-/tmp}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu-carry/whl/*.whl \
    || exit 1
export PYTHONPATH="/tmp/site:$PWD" PATH="$PWD/.gpu-carry/bin:$PATH" PYTHONUNBUFFERED=1
nvidia-smi -L
df -h /dev/shm | tail -1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout 180 python3 -m pytest -q -p no:cacheprovider -rs tests/test_weightsync_cuda.py 2>&1 | tee "$out/gpu_check.log"
tests=${PIPESTATUS[0]}
timeout 270 python3 -m bench.weightsync_gpu --out "$out/weightsync_gpu.json" 2>&1 | tee -a "$out/gpu_check.log"
bench=${PIPESTATUS[0]}
echo "tests exit $tests, benchmark exit $bench"
exit $((tests || bench))
