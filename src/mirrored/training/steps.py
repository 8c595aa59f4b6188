"""What each replica runs for one execution of fit, evaluate and predict.

A train step on a replica: forward on its shard (under autocast for mixed precision), the loss
summed over the shard and divided by the *global* batch's size (Keras's ``sum_over_batch_size``,
so the replicas' gradients add up to the single-device gradient), backward, the mirrored
optimizer's step (the all-reduce), and the metrics' partial sums. The replicas return those sums
as one float64 vector; the caller adds them up (``strategy.reduce``), so metrics of a ragged batch
equal the single-device ones. ``steps_per_execution`` batches run in one ``strategy.run``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from mirrored import losses as losses_module
from mirrored.context import get_replica_context
from mirrored.losses import compute_average_loss
from mirrored.metrics import Mean, Metric
from mirrored.training.loss_scale import LossScale
from mirrored.values import ReduceOp, map_structure

__all__ = ["MetricSet", "Steps", "call_module"]

PRECISIONS = {"32": None, "32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def call_module(module: Any, x: Any) -> Any:
    """A tuple of inputs goes in as positional arguments, a dict as keyword arguments."""
    if isinstance(x, (tuple, list)):
        return module(*x)
    if isinstance(x, Mapping):
        return module(**x)
    return module(x)


def _to(structure: Any, device: torch.device) -> Any:
    return map_structure(
        lambda v: (
            v.to(device, non_blocking=True)
            if isinstance(v, torch.Tensor) and v.device != device
            else v
        ),
        structure,
    )


class MetricSet:
    """The loss tracker and the compiled metrics, as one additive state vector."""

    def __init__(self, metrics: Sequence[Metric], weighted: Sequence[Metric]) -> None:
        self.loss = Mean(name="loss")
        self.metrics = list(metrics)
        self.weighted = list(weighted)

    @property
    def all(self) -> list[Metric]:
        return [self.loss, *self.metrics, *self.weighted]

    def batch_state(
        self, loss_sum: torch.Tensor, count: int, y: Any, y_pred: Any, sample_weight: Any
    ) -> torch.Tensor:
        """This shard's partial sums: [loss sum, examples, each metric's state...]."""
        parts = [torch.stack([loss_sum.detach().double(), loss_sum.new_full((), count).double()])]
        parts += [m.batch_state(y, y_pred) for m in self.metrics]
        parts += [m.batch_state(y, y_pred, sample_weight=sample_weight) for m in self.weighted]
        return torch.cat([p.to(parts[0].device) for p in parts])

    def merge(self, state: torch.Tensor) -> None:
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


@dataclasses.dataclass
class Steps:
    """The compiled pieces a replica function uses; built by ``Model.compile``."""

    module: Any  # the mirrored module (or the plain one under the default strategy)
    optimizer: Any  # the mirrored optimizer (or the plain one)
    loss: losses_module.Loss
    metrics: MetricSet
    precision: str
    schedule: Any  # a mirrored.optimizers.Optimizer whose learning rate is scheduled, or None
    lr_scheduler: Any  # a torch LRScheduler stepped after every update, or None

    # -- pieces ------------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        for parameter in self.module.parameters():
            return parameter.device
        return torch.device("cpu")

    def _autocast(self, device: torch.device) -> AbstractContextManager[Any]:
        dtype = PRECISIONS[self.precision]
        if dtype is None:
            return nullcontext()
        return torch.autocast(device_type=device.type, dtype=dtype)

    def _forward(self, batch: tuple[Any, Any, Any]) -> tuple[Any, Any, Any, Any]:
        device = self._device()
        x, y, sample_weight = _to(batch, device)
        with self._autocast(device):
            y_pred = call_module(self.module, x)
        return x, y, sample_weight, y_pred

    def _loss_sum(self, y: Any, y_pred: Any, sample_weight: Any) -> tuple[torch.Tensor, int]:
        """Sum over the shard of each example's (weighted) mean loss element; the shard size."""
        if y is None:
            raise ValueError("the data yields no targets (y); fit and evaluate need (x, y)")
        if not isinstance(y_pred, torch.Tensor):
            raise TypeError(
                f"the model returned a {type(y_pred).__name__}; compile()'s loss takes one "
                "tensor of predictions: return a tensor from forward()"
            )
        values = self.loss.call(y, y_pred)
        count = values.shape[0]
        if sample_weight is not None:
            values = values * losses_module.broadcast_weight(sample_weight, values)
        per_example = values if values.dim() == 1 else values.flatten(1).mean(dim=1)
        return per_example.sum(), count

    # -- replica functions -------------------------------------------------------------------------
    def train(
        self,
        batches: Sequence[tuple[Any, Any, Any]],
        global_batch_sizes: Sequence[int],
        first_iteration: int,
        loss_scale: LossScale,
    ) -> tuple[torch.Tensor, LossScale]:
        """Train on ``batches`` (this replica's shards), one update each."""
        replica = get_replica_context()
        first_replica = replica is None or replica.local_replica_id == 0
        total: torch.Tensor | None = None
        for offset, (batch, global_batch_size) in enumerate(
            zip(batches, global_batch_sizes, strict=True)
        ):
            _, y, sample_weight, y_pred = self._forward(batch)
            loss_sum, count = self._loss_sum(y, y_pred, sample_weight)
            loss = compute_average_loss(loss_sum.reshape(1), global_batch_size=global_batch_size)
            if self.precision == "16-mixed":
                (loss * loss_scale.scale).backward()
            else:
                loss.backward()
            # With gradient accumulation most steps only add to the gradients: schedules count
            # updates, and float16's loss scale is checked and moved at updates only.
            accumulation = getattr(self.optimizer, "accumulation_steps", 1)
            updates = getattr(self.optimizer, "step_updates", True)
            if first_replica and self.schedule is not None:
                update = (first_iteration + offset) // accumulation
                learning_rate = self.schedule.learning_rate_at(update)
                for group in self.optimizer.param_groups:
                    group["lr"] = learning_rate
            skipped = False
            if updates and self.precision == "16-mixed":
                skipped = self._unscale_gradients(loss_scale.scale)
                loss_scale = loss_scale.after_step(skipped)
            if skipped:
                discard = getattr(self.optimizer, "discard_gradients", self.optimizer.zero_grad)
                discard()
            else:
                self.optimizer.step()
            self.optimizer.zero_grad()
            if updates and not skipped and first_replica and self.lr_scheduler is not None:
                self.lr_scheduler.step()
            with torch.no_grad():
                state = self.metrics.batch_state(loss_sum, count, y, y_pred, sample_weight)
            total = state if total is None else total + state
        assert total is not None
        return total, loss_scale

    def _unscale_gradients(self, scale: float) -> bool:
        """Divide this replica's gradients by ``scale``; True when any replica's overflowed."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        device = self._device()
        found = torch.zeros(1, device=device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, found, torch.full((1,), 1.0 / scale, device=device)
            )
        replica = get_replica_context()
        if replica is not None:
            found = replica.all_reduce(ReduceOp.SUM, found)
        return bool(found.item())

    def test(self, batches: Sequence[tuple[Any, Any, Any]]) -> torch.Tensor:
        """Loss and metrics of ``batches``, without updates."""
        total: torch.Tensor | None = None
        with torch.no_grad():
            for batch in batches:
                _, y, sample_weight, y_pred = self._forward(batch)
                loss_sum, count = self._loss_sum(y, y_pred, sample_weight)
                state = self.metrics.batch_state(loss_sum, count, y, y_pred, sample_weight)
                total = state if total is None else total + state
        assert total is not None
        return total

    def predict(self, batches: Sequence[tuple[Any, Any, Any]]) -> list[Any]:
        """The model's outputs for ``batches``."""
        outputs = []
        with torch.no_grad():
            for batch in batches:
                outputs.append(map_structure(_detach, self._forward(batch)[3]))
        return outputs


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value
