#!/usr/bin/env bash
# Install adaptrain with its test dependencies and run every test (the README's second command).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[test,ray]"
# Reference implementations used only to cross-check ours (pinned, no dependency resolution).
python3 -m pip install -q --no-deps fairscale==0.4.13 || echo "fairscale unavailable: its cross-checks will skip"
ruff check src tests benchmarks examples
lint-imports  # the layer rule: .importlinter
python3 -m pytest -q --durations=30 "$@"
