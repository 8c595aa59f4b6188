"""Keras-named losses on PyTorch tensors, and the loss scaling helpers re-exported.

The scaling helpers (:mod:`mirrored.loss_scaling`) divide each replica's loss by the *global*
batch size, not its shard's, so that summing the replicas' gradients gives exactly the gradient
of the mean loss over the global batch, whatever the split.

The loss objects (``SparseCategoricalCrossentropy`` and friends) compute what Keras's do, on
PyTorch tensors. Their ``call`` gives one loss per element, unreduced, which is what a replica
needs: it weighs and sums its shard and the division is by the global count.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mirrored.loss_scaling import (
    compute_average_loss,
    compute_weighted_average_loss,
    scale_regularization_loss,
    scale_shard_mean,
)

__all__ = [
    "BinaryCrossentropy",
    "CategoricalCrossentropy",
    "Loss",
    "LossFunctionWrapper",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "SparseCategoricalCrossentropy",
    "binary_crossentropy",
    "broadcast_weight",
    "categorical_crossentropy",
    "compute_average_loss",
    "compute_weighted_average_loss",
    "get",
    "mae",
    "mean_absolute_error",
    "mean_squared_error",
    "mse",
    "scale_regularization_loss",
    "scale_shard_mean",
    "sparse_categorical_crossentropy",
]


# -- Keras-named loss objects ----------------------------------------------------------------------

_NO_IGNORED_CLASS = -(2**63)  # an ignore_index for F.cross_entropy that no class id equals
_EPSILON = 1e-7  # keras.backend.epsilon(): probabilities are clipped to [eps, 1 - eps]
# How far outside [0, 1] "probabilities" may stray (rounding) before the first-call check calls
# them logits.
_PROBABILITY_SLACK = 1e-5


def _shape(tensor: torch.Tensor) -> list[int]:
    return list(tensor.shape)


def _to_tensor(value: Any, name: str, device: torch.device | None = None) -> torch.Tensor:
    """``value`` as a tensor (array-likes converted), on ``device`` when one is given."""
    if isinstance(value, torch.Tensor):
        return value if device is None or value.device == device else value.to(device)
    try:
        return torch.as_tensor(value, device=device)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(
            f"{name} is a {type(value).__name__}: expected a tensor (or an array-like)"
        ) from error


def _at_least(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as a float of at least ``dtype``'s precision: float16 / bfloat16 predictions of
    mixed precision are cast up, so the loss itself stays accurate."""
    return tensor.to(torch.promote_types(tensor.dtype, dtype))


def _align_ranks(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keras's ``squeeze_or_expand_to_same_rank``: when the ranks differ by one and the larger
    ends in a dim of 1, a rank-1 tensor gains that dim, otherwise the larger loses it."""
    if a.dim() == b.dim() + 1 and a.shape[-1] == 1:
        if b.dim() == 1:
            b = b.unsqueeze(-1)
        else:
            a = a.squeeze(-1)
    elif b.dim() == a.dim() + 1 and b.shape[-1] == 1:
        if a.dim() == 1:
            a = a.unsqueeze(-1)
        else:
            b = b.squeeze(-1)
    return a, b


def _same_shape_pair(
    name: str, y_true: Any, y_pred: Any, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """y_true and y_pred of one shape [batch, ...] (a trailing dim of 1 aligned as Keras does), as
    floats of at least ``dtype``."""
    pred = _to_tensor(y_pred, "y_pred")
    true = _to_tensor(y_true, "y_true", pred.device)
    true_aligned, pred_aligned = _align_ranks(true, pred)
    if pred_aligned.dim() == 0 or true_aligned.shape != pred_aligned.shape:
        raise ValueError(
            f"{name}: y_true has shape {_shape(true)} and y_pred {_shape(pred)}; expected both "
            "of one shape [batch, ...] (a trailing dim of 1 on either side is aligned)"
        )
    pred_aligned = _at_least(pred_aligned, dtype)
    return true_aligned.to(pred_aligned.dtype), pred_aligned


def _mean_last(values: torch.Tensor) -> torch.Tensor:
    """Keras averages elementwise losses over the last dim; [batch] pairs keep one per example."""
    return values.mean(dim=-1) if values.dim() > 1 else values


def _squared_error(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    return _mean_last((y_pred - y_true).square())


def _absolute_error(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    return _mean_last((y_pred - y_true).abs())


def broadcast_weight(sample_weight: Any, values: torch.Tensor) -> torch.Tensor:
    """``sample_weight`` shaped to multiply ``values`` (per-element losses or metric values of
    shape [batch, ...]), broadcast from the left: a [batch] weight weighs every element of its
    example; a weight of the full shape (or any leading part of it) weighs elements; dims of 1
    broadcast. Trailing dims of 1 beyond ``values``'s rank are dropped; a scalar weighs everything
    alike. The result has ``values``'s dtype and device."""
    if isinstance(sample_weight, (int, float)) and not isinstance(sample_weight, bool):
        return values.new_full((), float(sample_weight))
    weight = _to_tensor(sample_weight, "sample_weight", values.device).to(values.dtype)
    received = _shape(weight)
    while weight.dim() > values.dim() and weight.shape[-1] == 1:
        weight = weight.squeeze(-1)
    if weight.dim() == 0:
        return weight
    leading = values.shape[: weight.dim()]
    if weight.dim() > values.dim() or any(
        w != v and w != 1 for w, v in zip(weight.shape, leading, strict=True)
    ):
        raise ValueError(
            f"sample_weight has shape {received} but the values it weighs have shape "
            f"{_shape(values)}; pass one weight per example (shape {_shape(values)[:1]}) or one "
            f"per element (shape {_shape(values)})"
        )
    return weight.reshape(*weight.shape, *([1] * (values.dim() - weight.dim())))


class Loss:
    """A Keras-named loss: ``call`` gives one loss per element of shape [batch, ...], unreduced,
    so that a replica can weigh and sum its shard and the strategy divide by the global count;
    calling the object reduces one batch the way Keras does by default ("sum_over_batch_size")."""

    def __init__(self, name: str | None = None) -> None:
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name={name!r}: expected a string or None")
        self.name = name if name is not None else type(self).__name__
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
        """Sum of the (weighted) per-element losses over the number of elements, 0 for an empty
        batch."""
        values = self.call(y_true, y_pred)
        if sample_weight is not None:
            values = values * broadcast_weight(sample_weight, values)
        mask = self.valid_mask(y_true, y_pred)
        if mask is None:
            return values.sum() / max(values.numel(), 1)
        return values.sum() / mask.sum().clamp(min=1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def _check_probabilities(self, y_pred: torch.Tensor) -> None:
        """With from_logits=False, check once per loss object (one host sync) that y_pred holds
        probabilities: logits fed as probabilities train silently badly. Replica threads racing
        here at most check twice."""
        if self._probabilities_checked or y_pred.numel() == 0:
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
        name: str = "sparse_categorical_crossentropy",
    ) -> None:
        super().__init__(name)
        if ignore_class is not None and (
            isinstance(ignore_class, bool) or not isinstance(ignore_class, int)
        ):
            raise TypeError(f"ignore_class={ignore_class!r}: expected an int class id or None")
        self.from_logits = bool(from_logits)
        self.ignore_class = ignore_class

    def _class_ids(self, y_true: Any, y_pred: torch.Tensor) -> torch.Tensor:
        given = ids = _to_tensor(y_true, "y_true", y_pred.device)
        if ids.dim() == y_pred.dim() and ids.dim() > 0 and ids.shape[-1] == 1:
            ids = ids.squeeze(-1)
        if y_pred.dim() < 2 or ids.shape != y_pred.shape[:-1]:
            received, hint = _shape(given), ""
            if received == _shape(y_pred):
                hint = "; for one-hot or probability targets use CategoricalCrossentropy"
            raise ValueError(
                f"{self.name}: y_true has shape {received} and y_pred {_shape(y_pred)}; expected "
                "y_pred [batch, ..., classes] and y_true of class ids shaped like y_pred without "
                f"its last dim (or with a last dim of 1){hint}"
            )
        return ids.long()

    def _check_class_ids(self, ids: torch.Tensor, num_classes: int) -> None:
        """Every id in 0..num_classes-1, else a ValueError naming one outside."""
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
        return self._class_ids(y_true, _to_tensor(y_pred, "y_pred")) != self.ignore_class

    def call(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        pred = _to_tensor(y_pred, "y_pred")
        ids = self._class_ids(y_true, pred)
        pred = _at_least(pred, torch.float32)
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
        name: str = "categorical_crossentropy",
    ) -> None:
        super().__init__(name)
        self.from_logits = bool(from_logits)
        self.label_smoothing = _check_label_smoothing(label_smoothing)

    def call(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        pred = _to_tensor(y_pred, "y_pred")
        true = _to_tensor(y_true, "y_true", pred.device)
        if pred.dim() < 2 or true.shape != pred.shape:
            hint = ""
            if true.dim() + 1 == pred.dim() or (true.dim() == pred.dim() and true.shape[-1] == 1):
                hint = "; for integer class ids use SparseCategoricalCrossentropy"
            raise ValueError(
                f"{self.name}: y_true has shape {_shape(true)} and y_pred {_shape(pred)}; "
                f"expected both [batch, ..., classes] (one-hot or probability targets){hint}"
            )
        pred = _at_least(pred, torch.float32)
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
        name: str = "binary_crossentropy",
    ) -> None:
        super().__init__(name)
        self.from_logits = bool(from_logits)
        self.label_smoothing = _check_label_smoothing(label_smoothing)

    def call(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        true, pred = _same_shape_pair(self.name, y_true, y_pred)
        if self.label_smoothing:
            true = true * (1.0 - self.label_smoothing) + 0.5 * self.label_smoothing
        if self.from_logits:
            values = F.binary_cross_entropy_with_logits(pred, true, reduction="none")
        else:
            self._check_probabilities(pred)
            # Written out rather than F.binary_cross_entropy, which refuses to run under autocast.
            probability = pred.clamp(_EPSILON, 1.0 - _EPSILON)
            values = -(true * probability.log() + (1.0 - true) * (-probability).log1p())
        return _mean_last(values)


class MeanSquaredError(Loss):
    """Squared error averaged over the last dim (Keras); [batch] pairs give one per example."""

    def __init__(self, name: str = "mean_squared_error") -> None:
        super().__init__(name)

    def call(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        return _squared_error(*_same_shape_pair(self.name, y_true, y_pred))


class MeanAbsoluteError(Loss):
    """Absolute error averaged over the last dim (Keras); [batch] pairs give one per example."""

    def __init__(self, name: str = "mean_absolute_error") -> None:
        super().__init__(name)

    def call(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        return _absolute_error(*_same_shape_pair(self.name, y_true, y_pred))


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

    def __init__(self, fn: Callable[..., Any], name: str | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"fn={fn!r}: expected a function fn(y_true, y_pred)")
        super().__init__(name if name is not None else function_name(fn))
        self.fn = fn

    def call(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        if isinstance(y_true, torch.Tensor) and isinstance(y_pred, torch.Tensor):
            y_true, y_pred = _align_ranks(y_true, y_pred)
            if y_pred.is_floating_point():
                y_pred = _at_least(y_pred, torch.float32)
        values = self.fn(y_true, y_pred)
        if not isinstance(values, torch.Tensor) or values.dim() == 0:
            received = "a 0-dim tensor" if isinstance(values, torch.Tensor) else repr(values)
            raise ValueError(
                f"loss function {self.name!r} returned {received}; it must return one loss per "
                "example (reduction='none'), a tensor of shape [batch, ...]"
            )
        return values


# -- Keras's function forms ------------------------------------------------------------------------
# keras.losses.sparse_categorical_crossentropy(y_true, y_pred, ...) and friends: one loss per
# example (per position for sequences), unreduced, usable as compile(loss=fn) and metrics=[fn].


_LOSS_OBJECTS: dict[tuple[Any, ...], Loss] = {}


def _loss_object(kind: type[Loss], *arguments: Any) -> Loss:
    """One loss object per kind and arguments, so that the first-call probability check runs
    once per combination, not on every call."""
    key = (kind, *arguments)
    try:
        return _LOSS_OBJECTS[key]
    except (KeyError, TypeError):  # new, or unhashable: the constructor names a bad argument
        return _LOSS_OBJECTS.setdefault(key, kind(*arguments))


def _classes_last(kind: type[Loss], axis: int, *arguments: Any) -> Loss:
    """The loss object of a Keras function taking ``axis``, which must be the last dim."""
    loss = _loss_object(kind, *arguments)
    if axis != -1:
        raise ValueError(
            f"{loss.name}(axis={axis!r}): mirrored's losses take the classes on the last dim; "
            f"move them there (y_pred.movedim({axis}, -1)) and pass axis=-1"
        )
    return loss


def sparse_categorical_crossentropy(
    y_true: Any,
    y_pred: Any,
    from_logits: bool = False,
    ignore_class: int | None = None,
    axis: int = -1,
) -> torch.Tensor:
    """Keras's function: the cross-entropy of each example (each position), shape y_pred's
    without its class dim; 0 where y_true is ``ignore_class``."""
    kind = SparseCategoricalCrossentropy
    return _classes_last(kind, axis, bool(from_logits), ignore_class).call(y_true, y_pred)


def categorical_crossentropy(
    y_true: Any,
    y_pred: Any,
    from_logits: bool = False,
    label_smoothing: float = 0.0,
    axis: int = -1,
) -> torch.Tensor:
    """Keras's function: the cross-entropy of each example against one-hot or probability
    targets, shape y_pred's without its class dim."""
    kind = CategoricalCrossentropy
    return _classes_last(kind, axis, bool(from_logits), label_smoothing).call(y_true, y_pred)


def binary_crossentropy(
    y_true: Any,
    y_pred: Any,
    from_logits: bool = False,
    label_smoothing: float = 0.0,
    axis: int = -1,
) -> torch.Tensor:
    """Keras's function: binary cross-entropy averaged over the last dim, one per example."""
    kind = BinaryCrossentropy
    return _classes_last(kind, axis, bool(from_logits), label_smoothing).call(y_true, y_pred)


def mean_squared_error(y_true: Any, y_pred: Any) -> torch.Tensor:
    """Keras's function: the squared error averaged over the last dim, one per example."""
    return _loss_object(MeanSquaredError).call(y_true, y_pred)


def mean_absolute_error(y_true: Any, y_pred: Any) -> torch.Tensor:
    """Keras's function: the absolute error averaged over the last dim, one per example."""
    return _loss_object(MeanAbsoluteError).call(y_true, y_pred)


mse = mean_squared_error
mae = mean_absolute_error


_LOSSES: dict[str, Callable[[], Loss]] = {
    "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
    "categorical_crossentropy": CategoricalCrossentropy,
    "binary_crossentropy": BinaryCrossentropy,
    "mean_squared_error": MeanSquaredError,
    "mse": MeanSquaredError,
    "mean_absolute_error": MeanAbsoluteError,
    "mae": MeanAbsoluteError,
}


def _key(name: str) -> str:
    """Names match in any case, with or without underscores ("MeanSquaredError" too)."""
    return name.lower().replace("_", "")


def get(identifier: Loss | str | Callable[..., Any] | type[Loss]) -> Loss:
    """The loss for ``compile(loss=...)``: a Loss as is, a Loss class instantiated, a Keras name
    (any case), or a function fn(y_true, y_pred) returning per-element losses, wrapped."""
    if isinstance(identifier, Loss):
        return identifier
    if isinstance(identifier, type) and issubclass(identifier, Loss):
        return identifier()
    if isinstance(identifier, str):
        for name, factory in _LOSSES.items():
            if _key(name) == _key(identifier):
                return factory()
        raise ValueError(
            f"loss={identifier!r} is not a known loss; known names: {', '.join(_LOSSES)} (or "
            "pass a mirrored.losses.Loss, or a function fn(y_true, y_pred) returning one loss "
            "per example)"
        )
    if callable(identifier):
        return LossFunctionWrapper(identifier)
    raise TypeError(
        f"loss={identifier!r}: expected a loss name ({', '.join(_LOSSES)}), a "
        "mirrored.losses.Loss, or a function fn(y_true, y_pred) returning one loss per example"
    )
