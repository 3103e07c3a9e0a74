#!/usr/bin/env python3
"""transformers' side of the GPU benchmark, and the GPU's measured limits.

Builds the synthetic Qwen3.5 shapes `strata bench --synthetic` builds (both read
crates/model/src/synthetic_shapes.json) with random bf16 weights on the GPU, and prints one JSON object
per line:
  {"kind": "limits", "copy_gb_s": ..., "bf16_tflop_s": ...}
  {"kind": "model", "shape": ..., "params": ..., "weight_bytes_per_token": ..., "state_bytes_per_row": ...}
  {"kind": "decode", "shape": ..., "batch": B, "tok_s": ...}      (eager, DynamicCache)
  {"kind": "decode", "mode": "compiled", "shape": ..., "batch": B, "tok_s": ...}   (with --compile)
  {"kind": "prefill", "shape": ..., "prompt": P, "tok_s": ..., "peak_gib": ...}
Usage: bench_transformers.py --shape qwen3.5-4b [--batch 1,8,32,64] [--prompt 2048,8192,32768] [--compile]

--compile also decodes with the model's forward compiled by `torch.compile` (default mode,
dynamic shapes, the DynamicCache Qwen3.5 uses; `generate` with transformers' static cache ran at
1.3 tok/s on the H200 machine, probe_transformers_fast_paths.py), after the prefill rows.
Compilation happens in an untimed warm-up over the same steps; a failure, or a recompile in the
timed steps, prints {"kind": "decode", "mode": "compiled", ..., "error": ...} and the run goes on.
"""
import argparse
import json
import pathlib
import time

import torch
from transformers import (
    DynamicCache,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

# The shapes `strata bench --synthetic` builds, from the file it reads them from.
SHAPES = json.loads((pathlib.Path(__file__).parents[2] / "crates/model/src/synthetic_shapes.json").read_text())


def config(name):
    """The shape's text config; a mixture-of-experts shape (`experts`) gives a Qwen3_5MoeTextConfig."""
    shape = SHAPES[name]
    hidden, layers, tied = shape["hidden"], shape["layers"], shape["tied"]
    heads, kv, lk, lv = shape["heads"], shape["kv_heads"], shape["linear_key_heads"], shape["linear_value_heads"]
    experts = shape.get("experts")
    if experts:
        make, feed_forward = Qwen3_5MoeTextConfig, dict(
            num_experts=experts["count"], num_experts_per_tok=experts["per_token"],
            moe_intermediate_size=experts["intermediate"], shared_expert_intermediate_size=experts["shared"])
    else:
        make, feed_forward = Qwen3_5TextConfig, dict(intermediate_size=shape["intermediate"])
    return make(
        vocab_size=248_320, hidden_size=hidden, num_hidden_layers=layers, **feed_forward,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=256, linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=lk,
        linear_num_value_heads=lv, rms_norm_eps=1e-6, max_position_embeddings=262_144,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True})


def timed(fn, repeat=1):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def limits():
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = timed(lambda: dst.copy_(src), 20)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm = timed(lambda: a @ a, 20)
    return {"kind": "limits", "copy_gb_s": 2 * src.numel() / copy / 1e9, "bf16_tflop_s": 2 * 8192**3 / mm / 1e12}


def decode_rate(model, cfg, step, batch, prompt, gen):
    """Tokens/s of `gen` greedy decode steps of `step` (the model's forward, or it compiled) after
    an eager prefill of `batch` random prompts of `prompt` tokens; the prefill is not timed."""
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), device="cuda")
    cache = DynamicCache(config=cfg)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(gen):
        out = step(input_ids=nxt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    return batch * gen / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--batch", default="1")
    ap.add_argument("--prompt", default="2048")
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--limits", action="store_true")
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    if a.limits:
        print(json.dumps(limits()), flush=True)
    torch.manual_seed(0)
    cfg = config(a.shape)
    with torch.device("cuda"):
        model = (Qwen3_5MoeForCausalLM if isinstance(cfg, Qwen3_5MoeTextConfig) else Qwen3_5ForCausalLM)(cfg).to(torch.bfloat16).eval()
    embed = model.model.embed_tokens.weight.numel()
    total = sum(p.numel() for p in model.parameters())
    # Read per decoded token: every matrix once (the tied embedding once, as the output head).
    read = total if cfg.tie_word_embeddings else total - embed
    # The recurrent state every decode step reads per sequence (f32, every DeltaNet layer).
    linear = sum(t == "linear_attention" for t in cfg.layer_types)
    state = 4 * linear * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    print(json.dumps({"kind": "model", "shape": a.shape, "params": total, "weight_bytes_per_token": 2 * read,
                      "state_bytes_per_row": state}), flush=True)
    vocab = cfg.vocab_size

    def decode(step, batch, gen):
        return decode_rate(model, cfg, step, batch, a.decode_prompt, gen)

    batches = list(map(int, a.batch.split(",")))
    with torch.no_grad():
        for batch in batches:
            print(json.dumps({"kind": "decode", "shape": a.shape, "batch": batch, "tok_s": decode(model, batch, a.gen)}),
                  flush=True)
        for prompt in map(int, a.prompt.split(",")):
            ids = torch.randint(0, vocab, (1, prompt), device="cuda")
            torch.cuda.reset_peak_memory_stats()
            try:
                seconds = timed(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1))
                print(json.dumps({"kind": "prefill", "shape": a.shape, "prompt": prompt, "tok_s": prompt / seconds,
                                  "peak_gib": torch.cuda.max_memory_allocated() / 2**30}), flush=True)
            except torch.OutOfMemoryError:
                print(json.dumps({"kind": "prefill", "shape": a.shape, "prompt": prompt, "error": "out of memory"}), flush=True)
                torch.cuda.empty_cache()
        # After the prefill rows, whose peak memory the compiled runs' allocations would skew.
        if a.compile:
            compiled = torch.compile(model.forward, dynamic=True)
            for batch in batches:
                row = {"kind": "decode", "mode": "compiled", "shape": a.shape, "batch": batch}
                try:
                    # Compiles outside the timing, over the same cache lengths the timed run sees;
                    # a recompile inside it (or Dynamo falling back to eager) is then an error row,
                    # not a slow "compiled" figure.
                    decode(compiled, batch, a.gen)
                    torch.compiler.set_stance("fail_on_recompile")
                    try:
                        row["tok_s"] = decode(compiled, batch, a.gen)
                    finally:
                        torch.compiler.set_stance("default")
                except Exception as e:  # a compiler failure is a result to report, not the end of the run
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
