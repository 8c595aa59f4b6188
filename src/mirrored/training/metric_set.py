"""The loss tracker and the compiled metrics of a model, as one additive state vector.

Replicas return their shard's sums (``batch_state``); the caller adds each step's reduced sums to
a running total on the device (``add``), which reaches the metrics and the host only when a
result is read: the epoch's logs, a callback that reads its batch logs (``batch_logs``), a
backup of the state. So a step whose logs nobody reads never waits for the device.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from mirrored.metrics import Mean, Metric
from mirrored.training.lazy_logs import LazyLogs

__all__ = ["MetricSet"]


class MetricSet:
    """The loss tracker (``loss``), the metrics and the weighted metrics of ``compile``."""

    def __init__(self, metrics: Sequence[Metric], weighted: Sequence[Metric]) -> None:
        self.loss = Mean(name="loss")
        self.metrics = list(metrics)
        self.weighted = list(weighted)
        self._base: list[dict[str, Any]] = []
        self._pending: torch.Tensor | None = None
        self.reset()

    @property
    def all(self) -> list[Metric]:
        return [self.loss, *self.metrics, *self.weighted]

    def batch_state(
        self,
        loss_total: torch.Tensor,
        loss_count: torch.Tensor | int,
        y: Any,
        predicted: Any,
        mask: Any,
        sample_weight: Any,
    ) -> torch.Tensor:
        """One shard's partial sums: [loss sum, its count, each metric's state...] (``mask``
        weighs the plain metrics, ``sample_weight`` the weighted ones)."""
        count = torch.as_tensor(loss_count, dtype=torch.float64, device=loss_total.device)
        parts = [torch.stack([loss_total, count])]
        if self.metrics or self.weighted:
            if y is None:
                raise ValueError(
                    "compile()'s metrics compare the predictions with targets, but the data "
                    "yields none: pass y, or x as a dict carrying 'labels'"
                )
            parts += [m.batch_state(y, predicted, sample_weight=mask) for m in self.metrics]
            parts += [
                m.batch_state(y, predicted, sample_weight=sample_weight) for m in self.weighted
            ]
        return torch.cat([p.to(loss_total.device) for p in parts])

    def add(self, state: torch.Tensor) -> None:
        """Add one step's sums (all replicas') to the running total, on their device."""
        self._pending = state if self._pending is None else self._pending + state

    def merge(self, state: torch.Tensor) -> None:
        """Add ``state`` to the metrics now."""
        self.add(state)
        self._fold()

    def reset(self) -> None:
        for metric in self.all:
            metric.reset_state()
        self._set_base([m.state_dict() for m in self.all])

    def results(self) -> dict[str, float]:
        self._fold()
        return {m.name: m.result() for m in self.all}

    def batch_logs(self, num_examples: int | None = None) -> LazyLogs:
        """The results as they stand now (and ``num_examples`` when given), computed when first
        read, from this moment's sums (later steps replace them, never change them in place)."""
        base, pending = self._base, self._pending

        def compute() -> dict[str, Any]:
            if base is self._base and pending is self._pending:  # read before the next step
                results = self.results()
            else:
                results = {m.name: m.result() for m in self._calculators(base, pending)}
            return results if num_examples is None else {**results, "num_examples": num_examples}

        return LazyLogs(compute)

    def state_dict(self) -> list[dict[str, Any]]:
        self._fold()
        return list(self._base)

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        for metric, state in zip(self.all, states, strict=True):
            metric.load_state_dict(state)
        self._set_base([m.state_dict() for m in self.all])

    # -- the running sums --------------------------------------------------------------------------
    def _set_base(self, base: list[dict[str, Any]]) -> None:
        self._base = base  # CPU copies of the merged sums, one state_dict per metric
        self._pending = None  # sums added since, on the device

    def _calculators(
        self, base: list[dict[str, Any]], pending: torch.Tensor | None
    ) -> list[Metric]:
        """Copies of the metrics holding ``base`` plus ``pending`` (one host copy)."""
        metrics = [copy.copy(m) for m in self.all]
        for metric, saved in zip(metrics, base, strict=True):
            metric.load_state_dict(saved)
        if pending is not None:
            sums, offset = pending.detach().cpu(), 0
            for metric in metrics:
                metric.merge_state(sums[offset : offset + metric.num_state])
                offset += metric.num_state
        return metrics

    def _fold(self) -> None:
        """Merge what ``add`` holds into the metrics themselves."""
        if self._pending is None:
            return
        folded = [m.state_dict() for m in self._calculators(self._base, self._pending)]
        for metric, state in zip(self.all, folded, strict=True):
            metric.load_state_dict(state)
        self._set_base(folded)
