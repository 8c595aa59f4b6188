"""rng_state: capture and restore every generator; the capture loads with weights_only."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from mirrored import checkpoint
from mirrored.random import rng_state


def draws() -> tuple[float, float, float]:
    return torch.rand(1).item(), float(np.random.rand()), random.random()


def test_capture_then_restore_repeats_every_stream(tmp_path: Path) -> None:
    np.random.seed(1)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    state = rng_state.capture()
    expected = draws()
    checkpoint.save(state, tmp_path / "rng.pt")
    rng_state.restore(checkpoint.load(tmp_path / "rng.pt"))
    assert draws() == expected
