# Environment for a CUDA build of strata (sourced by build.sh): the toolkit that setup.sh put
# under .cuda/, the H200's compute capability (there is no GPU here to ask), and the link stubs.
STRATA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CUDA_ROOT="$(echo "$STRATA_ROOT"/.cuda/venv/lib/python3*/site-packages/nvidia/cu13)"
if [ ! -x "$CUDA_ROOT/bin/nvcc" ]; then
    echo "no CUDA toolkit under .cuda/: run scripts/cuda/setup.sh first" >&2
    return 1
fi
export CUDA_ROOT CUDA_PATH="$CUDA_ROOT" PATH="$CUDA_ROOT/bin:$PATH"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
# candle-kernels' build runs its nvcc jobs on half the cores unless told otherwise; it is the
# longest step of the build and nothing else waits to run beside it.
export CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-$(nproc)}"
# The link stubs reach the linker through LIBRARY_PATH, not RUSTFLAGS: changed RUSTFLAGS would
# rebuild every crate, while this way the CUDA build reuses every dependency the CPU build made
# that CUDA does not change.
export LIBRARY_PATH="$STRATA_ROOT/.cuda/stubs:$CUDA_ROOT/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
