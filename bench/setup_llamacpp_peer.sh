#!/usr/bin/env bash
# Sets up the peer for bench/engine_vs_llamacpp.py: llama-cpp-python compiled for this CPU
# (GGML_NATIVE, so ggml uses every instruction set the machine has) in its own venv, never a
# dependency of shoal. The compile takes long on a small machine, so everything it makes lives
# in one cache folder, LLAMACPP_CACHE (default .bench):
#
#     llamacpp-venv/                      the peer's venv
#     sdist/                              the source archive, downloaded once
#     build/llamacpp-VERSION-FLAGS/       CMake's build tree: an interrupted compile resumes
#     wheels/llamacpp-VERSION-FLAGS/      the built wheel: a second setup installs it at once
#
# FLAGS is a hash of the CPU's flags: a wheel compiled natively on one kind of processor may not
# run on another. The compile runs at the lowest priority (nice 19). Only the text library is
# built (LLAVA_BUILD=OFF): the bench does not use the multimodal one.
#
#     bench/setup_llamacpp_peer.sh    # then: bench/engine_vs_llamacpp.py
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="0.3.36"
CACHE="${LLAMACPP_CACHE:-.bench}"
VENV="$CACHE/llamacpp-venv"
FLAGS_KEY="$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-12)"
KEY="llamacpp-${VERSION}-${FLAGS_KEY}"
WHEELS="$CACHE/wheels/$KEY"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
  echo "llama.cpp peer ready: $VENV"
  exit 0
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
mkdir -p "$WHEELS" "$CACHE/sdist" "$CACHE/build"
if ! ls "$WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  SDIST="$CACHE/sdist/llama_cpp_python-${VERSION}.tar.gz"
  [ -f "$SDIST" ] || "$VENV/bin/python" -m pip download -q --no-deps --no-binary :all: \
    -d "$CACHE/sdist" "llama-cpp-python==${VERSION}"
  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" \
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
    nice -n 19 "$VENV/bin/python" -m pip wheel --no-deps -w "$WHEELS" \
    -C "build-dir=$(realpath "$CACHE/build")/$KEY" "$SDIST"
fi
"$VENV/bin/python" -m pip install -q "$WHEELS"/llama_cpp_python-*.whl
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
echo "llama.cpp peer ready: $VENV"
