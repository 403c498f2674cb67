#!/usr/bin/env bash
# One-shot device check for a lent GPU machine (one H200, no Ray; its image has torch, triton,
# transformers and pytest but not msgspec, pyzmq or gguf). Finishes in under 8 minutes:
#   1. the `gpu`-marked tests (TRITON_ATTN against the torch reference on CUDA included);
#   2. bench/gpu_check.py: greedy vs HF in bf16 for a Llama-3.2-1B-shaped Llama and a Mixtral of
#      Mixtral-8x7B's layer shape (4 layers), random weights; TRITON_ATTN vs TORCH_SDPA at those
#      shapes; decode step time and offline throughput beside the HBM-bandwidth bound.
# Writes gpu_tests.log and gpu_check.md to $OUT (default ./gpu-check-out).
#
# Here, once, in the repository root (fetches the missing packages as Python 3.12 wheels):
#   bash bench/gpu_check.sh --fetch-wheels
# Then, on the device machine, carrying .whl:
#   bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--fetch-wheels" ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
  for pkg in msgspec pyzmq gguf; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d .whl "$pkg" || exit 1
  done
  ls .whl
  exit 0
fi

OUT=${OUT:-./gpu-check-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu_tests.log"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton",
triton.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/gpu_tests.log"

# The files that hold `gpu` tests (others beside them need Ray or the HTTP stack to import).
gpu_files=$(grep -rl --include='test_*.py' 'mark.gpu' tests | sort)
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider $gpu_files 2>&1 \
  | tee -a "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

timeout 260 python3 bench/gpu_check.py --out "$OUT/gpu_check.md" 2>&1 | tail -n 40
check_rc=${PIPESTATUS[0]}
echo "gpu tests: exit $tests_rc; gpu_check.py: exit $check_rc"
[ "$tests_rc" = 0 ] && [ "$check_rc" = 0 ]
