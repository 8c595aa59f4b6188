"""Every private name of torch that traced steps (:mod:`mirrored.tracing`) reach: fake tensors,
ATen overloads and their schemas, TorchScript's resolved ops, torch's pytrees, the dispatch
modes of a trace. Kept apart from :mod:`mirrored._torch_internals` as
:mod:`mirrored._torch_distributed` is, each name here with the reason it is needed."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode  # a mode that sees every ATen op

__all__ = [
    "TorchDispatchMode",
    "is_fake",
    "key_path_name",
    "outside_dispatch_modes",
    "overload_keywords",
    "overload_packet",
    "overload_schema",
    "script_schemas",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_unflatten",
]


def is_fake(tensor: Any) -> bool:
    """A fake tensor (shapes and dtypes, no data): what a step being traced computes with."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def overload_packet(target: Any) -> Any:
    """An ATen op overload's packet (``aten.add.Tensor`` -> ``aten.add``), which TorchScript
    resolves by its arguments' types; any other target as it is."""
    from torch._ops import OpOverload

    return target.overloadpacket if isinstance(target, OpOverload) else target


def overload_schema(target: Any) -> str | None:
    """An ATen op overload's schema as text (``aten::view.dtype(Tensor(a) self, ...)``); None
    for any other target."""
    from torch._ops import OpOverload

    return str(target._schema) if isinstance(target, OpOverload) else None


def overload_keywords(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """An ATen op overload's arguments, each by its schema's name for it."""
    names = [argument.name for argument in target._schema.arguments]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def script_schemas(scripted: Any) -> list[str]:
    """The schemas of the ATen ops a scripted module's ``forward`` calls, in order: which
    overloads TorchScript resolved."""
    return [
        str(node.schema())
        for node in scripted.forward.graph.nodes()
        if node.kind().startswith("aten::")
    ]


def tree_flatten_with_path(tree: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """torch's pytree flattening of ``tree`` with each leaf's path, and the tree's spec."""
    from torch.utils import _pytree

    return _pytree.tree_flatten_with_path(tree)


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    from torch.utils import _pytree

    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    from torch.utils import _pytree

    return _pytree.tree_unflatten(leaves, spec)


def key_path_name(path: Any) -> str:
    """A pytree leaf's path as Python would index it (``[0]['x']``)."""
    from torch.utils import _pytree

    return _pytree.keystr(path)


def outside_dispatch_modes() -> AbstractContextManager[Any]:
    """Real tensors and real kernels inside a step being traced: no dispatch mode (the
    tracer's, fake tensors', the trace's own) while the block runs."""
    from contextlib import ExitStack

    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
    from torch.utils._python_dispatch import _disable_current_modes

    stack = ExitStack()
    stack.enter_context(_disable_current_modes())  # the trace's own (mirrored's undoing mode)
    stack.enter_context(disable_proxy_modes_tracing())
    stack.enter_context(unset_fake_temporarily())
    return stack
