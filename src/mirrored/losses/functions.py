"""Keras's function forms of the losses, and the lookup behind ``compile(loss=...)``.

``sparse_categorical_crossentropy(y_true, y_pred, ...)`` and friends give one loss per example
(per position for sequences), unreduced, usable as ``compile(loss=fn)`` and ``metrics=[fn]``.
Each calls a loss object kept per arguments, so that the probability check runs once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mirrored.losses.classes import (
    BinaryCrossentropy,
    CategoricalCrossentropy,
    Loss,
    LossFunctionWrapper,
    MeanAbsoluteError,
    MeanSquaredError,
    SparseCategoricalCrossentropy,
)

__all__ = [
    "binary_crossentropy",
    "categorical_crossentropy",
    "get",
    "mae",
    "mean_absolute_error",
    "mean_squared_error",
    "mse",
    "name_key",
    "sparse_categorical_crossentropy",
]


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


def name_key(name: str) -> str:
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
            if name_key(name) == name_key(identifier):
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
