"""What each replica runs for one execution of fit, evaluate and predict.

A train step on a replica: forward on its shard (under autocast for mixed precision), the loss
summed over the shard and divided by the *global* batch's size (Keras's ``sum_over_batch_size``,
so the replicas' gradients add up to the single-device gradient), backward, the mirrored
optimizer's step (the all-reduce), and the metrics' partial sums. The replicas return those sums
as one float64 vector; the caller adds them up (``strategy.reduce``), so metrics of a ragged batch
equal the single-device ones. ``steps_per_execution`` batches run in one ``strategy.run``.

Hugging Face models return a mapping (a ``ModelOutput``): the compiled loss and metrics take its
``logits``. With ``compile(loss=None)`` the model's own ``loss`` (a mean over the shard) trains,
scaled to its share of the global mean by ``scale_shard_mean``. When the data has no y and x is a
dict carrying ``labels``, those labels are the targets, weighted 0 where they are -100 (the
positions without a loss), as Keras would treat them with ``sample_weight`` 0. A causal language
model predicts token t + 1 at position t and its own loss averages ``labels[..., 1:]``: for it the
targets of position t are the labels of t + 1, and its loss counts those.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from mirrored import losses as losses_module
from mirrored._torch_internals import amp_unscale_and_check_, code_of
from mirrored.core.context import get_replica_context
from mirrored.core.param_groups import plain_settings, settings_of
from mirrored.core.values import ReduceOp, flatten, map_structure
from mirrored.input import InputOptions, batch_size_of
from mirrored.losses import broadcast_weight, compute_average_loss, scale_shard_mean
from mirrored.training.float16_loss_scale import LossScale
from mirrored.training.metric_set import MetricSet

__all__ = [
    "IGNORE_INDEX",
    "ShardLoss",
    "Steps",
    "Targets",
    "call_module",
    "cast_images",
    "floating_dtype",
    "predictions",
    "shifts_labels",
    "targets_of",
    "to_device",
]

PRECISIONS = {"32": None, "32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
IGNORE_INDEX = -100  # Hugging Face's label for positions without a loss (torch's ignore_index)


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


def predictions(y_pred: Any) -> Any:
    """What the compiled loss and metrics compare with the targets: the model's output, or the
    ``logits`` of a mapping output (a Hugging Face ``ModelOutput``)."""
    if not isinstance(y_pred, Mapping):
        return y_pred
    if "logits" not in y_pred:
        raise TypeError(
            f"the model returned a {type(y_pred).__name__} with keys {list(y_pred)}; compile()'s "
            "loss and metrics take its 'logits': return them under that key (or a tensor)"
        )
    return y_pred["logits"]


def _hugging_face_labels(x: Any, key: str = "labels") -> torch.Tensor | None:
    """The ``labels`` tensor of a dict x (a Hugging Face model's inputs), or None."""
    labels = x.get(key) if isinstance(x, Mapping) else None
    return labels if isinstance(labels, torch.Tensor) else None


def shifts_labels(module: Any) -> bool:
    """Whether ``module`` is a Hugging Face causal language model: its forward computes its loss
    through ``self.loss_function`` and that is transformers' ``ForCausalLMLoss``, which compares
    the logits at position t with the labels at t + 1. An encoder-decoder is excluded: its decoder
    is fed shifted inputs, and its loss compares each position with its own label."""
    loss_utils = sys.modules.get("transformers.loss.loss_utils")
    forward = getattr(getattr(module, "forward", None), "__func__", None)
    code = code_of(forward)
    if loss_utils is None or code is None or "loss_function" not in code.co_names:
        return False
    if getattr(getattr(module, "config", None), "is_encoder_decoder", False):
        return False
    return getattr(module, "loss_function", None) is getattr(loss_utils, "ForCausalLMLoss", ())


def _labels_of_logits(x: Any, shifted: bool) -> torch.Tensor | None:
    """The labels of a dict x aligned with the model's logits, position by position: for a
    causal language model (``shifted``) x's ``shift_labels`` where it carries them, else
    ``labels[..., 1:]`` with IGNORE_INDEX at the last position, as ``ForCausalLMLoss`` pads them."""
    labels = _hugging_face_labels(x)
    if labels is None or not shifted:
        return labels
    given = _hugging_face_labels(x, "shift_labels")
    return given if given is not None else F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


@dataclasses.dataclass
class Targets:
    """What one batch's loss and metrics compare the predictions with."""

    y: Any  # None when the data carries no targets
    sample_weight: Any  # for the loss and weighted_metrics: the user's weights (times ``mask``)
    mask: torch.Tensor | None  # for metrics: 0 where the labels are IGNORE_INDEX, else None


def targets_of(x: Any, y: Any, sample_weight: Any, shifted: bool = False) -> Targets:
    """``y``; without one, the ``labels`` of a dict x (those of the next position for a causal
    language model: ``shifted``), their IGNORE_INDEX positions weighted 0 (and given class 0, so
    that no loss sees an id of -100)."""
    labels = _labels_of_logits(x, shifted) if y is None else None
    if labels is None:
        return Targets(y, sample_weight, None)
    valid = labels != IGNORE_INDEX
    mask = valid.to(torch.float32)
    weight = mask if sample_weight is None else broadcast_weight(sample_weight, mask) * mask
    return Targets(labels.masked_fill(~valid, 0), weight, mask)


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


def _own_loss_count(x: Any, shifted: bool, batch_dim: int) -> torch.Tensor | int:
    """How many terms a model's own mean loss averages on this shard: its labels that are not
    IGNORE_INDEX when x carries labels (a causal language model's from the second position on:
    ``shifted``), else its examples."""
    labels = _labels_of_logits(x, shifted)
    return batch_size_of(x, batch_dim) if labels is None else (labels != IGNORE_INDEX).sum()


def _per_example(value: Any, batch_dim: int) -> bool:
    leaves = flatten(value)
    return bool(leaves) and all(isinstance(v, torch.Tensor) and v.dim() > batch_dim for v in leaves)


def _predicted(y_pred: Any, batch_dim: int) -> Any:
    """What predict returns of one batch's output: a mapping output as a plain dict of its
    per-example entries (a model's mean loss and a cache object left out), all detached."""
    if isinstance(y_pred, Mapping):
        y_pred = {k: v for k, v in y_pred.items() if _per_example(v, batch_dim)}
    return map_structure(_detach, y_pred)


def _moved_first(value: Any, batch_dim: int) -> Any:
    """The tensors of ``value`` with dim ``batch_dim`` moved first (views; scalars as they are)."""
    return map_structure(
        lambda v: (
            v.movedim(batch_dim, 0) if isinstance(v, torch.Tensor) and v.dim() > batch_dim else v
        ),
        value,
    )


def _batch_first(x: Any, targets: Targets, y_pred: Any, batch_dim: int) -> tuple[Targets, Any]:
    """Targets and predictions of a batch split along ``batch_dim`` with that dimension moved
    first, where the loss and metrics read the examples: the same loss, per example, as the
    batch-first model's. The predictions must hold the batch where the inputs do; one that
    does not (a ``[batch, classes]`` output of ``[seq, batch]`` inputs) is refused."""
    if batch_dim == 0:
        return targets, y_pred
    if isinstance(y_pred, Mapping) and "logits" not in y_pred:
        return _targets_first(targets, batch_dim), y_pred
    predicted = predictions(y_pred)
    size = batch_size_of(x, batch_dim)
    if isinstance(predicted, torch.Tensor) and (
        predicted.dim() <= batch_dim or predicted.shape[batch_dim] != size
    ):
        raise ValueError(
            f"InputOptions(batch_dim={batch_dim}) reads the model's predictions along dim "
            f"{batch_dim}, as its inputs, but for a shard of {size} examples the model returned "
            f"shape {list(predicted.shape)}; return the predictions with the batch in dim "
            f"{batch_dim}, or give the model batch-first data and batch_dim=0"
        )
    if isinstance(y_pred, Mapping):
        y_pred = {**y_pred, "logits": _moved_first(predicted, batch_dim)}
    else:
        y_pred = _moved_first(y_pred, batch_dim)
    return _targets_first(targets, batch_dim), y_pred


def _targets_first(targets: Targets, batch_dim: int) -> Targets:
    """``targets`` with dim ``batch_dim`` of each tensor moved first (views)."""
    moved = _moved_first((targets.y, targets.sample_weight, targets.mask), batch_dim)
    return Targets(*moved)


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
        return x, *_batch_first(x, targets, y_pred, batch_dim)

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
            count = _own_loss_count(x, shifts_labels(self.module), self.input_options.batch_dim)
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
        backward, the update; returns the metrics' partial sums and the float16 loss scale."""
        replica = get_replica_context()
        first_replica = replica is None or replica.local_replica_id == 0
        total: torch.Tensor | None = None
        for offset, (batch, global_batch_size) in enumerate(
            zip(batches, global_batch_sizes, strict=True)
        ):
            x, targets, y_pred = self._outputs(batch)
            shard_loss = self._shard_loss(x, targets, y_pred)
            self._backward(shard_loss.scaled(global_batch_size), loss_scale)
            loss_scale = self._update(first_iteration + offset, loss_scale, first_replica)
            with torch.no_grad():
                state = self._batch_state(shard_loss, targets, y_pred)
            total = state if total is None else total + state
        assert total is not None
        return total, loss_scale

    def _backward(self, loss: torch.Tensor, loss_scale: LossScale) -> None:
        """Backward of this replica's part of the global batch's loss (scaled up under
        float16); the replicas' gradients are summed as it runs."""
        if self.precision == "16-mixed":
            loss = loss * loss_scale.scale
        loss.backward()

    def _update(self, iteration: int, loss_scale: LossScale, first_replica: bool) -> LossScale:
        """The optimizer's step for batch ``iteration`` at its scheduled learning rate (under
        float16 skipped when a gradient overflowed on any replica), gradients cleared, the LR
        scheduler stepped; returns the loss scale for the next batch. With gradient
        accumulation most steps only add to the gradients: schedules count updates, and
        float16's loss scale is checked and moved at updates only."""
        updates = getattr(self.optimizer, "step_updates", True)
        if first_replica and self.schedule is not None:
            learning_rate = self.scheduled_learning_rate(iteration)
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
        return loss_scale

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
                x, targets, y_pred = self._outputs(batch)
                shard_loss = self._shard_loss(x, targets, y_pred)
                state = self._batch_state(shard_loss, targets, y_pred)
                total = state if total is None else total + state
        assert total is not None
        return total

    def predict(self, batches: Sequence[tuple[Any, Any, Any]]) -> list[Any]:
        """The model's outputs for ``batches``."""
        outputs = []
        with torch.no_grad():
            for batch in batches:
                y_pred = self._forward(batch)[3]
                outputs.append(_predicted(y_pred, self.input_options.batch_dim))
        return outputs


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value
