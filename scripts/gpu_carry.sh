#!/usr/bin/env bash
# Prepares .gpu-carry/ for scripts/gpu_check.sh. A lent GPU machine has PyTorch, transformers,
# safetensors, numpy, psutil and pytest, but no redis-server, no redis-py and no network: this
# copies redis-server with the libraries it links beyond glibc (behind a wrapper that sets their
# path for it alone) and downloads the redis-py wheel the venv here uses. Run it here, then
# call the device tool with carry [".gpu-carry", ".cache/tiny-model"] and the command
# "bash scripts/gpu_check.sh".
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu-carry
server=$(command -v redis-server) || { echo "redis-server is not installed here" >&2; exit 1; }
rm -rf "$out"
mkdir -p "$out/bin" "$out/libexec" "$out/lib" "$out/whl"
cp "$(readlink -f "$server")" "$out/libexec/redis-server"
ldd "$server" | awk '$3 ~ /^\// {print $1, $3}' | while read -r name path; do
    case "$name" in libc.so.*|libm.so.*|libgcc_s.so.*|libstdc++.so.*|ld-linux*) continue ;; esac
    cp "$(readlink -f "$path")" "$out/lib/$name"
done
cat > "$out/bin/redis-server" <<'WRAP'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")/..
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/libexec/redis-server" "$@"
WRAP
chmod +x "$out/bin/redis-server"
version=$(.venv/bin/python -c "import redis; print(redis.__version__)")
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 -d "$out/whl" "redis==$version"
"$out/bin/redis-server" --version
du -sh "$out"
