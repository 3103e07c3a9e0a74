#!/usr/bin/env bash
# Decode tokens/s of the demo model (Gemma 3 270M Q4_K_M) in llama.cpp and in strata, side by side
# on this machine: same file, 2 threads, a 65-token prompt ([BOS] + 64 tokens), 128 greedy decode
# steps, prompt time excluded. Needs scripts/reference/setup.sh (llama.cpp built from source) and a
# release build (cargo build --release). Run it on a quiet machine: both engines spin-wait on
# their threads, so other load skews the figures. The engines alternate for ROUNDS rounds
# (default 5) and the medians are compared: on a shared VM single runs vary by ±15%.
#
#   [ROUNDS=N] scripts/reference/bench-vs-llama-cpp.sh [MODEL.gguf]
set -euo pipefail
cd "$(dirname "$0")/../.."
model=${1:-${STRATA_MODELS_DIR:-$HOME/.cache/strata/models}/gemma-3-270m-q4_k_m.gguf}
threads=2

echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) logical CPUs; $(date -u +%Y-%m-%dT%H:%MZ)"
rounds=${ROUNDS:-5}
results=()
for round in $(seq "$rounds"); do
    llama=$(.venv/reference/bin/python scripts/reference/llama_cpp_reference.py --speed-only --threads $threads --model "$model" 2>/dev/null)
    strata=$(RAYON_NUM_THREADS=$threads ./target/release/strata bench --model "$model" --prompt-len 65 --gen-len 128 --json 2>/dev/null | tail -1)
    results+=("$llama" "$strata")
done
python3 - "${results[@]}" <<'PY'
import json, statistics, sys
runs = [json.loads(r) for r in sys.argv[1:]]
llama, strata = runs[0::2], runs[1::2]
for i, (l, s) in enumerate(zip(llama, strata), 1):
    print(f"round {i}: llama.cpp {l['llama_cpp_python_version']} {l['tokens_per_second']:.2f} tok/s | "
          f"strata {s['aggregate_decode_tok_s']:.2f} tok/s (ITL p50 {s['itl_ms_p50']:.1f} ms)")
l_med = statistics.median(l["tokens_per_second"] for l in llama)
s_med = statistics.median(s["aggregate_decode_tok_s"] for s in strata)
print(f"median: llama.cpp {l_med:.2f} tok/s | strata {s_med:.2f} tok/s | strata / llama.cpp = {s_med / l_med:.3f}")
PY
