"""ZeRO across worker processes lowers each worker's memory (issue 34).

Peak RSS is too noisy to test, so the jobs count the tensor bytes alive at each worker's peak
(tests/allocations.py: the same on every run) and the largest tensor each module allocated.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.multiprocess.spawn import assert_all_succeeded, run_workers

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

ZERO_MODULES = ("replication/zero_", "replication/sharded_update.py")


def _counts(out: Path) -> list[dict]:
    assert_all_succeeded(run_workers("zero_memory", out, args=[out.name]))
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(2)]


def test_zero_lowers_each_worker_s_peak_and_stages_no_whole_segment(tmp_path: Path) -> None:
    """2 workers x 1 device, Adam: stages 1 and 2 keep half of the state stage 0 keeps, and
    their buffers (a chunk of every worker's segment) must not give it back, in training or in
    gathering the state for a checkpoint: each worker's peak is below stage 0's, and ZeRO
    allocates no tensor as large as a worker's segment (half the parameters) whatever the
    model's size. The gathered state is stage 0's, bit for bit (two workers' sums, a + b, are
    the same in any order, and one replica per worker steps with torch's own loop)."""
    counts = {}
    for stage in ("0", "1", "2"):
        (tmp_path / stage).mkdir()
        counts[stage] = _counts(tmp_path / stage)
    parameters = sum(p.numel() * p.element_size() for p in counts["0"][0]["model"])
    for stage in ("1", "2"):
        for rank, (zero, plain) in enumerate(zip(counts[stage], counts["0"], strict=True)):
            assert zero["peak"] < plain["peak"], (stage, rank, zero["peak"], plain["peak"])
            largest = max(v for k, v in zero["largest"].items() if k.startswith(ZERO_MODULES))
            assert largest < parameters / 2, (stage, rank, largest, parameters)
            assert zero["state"].keys() == plain["state"].keys()
            for index, entries in plain["state"].items():  # the same sums (a + b), the same update
                for key, value in entries.items():
                    assert torch.equal(zero["state"][index][key], value), (stage, index, key)
