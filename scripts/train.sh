#!/usr/bin/env bash
# The main job: from a fresh clone with only Python 3 present, set up .venv and train the MLP of
# examples/custom_training_loop.py on 4 logical CPU devices. Arguments go to the example:
#   bash scripts/train.sh --devices 2 --epochs 3      (--help lists them)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ ! -x .venv/bin/python ]]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[examples]"
exec .venv/bin/python examples/custom_training_loop.py "$@"
