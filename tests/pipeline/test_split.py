"""Cutting a model into pipeline stages and placing them, with no strategy and no threads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from mirrored.pipeline.split import balanced_split_points, parameter_costs, place_stages


def test_parameter_split_balances_every_stage_and_keeps_activations_with_their_layer():
    # The article's MLP: one Linear (and its ReLU) per stage, not [Linear] | [ReLU] | [the rest].
    mlp = nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    assert balanced_split_points(parameter_costs(list(mlp)), 3) == [2, 4]
    assert balanced_split_points([5, 0, 0, 5], 2) == [3]
    assert balanced_split_points([1] * 7, 3) == [3, 5]
    assert balanced_split_points([9, 1, 1, 1, 1, 1], 2) == [1]


def test_a_parameter_shared_by_stages_on_different_devices_is_refused():
    shared = nn.Linear(4, 4)
    stages = [nn.Sequential(shared), nn.Sequential(nn.ReLU(), shared)]
    devices = [SimpleNamespace(torch_device=torch.device(d)) for d in ("cpu", "meta")]
    with pytest.raises(ValueError, match="shared by stages 0 and 1"):
        place_stages(stages, devices)
    assert shared.weight.device.type == "cpu"
