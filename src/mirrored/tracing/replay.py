"""Replaying a captured step: the graph cut at its host calls, the pieces between them run by
TorchScript's interpreter, the host calls by Python.

TorchScript runs a piece's ops one after the other in C++, without the GIL: the replicas'
threads replay at once, and no op pays Python's dispatch, a module's call, autograd's recording
or the replicas' torch-function mode (the graph computes the gradients itself; the random ops
in it already name the replica's generators). The kernels are the ones the step calls eagerly,
so a replay gives the eager step's values. A piece TorchScript cannot take, and every piece on
a device other than the CPU, runs as the graph's Python code instead: the same ops, with
Python's dispatch per op.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import operator
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from mirrored._torch_tracing import (
    overload_keywords,
    overload_packet,
    overload_schema,
    script_schemas,
    tree_unflatten,
)
from mirrored.core.trace_recording import HostCall
from mirrored.tracing.capture import GRAPH_OUTPUT, Capture
from mirrored.tracing.host_op import HOST_CALL

__all__ = ["Replay"]

_scripting = threading.Lock()


class _HostPiece:
    """A piece of the cut graph that is one host call: called directly."""

    def __init__(self, piece: fx.GraphModule, run: HostCall) -> None:
        nodes = list(piece.graph.nodes)
        self._placeholders = [n for n in nodes if n.op == "placeholder"]
        call = next(n for n in nodes if n.target is HOST_CALL)
        self._tensor_args = list(call.args[1])
        result = next(n for n in nodes if n.op == "output").args[0]
        self._single = isinstance(result, fx.Node)
        picks = [result] if self._single else list(result or ())
        self._indices = [n.args[1] for n in picks]
        self._run = run

    def __call__(self, *values: Any) -> Any:
        given = dict(zip(self._placeholders, values, strict=True))
        tensors = [given[a] if isinstance(a, fx.Node) else a for a in self._tensor_args]
        out = list(self._run(tensors) or ())
        picked = [out[i] for i in self._indices]
        return picked[0] if self._single else tuple(picked)


def _is_host(node: fx.Node) -> bool:
    if node.target is HOST_CALL:
        return True
    return (
        node.target is operator.getitem
        and isinstance(node.args[0], fx.Node)
        and node.args[0].target is HOST_CALL
    )


def _cut(graph: fx.GraphModule) -> fx.GraphModule:
    """``graph`` as a sequence of pieces: one per host call, one per run of ops between."""
    part = 0
    parts: dict[fx.Node, int] = {}
    for node in graph.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.target is HOST_CALL:
            part += 1
            parts[node] = part
            part += 1
        elif _is_host(node):
            parts[node] = parts[node.args[0]]
        else:
            parts[node] = part
    cut = split_module(graph, graph, lambda node: parts[node], keep_original_order=True)
    _constants_inside(cut)
    return cut


def _constants_inside(cut: fx.GraphModule) -> None:
    """``split_module`` hands every piece its constants (parameters, buffers, generators) as
    arguments: each piece between host calls gets them as attributes of its own instead, so
    that the glue passes fewer values and TorchScript knows a generator for one."""
    for call in cut.graph.nodes:
        if call.op != "call_module":
            continue
        piece = getattr(cut, call.target)
        if any(n.target is HOST_CALL for n in piece.graph.nodes):
            continue
        placeholders = [n for n in piece.graph.nodes if n.op == "placeholder"]
        kept = []
        for placeholder, given in zip(placeholders, call.args, strict=True):
            if not (isinstance(given, fx.Node) and given.op == "get_attr"):
                kept.append(given)
                continue
            _hold(piece, placeholder.name, getattr(cut, str(given.target)))
            with piece.graph.inserting_before(placeholder):
                # create_node: Graph.get_attr warns about a generator, a plain attribute
                held = piece.graph.create_node("get_attr", placeholder.name)
                placeholder.replace_all_uses_with(held)
            piece.graph.erase_node(placeholder)
        call.args = tuple(kept)
        piece.recompile()
    for node in list(cut.graph.nodes):  # not dead-code elimination: host calls return nothing
        if node.op == "get_attr" and not node.users:
            cut.graph.erase_node(node)
    cut.recompile()


def _hold(piece: nn.Module, name: str, value: Any) -> None:
    """``value`` as ``piece.<name>``: a parameter, a buffer (the tensor itself, not a copy), or
    a plain attribute."""
    if isinstance(value, nn.Parameter):
        piece.register_parameter(name, value)
    elif isinstance(value, torch.Tensor):
        piece.register_buffer(name, value, persistent=False)
    else:
        setattr(piece, name, value)


def _scripted(piece: fx.GraphModule) -> nn.Module:
    """``piece`` run by TorchScript where it can be (its ops on the CPU only) and calls the very
    overloads the trace recorded, else itself."""
    devices = {
        v.device
        for n in piece.graph.nodes
        for v in [n.meta.get("val")]
        if isinstance(v, torch.Tensor)
    } | {t.device for t in piece.state_dict(keep_vars=True).values()}
    if any(d.type != "cpu" for d in devices):
        return piece
    script_form = fx.GraphModule(piece, copy.deepcopy(piece.graph))  # the piece keeps its own
    # Ops whose results nothing uses (and that write nothing) TorchScript drops: so here too.
    script_form.graph.eliminate_dead_code()
    recorded = []
    for node in script_form.graph.nodes:
        schema = overload_schema(node.target)
        if schema is None:
            continue
        recorded.append(schema)
        # By name, each argument: TorchScript picks an overload by its arguments' types, and
        # a dtype is an int there (aten.view(x, torch.int32) would be a view of shape [3]).
        node.args, node.kwargs = (), overload_keywords(node.target, node.args, node.kwargs)
        node.target = overload_packet(node.target)
    script_form.recompile()
    try:
        # warnings' filters are process-wide: one replica scripts at a time.
        with _scripting, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit's deprecation, type-annotation notes
            scripted = torch.jit.script(script_form)
    except Exception:  # an op or argument TorchScript does not take: the FX code runs it
        return piece
    # TorchScript adds ops of its own around the recorded ones (a list's __getitem__ for an op
    # that returns several tensors): only ops of the names the trace recorded are compared.
    names = {_op_name(schema) for schema in recorded}
    resolved = [schema for schema in script_schemas(scripted) if _op_name(schema) in names]
    same = len(resolved) == len(recorded) and all(map(_same_overload, recorded, resolved))
    return scripted if same else piece


# Overloads that differ only in whether an argument is a tensor or a number: the trace records
# ``div.Tensor(x, 8)`` (a number wrapped as a tensor), TorchScript calls ``div.Scalar``; ATen
# computes both alike.
_TENSOR_OR_NUMBER = {"Tensor", "Scalar", "Tensor_Scalar", "Tensor_Tensor", "Scalar_Tensor"}


def _same_overload(recorded: str, resolved: str) -> bool:
    """Whether TorchScript resolved the call the trace recorded as ``recorded`` to it."""
    if recorded == resolved:
        return True
    names = [schema.split("(", 1)[0].partition(".") for schema in (recorded, resolved)]
    (op, _, overload), (other_op, _, other_overload) = names
    # TorchScript's twin of an op taking a list of optional tensors takes plain tensors.
    other_overload = other_overload.removesuffix("_hacked_twin")
    if op == other_op and overload == other_overload:
        return True
    return op == other_op and {overload, other_overload} <= _TENSOR_OR_NUMBER


def _op_name(schema: str) -> str:
    """``aten::view`` of ``aten::view.dtype(Tensor(a) self, ...)``."""
    return schema.split("(", 1)[0].partition(".")[0]


def _without_autocast() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for kind in ("cpu", "cuda"):
        if torch.is_autocast_enabled(kind):
            stack.enter_context(torch.autocast(kind, enabled=False))
    return stack


class Replay:
    """A captured step, ready to run again on new tensors of the same signature."""

    def __init__(self, capture: Capture) -> None:
        # The whole graph (with its fake tensors) is not kept: only what a replay needs.
        assert capture.graph is not None
        cut = _cut(capture.graph)
        self._capture = dataclasses.replace(capture, graph=None)
        scripted = True
        for name, piece in list(cut.named_children()):
            assert isinstance(piece, fx.GraphModule)
            host = next((n for n in piece.graph.nodes if n.target is HOST_CALL), None)
            run: Callable[..., Any]
            if host is not None:
                run = _HostPiece(piece, capture.host_calls[host.args[0]])
            else:
                ready = _scripted(piece)
                scripted = scripted and isinstance(ready, torch.jit.ScriptModule)
                run = ready.forward  # no module call around it: the glue calls it each step
            # The glue's code reads ``self.<name>``: an attribute, not a submodule, now.
            del cut._modules[name]
            object.__setattr__(cut, name, run)
        self._cut = cut
        self.scripted = scripted
        """Whether TorchScript runs every piece between host calls (else some run as the
        graph's Python code)."""

    @property
    def called_modules(self) -> list[nn.Module]:
        """Every module the step called while it traced."""
        return self._capture.called_modules

    @property
    def drawn_devices(self) -> tuple[torch.device, ...]:
        """The devices whose replica generators the graph draws from."""
        return self._capture.drawn_devices

    def __call__(self, tensors: list[torch.Tensor], prepare: Callable[[], None]) -> Any:
        """The step's result on ``tensors``; ``prepare`` first readies the random streams."""
        capture = self._capture
        prepare()
        capture.inputs.tensors = tensors
        try:
            # The graph holds the casts autocast made while tracing (autocast is part of the
            # signature): autocast applied again to the replayed ops would cast twice.
            with torch.no_grad(), _without_autocast():
                results = self._cut.forward(*tensors)
        finally:
            capture.inputs.tensors = []
        if isinstance(results, torch.Tensor):
            results = [results]
        values = iter(results)
        leaves = [next(values) if c is GRAPH_OUTPUT else c for c in capture.output_leaves]
        return tree_unflatten(leaves, capture.output_spec)
