"""ParameterServerStrategy with real processes on 127.0.0.1: a chief, 2 workers, 2 ps tasks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.multiprocess.parameter_server_jobs import plain_digits_accuracy
from tests.multiprocess.spawn import assert_all_succeeded, run_workers

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_asynchronous_training_reaches_the_synchronous_accuracy_on_digits(
    tmp_path: Path, mode: str
) -> None:
    workers = run_workers("train_digits", tmp_path, 5, cluster="ps:2:2", args=[mode], timeout=240)
    assert_all_succeeded(workers)
    result = torch.load(tmp_path / "chief.pt", weights_only=True)
    reference = plain_digits_accuracy()
    assert reference > 0.9
    assert result["accuracy"] >= reference - 0.02, (result["accuracy"], reference)
    assert result["losses"][-20:].mean() < result["losses"][:20].mean() / 4
