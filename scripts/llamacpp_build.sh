#!/usr/bin/env bash
# Build llama.cpp for the bench's opt-in `llamacpp` section (edgelin/bench/llamacpp.py), from the source vendored in
# PyPI's llama-cpp-python sdist (fetched with pip). Benchmarks only: never part of `make test`.
#
#   bash scripts/llamacpp_build.sh DIR      about 10-40 min on 2 cores; then
#   EDGELIN_LLAMA_CPP=DIR/llama.cpp edgelin bench --section llamacpp
#
# Leaves DIR/llama.cpp (the source, its convert_hf_to_gguf.py, build/bin/llama-bench, llama-quantize, libllama) and
# DIR/llama_cpp_python-VERSION (the rest of the sdist: its ctypes bindings give the section llama.cpp's greedy ids).
# Needs cmake, ninja and a C++ compiler; PY (default: python3) needs pip.
set -euo pipefail
dir=${1:?usage: llamacpp_build.sh DIR}
PY=${PY:-python3}
version=${LLAMA_CPP_PYTHON:-0.3.36}
src=$dir/llama.cpp
mkdir -p "$dir"
if [ ! -d "$src" ]; then
  "$PY" -m pip download --no-deps --no-binary :all: -d "$dir/sdist" "llama-cpp-python==$version" >/dev/null
  tar xzf "$dir/sdist/llama_cpp_python-$version.tar.gz" -C "$dir"
  mv "$dir/llama_cpp_python-$version/vendor/llama.cpp" "$src"
fi
cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
cmake --build "$src/build" -j "$(nproc)" --target llama-bench llama-quantize
echo "built; now: export EDGELIN_LLAMA_CPP=$(realpath "$src")"
