#!/usr/bin/env bash
# Runs the official OpenAI and Anthropic Python SDKs against `strata serve` on a fixture model.
# Creates .venv (once) with the SDKs, pytest and the readers for the fixture files.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install --quiet --disable-pip-version-check openai anthropic pytest numpy safetensors tokenizers jsonschema
cargo build --quiet -p strata-cli
cd tests/sdk
exec ../../.venv/bin/python -m pytest -q "$@"
