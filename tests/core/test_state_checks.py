"""state_checks: a state that does not fit a module or an optimizer is refused, naming the entry
and what was expected, before anything is loaded (no threads)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from mirrored import checkpoint
from mirrored.core.state_checks import check_optimizer_state, first_non_finite
from mirrored.replication.sharded_update import load_own_copy


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def _stepped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    optimizer.step()
    return optimizer


def _snapshot(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy(optimizer.state_dict())


def _assert_unchanged(optimizer: torch.optim.Optimizer, before: dict[str, Any]) -> None:
    after = optimizer.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert after["state"].keys() == before["state"].keys()
    for index, state in before["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][index][key], value), (index, key)


def test_a_state_dict_entry_that_is_not_a_tensor_loads_nothing() -> None:
    module = _net()
    before = copy.deepcopy(module.state_dict())
    changed = {k: v + 1 for k, v in before.items()}
    changed["1.bias"] = [0.0, 0.0]  # torch would copy the other three first, then fail
    with pytest.raises(ValueError, match=r"1\.bias: checkpoint list, model a tensor"):
        checkpoint.load_module_state(module, changed, "w.pt")
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_an_sgd_state_into_adam_is_refused_naming_the_saver_and_changes_nothing() -> None:
    sgd = _stepped(torch.optim.SGD(_net().parameters(), lr=0.1, momentum=0.9))
    adam = _stepped(torch.optim.Adam(_net().parameters()))
    before = _snapshot(adam)
    with pytest.raises(
        ValueError, match=r"group 0 has no \['betas', 'eps'\] \(.*saved by SGD\?\); .* is Adam"
    ):
        load_own_copy(adam, sgd.state_dict())
    _assert_unchanged(adam, before)
    # Adam's hyperparameters over SGD's per-parameter state: the entries are what is missing.
    mixed = {**sgd.state_dict(), "param_groups": adam.state_dict()["param_groups"]}
    with pytest.raises(
        ValueError,
        match=r"optimizer state for parameter 0 has no 'step' \(it holds \['momentum_buffer'\]: "
        r"saved by Muon or SGD\?\); the model's optimizer is Adam",
    ):
        load_own_copy(adam, mixed)
    _assert_unchanged(adam, before)


def test_a_state_of_the_wrong_shape_or_for_no_parameter_is_refused() -> None:
    adam = _stepped(torch.optim.Adam(_net().parameters()))
    saved = _snapshot(adam)
    saved["state"][2]["exp_avg"] = torch.zeros(4)
    with pytest.raises(ValueError, match=r"parameter 2: 'exp_avg' is of shape \(4,\) for a "):
        check_optimizer_state(adam, saved, "x.pt")
    saved = _snapshot(adam)
    saved["state"][7] = saved["state"][0]
    with pytest.raises(ValueError, match=r"state for parameter 7, which no parameter group lists"):
        check_optimizer_state(adam, saved, "x.pt")
    saved = _snapshot(adam)
    saved["state"][1]["step"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"'step' is a tensor of shape \(3,\); .* a number"):
        check_optimizer_state(adam, saved, "x.pt")
    saved = _snapshot(adam)
    saved["param_groups"][0]["params"] = [0, 1, 2]
    with pytest.raises(ValueError, match=r"groups of \[3\] parameters, the model's Adam \[4\]"):
        check_optimizer_state(adam, saved, "x.pt")
    with pytest.raises(ValueError, match="not a torch optimizer's state_dict"):
        check_optimizer_state(adam, {"state": {}}, "x.pt")


def test_a_state_saved_before_torch_added_hyperparameters_still_loads() -> None:
    adam = _stepped(torch.optim.Adam(_net().parameters()))
    saved = _snapshot(adam)
    for group in saved["param_groups"]:  # as an older torch wrote them
        for key in ("foreach", "differentiable", "fused", "capturable", "decoupled_weight_decay"):
            group.pop(key)
    fresh = torch.optim.Adam(_net().parameters())
    load_own_copy(fresh, saved)
    assert fresh.param_groups[0]["foreach"] is None


def test_a_parameter_group_key_the_optimizer_lacks_is_refused() -> None:
    """Loaded, the key would join the group, and the model would refuse its own earlier
    checkpoints (they lack it); a scheduler's 'initial_lr' is torch's own and passes."""
    adam = _stepped(torch.optim.Adam(_net().parameters()))
    saved = _snapshot(adam)
    saved["param_groups"][0]["momentum_decay"] = 0.004
    with pytest.raises(
        ValueError, match=r"group 0 has \['momentum_decay'\], which the model's Adam"
    ):
        check_optimizer_state(adam, saved, "the file")
    scheduled = _snapshot(adam)
    scheduled["param_groups"][0]["initial_lr"] = 1e-3
    check_optimizer_state(adam, scheduled, "the file")


def test_each_parameter_is_checked_against_the_state_its_optimizer_keeps_for_its_shape() -> None:
    # Adafactor keeps row and column statistics for a matrix, one variance for a vector.
    module = _net()
    factored = _stepped(torch.optim.Adafactor(module.parameters()))
    check_optimizer_state(torch.optim.Adafactor(_net().parameters()), factored.state_dict(), "x")
    swapped = _snapshot(factored)
    swapped["state"][0], swapped["state"][1] = swapped["state"][1], swapped["state"][0]
    with pytest.raises(ValueError, match=r"parameter 0 has no 'row_var'"):
        check_optimizer_state(factored, swapped, "x.pt")


def test_an_optimizer_that_cannot_be_probed_is_checked_for_structure_only() -> None:
    class NeedsMore(torch.optim.SGD):
        def __init__(self, params: Any, lr: float, extra: int) -> None:
            super().__init__(params, lr=lr)

    optimizer = NeedsMore(_net().parameters(), lr=0.1, extra=1)
    saved = {**_snapshot(optimizer), "state": {0: {"anything": torch.zeros(1)}}}
    check_optimizer_state(optimizer, saved, "x.pt")
    with pytest.raises(ValueError, match="parameter 0 is a list, not a dict of its state"):
        check_optimizer_state(optimizer, {**saved, "state": {0: []}}, "x.pt")


def test_first_non_finite_names_the_entry() -> None:
    state = {"a": torch.ones(2), "steps": torch.tensor([3]), "b": torch.tensor([1.0, float("inf")])}
    assert first_non_finite(state) == "b"
    assert first_non_finite({"a": torch.ones(2)}) is None
