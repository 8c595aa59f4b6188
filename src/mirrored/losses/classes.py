"""The Keras-named loss objects (``SparseCategoricalCrossentropy`` and friends) on PyTorch tensors.

Each computes what Keras's does. Their ``call`` gives one loss per element, unreduced, which is
what a replica needs: it weighs and sums its shard and the division is by the global count.
Calling a loss object reduces as its ``reduction`` says, with Keras 3's values; TensorFlow's
custom-loop pattern is ``reduction=None`` (or ``Reduction.NONE``), then
``mirrored.compute_average_loss``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mirrored.core.trace_recording import recording
from mirrored.losses.shapes import (
    absolute_error,
    align_ranks,
    at_least,
    broadcast_weight,
    mean_last,
    per_example_values,
    same_shape_pair,
    shape_of,
    squared_error,
    to_tensor,
)

__all__ = [
    "REDUCTIONS",
    "BinaryCrossentropy",
    "CategoricalCrossentropy",
    "Loss",
    "LossFunctionWrapper",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "Reduction",
    "SparseCategoricalCrossentropy",
    "function_name",
]

# An ignore_index for F.cross_entropy that no class id equals (and TorchScript can write).
_NO_IGNORED_CLASS = -(2**63) + 1
_EPSILON = 1e-7  # keras.backend.epsilon(): probabilities are clipped to [eps, 1 - eps]
# How far outside [0, 1] "probabilities" may stray (rounding) before the first-call check calls
# them logits.
_PROBABILITY_SLACK = 1e-5

_DEFAULT_REDUCTION = "sum_over_batch_size"
# Keras 3's reductions (``keras.losses.Loss``), and TensorFlow 2's "auto" (its default, which
# meant "sum_over_batch_size").
REDUCTIONS = (_DEFAULT_REDUCTION, "sum", None, "none", "mean", "mean_with_sample_weight", "auto")


class Reduction:
    """TensorFlow 2's ``tf.keras.losses.Reduction`` constants, for code that spells them so."""

    AUTO = "auto"
    NONE = "none"
    SUM = "sum"
    SUM_OVER_BATCH_SIZE = _DEFAULT_REDUCTION

    @classmethod
    def all(cls) -> tuple[str, ...]:
        return (cls.AUTO, cls.NONE, cls.SUM, cls.SUM_OVER_BATCH_SIZE)

    @classmethod
    def validate(cls, key: Any) -> None:
        _check_reduction(key)


def _check_reduction(reduction: Any) -> str | None:
    """``reduction`` if it is one of ``REDUCTIONS``, else a ValueError listing them."""
    if reduction is None or (isinstance(reduction, str) and reduction in REDUCTIONS):
        return reduction
    raise ValueError(
        f"reduction={reduction!r} is not a loss reduction; expected one of "
        f"{', '.join(repr(r) for r in REDUCTIONS)} (None or 'none' for one loss per example, as "
        "mirrored.compute_average_loss takes them)"
    )


class Loss:
    """A Keras-named loss: ``call`` gives one loss per element of shape [batch, ...], unreduced,
    so that a replica can weigh and sum its shard and the strategy divide by the global count;
    calling the object reduces one batch as ``reduction`` says (Keras 3's meanings):

    - ``"sum_over_batch_size"`` (the default; also ``"mean"`` and TensorFlow 2's ``"auto"``):
      the sum of the weighted losses over the number of elements (those not ignored);
    - ``"mean_with_sample_weight"``: that sum over the sum of the weights;
    - ``"sum"``: the sum;
    - ``None`` or ``"none"``: the weighted losses themselves, one per element, for
      ``mirrored.compute_average_loss`` in a replica.

    Inside a replica of a strategy, a mean over the shard is refused at ``loss.backward()``
    (the replicas' gradients are summed): take per-example losses and
    ``compute_average_loss``. ``Model.compile`` uses ``call`` and always averages over the
    global batch, whatever the reduction."""

    def __init__(self, name: str | None = None, reduction: str | None = _DEFAULT_REDUCTION) -> None:
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name={name!r}: expected a string or None")
        self.name = name if name is not None else type(self).__name__
        self.reduction = _check_reduction(reduction)
        self._probabilities_checked = False

    def call(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        """Per-element losses of shape [batch, ...], no reduction."""
        raise NotImplementedError(f"{type(self).__name__} must implement call(y_true, y_pred)")

    def valid_mask(self, y_true: Any, y_pred: Any) -> torch.Tensor | None:
        """The elements of ``call``'s result that count (bool, same shape), or None when all do.
        Only ``SparseCategoricalCrossentropy(ignore_class=...)`` masks: Keras divides its loss by
        the number of elements that are not ignored."""
        return None

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        """The (weighted) per-element losses reduced as ``reduction`` says; a mean of an empty
        batch is 0."""
        values = self.call(y_true, y_pred)
        weight = None if sample_weight is None else broadcast_weight(sample_weight, values)
        if weight is not None:
            values = values * weight
        reduction = self.reduction
        if reduction is None or reduction == "none":
            return values
        if reduction == "sum" or values.numel() == 0:
            return values.sum()
        mask = self.valid_mask(y_true, y_pred)
        if reduction == "mean_with_sample_weight" and weight is not None:
            counted = (weight.expand(values.shape) if mask is None else weight * mask).sum()
            divisor = torch.where(counted == 0, torch.ones_like(counted), counted)
        elif mask is None:
            # Written as a mean, so that a replica's loss.backward() sees a mean over its shard
            # and refuses it (mirrored.replication.global_batch_loss).
            return values.mean()
        else:
            divisor = mask.sum().clamp(min=1)  # the elements that count
        return (values * (values.numel() / divisor)).mean()  # a mean, for the same reason

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, reduction={self.reduction!r})"

    def _check_probabilities(self, y_pred: torch.Tensor) -> None:
        """With from_logits=False, check once per loss object (one host sync) that y_pred holds
        probabilities: logits fed as probabilities train silently badly. Replica threads racing
        here at most check twice. A traced step (:func:`mirrored.function`) checks at replays,
        where the values are known."""
        if self._probabilities_checked or y_pred.numel() == 0:
            return
        recorder = recording()
        if recorder is not None:
            recorder.host_call(lambda real: self._check_probabilities(real[0]), [y_pred.detach()])
            return
        low, high = torch.stack(torch.aminmax(y_pred.detach())).tolist()
        if low < -_PROBABILITY_SLACK or high > 1 + _PROBABILITY_SLACK:
            raise ValueError(
                f"{self.name}: from_logits=False but y_pred got values outside [0, 1] (min "
                f"{low:.4g}, max {high:.4g}); the model outputs logits: use "
                f"{type(self).__name__}(from_logits=True) or end it with softmax/sigmoid"
            )
        self._probabilities_checked = True


def _check_label_smoothing(label_smoothing: float) -> float:
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"label_smoothing={label_smoothing!r}: expected a float in [0, 1]")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing!r}: expected a float in [0, 1]")
    return float(label_smoothing)


class SparseCategoricalCrossentropy(Loss):
    """Cross-entropy of integer class ids y_true [batch, ...] (a trailing dim of 1 is squeezed)
    against y_pred [batch, ..., classes]: logits (``from_logits=True``) or probabilities, which
    are renormalised to sum to 1 and clipped to [1e-7, 1 - 1e-7] as Keras does. Positions whose
    id is ``ignore_class`` get loss 0 and do not count in the mean."""

    def __init__(
        self,
        from_logits: bool = False,
        ignore_class: int | None = None,
        reduction: str | None = _DEFAULT_REDUCTION,
        name: str = "sparse_categorical_crossentropy",
    ) -> None:
        super().__init__(name, reduction)
        if ignore_class is not None and (
            isinstance(ignore_class, bool) or not isinstance(ignore_class, int)
        ):
            raise TypeError(f"ignore_class={ignore_class!r}: expected an int class id or None")
        self.from_logits = bool(from_logits)
        self.ignore_class = ignore_class

    def _class_ids(self, y_true: Any, y_pred: torch.Tensor) -> torch.Tensor:
        given = ids = to_tensor(y_true, "y_true", y_pred.device)
        if ids.dim() == y_pred.dim() and ids.dim() > 0 and ids.shape[-1] == 1:
            ids = ids.squeeze(-1)
        if y_pred.dim() < 2 or ids.shape != y_pred.shape[:-1]:
            received, hint = shape_of(given), ""
            if received == shape_of(y_pred):
                hint = "; for one-hot or probability targets use CategoricalCrossentropy"
            raise ValueError(
                f"{self.name}: y_true has shape {received} and y_pred {shape_of(y_pred)}; expected "
                "y_pred [batch, ..., classes] and y_true of class ids shaped like y_pred without "
                f"its last dim (or with a last dim of 1){hint}"
            )
        return ids.long()

    def _check_class_ids(self, ids: torch.Tensor, num_classes: int) -> None:
        """Every id in 0..num_classes-1, else a ValueError naming one outside (in a traced step,
        :func:`mirrored.function`, at each replay, where the ids are known)."""
        recorder = recording()
        if recorder is not None:
            recorder.host_call(lambda real: self._check_class_ids(real[0], num_classes), [ids])
            return
        if ids.numel() == 0:
            return
        low, high = torch.stack(torch.aminmax(ids)).tolist()
        if low < 0 or high >= num_classes:
            raise ValueError(
                f"{self.name}: y_true holds class id {low if low < 0 else high} but y_pred has "
                f"{num_classes} classes (ids 0..{num_classes - 1})"
            )

    def _cross_entropy_of_logits(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """torch's fused cross-entropy, one value per id; it checks the ids' range itself on
        the host, and no id is ignored (torch's default ignores -100)."""
        num_classes = logits.shape[-1]
        flat = logits.dim() == 2  # [batch, classes]: torch's own layout
        try:
            losses = F.cross_entropy(
                logits if flat else logits.reshape(-1, num_classes),
                ids if flat else ids.reshape(-1),
                reduction="none",
                ignore_index=_NO_IGNORED_CLASS,
            )
        except IndexError:  # torch's "Target 5 is out of bounds.": say which input and why
            self._check_class_ids(ids, num_classes)
            raise
        return losses if flat else losses.reshape(ids.shape)

    def valid_mask(self, y_true: Any, y_pred: Any) -> torch.Tensor | None:
        if self.ignore_class is None:
            return None
        return self._class_ids(y_true, to_tensor(y_pred, "y_pred")) != self.ignore_class

    def call(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        pred = to_tensor(y_pred, "y_pred")
        ids = self._class_ids(y_true, pred)
        pred = at_least(pred, torch.float32)
        valid = None if self.ignore_class is None else ids != self.ignore_class
        if valid is not None:
            ids = ids.masked_fill(~valid, 0)
        if self.from_logits:
            losses = self._cross_entropy_of_logits(pred, ids)
        else:
            if ids.device.type == "cpu":  # on an accelerator: a host sync per call
                self._check_class_ids(ids, pred.shape[-1])
            self._check_probabilities(pred)
            picked = pred.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
            probability = picked / pred.sum(dim=-1)
            losses = -probability.clamp(_EPSILON, 1.0 - _EPSILON).log()
        return losses if valid is None else losses.masked_fill(~valid, 0.0)


class CategoricalCrossentropy(Loss):
    """Cross-entropy of one-hot or probability targets y_true against y_pred, both of shape
    [batch, ..., classes]; ``label_smoothing`` mixes the targets with the uniform distribution."""

    def __init__(
        self,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        reduction: str | None = _DEFAULT_REDUCTION,
        name: str = "categorical_crossentropy",
    ) -> None:
        super().__init__(name, reduction)
        self.from_logits = bool(from_logits)
        self.label_smoothing = _check_label_smoothing(label_smoothing)

    def call(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        pred = to_tensor(y_pred, "y_pred")
        true = to_tensor(y_true, "y_true", pred.device)
        if pred.dim() < 2 or true.shape != pred.shape:
            hint = ""
            if true.dim() + 1 == pred.dim() or (true.dim() == pred.dim() and true.shape[-1] == 1):
                hint = "; for integer class ids use SparseCategoricalCrossentropy"
            raise ValueError(
                f"{self.name}: y_true has shape {shape_of(true)} and y_pred {shape_of(pred)}; "
                f"expected both [batch, ..., classes] (one-hot or probability targets){hint}"
            )
        pred = at_least(pred, torch.float32)
        true = true.to(pred.dtype)
        if self.label_smoothing:
            true = true * (1.0 - self.label_smoothing) + self.label_smoothing / pred.shape[-1]
        if self.from_logits:
            log_probability = torch.log_softmax(pred, dim=-1)
        else:
            self._check_probabilities(pred)
            probability = pred / pred.sum(dim=-1, keepdim=True)
            log_probability = probability.clamp(_EPSILON, 1.0 - _EPSILON).log()
        return -(true * log_probability).sum(dim=-1)


class BinaryCrossentropy(Loss):
    """Binary cross-entropy of targets in [0, 1] against y_pred of the same shape (a trailing
    dim of 1 aligned: y_true [batch] with y_pred [batch, 1] is the usual case), averaged over the
    last dim as Keras does; ``label_smoothing`` pulls the targets towards 0.5."""

    def __init__(
        self,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        reduction: str | None = _DEFAULT_REDUCTION,
        name: str = "binary_crossentropy",
    ) -> None:
        super().__init__(name, reduction)
        self.from_logits = bool(from_logits)
        self.label_smoothing = _check_label_smoothing(label_smoothing)

    def call(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        true, pred = same_shape_pair(self.name, y_true, y_pred)
        if self.label_smoothing:
            true = true * (1.0 - self.label_smoothing) + 0.5 * self.label_smoothing
        if self.from_logits:
            values = F.binary_cross_entropy_with_logits(pred, true, reduction="none")
        else:
            self._check_probabilities(pred)
            # Written out rather than F.binary_cross_entropy, which refuses to run under autocast.
            probability = pred.clamp(_EPSILON, 1.0 - _EPSILON)
            values = -(true * probability.log() + (1.0 - true) * (-probability).log1p())
        return mean_last(values)


class MeanSquaredError(Loss):
    """Squared error averaged over the last dim (Keras); [batch] pairs give one per example."""

    def __init__(
        self, reduction: str | None = _DEFAULT_REDUCTION, name: str = "mean_squared_error"
    ) -> None:
        super().__init__(name, reduction)

    def call(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        return squared_error(*same_shape_pair(self.name, y_true, y_pred))


class MeanAbsoluteError(Loss):
    """Absolute error averaged over the last dim (Keras); [batch] pairs give one per example."""

    def __init__(
        self, reduction: str | None = _DEFAULT_REDUCTION, name: str = "mean_absolute_error"
    ) -> None:
        super().__init__(name, reduction)

    def call(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        return absolute_error(*same_shape_pair(self.name, y_true, y_pred))


def function_name(fn: Callable[..., Any]) -> str:
    """The name a function is logged under: its ``__name__``, a ``functools.partial``'s
    function's (``partial(sparse_categorical_crossentropy, from_logits=True)`` logs as
    "sparse_categorical_crossentropy", as Keras logs it)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return str(getattr(fn, "__name__", type(fn).__name__))


class LossFunctionWrapper(Loss):
    """A function ``fn(y_true, y_pred)`` returning one loss per example (or per element) as a
    Loss. As Keras does, a trailing dim of 1 on y_true or y_pred is aligned before the call, so
    that y_true [batch] and y_pred [batch, 1] do not broadcast to [batch, batch]."""

    def __init__(
        self,
        fn: Callable[..., Any],
        reduction: str | None = _DEFAULT_REDUCTION,
        name: str | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"fn={fn!r}: expected a function fn(y_true, y_pred)")
        try:
            super().__init__(name if name is not None else function_name(fn), reduction)
        except ValueError as error:
            if isinstance(reduction, str) and reduction not in REDUCTIONS:  # the old (fn, name)
                raise ValueError(
                    f"{error}; to name the loss, pass name=... by keyword "
                    f"(LossFunctionWrapper(fn, name={reduction!r}))"
                ) from None
            raise
        self.fn = fn

    def call(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        if isinstance(y_true, torch.Tensor) and isinstance(y_pred, torch.Tensor):
            y_true, y_pred = align_ranks(y_true, y_pred)
            if y_pred.is_floating_point():
                y_pred = at_least(y_pred, torch.float32)
        return per_example_values(
            self.fn(y_true, y_pred),
            f"loss function {self.name!r}",
            "one loss per example (reduction='none'), a tensor of shape [batch, ...]",
        )
