#!/usr/bin/env python3
"""Writes fixtures/gemma3/llama_cpp_reference.json: what llama.cpp (through llama-cpp-python)
computes for the Gemma 3 270M Q4_K_M GGUF, for strata's tests to compare against.

llama.cpp is only an outside reference here, never a dependency of strata.

Sections of the JSON:
  tokenize      token ids for a list of test strings (add_bos, special=True and special=False),
                plus the ids of the whole GPL-3 text (no BOS, no special parsing).
  perplexity    windowed perplexity over GPL-3, with exactly the definition in `perplexity()`
                below (strata implements the same one).
  greedy        32 greedy tokens after [BOS] + the first N GPL-3 tokens (longer than the
                512-token sliding window), with llama.cpp's default f16 KV cache, and the gap
                between the best and second-best logit at each step. N is the first of
                600, 625, 650, ... whose first 16 steps all have a gap of at least 0.3 with both KV caches: where
                two tokens are closer than that, rounding (llama.cpp's own KV precision, or any
                summation order) decides, and the comparison would test the rounding.
  greedy_f32_kv the same with an f32 KV cache: the precision strata keeps its KV in, so the
                two compute the same thing up to summation order.
  decode_speed  decode tokens/s with 2 threads after [BOS] + 64 GPL-3 tokens (prompt excluded).

Setup:  scripts/reference/setup.sh
Run:    .venv/reference/bin/python scripts/reference/llama_cpp_reference.py
        .venv/reference/bin/python scripts/reference/llama_cpp_reference.py --speed-only
        .venv/reference/bin/python scripts/reference/llama_cpp_reference.py --greedy-only
"""
import argparse
import gc
import hashlib
import json
import math
import os
import platform
import re
import sys
import time

import numpy as np
import llama_cpp
from llama_cpp import Llama

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MODEL = os.environ.get(
    "STRATA_GEMMA3_GGUF",
    os.path.expanduser("~/.cache/strata/models/gemma-3-270m-q4_k_m.gguf"),
)
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"
DEFAULT_OUT = os.path.join(ROOT, "fixtures", "gemma3", "llama_cpp_reference.json")

# The prompt the transformers oracle (gemma3_gguf_oracle.py) also feeds, by these very ids.
ORACLE_PROMPT = "The capital of France is Paris. The capital of Germany is"
CONTROL_STRING = "<start_of_turn>user\nhi<end_of_turn>\n"

TEST_STRINGS = [
    ("english", "The quick brown fox jumps over the lazy dog."),
    ("leading_spaces", "   leading spaces"),
    ("trailing_spaces", "trailing spaces   "),
    ("multiple_spaces", "multiple    spaces  between   words"),
    ("single_space", " "),
    ("newlines_tabs", "line one\nline two\n\nparagraph two\n\n\nthree newlines\tone tab\t\ttwo tabs\n"),
    ("accents", "Café naïve résumé façade — Ångström Über"),
    ("cjk", "日本語のテキストと中文文本，한국어 텍스트"),
    ("emoji", "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧"),
    # U+10FFFD (plane-16 private use) and U+1D11E (musical G clef): neither is a vocabulary
    # piece, so SentencePiece byte fallback spells them as <0xF4><0x8F>... byte tokens.
    ("byte_fallback", "rare: \U0010FFFD and \U0001D11E end"),
    ("code", "def add(a, b):\n    if a > b:\n        return a + b\n\treturn b - a  # tab-indented\n"),
    ("control_tokens", CONTROL_STRING),
    ("bos_literal", "<bos>hello<eos>"),
    # "<h1>", "<b>", "<s>", runs of spaces/tabs/newlines are USER_DEFINED tokens in this vocab:
    # llama.cpp splits them out of the raw text even with special=False.
    ("html_user_defined", "<h1>Title</h1> <b>bold</b> <s>x</s>"),
    ("digits", "12345 3.14159"),
    ("empty", ""),
    ("oracle_prompt", ORACLE_PROMPT),
]

PERPLEXITY_CONFIGS = [
    # (ctx, stride, max_tokens)
    (512, 256, 1024),
    (2048, 1024, 2560),
    (512, 256, None),
    (2048, 1024, None),
]
# 800: past the 512-token window, and a prompt whose continuation has no near ties — llama.cpp's
# f16 and f32 KV caches agree on all 32 tokens (after 700 tokens the second token is a tie
# 0.2 apart in the logits that the KV precision alone flips).
GREEDY_PROMPT_CANDIDATES = range(600, 2000, 25)
GREEDY_STEPS = 32
GREEDY_CHECKED_STEPS = 16
GREEDY_MIN_GAP = 0.3
SPEED_PROMPT_TOKENS = 64
SPEED_STEPS = 128


def dumps_compact(obj):
    """Indented JSON with every list of numbers kept on one line."""
    text = json.dumps(obj, indent=1, ensure_ascii=False)
    text = re.sub(
        r"\[\s*(-?[0-9][-0-9.eE+]*(?:,\s*-?[0-9][-0-9.eE+]*)*)\s*\]",
        lambda m: "[" + ",".join(x.strip() for x in m.group(1).split(",")) + "]",
        text,
    )
    return text + "\n"


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


GGML_TYPE_F32 = 0


def load(model, n_ctx, threads, logits_all, kv_f32=False):
    kv = {"type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32} if kv_f32 else {}
    return Llama(
        model_path=model,
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        logits_all=logits_all,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
        **kv,
    )


def clear(llm):
    """Forget everything: llama-cpp-python's token count and llama.cpp's whole KV cache (both the
    sliding-window and the global part of Gemma 3's iSWA cache)."""
    llm.reset()
    llm._ctx.kv_cache_clear()


def last_logits(llm):
    """float32 logits of the last token of the last llama_decode (works without logits_all)."""
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def nll_rows(logits, targets):
    """-log softmax(logits[i])[targets[i]] in float64, for rows of float32 logits."""
    out = np.empty(len(targets), dtype=np.float64)
    for a in range(0, len(targets), 128):
        x = logits[a : a + 128].astype(np.float64)
        m = x.max(axis=1, keepdims=True)
        lse = np.log(np.exp(x - m).sum(axis=1)) + m[:, 0]
        out[a : a + 128] = lse - x[np.arange(len(x)), targets[a : a + 128]]
    return out


def perplexity(model, tokens, bos, ctx, stride, max_tokens, threads):
    """The windowed perplexity strata implements too.

    t = the text's tokens (no BOS, no special parsing), N = len(t), truncated to max_tokens.
    Windows start at s = 0, S, 2S, ...; a window's input is [BOS] + t[s : min(s+C-1, N)].
    The first window scores every text token in it; a later window scores only t[j] with
    j >= s + C - 1 - S (the tokens no earlier window scored). A token's score is
    -log softmax(logits at the position before it)[t[j]], in float64 from the float32 logits
    (BOS's position predicts t[s]). Stop after the first window that reaches N.
    """
    assert 1 <= stride <= ctx - 1
    t = tokens if max_tokens is None else tokens[:max_tokens]
    n = len(t)
    llm = load(model, ctx, threads, logits_all=True)
    t0 = time.time()
    nll_sum = 0.0
    scored = 0
    windows = 0
    s = 0
    while True:
        end = min(s + ctx - 1, n)
        first = s if s == 0 else s + ctx - 1 - stride
        clear(llm)
        llm.eval([bos] + t[s:end])
        assert llm.n_tokens == end - s + 1
        logits = llm.scores[: llm.n_tokens]
        # Row r of the window predicts input r+1, i.e. t[s + r]; so t[j] is scored at row j - s.
        rows = logits[first - s : end - s]
        targets = np.asarray(t[first:end], dtype=np.int64)
        nll_sum += float(nll_rows(rows, targets).sum())
        scored += end - first
        windows += 1
        if s + ctx - 1 >= n:
            break
        s += stride
    seconds = time.time() - t0
    del llm
    gc.collect()
    assert scored == n, (scored, n)
    return {
        "ctx": ctx,
        "stride": stride,
        "max_tokens": max_tokens,
        "windows": windows,
        "tokens_scored": scored,
        "nll_sum": nll_sum,
        "perplexity": math.exp(nll_sum / scored),
        "seconds": round(seconds, 2),
    }


def greedy(model, tokens, bos, threads, prompt_tokens, kv_f32=False):
    prompt = [bos] + tokens[:prompt_tokens]
    llm = load(model, 2048, threads, logits_all=False, kv_f32=kv_f32)
    clear(llm)
    llm.eval(prompt)
    out, gaps = [], []
    for _ in range(GREEDY_STEPS):
        logits = last_logits(llm)
        first, second = np.argsort(logits)[::-1][:2]
        out.append(int(first))
        gaps.append(round(float(logits[first] - logits[second]), 4))
        llm.eval([int(first)])
    text = llm.detokenize(out).decode("utf-8", errors="replace")
    del llm
    gc.collect()
    return {
        "prompt": f"[BOS] + first {prompt_tokens} GPL-3 tokens",
        "prompt_len": len(prompt),
        "kv_cache": "f32" if kv_f32 else "f16",
        "steps": GREEDY_STEPS,
        "generated_ids": out,
        "top2_gaps": gaps,
        "generated_text": text,
    }


def greedy_sections(model, tokens, bos, threads):
    """`greedy` and `greedy_f32_kv` for the first candidate prompt free of near ties in both."""
    for n in GREEDY_PROMPT_CANDIDATES:
        runs = [greedy(model, tokens, bos, threads, n, kv_f32=f32) for f32 in (False, True)]
        gaps = [min(r["top2_gaps"][:GREEDY_CHECKED_STEPS]) for r in runs]
        if min(gaps) >= GREEDY_MIN_GAP:
            for r in runs:
                r["chosen_by"] = (
                    f"first of {GREEDY_PROMPT_CANDIDATES.start}, {GREEDY_PROMPT_CANDIDATES.start + GREEDY_PROMPT_CANDIDATES.step}, ... "
                    f"GPL-3 tokens whose first {GREEDY_CHECKED_STEPS} greedy steps have top-2 logit gaps >= {GREEDY_MIN_GAP} "
                    "with both the f16 and the f32 KV cache"
                )
            return runs
        print(f"greedy prompt of {n} tokens has a near tie (smallest gaps f16 KV {gaps[0]}, f32 KV {gaps[1]})", file=sys.stderr)
    raise SystemExit("no candidate greedy prompt is free of near ties")


def decode_speed(model, tokens, bos, threads):
    prompt = [bos] + tokens[:SPEED_PROMPT_TOKENS]
    llm = load(model, 512, threads, logits_all=False)
    clear(llm)
    llm.eval(prompt)
    tok = int(np.argmax(last_logits(llm)))
    t0 = time.perf_counter()
    for _ in range(SPEED_STEPS):
        llm.eval([tok])
        tok = int(np.argmax(last_logits(llm)))
    seconds = time.perf_counter() - t0
    del llm
    gc.collect()
    return {
        "engine": "llama.cpp",
        "llama_cpp_python_version": llama_cpp.__version__,
        "n_threads": threads,
        "prompt_len": len(prompt),
        "decode_steps": SPEED_STEPS,
        "decode_seconds": round(seconds, 4),
        "tokens_per_second": round(SPEED_STEPS / seconds, 2),
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
    }


def tokenize_section(llm, text_tokens, text_bytes):
    cases = []
    for name, s in TEST_STRINGS:
        b = s.encode("utf-8")
        cases.append(
            {
                "name": name,
                "text": s,
                "ids": llm.tokenize(b, add_bos=True, special=True),
                "ids_special_false": llm.tokenize(b, add_bos=True, special=False),
            }
        )
    return {
        "call": "Llama.tokenize(text.encode(), add_bos=True, special=True); "
        "ids_special_false: same with special=False",
        "cases": cases,
        "gpl3": {
            "path": DEFAULT_TEXT,
            "sha256": hashlib.sha256(text_bytes).hexdigest(),
            "bytes": len(text_bytes),
            "call": "Llama.tokenize(text, add_bos=False, special=False)",
            "n_tokens": len(text_tokens),
            "ids": text_tokens,
        },
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--text", default=DEFAULT_TEXT)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--speed-only", action="store_true", help="only run decode_speed; print one JSON line")
    ap.add_argument("--greedy-only", action="store_true", help="only rerun the greedy sections of an existing --out")
    args = ap.parse_args()

    with open(args.text, "rb") as f:
        text_bytes = f.read()
    tok_llm = Llama(model_path=args.model, n_ctx=512, vocab_only=True, verbose=False)
    bos = tok_llm.token_bos()
    text_tokens = tok_llm.tokenize(text_bytes, add_bos=False, special=False)

    if args.speed_only:
        print(json.dumps(decode_speed(args.model, text_tokens, bos, args.threads)))
        return
    if args.greedy_only:
        with open(args.out) as f:
            ref = json.load(f)
        ref["greedy"], ref["greedy_f32_kv"] = greedy_sections(args.model, text_tokens, bos, args.threads)
        with open(args.out, "w") as f:
            f.write(dumps_compact(ref))
        print(f"updated the greedy sections of {args.out}", file=sys.stderr)
        return

    ref = {
        "model": os.path.basename(os.path.realpath(args.model)),
        "model_sha256": sha256_file(args.model),
        "llama_cpp_python_version": llama_cpp.__version__,
        "bos": bos,
        "eos": tok_llm.token_eos(),
        "n_vocab": tok_llm.n_vocab(),
        "tokenize": tokenize_section(tok_llm, text_tokens, text_bytes),
    }
    del tok_llm

    ref["perplexity"] = []
    for ctx, stride, max_tokens in PERPLEXITY_CONFIGS:
        r = perplexity(args.model, text_tokens, bos, ctx, stride, max_tokens, args.threads)
        print(json.dumps(r), file=sys.stderr, flush=True)
        ref["perplexity"].append(r)

    ref["greedy"], ref["greedy_f32_kv"] = greedy_sections(args.model, text_tokens, bos, args.threads)
    print(json.dumps(ref["greedy"]), json.dumps(ref["greedy_f32_kv"]), file=sys.stderr, flush=True)
    ref["decode_speed"] = decode_speed(args.model, text_tokens, bos, args.threads)
    print(json.dumps(ref["decode_speed"]), file=sys.stderr, flush=True)

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(dumps_compact(ref))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
