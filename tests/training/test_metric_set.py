"""MetricSet: a step's sums merged in one add, equal to merging metric by metric."""

from __future__ import annotations

import copy

import pytest
import torch

from mirrored import metrics
from mirrored.strategies.default import default_strategy
from mirrored.training.evaluation import merge
from mirrored.training.metric_set import MetricSet


def _set() -> MetricSet:
    return MetricSet([metrics.SparseCategoricalAccuracy()], [metrics.SparseCategoricalAccuracy()])


def _steps(num_steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.rand(6, generator=generator, dtype=torch.float64) for _ in range(num_steps)]


def _one_by_one(metric_set: MetricSet, states: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each metric's sums as merging its part of every state on its own gives them."""
    alone = [copy.deepcopy(m) for m in metric_set.all]
    for state in states:
        for metric, part in zip(alone, state.split(2), strict=True):
            metric.merge_state(part)
    return [m.state for m in alone]


def test_merged_steps_equal_each_metric_merging_its_part() -> None:
    metric_set, states = _set(), _steps(5)
    for state in states:
        metric_set.merge(state)
    for merged, alone in zip(metric_set.all, _one_by_one(_set(), states), strict=True):
        assert torch.equal(merged.state, alone)


@pytest.mark.parametrize("change", ["reset", "load", "update"])
def test_a_metric_changed_apart_from_the_set_goes_on_from_its_own_state(change: str) -> None:
    metric_set, states = _set(), _steps(4)
    metric_set.merge(states[0])
    metric_set.merge(states[1])
    accuracy = metric_set.metrics[0]
    if change == "reset":
        accuracy.reset_state()
    elif change == "load":
        accuracy.load_state_dict({"state": torch.tensor([3.0, 4.0], dtype=torch.float64)})
    else:
        accuracy.update_state(torch.tensor([1, 0]), torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    own = accuracy.state.clone()
    metric_set.merge(states[2])
    metric_set.merge(states[3])
    assert torch.equal(accuracy.state, own + states[2][2:4] + states[3][2:4])
    assert torch.equal(metric_set.loss.state, _one_by_one(_set(), states)[0])


class _Largest(metrics.Metric):
    """Not additive: its own merge keeps the largest value seen."""

    num_state = 2

    def merge_state(self, state: torch.Tensor) -> None:
        self._state = state if self._state is None else torch.maximum(self._state, state)

    def result(self) -> float:
        return float(self.state[0])


def test_a_metric_that_merges_its_own_way_is_merged_by_it() -> None:
    metric_set = MetricSet([_Largest()], [])
    for value in (3.0, 1.0, 2.0):
        metric_set.merge(torch.tensor([1.0, 1.0, value, 0.0], dtype=torch.float64))
    assert metric_set.metrics[0].result() == 3.0
    assert metric_set.loss.state.tolist() == [3.0, 3.0]


def test_setting_a_state_of_the_wrong_shape_is_refused() -> None:
    metric = metrics.Mean()
    with pytest.raises(ValueError, match="'mean': state got \\[3\\]; expected a 1-D tensor of 2"):
        metric.state = torch.zeros(3, dtype=torch.float64)


def test_one_replica_s_sums_merge_where_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a reduce, which copies them to the strategy's first device (from a GPU, a wait
    for the device every step)."""
    strategy = default_strategy()

    def no_reduce(*args: object, **kwargs: object) -> None:
        raise AssertionError("one replica's sums were reduced")

    monkeypatch.setattr(strategy, "reduce", no_reduce)
    metric_set, (state,) = _set(), _steps(1)
    merge(strategy, metric_set, state)
    assert torch.equal(metric_set.loss.state, state[:2])


@pytest.mark.parametrize(
    "sums",
    [torch.zeros(2, dtype=torch.float32), torch.zeros(2, dtype=torch.float64, requires_grad=True)],
    ids=["float32", "requires grad"],
)
def test_setting_a_state_that_is_not_float64_sums_outside_autograd_is_refused(sums) -> None:
    metric = metrics.Mean()
    with pytest.raises(ValueError, match=r"state got a torch\.float.*expected float64 sums"):
        metric.state = sums
    assert torch.equal(metric.state, torch.zeros(2, dtype=torch.float64))  # unchanged
