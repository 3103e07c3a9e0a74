#!/usr/bin/env python3
"""Writes fixtures/gemma3/transformers_logits.json: float32 logits of Hugging Face transformers'
Gemma 3 (Gemma3ForCausalLM) with the weights dequantised from the Gemma 3 270M Q4_K_M GGUF
(`from_pretrained(dir, gguf_file=name)`), for strata's tests to compare against.

Two prompts, fed as the very token ids llama.cpp gives (read from llama_cpp_reference.json, so
run llama_cpp_reference.py first):
  short  [BOS] + "The capital of France is Paris. The capital of Germany is"; every position.
  long   [BOS] + the first 599 GPL-3 tokens (600 > the 512-token sliding window); last 4
         positions only.
Per stored position: the logits at vocab ids 0, 97, 194, ... (every 97th id) and the top-32 ids
with their logits.

Before computing anything it checks the config transformers built from the GGUF against the
GGUF's own metadata and Gemma 3's published definition (sliding/global layer pattern, both rope
bases, sliding window, query_pre_attn_scalar, norms' +1 offset, no soft-capping) and stops if
one is wrong. As information (not used by tests) it also records how far llama.cpp's logits on
the quantised weights are from these.

Setup:  scripts/reference/setup.sh
Run:    .venv/reference/bin/python scripts/reference/gemma3_gguf_oracle.py
"""
import argparse
import json
import os
import re
import sys
import time

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MODEL = os.environ.get(
    "STRATA_GEMMA3_GGUF",
    os.path.expanduser("~/.cache/strata/models/gemma-3-270m-q4_k_m.gguf"),
)
FIXTURES = os.path.join(ROOT, "fixtures", "gemma3")
STRIDE = 97
TOP_K = 32
LONG_PROMPT_TEXT_TOKENS = 599
LONG_KEEP = 4


def f32(x):
    """Shortest text that reads back as the same float32."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def dumps_compact(obj):
    """Indented JSON with every list of numbers kept on one line."""
    text = json.dumps(obj, indent=1, ensure_ascii=False)
    text = re.sub(
        r"\[\s*(-?[0-9][-0-9.eE+]*(?:,\s*-?[0-9][-0-9.eE+]*)*)\s*\]",
        lambda m: "[" + ",".join(x.strip() for x in m.group(1).split(",")) + "]",
        text,
    )
    return text + "\n"


def gguf_metadata(path):
    from gguf import GGUFReader

    reader = GGUFReader(path)
    meta = {}
    for key, field in reader.fields.items():
        if not key.startswith("gemma3.") and key not in ("general.architecture",):
            continue
        val = field.contents()
        meta[key] = val
    norms = {}
    for t in reader.tensors:
        if t.name in ("blk.0.attn_norm.weight", "blk.0.attn_q_norm.weight", "output_norm.weight"):
            norms[t.name] = np.asarray(t.data, dtype=np.float32).copy()
    return meta, norms


def check_config(cfg, meta, model, gguf_norms):
    """Checks transformers' config/weights against the GGUF and Gemma 3's definition."""
    n_layers = meta["gemma3.block_count"]
    expected_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)]
    rp = cfg.rope_parameters
    checks = {
        "num_hidden_layers == gemma3.block_count": cfg.num_hidden_layers == n_layers,
        "hidden_size == gemma3.embedding_length": cfg.hidden_size == meta["gemma3.embedding_length"],
        "intermediate_size == gemma3.feed_forward_length": cfg.intermediate_size == meta["gemma3.feed_forward_length"],
        "num_attention_heads == gemma3.attention.head_count": cfg.num_attention_heads == meta["gemma3.attention.head_count"],
        "num_key_value_heads == gemma3.attention.head_count_kv": cfg.num_key_value_heads == meta["gemma3.attention.head_count_kv"],
        "head_dim == gemma3.attention.key_length": cfg.head_dim == meta["gemma3.attention.key_length"],
        "rms_norm_eps == gemma3.attention.layer_norm_rms_epsilon": abs(cfg.rms_norm_eps - meta["gemma3.attention.layer_norm_rms_epsilon"]) < 1e-12,
        "sliding_window == gemma3.attention.sliding_window (512)": cfg.sliding_window == meta["gemma3.attention.sliding_window"] == 512,
        "layer_types: every 6th layer full, rest sliding": list(cfg.layer_types) == expected_types,
        "global rope_theta == gemma3.rope.freq_base (1e6)": rp["full_attention"]["rope_theta"] == meta["gemma3.rope.freq_base"] == 1e6,
        "global rope_type default (no scaling)": rp["full_attention"].get("rope_type", "default") == "default",
        "local rope_theta == 10000": rp["sliding_attention"]["rope_theta"] == 10000,
        "local rope_type default": rp["sliding_attention"].get("rope_type", "default") == "default",
        "query_pre_attn_scalar == head_dim (256)": cfg.query_pre_attn_scalar == 256 == cfg.head_dim,
        "final_logit_softcapping is None": cfg.final_logit_softcapping is None,
        "attn_logit_softcapping is None": cfg.attn_logit_softcapping is None,
        "hidden_activation gelu_pytorch_tanh": cfg.hidden_activation == "gelu_pytorch_tanh",
        "tie_word_embeddings": bool(cfg.tie_word_embeddings),
        "vocab_size == 262144": cfg.vocab_size == 262144,
        "causal (no bidirectional attention)": not getattr(cfg, "use_bidirectional_attention", False),
    }
    # GGUF stores Gemma's RMSNorm weights with the +1 already added; HF keeps w and computes (1+w).
    m = model.model
    pairs = {
        "blk.0.attn_norm.weight": m.layers[0].input_layernorm.weight,
        "blk.0.attn_q_norm.weight": m.layers[0].self_attn.q_norm.weight,
        "output_norm.weight": m.norm.weight,
    }
    for name, w in pairs.items():
        g = gguf_norms[name]
        checks[f"{name}: HF weight == GGUF - 1"] = bool(np.allclose(w.detach().numpy() + 1.0, g, atol=1e-6))
    checks["embedding scale sqrt(hidden_size)"] = abs(
        float(m.embed_tokens.embed_scale) - cfg.hidden_size**0.5
    ) < 1e-3
    return checks


def position_record(logits_row, pos, input_len):
    row = logits_row.astype(np.float32)
    top = np.argsort(-row, kind="stable")[:TOP_K]
    return {
        "position": pos,
        "sampled_logits": [f32(v) for v in row[::STRIDE]],
        "top_ids": [int(i) for i in top],
        "top_logits": [f32(row[i]) for i in top],
    }


def compare(a, b):
    """Differences between two [positions, vocab] float32 logit arrays (a: reference)."""
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    top1_a = a.argmax(-1)
    top1_b = b.argmax(-1)
    overlap = []
    for ra, rb in zip(a, b):
        ta = set(np.argsort(-ra)[:TOP_K].tolist())
        tb = set(np.argsort(-rb)[:TOP_K].tolist())
        overlap.append(len(ta & tb) / TOP_K)

    def logsm(x):
        x = x.astype(np.float64)
        m = x.max(-1, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))

    pa, pb = np.exp(logsm(a)), logsm(b)
    kl = (pa * (logsm(a) - pb)).sum(-1)
    return {
        "max_abs_diff": float(d.max()),
        "mean_abs_diff": float(d.mean()),
        "rms_diff": float(np.sqrt((d**2).mean())),
        "rms_reference": float(np.sqrt((a.astype(np.float64) ** 2).mean())),
        "top1_agree": int((top1_a == top1_b).sum()),
        "positions": int(a.shape[0]),
        "top32_overlap_mean": float(np.mean(overlap)),
        "kl_ref_to_other_mean": float(kl.mean()),
        "kl_ref_to_other_max": float(kl.max()),
    }


def llama_cpp_logits(model_path, ids, keep_last=None):
    from llama_cpp import Llama

    n = len(ids)
    llm = Llama(
        model_path=model_path, n_ctx=1024, n_batch=1024, n_ubatch=1024, logits_all=True,
        n_threads=2, n_threads_batch=2, verbose=False,
    )
    llm.reset()
    llm._ctx.kv_cache_clear()
    llm.eval(ids)
    out = np.array(llm.scores[:n], dtype=np.float32)
    del llm
    return out if keep_last is None else out[-keep_last:]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--llama-ref", default=os.path.join(FIXTURES, "llama_cpp_reference.json"))
    ap.add_argument("--out", default=os.path.join(FIXTURES, "transformers_logits.json"))
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp comparison")
    args = ap.parse_args()
    torch.set_num_threads(2)

    with open(args.llama_ref) as f:
        ref = json.load(f)
    cases = {c["name"]: c for c in ref["tokenize"]["cases"]}
    bos = ref["bos"]
    short_ids = cases["oracle_prompt"]["ids"]
    assert short_ids[0] == bos
    long_ids = [bos] + ref["tokenize"]["gpl3"]["ids"][:LONG_PROMPT_TEXT_TOKENS]

    model_path = os.path.realpath(args.model)
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path),
        gguf_file=os.path.basename(model_path),
        dtype=torch.float32,
        attn_implementation="eager",
    )
    model.eval()
    load_s = time.time() - t0
    cfg = model.config
    print(f"loaded {type(model).__name__} in {load_s:.1f}s", file=sys.stderr)
    print(cfg, file=sys.stderr)

    meta, gguf_norms = gguf_metadata(model_path)
    meta_small = {k: (v if not isinstance(v, list) or len(v) < 16 else f"[{len(v)} items]") for k, v in meta.items()}
    print("GGUF metadata:", json.dumps(meta_small, default=str), file=sys.stderr)
    checks = check_config(cfg, meta, model, gguf_norms)
    for k, v in checks.items():
        print(f"  {'ok ' if v else 'BAD'} {k}", file=sys.stderr)
    if not all(checks.values()):
        sys.exit("transformers' Gemma 3 config does not match the GGUF / Gemma 3 definition")

    with torch.no_grad():
        short = model(torch.tensor([short_ids])).logits[0].float().numpy()
        long = model(torch.tensor([long_ids]), logits_to_keep=LONG_KEEP).logits[0].float().numpy()
    assert short.shape == (len(short_ids), cfg.vocab_size)
    assert long.shape == (LONG_KEEP, cfg.vocab_size)

    out = {
        "model": os.path.basename(model_path),
        "model_sha256": ref["model_sha256"],
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "gguf": __import__("importlib.metadata").metadata.version("gguf"),
        },
        "how": "AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=float32, "
        "attn_implementation='eager'); weights dequantised from the GGUF by transformers; "
        "one forward pass per prompt, no cache",
        "config": {
            "num_hidden_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "rms_norm_eps": cfg.rms_norm_eps,
            "sliding_window": cfg.sliding_window,
            "layer_types": list(cfg.layer_types),
            "rope_parameters": cfg.rope_parameters,
            "query_pre_attn_scalar": cfg.query_pre_attn_scalar,
            "final_logit_softcapping": cfg.final_logit_softcapping,
            "attn_logit_softcapping": cfg.attn_logit_softcapping,
            "hidden_activation": cfg.hidden_activation,
            "tie_word_embeddings": bool(cfg.tie_word_embeddings),
            "vocab_size": cfg.vocab_size,
        },
        "config_checks": checks,
        "sampled_ids": f"0, {STRIDE}, {2 * STRIDE}, ... < vocab_size (every {STRIDE}th id)",
        "sample_stride": STRIDE,
        "top_k": TOP_K,
        "prompts": [
            {
                "name": "short",
                "text": "[BOS] + " + cases["oracle_prompt"]["text"],
                "input_ids": short_ids,
                "positions": [position_record(short[p], p, len(short_ids)) for p in range(len(short_ids))],
            },
            {
                "name": "long",
                "text": f"[BOS] + first {LONG_PROMPT_TEXT_TOKENS} GPL-3 tokens",
                "input_ids": long_ids,
                "positions": [
                    position_record(long[i], len(long_ids) - LONG_KEEP + i, len(long_ids)) for i in range(LONG_KEEP)
                ],
            },
        ],
    }

    if not args.no_llama_cpp:
        import llama_cpp

        lc_short = llama_cpp_logits(model_path, short_ids)
        lc_long = llama_cpp_logits(model_path, long_ids, keep_last=LONG_KEEP)
        out["llama_cpp_comparison"] = {
            "note": "information only: llama.cpp runs the quantised weights, transformers the "
            "dequantised ones in float32; reference = transformers",
            "llama_cpp_python_version": llama_cpp.__version__,
            "short": compare(short, lc_short),
            "long_last4": compare(long, lc_long),
        }
        print(json.dumps(out["llama_cpp_comparison"], indent=1), file=sys.stderr)

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(dumps_compact(out))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
