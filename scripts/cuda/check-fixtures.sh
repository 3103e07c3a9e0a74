#!/usr/bin/env bash
# On a GPU machine: greedy tokens of every Qwen3.5 fixture (dense and mixture of experts), or of
# the fixture folders named after the binary, with --device cuda against the
# transformers reference (reference.json, which the CPU path equals token for token), in f32,
# alone and drafted by the MTP head, and in bf16 against transformers' bf16 tokens (reported;
# bf16 rounding may flip a near tie). Needs python3 with numpy and safetensors.
# Usage: scripts/cuda/check-fixtures.sh [STRATA_BINARY [FIXTURE_DIR...]]
set -euo pipefail
cd "$(dirname "$0")/../.."
bin="${1:-target/cuda/release/strata}"
shift || true
dirs=("$@")
[ ${#dirs[@]} -gt 0 ] || dirs=(fixtures/qwen3_5*-tiny-*)
failed=0
for dir in "${dirs[@]}"; do
    prompt=$(python3 -c "from safetensors.numpy import load_file; print(','.join(map(str, load_file('$dir/reference.safetensors')['tokens'])))")
    for run in "f32" "f32 --draft mtp --num-draft-tokens 3" "bf16"; do
        dtype=${run%% *}
        extra=${run#"$dtype"}
        got=$("$bin" generate --model "$dir" --device cuda --dtype "$dtype" --tokens "$prompt" --max-tokens 24 \
            --temperature 0 --ignore-eos --json $extra 2>/dev/null | tail -1)
        key=$([ "$dtype" = bf16 ] && echo greedy_tokens_bf16 || echo greedy_tokens)
        verdict=$(python3 -c "
import json, sys
got = json.loads(sys.argv[1])['tokens']; want = json.load(open('$dir/reference.json'))['$key']
same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
print('equal' if got == want else f'differ from token {same}')" "$got")
        echo "$dir [$run]: $verdict"
        if [ "$dtype" = f32 ] && [ "$verdict" != equal ]; then failed=1; fi
    done
done
exit $failed
