"""What one batch's loss and metrics compare: the targets and the predictions, batch first.

Hugging Face models return a mapping (a ``ModelOutput``): the compiled loss and metrics take its
``logits``. When the data has no y and x is a dict carrying ``labels``, those labels are the
targets, weighted 0 where they are -100 (the positions without a loss), as Keras would treat them
with ``sample_weight`` 0. A causal language model predicts token t + 1 at position t and its own
loss averages ``labels[..., 1:]``: for it the targets of position t are the labels of t + 1.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from mirrored._torch_internals import code_of
from mirrored.core.values import flatten, map_structure
from mirrored.input import batch_size_of
from mirrored.losses import broadcast_weight

__all__ = [
    "IGNORE_INDEX",
    "Targets",
    "batch_first",
    "own_loss_count",
    "predicted",
    "predictions",
    "shifts_labels",
    "targets_of",
]

IGNORE_INDEX = -100  # Hugging Face's label for positions without a loss (torch's ignore_index)


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


def own_loss_count(x: Any, shifted: bool, batch_dim: int) -> torch.Tensor | int:
    """How many terms a model's own mean loss averages on this shard: its labels that are not
    IGNORE_INDEX when x carries labels (a causal language model's from the second position on:
    ``shifted``), else its examples."""
    labels = _labels_of_logits(x, shifted)
    return batch_size_of(x, batch_dim) if labels is None else (labels != IGNORE_INDEX).sum()


def _per_example(value: Any, batch_dim: int) -> bool:
    leaves = flatten(value)
    return bool(leaves) and all(isinstance(v, torch.Tensor) and v.dim() > batch_dim for v in leaves)


def predicted(y_pred: Any, batch_dim: int) -> Any:
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


def batch_first(x: Any, targets: Targets, y_pred: Any, batch_dim: int) -> tuple[Targets, Any]:
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


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value
