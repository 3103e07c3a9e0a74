#!/usr/bin/env bash
# On the GPU machine: strata against Hugging Face transformers (eager) on the synthetic Qwen3.5
# shapes, same GPU, same run, with the GPU's measured limits; writes a markdown table.
# Usage: scripts/cuda/bench-vs-transformers.sh STRATA_BINARY OUT.md [SHAPES...]
#   (default shapes: qwen3.5-0.8b qwen3.5-4b; needs python3 with torch and transformers)
set -euo pipefail
cd "$(dirname "$0")/../.."
bin="$1"
out="$2"
shift 2
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(qwen3.5-0.8b qwen3.5-4b)
raw="$(mktemp)"
python3 scripts/cuda/bench_transformers.py --shape "${shapes[0]}" --limits --batch 1 --prompt 2048 \
    | sed 's/^/transformers /' >>"$raw"
for shape in "${shapes[@]}"; do
    if [ "$shape" != "${shapes[0]}" ]; then
        python3 scripts/cuda/bench_transformers.py --shape "$shape" --batch 1 --prompt 2048 | sed 's/^/transformers /' >>"$raw"
    fi
    "$bin" bench --synthetic "$shape" --device cuda --prompt-len 128 --gen-len 32 --concurrency 1 --json \
        | sed "s/^/strata-decode $shape /" >>"$raw"
    "$bin" bench --synthetic "$shape" --device cuda --prompt-len 2048 --gen-len 2 --concurrency 1 --json \
        | sed "s/^/strata-prefill $shape /" >>"$raw"
done
python3 - "$raw" "$out" <<'EOF'
import json, subprocess, sys
rows = [line.split(" ", 2) if line.startswith("strata") else line.split(" ", 1) for line in open(sys.argv[1])]
tf = [json.loads(r[-1]) for r in rows if r[0] == "transformers"]
limits = next(t for t in tf if t["kind"] == "limits")
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
lines = [f"GPU: {gpu}. Measured limits: copy {limits['copy_gb_s']:.0f} GB/s, bf16 matmul "
         f"{limits['bf16_tflop_s']:.0f} TFLOP/s (8192³). bf16, batch 1, random weights.", "",
         "| shape | measure | strata | transformers (eager) | roofline |", "|---|---|---:|---:|---:|"]
for r in rows:
    if r[0] == "strata-decode":
        shape, s = r[1], json.loads(r[2])
        m = next(t for t in tf if t["kind"] == "model" and t["shape"] == shape)
        t = next(t for t in tf if t["kind"] == "decode" and t["shape"] == shape and t["batch"] == 1)
        roof = limits["copy_gb_s"] * 1e9 / m["weight_bytes_per_token"]
        lines.append(f"| {shape} | decode tok/s (128-token prompt) | {s['aggregate_decode_tok_s']:.1f} | {t['tok_s']:.1f} | {roof:.0f} |")
    elif r[0] == "strata-prefill":
        shape, s = r[1], json.loads(r[2])
        m = next(t for t in tf if t["kind"] == "model" and t["shape"] == shape)
        t = next(t for t in tf if t["kind"] == "prefill" and t["shape"] == shape and t["prompt"] == 2048)
        roof = limits["bf16_tflop_s"] * 1e12 / (2 * m["params"])
        lines.append(f"| {shape} | prefill tok/s (2048 tokens) | {s['prefill_tok_s']:.0f} | {t.get('tok_s', 0):.0f} | {roof:.0f} |")
lines += ["", "Decode roofline: weight bytes read per token ÷ copy bandwidth. Prefill roofline: "
          "2 × parameters FLOPs per token ÷ bf16 matmul rate (attention's quadratic term left out)."]
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
