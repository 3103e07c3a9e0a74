#!/usr/bin/env bash
# Builds the CUDA-enabled strata binary (no GPU needed): target/cuda/release/strata.
# With --tests, also the GPU test binaries — the kernels against their CPU twins
# (crates/kernels/tests/gpu.rs), captured decode steps against eager ones
# (crates/model/tests/gpu_graph.rs) and images against transformers on CPU and GPU
# (crates/model/tests/vision_oracle.rs) — whose paths it prints last; run them on the GPU machine
# from their crate's folder.
# With --check (CI), the same builds in the dev profile in the CPU build's target folder: they
# compile and link everything the release build does and share the CPU build's optimised
# dependencies, instead of building them all again; not for running on a GPU (slow).
# Run scripts/cuda/setup.sh once first.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/cuda/env.sh
profile=(--release)
target_dir="$STRATA_ROOT/target/cuda"
tests=false
for arg in "$@"; do
    case "$arg" in
        --tests) tests=true ;;
        --check) profile=(); target_dir="$STRATA_ROOT/target" ;;
        *) echo "usage: scripts/cuda/build.sh [--tests] [--check]" >&2; exit 2 ;;
    esac
done
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$target_dir}"
if $tests; then
    # The binary and the GPU tests in one command: one feature resolution (with the tests'
    # dev-dependencies, as the CPU test build has) and one profile, where a second command
    # (-p strata-kernels, or `cargo test` after `cargo build`) compiled shared dependencies
    # again. The test binaries' paths come from cargo's JSON messages.
    cargo build "${profile[@]}" --workspace --features strata-cli/cuda --bins --test gpu --test gpu_graph --test vision_oracle \
        --message-format=json-render-diagnostics |
        grep '"kind":\["test"\]' | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p'
else
    cargo build "${profile[@]}" -p strata-cli --features cuda
fi
