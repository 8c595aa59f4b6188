"""ReduceOp and the nested-structure helpers."""

from __future__ import annotations

import collections

import pytest
import torch

from mirrored.core.values import (
    PerReplica,
    ReduceOp,
    flatten,
    map_structure,
    regroup,
    select_replica,
)

Point = collections.namedtuple("Point", ["x", "y"])


def test_reduce_op_accepts_enum_and_names():
    assert ReduceOp.of("SUM") is ReduceOp.SUM and ReduceOp.of("mean") is ReduceOp.MEAN
    assert ReduceOp.of(ReduceOp.MEAN) is ReduceOp.MEAN
    with pytest.raises(ValueError, match="reduce_op=3"):
        ReduceOp.of(3)


def test_map_structure_keeps_shape_of_nested_containers():
    structure = {"a": [1, (2, 3)], "b": Point(4, 5)}
    doubled = map_structure(lambda v: v * 2, structure)
    assert doubled == {"a": [2, (4, 6)], "b": Point(8, 10)}
    assert isinstance(doubled["b"], Point)
    assert flatten(structure) == [1, 2, 3, 4, 5]
    assert map_structure(lambda a, b: a + b, [1, 2], [10, 20]) == [11, 22]


def test_regroup_and_select_replica_are_inverse():
    shared = object()
    per_replica = [{"loss": 0, "same": shared}, {"loss": 1, "same": shared}]
    grouped = regroup(per_replica)
    assert isinstance(grouped["loss"], PerReplica) and grouped["loss"].values == (0, 1)
    assert grouped["same"] is shared
    assert [select_replica(i, grouped) for i in range(2)] == per_replica
    assert regroup([7]) == 7
    assert "0: 0" in repr(grouped["loss"])


def test_a_shape_is_one_leaf_so_replicas_may_return_different_shapes():
    shapes = [{"shape": torch.Size([3, 2])}, {"shape": torch.Size([2, 2])}]
    grouped = regroup(shapes)
    assert grouped["shape"].values == (torch.Size([3, 2]), torch.Size([2, 2]))
    assert flatten(torch.Size([3, 2])) == [torch.Size([3, 2])]
