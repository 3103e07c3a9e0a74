#!/usr/bin/env bash
# Builds the CUDA-enabled strata binary (no GPU needed): target/cuda/release/strata.
# With --tests, also the GPU test binaries — the kernels against their CPU twins
# (crates/kernels/tests/gpu.rs) and captured decode steps against eager ones
# (crates/model/tests/gpu_graph.rs) — whose paths it prints last; run them on the GPU machine
# from their crate's folder.
# Run scripts/cuda/setup.sh once first.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/cuda/env.sh
cargo build --release -p strata-cli --features cuda
if [ "${1:-}" = "--tests" ]; then
    for crate_test in "strata-kernels gpu" "strata-model gpu_graph"; do
        set -- $crate_test
        cargo test --release -p "$1" --features cuda --test "$2" --no-run 2>&1 | tee /dev/stderr |
            sed -n 's/.*Executable .*(\(.*\))$/\1/p'
    done
fi
