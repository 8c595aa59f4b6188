"""Values that live on several replicas, reduce operations, and nested-structure helpers.

A ``PerReplica`` holds one value per replica (a shard of a batch, a per-replica loss); it is what
``strategy.run`` takes and returns. Nested structures (tuples, lists, dicts, namedtuples) of them
are handled leaf by leaf, as in ``tf.nest``.
"""

from __future__ import annotations

import copy
import enum
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mirrored._torch_internals import tensor_bytes

__all__ = [
    "PerReplica",
    "ReduceOp",
    "VariableAggregation",
    "fingerprint",
    "flatten",
    "map_structure",
]


class ReduceOp(enum.Enum):
    """How values of the replicas are combined."""

    SUM = "sum"
    MEAN = "mean"

    @classmethod
    def of(cls, op: ReduceOp | str) -> ReduceOp:
        """Accept a ReduceOp or its name ("sum", "mean", any case)."""
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str) and op.lower() in ("sum", "mean"):
            return cls(op.lower())
        raise ValueError(f"reduce_op={op!r}: expected ReduceOp.SUM, ReduceOp.MEAN, 'sum' or 'mean'")


class VariableAggregation(enum.Enum):
    """How the replicas' differing copies of a value are combined (TensorFlow's
    ``tf.VariableAggregation``): NONE means they may not differ."""

    NONE = "none"
    SUM = "sum"
    MEAN = "mean"
    ONLY_FIRST_REPLICA = "only_first_replica"

    @classmethod
    def of(cls, value: VariableAggregation | str) -> VariableAggregation:
        """Accept a VariableAggregation or its name (any case)."""
        if isinstance(value, VariableAggregation):
            return value
        if isinstance(value, str) and value.lower() in cls._value2member_map_:
            return cls(value.lower())
        names = ", ".join(repr(a.value) for a in cls)
        raise ValueError(f"aggregation={value!r}: expected a VariableAggregation or one of {names}")


class PerReplica:
    """One value per replica, in replica order."""

    __slots__ = ("values",)

    def __init__(self, values: Sequence[Any]) -> None:
        self.values = tuple(values)

    def __len__(self) -> int:
        return len(self.values)

    def __repr__(self) -> str:
        inner = ",\n  ".join(f"{i}: {v!r}" for i, v in enumerate(self.values))
        return f"PerReplica({{\n  {inner}\n}})"


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


# Types that are always leaves, told apart by one lookup (every step maps its arguments several
# times: a batch's tensors and the step's numbers, None and small objects).
_PLAIN_LEAVES = frozenset({torch.Tensor, int, float, bool, str, type(None), PerReplica})


def map_structure(fn: Callable[..., Any], *structures: Any) -> Any:
    """Apply ``fn`` to the leaves of same-shaped nested structures, keeping the shape."""
    first = structures[0]
    kind = type(first)
    if kind in _PLAIN_LEAVES:
        return fn(*structures)
    if kind is list or kind is tuple:
        if len(structures) == 1:
            return kind([map_structure(fn, part) for part in first])
        return kind([map_structure(fn, *parts) for parts in zip(*structures, strict=True)])
    if isinstance(first, torch.Tensor):  # tensor subclasses (nn.Parameter, ...)
        return fn(*structures)
    if isinstance(first, dict):
        pairs = [(k, map_structure(fn, *(s[k] for s in structures))) for k in first]
        if type(first) is dict:
            return dict(pairs)
        result = copy.copy(first)  # dict subclasses (defaultdict, OrderedDict) keep their type
        result.clear()
        result.update(pairs)
        return result
    if isinstance(first, torch.Size):  # a shape is one value, as TensorFlow's TensorShape
        return fn(*structures)
    if _is_namedtuple(first):
        return type(first)(*(map_structure(fn, *parts) for parts in zip(*structures, strict=True)))
    if isinstance(first, (list, tuple)):
        return type(first)(map_structure(fn, *parts) for parts in zip(*structures, strict=True))
    return fn(*structures)


def flatten(structure: Any) -> list[Any]:
    """The leaves of a nested structure, in ``map_structure`` order."""
    leaves: list[Any] = []
    map_structure(leaves.append, structure)
    return leaves


def fingerprint(structure: Any) -> int:
    """A checksum of the tensors of ``structure`` (their shapes and bytes, in order): equal on
    two processes when they hold the same values, so that workers can compare a batch or a
    restored state with one small collective."""
    checksum = 0
    for leaf in flatten(structure):
        if isinstance(leaf, torch.Tensor):
            data = tensor_bytes(leaf.cpu())
            checksum = zlib.crc32(f"{tuple(leaf.shape)} {leaf.dtype}".encode(), checksum)
            checksum = zlib.crc32(data.numpy().tobytes(), checksum)
    return checksum


def select_replica(replica_id: int, structure: Any) -> Any:
    """The structure as replica ``replica_id`` sees it: PerReplica leaves replaced by its part."""
    return map_structure(
        lambda v: v.values[replica_id] if isinstance(v, PerReplica) else v, structure
    )


def regroup(per_replica_structures: Sequence[Any]) -> Any:
    """Turn a list of per-replica structures into one structure of PerReplica leaves.

    Leaves that are the very same object on every replica are passed through unwrapped.
    """

    def combine(*leaves: Any) -> Any:
        if all(leaf is leaves[0] for leaf in leaves):
            return leaves[0]
        return PerReplica(leaves)

    if len(per_replica_structures) == 1:
        return per_replica_structures[0]
    return map_structure(combine, *per_replica_structures)
