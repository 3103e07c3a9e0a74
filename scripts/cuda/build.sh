#!/usr/bin/env bash
# Builds the CUDA-enabled strata binary (no GPU needed): target/cuda/release/strata.
# With --tests, also the kernels' GPU-against-CPU test binary (crates/kernels/tests/gpu.rs),
# whose path it prints last; run it on the GPU machine.
# Run scripts/cuda/setup.sh once first.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/cuda/env.sh
cargo build --release -p strata-cli --features cuda
if [ "${1:-}" = "--tests" ]; then
    cargo test --release -p strata-kernels --features cuda --test gpu --no-run 2>&1 | tee /dev/stderr |
        sed -n 's/.*Executable .*(\(.*\))$/\1/p'
fi
