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

import operator
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from mirrored._torch_internals import overload_packet, tree_unflatten
from mirrored.core.trace_recording import HostCall
from mirrored.tracing.capture import Capture
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
    return split_module(graph, graph, lambda node: parts[node], keep_original_order=True)


def _scripted(piece: fx.GraphModule) -> nn.Module:
    """``piece`` run by TorchScript where it can be (its ops on the CPU only), else itself."""
    devices = {
        v.device
        for n in piece.graph.nodes
        for v in [n.meta.get("val")]
        if isinstance(v, torch.Tensor)
    } | {t.device for t in piece.state_dict(keep_vars=True).values()}
    if any(d.type != "cpu" for d in devices):
        return piece
    script_form = fx.GraphModule(piece, piece.graph)
    for node in script_form.graph.nodes:
        node.target = overload_packet(node.target)
    script_form.recompile()
    try:
        # warnings' filters are process-wide: one replica scripts at a time.
        with _scripting, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit's deprecation, type-annotation notes
            return torch.jit.script(script_form)
    except Exception:  # an op or argument TorchScript does not take: the FX code runs it
        return piece


class Replay:
    """A captured step, ready to run again on new tensors of the same signature."""

    def __init__(self, capture: Capture) -> None:
        self._capture = capture
        cut = _cut(capture.graph)
        scripted = False
        for name, piece in list(cut.named_children()):
            assert isinstance(piece, fx.GraphModule)
            host = next((n for n in piece.graph.nodes if n.target is HOST_CALL), None)
            run: Callable[..., Any]
            if host is not None:
                run = _HostPiece(piece, capture.host_calls[host.args[0]])
            else:
                ready = _scripted(piece)
                scripted = scripted or isinstance(ready, torch.jit.ScriptModule)
                run = ready.forward  # no module call around it: the glue calls it each step
            # The glue's code reads ``self.<name>``: an attribute, not a submodule, now.
            del cut._modules[name]
            object.__setattr__(cut, name, run)
        self._cut = cut
        self.scripted = scripted
        """Whether TorchScript runs any piece (else the graph's Python code runs them all)."""

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
            with torch.no_grad():
                results = self._cut.forward(*tensors)
        finally:
            capture.inputs.tensors = []
        if isinstance(results, torch.Tensor):
            results = [results]
        values = iter(results)
        leaves = [next(values) if c is None else c for c in capture.output_leaves]
        return tree_unflatten(leaves, capture.output_spec)
