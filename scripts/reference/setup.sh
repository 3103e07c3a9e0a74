#!/usr/bin/env bash
# Creates .venv/reference (repo-relative, gitignored) with the outside references strata's
# Gemma 3 fixtures are generated from: llama.cpp through llama-cpp-python (built from source,
# plain CPU build with native optimisations) and Hugging Face transformers reading the GGUF.
# llama.cpp is only ever an outside reference for these scripts, never a dependency of strata.
#
# Run from anywhere:  scripts/reference/setup.sh
# Building llama.cpp takes several minutes; set CMAKE_BUILD_PARALLEL_LEVEL (default 2) to
# change how many compile jobs it uses. The torch wheel is PyPI's default Linux one, which
# bundles CUDA libraries (several GB) but runs on CPU; nothing here needs a GPU.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$ROOT/.venv/reference"
PYTHON="${PYTHON:-python3}"

# Versions the fixtures in fixtures/gemma3/ were generated with.
LLAMA_CPP_PYTHON_VERSION=0.3.36
NUMPY_VERSION=2.4.6
TORCH_VERSION=2.15.0
TRANSFORMERS_VERSION=5.24.0
GGUF_VERSION=0.19.0
SENTENCEPIECE_VERSION=0.2.3
PROTOBUF_VERSION=7.36.2
ACCELERATE_VERSION=1.15.0

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --upgrade pip

"$VENV/bin/python" -m pip install "numpy==$NUMPY_VERSION"

# llama.cpp: CPU only, tuned for this machine (-march=native), no BLAS/GPU backends, no curl.
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_HIP=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
FORCE_CMAKE=1 nice -n 10 "$VENV/bin/python" -m pip install --no-cache-dir --verbose \
    "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"

# transformers oracle (dequantises the GGUF itself through the gguf package; loading a GGUF
# needs accelerate).
"$VENV/bin/python" -m pip install \
    "torch==$TORCH_VERSION" \
    "transformers==$TRANSFORMERS_VERSION" \
    "gguf==$GGUF_VERSION" \
    "accelerate==$ACCELERATE_VERSION" \
    "sentencepiece==$SENTENCEPIECE_VERSION" \
    "protobuf==$PROTOBUF_VERSION"

"$VENV/bin/python" - <<'PY'
from importlib.metadata import version
import llama_cpp, torch, transformers, gguf, accelerate  # noqa: F401  (all importable)
for name in ("llama-cpp-python", "numpy", "torch", "transformers", "gguf", "accelerate",
             "sentencepiece", "protobuf"):
    print(name, version(name))
PY
echo "reference venv ready: $VENV"
