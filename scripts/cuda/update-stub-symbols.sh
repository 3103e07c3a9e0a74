#!/usr/bin/env bash
# Regenerates scripts/cuda/stub-symbols.txt — the CUDA library symbols the link stubs export —
# after a candle or cudarc upgrade: every symbol the CUDA build's cudarc rlib and candle's
# libmoe.a leave undefined, assigned to its library by name. Run it after scripts/cuda/build.sh
# has compiled those (its final link may fail for a symbol the old list lacks), then
# scripts/cuda/setup.sh to rebuild the stubs, then build.sh again.
set -euo pipefail
cd "$(dirname "$0")/../.."
objects=(target/cuda/release/deps/libcudarc-*.rlib target/cuda/release/build/candle-kernels-*/out/libmoe.a)
for o in "${objects[@]}"; do
    [ -e "$o" ] || { echo "no $o: run scripts/cuda/build.sh first" >&2; exit 1; }
done
for o in "${objects[@]}"; do nm -u "$o" 2>/dev/null; done | awk '{print $NF}' |
    grep -E '^(cu[A-Z]|cublas|curand|nvrtc)' | sort -u | awk '
        /^cublasLt/ { print "libcublasLt.so.13", $0; next }
        /^cublas/   { print "libcublas.so.13", $0; next }
        /^curand/   { print "libcurand.so.10", $0; next }
        /^nvrtc/    { print "libnvrtc.so.13", $0; next }
                    { print "libcuda.so.1", $0 }' | sort >scripts/cuda/stub-symbols.txt.new
mv scripts/cuda/stub-symbols.txt.new scripts/cuda/stub-symbols.txt
cut -d' ' -f1 scripts/cuda/stub-symbols.txt | uniq -c
