"""Keras-named metrics whose state adds up exactly across replicas.

A metric's state is a short float64 vector of sums (for a mean: the weighted sum of the values
and the sum of the weights). Each replica computes the state of its shard with ``batch_state``,
which is pure and never waits for the device; the caller adds the replicas' states and merges
them, so a ragged last batch, or an empty shard, gives exactly the single-device value. Sums are
kept in float64 so that an epoch of batches adds up without float32 rounding drift.

Keras's function forms (``sparse_categorical_accuracy(y_true, y_pred)`` and friends) give one
value per example; ``compile(metrics=[fn])`` averages them, logged under the function's name.

A metric updated inside a replica function (TensorFlow's ``train_accuracy.update_state(labels,
predictions)`` in the step given to ``strategy.run``) keeps each replica's sums apart, so that
threads never read and write the same sums; they are added in replica order when the metric is
next read or updated outside the replicas, the same order whatever the thread timing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from mirrored import losses
from mirrored.core.context import current_replica_context
from mirrored.losses.classes import function_name
from mirrored.losses.functions import name_key
from mirrored.losses.shapes import (
    absolute_error,
    aligned_pair,
    broadcast_weight,
    per_example_values,
    same_shape_pair,
    shape_of,
    squared_error,
    to_tensor,
)

__all__ = [
    "AutoAccuracy",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "Mean",
    "MeanAbsoluteError",
    "MeanMetricWrapper",
    "MeanSquaredError",
    "Metric",
    "SparseCategoricalAccuracy",
    "binary_accuracy",
    "categorical_accuracy",
    "get",
    "sparse_categorical_accuracy",
]


# Guards a metric's per-replica sums: a replica's merge (a copy of the dict and one small add)
# and the caller's taking of them.
_REPLICA_SUMS_LOCK = threading.Lock()


class Metric:
    """A metric as an additive state vector of ``num_state`` float64 sums.

    ``batch_state`` is pure (no grad, no host sync). ``update_state`` and ``merge_state`` may be
    called from replica threads inside ``strategy.run``: each replica's sums are kept apart and
    added, in replica order, when the metric is read (``result``, ``state``) or updated outside
    the replicas. Read results outside the replica function.
    """

    num_state: int = 0

    def __init__(self, name: str | None = None) -> None:
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name={name!r}: expected a string or None")
        self.name = name if name is not None else type(self).__name__
        self._state: torch.Tensor | None = None
        self._replica_sums: dict[int, torch.Tensor] = {}  # merged by replica threads, not added

    @property
    def state(self) -> torch.Tensor:
        """The merged sums so far (zeros after a reset), on the device of the merged states."""
        replica = current_replica_context()
        if replica is not None and replica.num_replicas_in_sync > 1:
            raise ValueError(
                f"metric {self.name!r} read inside a replica function: there it holds only the "
                "updates merged so far; read result() after strategy.run returns"
            )
        self._add_replica_sums()
        if self._state is None:
            return torch.zeros(self.num_state, dtype=torch.float64)
        return self._state

    @state.setter
    def state(self, sums: torch.Tensor) -> None:
        """Replace the merged sums (a vector of the ``batch_state`` form, kept as given: a
        ``MetricSet`` keeps its metrics' sums as views of one vector), so it must already be
        float64 sums outside autograd, as ``merge_state`` would make them."""
        self._check_state(sums, "state")
        self._take_replica_sums()  # replaced, with what replicas merged since the last read
        if sums.dtype != torch.float64 or sums.requires_grad:
            raise ValueError(
                f"metric {self.name!r}: state got a {sums.dtype} tensor"
                f"{' that requires grad' if sums.requires_grad else ''}; expected float64 sums "
                "outside autograd (detach() and .double() it, or use merge_state)"
            )
        self._state = sums

    def _check_state(self, state: Any, what: str) -> None:
        if not isinstance(state, torch.Tensor) or state.shape != (self.num_state,):
            received = shape_of(state) if isinstance(state, torch.Tensor) else type(state).__name__
            raise ValueError(
                f"metric {self.name!r}: {what} got {received}; expected a 1-D tensor of "
                f"{self.num_state} sums, as batch_state returns"
            )

    def batch_state(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The additive state of one batch (its arguments and an optional ``sample_weight``): a
        1-D float64 tensor of ``num_state`` sums on the inputs' device."""
        raise NotImplementedError(f"{type(self).__name__} must implement batch_state")

    def merge_state(self, state: torch.Tensor) -> None:
        """Add ``state`` (of this metric's ``batch_state`` form) to the running sums. The sums
        stay on the first accelerator they meet, so merging never waits for the device."""
        self._check_state(state, "merge_state")
        state = state.detach().to(torch.float64)
        replica = current_replica_context()
        if replica is not None and replica.num_replicas_in_sync > 1:
            self._merge_replica_state(replica.replica_id_in_sync_group, state)
            return
        self._add_replica_sums()
        own = self._state
        self._state = state.clone() if own is None else add_sums(own, state)

    def _merge_replica_state(self, replica_id: int, state: torch.Tensor) -> None:
        """Add ``state`` to replica ``replica_id``'s own sums, which only its thread writes.
        The dict of sums is replaced, never changed in place, so that a copy of the metric
        keeps its own."""
        with _REPLICA_SUMS_LOCK:
            sums = dict(self.__dict__.get("_replica_sums", {}))
            own = sums.get(replica_id)
            sums[replica_id] = state.clone() if own is None else add_sums(own, state)
            self._replica_sums = sums

    def _take_replica_sums(self) -> dict[int, torch.Tensor]:
        """The replicas' sums merged since the last read, now this caller's to add."""
        if not self.__dict__.get("_replica_sums"):
            return {}
        with _REPLICA_SUMS_LOCK:
            sums, self._replica_sums = self._replica_sums, {}
        return sums

    def _add_replica_sums(self) -> None:
        """The replicas' sums into the running sums, in replica order (on the caller's thread,
        after the replicas' merges, so no update is added twice or lost)."""
        taken = self._take_replica_sums()
        for replica_id in sorted(taken):
            own = self._state
            self._state = taken[replica_id] if own is None else add_sums(own, taken[replica_id])

    def result(self) -> float:
        raise NotImplementedError(f"{type(self).__name__} must implement result")

    def reset_state(self) -> None:
        self._take_replica_sums()
        self._state = None

    def update_state(self, *args: Any, sample_weight: Any = None) -> None:
        """Keras's one-device update: ``merge_state(batch_state(...))``."""
        self.merge_state(self.batch_state(*args, sample_weight=sample_weight))

    def state_dict(self) -> dict[str, Any]:
        """The sums as a CPU tensor, for backups."""
        return {"state": self.state.detach().to("cpu", torch.float64).clone()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state = state_dict.get("state") if isinstance(state_dict, Mapping) else None
        if not isinstance(state, torch.Tensor) or state.shape != (self.num_state,):
            raise ValueError(
                f"metric {self.name!r}: load_state_dict expected {{'state': a tensor of "
                f"{self.num_state} sums}} as state_dict() returns, got {state_dict!r}"
            )
        self._take_replica_sums()
        self._state = state.detach().to("cpu", torch.float64).clone()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def add_sums(own: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Running sums plus a step's, out of place, on the first accelerator they meet: sums on
    the CPU move to the step's device, a step elsewhere moves to theirs."""
    own_device, device = own.device, state.device
    if own_device == device:
        return own + state
    if own_device.type == "cpu":
        return own.to(device) + state
    return own + state.to(own_device)


def _mean_state(values: Any, sample_weight: Any) -> torch.Tensor:
    """[sum of values * weight, sum of the weights broadcast to the values] in float64."""
    values = to_tensor(values, "values").detach()
    if sample_weight is None:
        count = torch.full((), values.numel(), dtype=torch.float64, device=values.device)
        return torch.stack([values.sum(dtype=torch.float64), count])
    values = values.to(torch.float64)
    weight = broadcast_weight(sample_weight, values).detach()
    return torch.stack([(values * weight).sum(), weight.expand(values.shape).sum()])


class _WeightedMean(Metric):
    """A metric whose state is [weighted sum, sum of weights] and result their ratio."""

    num_state = 2

    def result(self) -> float:
        total, count = self.state.tolist()
        return total / count if count else 0.0  # Keras's divide_no_nan


class Mean(_WeightedMean):
    """The (weighted) mean of the values given, as ``keras.metrics.Mean``. Weights broadcast from
    the left: a [batch] weight weighs every element of its example."""

    def __init__(self, name: str = "mean") -> None:
        super().__init__(name)

    def batch_state(self, values: Any, sample_weight: Any = None) -> torch.Tensor:
        with torch.no_grad():
            return _mean_state(values, sample_weight)


class MeanMetricWrapper(_WeightedMean):
    """The mean of ``fn(y_true, y_pred)``, a function giving one value per example (or per
    element) of shape [batch, ...]. Not a ``Mean`` subclass: it takes (y_true, y_pred), not values.
    """

    def __init__(self, fn: Callable[..., Any], name: str | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"fn={fn!r}: expected a function fn(y_true, y_pred)")
        super().__init__(name if name is not None else function_name(fn))
        self.fn = fn

    def batch_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        with torch.no_grad():
            values = per_example_values(
                self._values(y_true, y_pred),
                f"metric function {self.name!r}",
                "one value per example, a tensor of shape [batch, ...], so that the replicas' "
                "shards add up exactly",
            )
            return _mean_state(values, sample_weight)

    def _values(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        """What the state averages: ``fn``'s values (an accuracy's matches as booleans, which
        sum to the same counts in one op fewer)."""
        return self.fn(y_true, y_pred)


def _squeeze_trailing_one(values: torch.Tensor) -> torch.Tensor:
    return values.squeeze(-1) if values.dim() > 1 and values.shape[-1] == 1 else values


def sparse_categorical_accuracy(y_true: Any, y_pred: Any) -> torch.Tensor:
    """Keras's function: 1.0 where the argmax of y_pred [batch, ..., classes] is the class id
    y_true [batch, ...] (a trailing dim of 1 squeezed), one value per example (per position)."""
    return _sparse_categorical_matches(y_true, y_pred).to(torch.float32)


def _sparse_categorical_matches(y_true: Any, y_pred: Any) -> torch.Tensor:
    pred = to_tensor(y_pred, "y_pred")
    true = to_tensor(y_true, "y_true", pred.device)
    ids = true.squeeze(-1) if true.dim() == pred.dim() and true.dim() > 0 else true
    if pred.dim() < 2 or ids.shape != pred.shape[:-1]:
        raise ValueError(
            f"sparse_categorical_accuracy: y_true has shape {shape_of(true)} and y_pred "
            f"{shape_of(pred)}; expected y_pred [batch, ..., classes] and y_true of class ids "
            "shaped like y_pred without its last dim (or with a last dim of 1)"
        )
    return _squeeze_trailing_one(pred.argmax(dim=-1) == ids)


def categorical_accuracy(y_true: Any, y_pred: Any) -> torch.Tensor:
    """Keras's function: 1.0 where y_true and y_pred, both [batch, ..., classes], have their
    argmax in common."""
    return _categorical_matches(y_true, y_pred).to(torch.float32)


def _categorical_matches(y_true: Any, y_pred: Any) -> torch.Tensor:
    pred = to_tensor(y_pred, "y_pred")
    true = to_tensor(y_true, "y_true", pred.device)
    if pred.dim() < 2 or true.shape != pred.shape:
        raise ValueError(
            f"categorical_accuracy: y_true has shape {shape_of(true)} and y_pred {shape_of(pred)}; "
            "expected both [batch, ..., classes] (one-hot targets; for class ids use "
            "sparse_categorical_accuracy)"
        )
    return _squeeze_trailing_one(pred.argmax(dim=-1) == true.argmax(dim=-1))


def binary_accuracy(y_true: Any, y_pred: Any, threshold: float = 0.5) -> torch.Tensor:
    """Keras's function: 1.0 where (y_pred > threshold) equals y_true, elementwise over one shape
    (a trailing dim of 1 aligned as Keras does)."""
    return _binary_matches(y_true, y_pred, threshold).to(torch.float32)


def _binary_matches(y_true: Any, y_pred: Any, threshold: float = 0.5) -> torch.Tensor:
    true_aligned, pred_aligned = aligned_pair("binary_accuracy", y_true, y_pred)
    return _squeeze_trailing_one((pred_aligned > threshold).to(true_aligned.dtype) == true_aligned)


class SparseCategoricalAccuracy(MeanMetricWrapper):
    """How often the argmax of y_pred (logits or probabilities) is the class id in y_true."""

    def __init__(self, name: str = "sparse_categorical_accuracy") -> None:
        super().__init__(sparse_categorical_accuracy, name)

    def _values(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        return _sparse_categorical_matches(y_true, y_pred)


class CategoricalAccuracy(MeanMetricWrapper):
    """How often the argmax of y_pred is the argmax of the one-hot y_true."""

    def __init__(self, name: str = "categorical_accuracy") -> None:
        super().__init__(categorical_accuracy, name)

    def _values(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        return _categorical_matches(y_true, y_pred)


class BinaryAccuracy(MeanMetricWrapper):
    """How often (y_pred > threshold) equals y_true; ``threshold`` applies to y_pred as given
    (0.0 for logits)."""

    def __init__(self, name: str = "binary_accuracy", threshold: float = 0.5) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise TypeError(f"threshold={threshold!r}: expected a float")
        self.threshold = float(threshold)
        super().__init__(self._matches, name)

    def _matches(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        return binary_accuracy(y_true, y_pred, self.threshold)

    def _values(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        return _binary_matches(y_true, y_pred, self.threshold)


_EXACT = torch.float64  # regression metrics compute their values in float64 too


def _squared_error(y_true: Any, y_pred: Any) -> torch.Tensor:
    return squared_error(*same_shape_pair("mean_squared_error", y_true, y_pred, _EXACT))


def _absolute_error(y_true: Any, y_pred: Any) -> torch.Tensor:
    return absolute_error(*same_shape_pair("mean_absolute_error", y_true, y_pred, _EXACT))


class MeanSquaredError(MeanMetricWrapper):
    """Mean of the squared error, averaged over the last dim per example as Keras does."""

    def __init__(self, name: str = "mean_squared_error") -> None:
        super().__init__(_squared_error, name)


class MeanAbsoluteError(MeanMetricWrapper):
    """Mean of the absolute error, averaged over the last dim per example as Keras does."""

    def __init__(self, name: str = "mean_absolute_error") -> None:
        super().__init__(_absolute_error, name)


# Each kind's matches, as booleans.
_ACCURACY_KINDS: dict[str, Callable[[Any, Any], torch.Tensor]] = {
    "binary": _binary_matches,
    "sparse_categorical": _sparse_categorical_matches,
    "categorical": _categorical_matches,
}


def _accuracy_kind(y_true: torch.Tensor, y_pred: torch.Tensor) -> str:
    """Keras's choice for "accuracy" from shapes (``is_binary_or_sparse_categorical``): binary
    when y_pred's last dim is 1, sparse categorical when y_true has a dim fewer or a last dim of
    1, categorical otherwise."""
    if y_pred.dim() <= 1 or y_pred.shape[-1] == 1:
        return "binary"
    if y_true.dim() < y_pred.dim() or y_true.shape[-1] == 1:
        return "sparse_categorical"
    return "categorical"


class AutoAccuracy(_WeightedMean):
    """The "accuracy" of a loss that does not say which kind: binary (threshold 0.5), sparse
    categorical or categorical, chosen from the shapes of the first batch (``_accuracy_kind``)
    and kept. Not Keras's ``Accuracy``, which counts exact equality of y_true and y_pred."""

    def __init__(self, name: str = "accuracy") -> None:
        super().__init__(name)
        self.kind: str | None = None

    def batch_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        if self.kind is None:
            pred = to_tensor(y_pred, "y_pred")
            # Replica threads racing here all pick the same kind from the same shapes.
            self.kind = _accuracy_kind(to_tensor(y_true, "y_true", pred.device), pred)
        with torch.no_grad():
            return _mean_state(_ACCURACY_KINDS[self.kind](y_true, y_pred), sample_weight)


def _accuracy_for(loss: Any, name: str) -> Metric:
    if isinstance(loss, str):
        loss = losses.get(loss)
    if isinstance(loss, losses.SparseCategoricalCrossentropy):
        return SparseCategoricalAccuracy(name=name)
    if isinstance(loss, losses.CategoricalCrossentropy):
        return CategoricalAccuracy(name=name)
    if isinstance(loss, losses.BinaryCrossentropy):
        return BinaryAccuracy(name=name, threshold=0.0 if loss.from_logits else 0.5)
    return AutoAccuracy(name=name)


_METRICS: dict[str, Callable[[str], Metric]] = {
    "accuracy": lambda name: AutoAccuracy(name),
    "acc": lambda name: AutoAccuracy(name),
    "sparse_categorical_accuracy": SparseCategoricalAccuracy,
    "categorical_accuracy": CategoricalAccuracy,
    "binary_accuracy": BinaryAccuracy,
    "mean_absolute_error": MeanAbsoluteError,
    "mae": MeanAbsoluteError,
    "mean_squared_error": MeanSquaredError,
    "mse": MeanSquaredError,
}


def get(identifier: Metric | str | Callable[..., Any] | type[Metric], loss: Any = None) -> Metric:
    """The metric for ``compile(metrics=[...])``: a Metric as is, a Metric class instantiated, a
    Keras name (any case; the metric is named by the string given, as Keras logs it), or a
    function fn(y_true, y_pred) returning one value per example, wrapped. "accuracy" / "acc"
    follow the compiled ``loss`` (a mirrored.losses object or name): sparse categorical,
    categorical or binary (threshold 0 on logits), else decided from the first batch's shapes."""
    if isinstance(identifier, Metric):
        return identifier
    if isinstance(identifier, type) and issubclass(identifier, Metric):
        return identifier()
    if isinstance(identifier, str):
        key = name_key(identifier)
        if key in ("accuracy", "acc"):
            return _accuracy_for(loss, identifier)
        for name, factory in _METRICS.items():
            if name_key(name) == key:
                return factory(identifier)
        raise ValueError(
            f"metric {identifier!r} is not a known metric; known names: {', '.join(_METRICS)} "
            "(or pass a mirrored.metrics.Metric, or a function fn(y_true, y_pred) returning one "
            "value per example)"
        )
    if callable(identifier):
        return MeanMetricWrapper(identifier)
    raise TypeError(
        f"metric {identifier!r}: expected a metric name ({', '.join(_METRICS)}), a "
        "mirrored.metrics.Metric, or a function fn(y_true, y_pred) returning one value per example"
    )
