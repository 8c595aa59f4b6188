"""The loss tracker and the compiled metrics of a model, as one additive state vector.

Replicas return their shard's sums (``batch_state``); the caller merges each step's reduced sums
into the metrics where they are (on a GPU, on the GPU), so the metrics hold every step's sums in
step order and nothing waits for the device until a result is read (``results``: the epoch's
logs, or a batch's logs when a callback reads them). The running sums of all the metrics are one
vector, each metric's state a view of it, so that a step's merge is one add.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mirrored.metrics import Mean, Metric, add_sums

__all__ = ["MetricSet"]


class MetricSet:
    """The loss tracker (``loss``), the metrics and the weighted metrics of ``compile``."""

    def __init__(self, metrics: Sequence[Metric], weighted: Sequence[Metric]) -> None:
        self.loss = Mean(name="loss")
        self.metrics = list(metrics)
        self.weighted = list(weighted)
        self._sums: torch.Tensor | None = None  # every metric's sums, in ``all``'s order
        self._views: list[torch.Tensor] = []  # each metric's state as this set last merged it
        # Metrics that keep their sums as Metric does can share one vector.
        self._shareable = all(
            type(m).merge_state is Metric.merge_state and type(m).state is Metric.state
            for m in self.all
        )

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
        device = loss_total.device
        if isinstance(loss_count, torch.Tensor):
            count = loss_count.to(device, torch.float64)
        else:
            count = torch.full((), loss_count, dtype=torch.float64, device=device)
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
        return torch.cat([p.to(device) for p in parts])

    def merge(self, state: torch.Tensor) -> None:
        """Add one step's sums (all replicas') to the metrics, on the sums' device: one add to
        the vector their states are views of, unless a state was changed apart from this set
        (reset, loaded, updated), or a metric merges its own way."""
        metrics = self.all
        sums = self._sums
        if sums is None or any(m.state is not v for m, v in zip(metrics, self._views, strict=True)):
            offset = 0
            for metric in metrics:
                metric.merge_state(state[offset : offset + metric.num_state])
                offset += metric.num_state
            self._gather_states()
            return
        self._share(add_sums(sums, state.detach().to(torch.float64)))

    def _gather_states(self) -> None:
        """The metrics' states into one vector, when they can share one."""
        self._sums = None
        states = [m.state for m in self.all]
        if self._shareable and len({s.device for s in states}) == 1:
            self._share(torch.cat(states))

    def _share(self, sums: torch.Tensor) -> None:
        """``sums`` as the running vector, each metric's state a view of its part."""
        self._sums = sums
        self._views = list(sums.split_with_sizes([m.num_state for m in self.all]))
        for metric, view in zip(self.all, self._views, strict=True):
            metric.state = view

    def reset(self) -> None:
        for metric in self.all:
            metric.reset_state()
        self._sums = None

    def results(self) -> dict[str, float]:
        return {m.name: m.result() for m in self.all}

    def state_dict(self) -> list[dict[str, Any]]:
        return [m.state_dict() for m in self.all]

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        for metric, state in zip(self.all, states, strict=True):
            metric.load_state_dict(state)
