"""What each replica runs for one execution of fit, evaluate and predict.

A train step on a replica: forward on its shard (under autocast for mixed precision), the loss
summed over the shard and divided by the *global* batch's size (Keras's ``sum_over_batch_size``,
so the replicas' gradients add up to the single-device gradient), backward, the mirrored
optimizer's step (the all-reduce), and the metrics' partial sums. The replicas return those sums
as one float64 vector; the caller adds them up (``strategy.reduce``), so metrics of a ragged batch
equal the single-device ones. ``steps_per_execution`` batches run in one ``strategy.run``.

With ``compile(loss=None)`` the model's own ``loss`` (a mean over the shard) trains, scaled to
its share of the global mean by ``scale_shard_mean``; what the loss and metrics compare is
:mod:`mirrored.training.targets`'s. With ``compile(jit_compile=True)`` each batch's step is
traced once per replica and signature (:func:`mirrored.function`); the learning rate's schedule
and a torch scheduler act around it, on the host, at every step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from mirrored import losses as losses_module
from mirrored._torch_internals import amp_unscale_and_check_
from mirrored.core.context import get_replica_context
from mirrored.core.param_groups import plain_settings, settings_of
from mirrored.core.values import ReduceOp, map_structure
from mirrored.input import InputOptions
from mirrored.losses import broadcast_weight, compute_average_loss, scale_shard_mean
from mirrored.tracing.function import function
from mirrored.training.float16_loss_scale import LossScale
from mirrored.training.metric_set import MetricSet
from mirrored.training.targets import (
    Targets,
    batch_first,
    own_loss_count,
    predicted,
    predictions,
    shifts_labels,
    targets_of,
)

__all__ = [
    "ShardLoss",
    "Steps",
    "call_module",
    "cast_images",
    "floating_dtype",
    "to_device",
]

PRECISIONS = {"32": None, "32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def call_module(module: Any, x: Any) -> Any:
    """A tuple of inputs goes in as positional arguments, a dict as keyword arguments."""
    if isinstance(x, (tuple, list)):
        return module(*x)
    if isinstance(x, Mapping):
        return module(**x)
    return module(x)


def floating_dtype(module: Any) -> torch.dtype:
    """The dtype of the module's first floating parameter (float32 when it has none)."""
    for parameter in module.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32


def _placement(module: Any) -> tuple[torch.device, torch.dtype]:
    """The device of the module's first parameter (the CPU without one) and its
    ``floating_dtype``, in one pass over the parameters."""
    device = None
    for parameter in module.parameters():
        device = parameter.device if device is None else device
        if parameter.is_floating_point():
            return device, parameter.dtype
    return device or torch.device("cpu"), torch.float32


def cast_images(x: Any, dtype: torch.dtype) -> Any:
    """uint8 inputs (images) as ``dtype``, the model's floating dtype, as Keras casts inputs to
    its model's dtype; inputs of other integer dtypes (token ids, int64) stay as they are."""
    return map_structure(
        lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.dtype == torch.uint8 else v, x
    )


@dataclasses.dataclass
class ShardLoss:
    """A replica's loss on its shard: its examples' losses (a compiled loss), or the model's own
    loss, a mean over ``count`` elements (``compile(loss=None)``)."""

    value: torch.Tensor  # one loss per example, or the model's mean
    count: torch.Tensor | int  # the examples, or the elements the model averaged
    is_mean: bool

    def scaled(self, global_batch_size: int) -> torch.Tensor:
        """This replica's part of the global batch's mean loss, through a scaling helper."""
        if self.is_mean:
            return scale_shard_mean(self.value, self.count)
        return compute_average_loss(self.value, global_batch_size=global_batch_size)

    def total(self) -> torch.Tensor:
        """The loss summed over the shard, detached, in float64 (0 for a shard with nothing
        to average, whose mean is NaN); the same sum as ``scaled``'s."""
        if not self.is_mean:
            return self.value.detach().sum().double()
        value = self.value.detach().double().reshape(())
        count = torch.as_tensor(self.count, device=value.device)
        return torch.where(count > 0, value * count, torch.zeros_like(value))


def to_device(structure: Any, device: torch.device) -> Any:
    """The tensors of ``structure`` on ``device`` (those already there as they are)."""
    return map_structure(
        lambda v: (
            v.to(device, non_blocking=True)
            if isinstance(v, torch.Tensor) and v.device != device
            else v
        ),
        structure,
    )


@dataclasses.dataclass
class Steps:
    """The compiled pieces a replica function uses; built by ``Model.compile``."""

    module: Any  # the mirrored module (or the plain one); None until a lazy module is built
    optimizer: Any  # the mirrored optimizer (or the plain one)
    loss: losses_module.Loss | None  # None: the model's own loss (a mapping output's "loss")
    metrics: MetricSet
    precision: str
    schedule: Any  # a mirrored.optimizers.Optimizer whose learning rate is scheduled, or None
    lr_scheduler: Any  # a torch LRScheduler stepped after every update, or None
    # how each batch is split: its batch_dim
    input_options: InputOptions = dataclasses.field(default_factory=InputOptions)
    # each replica's step traced once and replayed (mirrored.function)
    jit_compile: bool = False
    _traced: dict[str, Callable[..., Any]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    # -- pieces ------------------------------------------------------------------------------------
    def scheduled_learning_rate(self, iteration: int) -> float:
        """The schedule's rate for the update that batch ``iteration`` (0-based) belongs to:
        schedules count updates, and with gradient accumulation several batches make one."""
        accumulation = getattr(self.optimizer, "accumulation_steps", 1)
        return float(self.schedule.learning_rate_at(iteration // accumulation))

    def learning_rate(self, optimizer: torch.optim.Optimizer, iteration: int) -> float:
        """The rate of the update batch ``iteration`` belongs to: the schedule's, else the first
        parameter group's of ``optimizer`` (the compiled one; a torch scheduler moves it)."""
        if self.schedule is not None:
            return self.scheduled_learning_rate(iteration)
        return float(optimizer.param_groups[0]["lr"])

    def set_learning_rate(self, optimizer: torch.optim.Optimizer, value: float) -> None:
        """Every parameter group's rate (``model.learning_rate = ...``), unless a schedule
        drives it."""
        if self.schedule is not None or self.lr_scheduler is not None:
            raise ValueError(
                "the learning rate is driven by a schedule given to compile(); it cannot also "
                "be set directly"
            )
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"learning_rate={value!r}: expected a non-negative number")
        for group in optimizer.param_groups:
            group["lr"] = float(value)

    def settings(self) -> dict[str, Any]:
        """What every worker must train with alike: the optimizer's kind and hyperparameters,
        a schedule of the learning rate, a torch scheduler's kind and state (JSON-plain)."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        settings = {} if optimizer is None else settings_of(optimizer)
        if self.schedule is not None:
            settings["schedule"] = repr(getattr(self.schedule, "learning_rate", self.schedule))
        if self.lr_scheduler is not None:
            settings["lr_scheduler"] = type(self.lr_scheduler).__qualname__
            settings["lr_scheduler state"] = self.lr_scheduler.state_dict()
        return plain_settings(settings)

    def _device(self) -> torch.device:
        return _placement(self.module)[0]

    def _autocast(self, device: torch.device) -> AbstractContextManager[Any]:
        dtype = PRECISIONS[self.precision]
        if dtype is None:
            return nullcontext()
        return torch.autocast(device_type=device.type, dtype=dtype)

    def _forward(self, batch: tuple[Any, Any, Any]) -> tuple[Any, Any, Any, Any]:
        device, dtype = _placement(self.module)
        x, y, sample_weight = to_device(batch, device)
        x = cast_images(x, dtype)
        with self._autocast(device):
            y_pred = call_module(self.module, x)
        return x, y, sample_weight, y_pred

    def _outputs(self, batch: tuple[Any, Any, Any]) -> tuple[Any, Targets, Any]:
        """Forward on one batch: its inputs, and targets and predictions batch first."""
        x, y, sample_weight, y_pred = self._forward(batch)
        shifted, batch_dim = shifts_labels(self.module), self.input_options.batch_dim
        if shifted and batch_dim:
            raise ValueError(
                f"InputOptions(batch_dim={batch_dim}) with a causal language model, whose "
                "labels are shifted along their last dimension: give it batch-first data "
                "(batch_dim=0), as Hugging Face models take"
            )
        targets = targets_of(x, y, sample_weight, shifted)
        return x, *batch_first(x, targets, y_pred, batch_dim)

    def _shard_loss(self, x: Any, targets: Targets, y_pred: Any) -> ShardLoss:
        """The compiled loss summed over the shard (each example's weighted mean loss element),
        or the model's own mean loss."""
        if self.loss is None:
            own = y_pred.get("loss") if isinstance(y_pred, Mapping) else None
            if not isinstance(own, torch.Tensor):
                raise ValueError(
                    f"compile(loss=None) trains on the model's own loss, but the model returned a "
                    f"{type(y_pred).__name__} without a 'loss' tensor (a Hugging Face model "
                    "computes it when x carries 'labels'): put the labels in x, or compile with "
                    "a loss"
                )
            count = own_loss_count(x, shifts_labels(self.module), self.input_options.batch_dim)
            return ShardLoss(own, count, is_mean=True)
        if targets.y is None:
            raise ValueError(
                "the data yields no targets: fit and evaluate need (x, y), x as a dict carrying "
                "'labels', or compile(loss=None) for a model that computes its own loss"
            )
        predicted = predictions(y_pred)
        if not isinstance(predicted, torch.Tensor):
            raise TypeError(
                f"the model returned a {type(predicted).__name__}; compile()'s loss takes one "
                "tensor of predictions: return a tensor (or a mapping with 'logits') from "
                "forward()"
            )
        values = self.loss.call(targets.y, predicted)
        count = values.shape[0]
        if targets.sample_weight is not None:
            values = values * broadcast_weight(targets.sample_weight, values)
        per_example = values if values.dim() == 1 else values.flatten(1).mean(dim=1)
        return ShardLoss(per_example, count, is_mean=False)

    def _batch_state(self, loss: ShardLoss, targets: Targets, y_pred: Any) -> torch.Tensor:
        return self.metrics.batch_state(
            loss.total(),
            loss.count,
            targets.y,
            predictions(y_pred) if targets.y is not None and self.metrics.compares else None,
            targets.mask,
            targets.sample_weight,
        )

    # -- replica functions -------------------------------------------------------------------------
    def train(
        self,
        batches: Sequence[tuple[Any, Any, Any]],
        global_batch_sizes: Sequence[int],
        first_iteration: int,
        loss_scale: LossScale,
    ) -> tuple[torch.Tensor, LossScale]:
        """Train on ``batches`` (this replica's shards), one update each: forward and loss,
        backward, the update; returns the metrics' partial sums and the float16 loss scale.
        The learning rate's schedule and a torch scheduler act around each batch's step, which
        ``jit_compile`` traces (:func:`mirrored.function`)."""
        replica = get_replica_context()
        first_replica = replica is None or replica.local_replica_id == 0
        total: torch.Tensor | None = None
        for offset, (batch, global_batch_size) in enumerate(
            zip(batches, global_batch_sizes, strict=True)
        ):
            updates = getattr(self.optimizer, "step_updates", True)
            if first_replica and self.schedule is not None:
                learning_rate = self.scheduled_learning_rate(first_iteration + offset)
                for group in self.optimizer.param_groups:
                    group["lr"] = learning_rate
            if self.precision == "16-mixed":
                state, loss_scale, updated = self._learn_float16(
                    batch, global_batch_size, loss_scale, updates
                )
            else:
                state, updated = (
                    self._replica_step("learn", self._learn)(batch, global_batch_size),
                    True,
                )
            if updates and updated and first_replica and self.lr_scheduler is not None:
                self.lr_scheduler.step()
            total = state if total is None else total + state
        assert total is not None
        return total, loss_scale

    def _replica_step(self, name: str, step: Callable[..., Any]) -> Callable[..., Any]:
        """``step``, traced once per replica and signature under ``jit_compile``."""
        if not self.jit_compile:
            return step
        traced = self._traced.get(name)
        if traced is None:
            traced = self._traced[name] = function(step)
        return traced

    def _learn(self, batch: tuple[Any, Any, Any], global_batch_size: int) -> torch.Tensor:
        """One batch's forward and loss, backward, the optimizer's step; the metrics' sums."""
        x, targets, y_pred = self._outputs(batch)
        shard_loss = self._shard_loss(x, targets, y_pred)
        shard_loss.scaled(global_batch_size).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        with torch.no_grad():
            return self._batch_state(shard_loss, targets, y_pred)

    def _learn_float16(
        self,
        batch: tuple[Any, Any, Any],
        global_batch_size: int,
        loss_scale: LossScale,
        updates: bool,
    ) -> tuple[torch.Tensor, LossScale, bool]:
        """``_learn`` under float16's dynamic loss scale, which reads every replica's gradients
        on the host (so it is never traced): an overflow anywhere skips the update. Returns the
        metrics' sums, the next loss scale and whether the optimizer stepped. With gradient
        accumulation the scale is checked and moved at updates only."""
        x, targets, y_pred = self._outputs(batch)
        shard_loss = self._shard_loss(x, targets, y_pred)
        (shard_loss.scaled(global_batch_size) * loss_scale.scale).backward()
        skipped = False
        if updates:
            skipped = self._unscale_gradients(loss_scale.scale)
            loss_scale = loss_scale.after_step(skipped)
        if skipped:
            discard = getattr(self.optimizer, "discard_gradients", self.optimizer.zero_grad)
            discard()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad()
        with torch.no_grad():
            return self._batch_state(shard_loss, targets, y_pred), loss_scale, not skipped

    def _unscale_gradients(self, scale: float) -> bool:
        """Divide this replica's gradients by ``scale``; True when any replica's overflowed."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        device = self._device()
        found = torch.zeros(1, device=device)
        if grads:
            amp_unscale_and_check_(grads, found, torch.full((1,), 1.0 / scale, device=device))
        replica = get_replica_context()
        if replica is not None:
            found = replica.all_reduce(ReduceOp.SUM, found)
        return bool(found.item())

    def test(self, batches: Sequence[tuple[Any, Any, Any]]) -> torch.Tensor:
        """Loss and metrics of ``batches``, without updates."""
        total: torch.Tensor | None = None
        with torch.no_grad():
            for batch in batches:
                state = self._replica_step("test", self._test_batch)(batch)
                total = state if total is None else total + state
        assert total is not None
        return total

    def _test_batch(self, batch: tuple[Any, Any, Any]) -> torch.Tensor:
        x, targets, y_pred = self._outputs(batch)
        return self._batch_state(self._shard_loss(x, targets, y_pred), targets, y_pred)

    def predict(self, batches: Sequence[tuple[Any, Any, Any]]) -> list[Any]:
        """The model's outputs for ``batches``."""
        with torch.no_grad():
            return [self._replica_step("predict", self._predict_batch)(b) for b in batches]

    def _predict_batch(self, batch: tuple[Any, Any, Any]) -> Any:
        return predicted(self._forward(batch)[3], self.input_options.batch_dim)
