"""The replay's TorchScript pieces call the overloads the trace recorded."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from mirrored.tracing.replay import _same_overload


def schema(op: torch._ops.OpOverload) -> str:
    return str(op._schema)


def test_an_overload_that_only_takes_a_number_for_a_tensor_is_the_same() -> None:
    assert _same_overload(schema(torch.ops.aten.div.Tensor), schema(torch.ops.aten.div.Scalar))
    assert _same_overload(schema(torch.ops.aten.add_.Tensor), schema(torch.ops.aten.add_.Scalar))
    twin = torch.ops.aten.index.Tensor_hacked_twin  # indices as Tensor[], not Tensor?[]
    assert _same_overload(schema(torch.ops.aten.index.Tensor), schema(twin))


def test_an_overload_that_means_another_thing_is_not() -> None:
    # aten.view(x, torch.int32) resolved by argument types: a view of shape [3], not of dtype.
    assert not _same_overload(
        schema(torch.ops.aten.view.dtype), schema(torch.ops.aten.view.default)
    )
    assert not _same_overload(schema(torch.ops.aten.add.Tensor), schema(torch.ops.aten.sub.Tensor))
    assert not _same_overload(
        schema(torch.ops.aten.sum.dim_IntList), schema(torch.ops.aten.sum.default)
    )


def test_a_piece_torchscript_would_call_otherwise_runs_as_the_graph_s_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mirrored.tracing import replay

    graph = make_fx(lambda x: (x * 2).sum())(torch.ones(3))
    assert isinstance(replay._scripted(graph), torch.jit.ScriptModule)
    # TorchScript resolving another overload than the trace recorded (simulated): not used.
    monkeypatch.setattr(replay, "script_schemas", lambda _: [schema(torch.ops.aten.sub.Tensor)] * 2)
    assert replay._scripted(graph) is graph
