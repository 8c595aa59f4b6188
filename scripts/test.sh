#!/usr/bin/env bash
# Set up a virtual environment and run everything CI runs: lint, format, type check, the import
# layers, the strict documentation build, all tests.
# Usage: bash scripts/test.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# torch is pinned to the CPU build shipped on this project's machines; pyproject keeps a loose range.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[test,docs]"
# Ray Train for tests/cluster/test_ray.py, where it installs (its wheels do not exist for every
# Python and platform); without it that test skips, saying so.
.venv/bin/pip install -q -e ".[ray]" \
  || echo "scripts/test.sh: could not install the ray extra; tests/cluster/test_ray.py skips" >&2

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/lint-imports --no-cache  # the package layers, contracts in pyproject.toml
bash scripts/build_docs.sh  # strict: fails on any warning
.venv/bin/python -m pytest -q "$@"
