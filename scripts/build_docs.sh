#!/usr/bin/env bash
# Build the documentation into site/ (ignored by git); any warning fails the build.
# Used by scripts/test.sh and tests/docs/test_docs_build.py, so the test checks this very command.
# No --quiet: it drops the warnings before --strict counts them, and a broken page passes.
# Usage: bash scripts/build_docs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict
