#!/usr/bin/env bash
# On a GPU machine: the checks and serving benchmark of a new build beside an old one, in one
# run (absolute figures drift between machines; the two builds are compared in the same lease).
#   1. the GPU tests of the new build (kernels against their CPU twins, recorded decode steps
#      against eager ones), run from their crates' folders;
#   2. the fixtures' greedy tokens of the new build against transformers (check-fixtures.sh);
#   3. `strata bench` of both builds on a synthetic shape: 128-token prompts, 128 output tokens,
#      at each concurrency, and the new build with output lengths spread from 32 to 128, so
#      rows leave while others run (its JSON counts the CUDA graph recordings).
# Usage: scripts/cuda/compare-builds.sh OLD_STRATA NEW_STRATA OUT_DIR [SHAPE] [CONCURRENCY]
#        with the GPU test binaries' paths in GPU_TESTS (space-separated), if any.
# Every command's output also goes to OUT_DIR, one file each, as it runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
old=$1 new=$2 out=$3 shape=${4:-qwen3.5-4b} concurrency=${5:-1,64,128,256}
mkdir -p "$out"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"

for test in ${GPU_TESTS:-}; do
    name=$(basename "$test")
    crate=crates/kernels
    case "$name" in gpu_graph-*) crate=crates/model ;; esac
    echo "== $name (in $crate)"
    (cd "$crate" && timeout 90 "$test" --test-threads 1 2>&1) | tee "$out/$name.txt" | grep -E "^test |test result"
done

echo "== fixtures (new build)"
timeout 90 scripts/cuda/check-fixtures.sh "$new" 2>&1 | tee "$out/fixtures.txt"

bench() {
    local label=$1 bin=$2
    shift 2
    echo "== bench $label: $*"
    timeout 120 "$bin" bench --synthetic "$shape" --device cuda --prompt-len 128 --gen-len 128 --json "$@" 2>&1 |
        tee "$out/bench-$label.jsonl" | grep '^{' | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print("conc %4d  decode %9.1f tok/s  prefill %9.1f tok/s  TTFT p50 %7.1f ms  ITL p50 %6.2f ms  recordings %s  replays %s"
          % (r["concurrency"], r["aggregate_decode_tok_s"], r["prefill_tok_s"], r["ttft_ms_p50"], r["itl_ms_p50"],
             r.get("cuda_graph_recordings", "-"), r.get("cuda_graph_replays", "-")))'
}
bench new "$new" --concurrency "$concurrency"
bench new-spread "$new" --concurrency "$concurrency" --gen-len-min 32
bench old "$old" --concurrency "$concurrency"
