#!/usr/bin/env bash
# Builds the CUDA-enabled strata binary (no GPU needed): target/cuda/release/strata.
# Run scripts/cuda/setup.sh once first. Extra arguments go to cargo (e.g. --tests).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/cuda/env.sh
cargo build --release -p strata-cli --features cuda "$@"
