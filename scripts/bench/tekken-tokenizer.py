"""Writes a tokenizer.json with a real 150,000-token byte-level BPE vocabulary, for benchmarks
of structured output on random-weight models (`strata bench --synthetic ... --tokenizer`):
their masks cost what the vocabulary's token trie costs, so a numbered vocabulary would
measure nothing real. The vocabulary is Mistral's tekken (tiktoken-style ranks), from the
mistral-common package on PyPI; its merges are recovered from the ranks (a token's merge is
the pair that byte-pair encoding with only the lower ranks leaves of it).

Usage: python3 scripts/bench/tekken-tokenizer.py OUT_DIR   (needs pip's access to PyPI)
"""
import base64
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "mistral-common==1.13.1"
MEMBER = "mistral_common/data/tekken_240911.json"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_alphabet():
    """GPT-2's printable stand-in for each byte, as the ByteLevel pre-tokenizer writes them."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def merge_of(token, ranks):
    """The two parts byte-pair encoding with ranks below `token`'s own leaves of it."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        pairs = [(ranks.get(parts[i] + parts[i + 1]), i) for i in range(len(parts) - 1)]
        pairs = [(r, i) for r, i in pairs if r is not None and r < limit]
        if not pairs:
            break
        _, i = min(pairs)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise SystemExit(f"no merge makes token rank {limit}: {parts}")
    return parts


def main(out_dir):
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, WHEEL], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        tekken = json.loads(zipfile.ZipFile(wheel).read(MEMBER))
    tokens = [base64.b64decode(entry["token_bytes"]) for entry in sorted(tekken["vocab"], key=lambda e: e["rank"])]
    ranks = {token: rank for rank, token in enumerate(tokens)}
    chars = byte_level_alphabet()
    spell = lambda token: "".join(chars[b] for b in token)
    vocab = {spell(token): rank for rank, token in enumerate(tokens)}
    merges = [[spell(a), spell(b)] for a, b in (merge_of(t, ranks) for t in tokens if len(t) > 1)]
    added = [
        {"id": len(tokens) + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, s in enumerate(SPECIALS)
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": tekken["config"]["pattern"]}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    print(f"{out / 'tokenizer.json'}: {len(tokens)} tokens, {len(merges)} merges, {len(added)} special")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
