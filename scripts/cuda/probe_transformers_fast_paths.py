#!/usr/bin/env python3
"""Which of transformers' faster decode paths run for the synthetic Qwen3.5 4B shape on this GPU,
and how fast: `generate` with its default (dynamic) cache and with `cache_implementation="static"`,
and a greedy loop over the forward compiled by `torch.compile` (dynamic shapes, DynamicCache) —
what bench_transformers.py --compile times. Each prints "ok <tok/s> in <seconds>" or the error.
Batch 1, 128-token prompt; generate: 64 tokens after an 8-token warm-up call, its prefill inside
the timing; compiled loop: a second round of 32 decode steps after a first that compiles, the
prefill outside.
Usage (on the GPU machine): python3 scripts/cuda/probe_transformers_fast_paths.py
"""
import pathlib
import sys
import time
import traceback

import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import bench_transformers as bt  # noqa: E402  (the shapes and config it builds)


def main():
    print("transformers", transformers.__version__, "torch", torch.__version__)
    cfg = bt.config("qwen3.5-4b")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = bt.Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 128), device="cuda")

    def run(name, fn):
        start = time.perf_counter()
        try:
            rate = fn()
            print(name, "ok", round(rate, 1), "in", round(time.perf_counter() - start, 1), "s", flush=True)
        except Exception as e:  # a path that does not run is the finding
            print(name, "FAILED", type(e).__name__, str(e)[:400], flush=True)
            traceback.print_exc(limit=3)

    def generate(**kw):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, **kw)
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False, **kw)
            torch.cuda.synchronize()
            return 64 / (time.perf_counter() - start)

    def compiled_loop():
        step = torch.compile(model.forward, dynamic=True)
        with torch.no_grad():
            bt.decode_rate(model, cfg, step, 1, 128, 32)  # compiles
            return bt.decode_rate(model, cfg, step, 1, 128, 32)

    run("generate, dynamic cache", generate)
    run("generate, static cache", lambda: generate(cache_implementation="static"))
    run("torch.compile'd forward, dynamic cache", compiled_loop)


if __name__ == "__main__":
    main()
