#!/usr/bin/env bash
# Decode tokens/s of the demo model (Gemma 3 270M Q4_K_M) in llama.cpp and in strata, side by side
# on this machine: same file, 2 threads, a 65-token prompt ([BOS] + 64 tokens), 128 greedy decode
# steps, prompt time excluded. Needs scripts/reference/setup.sh (llama.cpp built from source) and a
# release build (cargo build --release). Run it on a quiet machine: both engines spin-wait on
# their threads, so other load skews the figures.
#
#   scripts/reference/bench-vs-llama-cpp.sh [MODEL.gguf]
set -euo pipefail
cd "$(dirname "$0")/../.."
model=${1:-${STRATA_MODELS_DIR:-$HOME/.cache/strata/models}/gemma-3-270m-q4_k_m.gguf}
threads=2

echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) logical CPUs; $(date -u +%Y-%m-%dT%H:%MZ)"
for round in 1 2; do
    llama=$(.venv/reference/bin/python scripts/reference/llama_cpp_reference.py --speed-only --threads $threads --model "$model" 2>/dev/null)
    strata=$(RAYON_NUM_THREADS=$threads ./target/release/strata bench --model "$model" --prompt-len 65 --gen-len 128 --json 2>/dev/null | tail -1)
    python3 - "$round" "$llama" "$strata" <<'PY'
import json, sys
round_, llama, strata = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
print(f"round {round_}: llama.cpp {llama['llama_cpp_python_version']} {llama['tokens_per_second']:.2f} tok/s | "
      f"strata {strata['aggregate_decode_tok_s']:.2f} tok/s (ITL p50 {strata['itl_ms_p50']:.1f} ms)")
PY
done
