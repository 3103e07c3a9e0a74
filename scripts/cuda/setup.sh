#!/usr/bin/env bash
# Provisions a CUDA build of strata on a machine with no GPU and no CUDA install (CI, laptops):
#  - the CUDA 13.0 compiler toolkit from the Python package registry, pinned (an unpinned
#    nvidia-nvvm is newer and emits PTX the 13.0 ptxas rejects), into .cuda/venv;
#  - link stubs in .cuda/stubs: shared objects with the real libraries' sonames exporting the
#    symbols strata's dependencies use (stub-symbols.txt), so the binary links here and finds
#    the real driver, cuBLAS, cuRAND and NVRTC at run time on the GPU machine.
# Idempotent. Then: scripts/cuda/build.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."

if [ ! -x .cuda/venv/bin/pip ]; then
    python3 -m venv .cuda/venv
fi
.cuda/venv/bin/pip install --quiet --disable-pip-version-check \
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-cccl==13.0.85 nvidia-nvvm==13.0.88
cuda_root="$(echo .cuda/venv/lib/python3*/site-packages/nvidia/cu13)"

rm -rf .cuda/stubs && mkdir -p .cuda/stubs
# The runtime ships in the toolkit package; link against it as is.
ln -s "$PWD/$cuda_root/lib/libcudart.so.13" .cuda/stubs/libcudart.so
for soname in $(cut -d' ' -f1 scripts/cuda/stub-symbols.txt | sort -u); do
    name="${soname%%.so*}"
    grep "^$soname " scripts/cuda/stub-symbols.txt | while read -r _ symbol; do
        echo "void $symbol(void) {}"
    done > ".cuda/stubs/$name.c"
    cc -shared -fPIC -o ".cuda/stubs/$name.so" -Wl,-soname,"$soname" ".cuda/stubs/$name.c"
done
echo "CUDA toolkit in $cuda_root; link stubs in .cuda/stubs"
