"""What losses and metrics do to ``y_true``, ``y_pred`` and weights first: tensors, shapes.

Keras accepts array-likes, aligns a trailing dim of 1 (``y_true`` [batch] with ``y_pred``
[batch, 1]) and broadcasts ``sample_weight`` from the left; the losses and the metrics must agree
on all three, or a metric would report a value its loss never computed. So both use these.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "per_example_values",
    "absolute_error",
    "align_ranks",
    "aligned_pair",
    "at_least",
    "broadcast_weight",
    "mean_last",
    "same_shape_pair",
    "shape_of",
    "squared_error",
    "to_tensor",
]


def shape_of(tensor: torch.Tensor) -> list[int]:
    """The shape as a list, as error messages print it."""
    return list(tensor.shape)


def to_tensor(value: Any, name: str, device: torch.device | None = None) -> torch.Tensor:
    """``value`` as a tensor (array-likes converted), on ``device`` when one is given."""
    if isinstance(value, torch.Tensor):
        return value if device is None or value.device == device else value.to(device)
    try:
        return torch.as_tensor(value, device=device)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(
            f"{name} is a {type(value).__name__}: expected a tensor (or an array-like)"
        ) from error


def at_least(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as a float of at least ``dtype``'s precision: float16 / bfloat16 predictions of
    mixed precision are cast up, so the loss itself stays accurate."""
    if tensor.dtype == dtype:  # the common case, without promote_types' dispatch
        return tensor
    return tensor.to(torch.promote_types(tensor.dtype, dtype))


def align_ranks(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


def aligned_pair(name: str, y_true: Any, y_pred: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """y_true and y_pred of one shape [batch, ...] (a trailing dim of 1 aligned as Keras does),
    in their own dtypes; else a ValueError naming ``name`` and both shapes."""
    pred = to_tensor(y_pred, "y_pred")
    true = to_tensor(y_true, "y_true", pred.device)
    true_aligned, pred_aligned = align_ranks(true, pred)
    if pred_aligned.dim() == 0 or true_aligned.shape != pred_aligned.shape:
        raise ValueError(
            f"{name}: y_true has shape {shape_of(true)} and y_pred {shape_of(pred)}; expected both "
            "of one shape [batch, ...] (a trailing dim of 1 on either side is aligned)"
        )
    return true_aligned, pred_aligned


def same_shape_pair(
    name: str, y_true: Any, y_pred: Any, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``aligned_pair`` as floats of at least ``dtype``."""
    true_aligned, pred_aligned = aligned_pair(name, y_true, y_pred)
    pred_aligned = at_least(pred_aligned, dtype)
    return true_aligned.to(pred_aligned.dtype), pred_aligned


def mean_last(values: torch.Tensor) -> torch.Tensor:
    """Keras averages elementwise losses over the last dim; [batch] pairs keep one per example."""
    return values.mean(dim=-1) if values.dim() > 1 else values


def squared_error(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    return mean_last((y_pred - y_true).square())


def absolute_error(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    return mean_last((y_pred - y_true).abs())


def broadcast_weight(sample_weight: Any, values: torch.Tensor) -> torch.Tensor:
    """``sample_weight`` shaped to multiply ``values`` (per-element losses or metric values of
    shape [batch, ...]), broadcast from the left: a [batch] weight weighs every element of its
    example; a weight of the full shape (or any leading part of it) weighs elements; dims of 1
    broadcast. Trailing dims of 1 beyond ``values``'s rank are dropped; a scalar weighs everything
    alike. The result has ``values``'s dtype and device."""
    if isinstance(sample_weight, (int, float)) and not isinstance(sample_weight, bool):
        return values.new_full((), float(sample_weight))
    weight = to_tensor(sample_weight, "sample_weight", values.device).to(values.dtype)
    received = shape_of(weight)
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
            f"{shape_of(values)}; pass one weight per example (shape {shape_of(values)[:1]}) or "
            f"one per element (shape {shape_of(values)})"
        )
    return weight.reshape(*weight.shape, *([1] * (values.dim() - weight.dim())))


def per_example_values(values: Any, what: str, expected: str) -> torch.Tensor:
    """``values`` from a loss or metric function, refused unless there is one per example:
    ``what`` names the function, ``expected`` says what it must return."""
    if not isinstance(values, torch.Tensor) or values.dim() == 0:
        received = "a 0-dim tensor" if isinstance(values, torch.Tensor) else repr(values)
        raise ValueError(f"{what} returned {received}; it must return {expected}")
    return values
