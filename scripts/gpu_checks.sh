#!/usr/bin/env bash
# The checks that need a GPU, for a lent GPU machine whose python3 already holds a CUDA build
# of torch (no install step: such machines reach no package index). Runs the tests marked
# cuda: exactness on logical GPUs (in float64, so TF32 cannot blur a comparison), memory limits
# of logical GPUs, ZeRO, NCCL across physical GPUs where there are two, metrics and losses on
# CUDA tensors. Usage: bash scripts/gpu_checks.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, '|', torch.cuda.get_device_name(0))"
# The modules that hold cuda-marked tests (the others import CPU-only extras).
mapfile -t modules < <(grep -rl "pytest.mark.cuda" tests --include="test_*.py" | sort)
python3 -m pytest -q -p no:cacheprovider -m cuda -rs "${modules[@]}" "$@"
