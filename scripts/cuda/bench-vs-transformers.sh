#!/usr/bin/env bash
# On the GPU machine: strata against Hugging Face transformers (eager, and its decode compiled by
# torch.compile) on the synthetic Qwen3.5 shapes, same GPU, same run, with the GPU's measured
# limits; writes a markdown table.
# Usage: scripts/cuda/bench-vs-transformers.sh STRATA_BINARY OUT.md [SHAPES...]
#   (default shapes: qwen3.5-0.8b qwen3.5-4b; needs python3 with torch and transformers, and
#   nvidia-smi for strata's peak memory). Each measurement is also appended to OUT.md.raw
#   as it is made.
set -euo pipefail
cd "$(dirname "$0")/../.."
bin="$1"
out="$2"
shift 2
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(qwen3.5-0.8b qwen3.5-4b)
batches=1,8,32,64
prompts=(2048 8192 32768)
# Every measurement is appended to OUT.raw as it is made (and shown), so a run cut off before the
# table keeps what it measured.
raw="$out.raw"
: >"$raw"
mem="$(mktemp)"
limits=--limits
for shape in "${shapes[@]}"; do
    python3 scripts/cuda/bench_transformers.py --shape "$shape" $limits --compile --batch "$batches" \
        --prompt "$(IFS=,; echo "${prompts[*]}")" | sed -u 's/^/transformers /' | tee -a "$raw"
    limits=
    # Decode: 128-token prompts, long enough generations that every batch size has a window
    # where all its requests decode together (what `strata bench` reports).
    "$bin" bench --synthetic "$shape" --device cuda --prompt-len 128 --gen-len 128 --concurrency "$batches" --json \
        | sed -u "s/^/strata-decode $shape /" | tee -a "$raw"
    for p in "${prompts[@]}"; do
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >"$mem" &
        sampler=$!
        line=$("$bin" bench --synthetic "$shape" --device cuda --prompt-len "$p" --gen-len 2 --concurrency 1 --json)
        kill "$sampler"
        wait "$sampler" 2>/dev/null || true
        peak=$(sort -n "$mem" | tail -1)
        echo "strata-prefill $shape ${peak:--} $line" | tee -a "$raw"
    done
done
python3 - "$raw" "$out" <<'PY'
import json, subprocess, sys
rows = [line.rstrip("\n").split(" ", 1) for line in open(sys.argv[1])]
# Only the JSON lines: a library's stray line on stdout must not lose the run.
tf = [json.loads(r[1]) for r in rows if r[0] == "transformers" and r[1:] and r[1].startswith("{")]
limits = next(t for t in tf if t["kind"] == "limits")
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
bw, mm = limits["copy_gb_s"] * 1e9, limits["bf16_tflop_s"] * 1e12
lines = [f"GPU: {gpu}. Measured limits: copy {limits['copy_gb_s']:.0f} GB/s, bf16 matmul "
         f"{limits['bf16_tflop_s']:.0f} TFLOP/s (8192³). bf16, random weights.", "",
         "| shape | measure | strata | transformers (eager) | transformers (torch.compile) | roofline |",
         "|---|---|---:|---:|---:|---:|"]
def find(kind, shape, **keys):
    return next((t for t in tf if t["kind"] == kind and t["shape"] == shape
                 and all(t.get(k) == v for k, v in keys.items())), {})
for tag, rest in rows:
    if tag == "strata-decode":
        shape, s = rest.split(" ", 1)
        s = json.loads(s)
        m, b = find("model", shape), s["concurrency"]
        t, c = find("decode", shape, batch=b, mode=None), find("decode", shape, batch=b, mode="compiled")
        compiled = f"{c['tok_s']:.0f}" if "tok_s" in c else c.get("error", "-").split(":")[0]
        roof = b * bw / (m["weight_bytes_per_token"] + b * m["state_bytes_per_row"])
        lines.append(f"| {shape} | decode tok/s, batch {b} | {s['aggregate_decode_tok_s']:.0f} | "
                     f"{t.get('tok_s', float('nan')):.0f} | {compiled} | {roof:.0f} |")
    elif tag == "strata-prefill":
        shape, peak_mib, s = rest.split(" ", 2)
        s = json.loads(s)
        m, p = find("model", shape), s["prompt_len"]
        t = find("prefill", shape, prompt=p)
        tf_rate = f"{t['tok_s']:.0f}" if "tok_s" in t else t.get("error", "-")
        tf_ttft = f"{p / t['tok_s']:.2f}" if "tok_s" in t else "-"
        tf_peak = f"{t['peak_gib']:.1f}" if "peak_gib" in t else "-"
        lines.append(f"| {shape} | prefill tok/s, {p} tokens | {s['prefill_tok_s']:.0f} | {tf_rate} | - | "
                     f"{mm / (2 * m['params']):.0f} |")
        lines.append(f"| {shape} | TTFT s, {p} tokens | {s['ttft_ms_p50'] / 1e3:.2f} | {tf_ttft} | - | |")
        peak = f"{int(peak_mib) / 1024:.1f}" if peak_mib.isdigit() else "-"
        lines.append(f"| {shape} | peak GPU memory GiB, {p} tokens | {peak} | {tf_peak} | - | |")
lines += ["", "Decode: tokens/s over the window where the whole batch decodes (strata: 128-token prompts, "
          "128 tokens each; transformers: 32 steps after a batched 128-token prefill, eager, and with the "
          "forward compiled by torch.compile after an untimed warm-up that compiles it). Decode roofline: "
          "batch × copy bandwidth ÷ (weight bytes + batch × recurrent-state bytes) per step. Prefill roofline: "
          "2 × parameters FLOPs per token ÷ bf16 matmul rate (attention's quadratic term left out). "
          "Peak memory: strata's whole process as nvidia-smi reports it (CUDA context included); "
          "transformers' is PyTorch's peak allocation."]
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
