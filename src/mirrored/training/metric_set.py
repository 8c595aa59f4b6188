"""The loss tracker and the compiled metrics of a model, as one additive state vector.

Replicas return their shard's sums (``batch_state``); the caller merges each step's reduced sums
into the metrics where they are (on a GPU, on the GPU), so the metrics hold every step's sums in
step order and nothing waits for the device until a result is read (``results``: the epoch's
logs, or a batch's logs when a callback reads them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mirrored.metrics import Mean, Metric

__all__ = ["MetricSet"]


class MetricSet:
    """The loss tracker (``loss``), the metrics and the weighted metrics of ``compile``."""

    def __init__(self, metrics: Sequence[Metric], weighted: Sequence[Metric]) -> None:
        self.loss = Mean(name="loss")
        self.metrics = list(metrics)
        self.weighted = list(weighted)

    @property
    def compares(self) -> bool:
        """Whether any metric compares predictions with targets (beyond the loss tracker)."""
        return bool(self.metrics or self.weighted)

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
        if self.compares:
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

    def merge(self, state: torch.Tensor) -> None:
        """Add one step's sums (all replicas') to the metrics, on the sums' device."""
        offset = 0
        for metric in self.all:
            metric.merge_state(state[offset : offset + metric.num_state])
            offset += metric.num_state

    def reset(self) -> None:
        for metric in self.all:
            metric.reset_state()

    def results(self) -> dict[str, float]:
        return {m.name: m.result() for m in self.all}

    def state_dict(self) -> list[dict[str, Any]]:
        return [m.state_dict() for m in self.all]

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        for metric, state in zip(self.all, states, strict=True):
            metric.load_state_dict(state)
