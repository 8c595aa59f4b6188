"""Recording one replica's step as a graph of tensor ops, without running it.

The step runs once under ``make_fx`` on fake tensors: no kernel runs and no state changes. Its
tensor ops become the graph, with the parameters and buffers it reads held by reference (a
replay reads their values then). What acts on real state becomes a host call
(:mod:`mirrored.core.trace_recording`): ``loss.backward()`` is recorded as the gradients'
computation in the graph followed by a host call that hands them to the gradient reducer in one
call, or, where only an autograd pass does what eager backward does, to autograd's accumulation
(so ``.grad``, gradient hooks and the gradient reducer see what eager backward gives them);
mirrored optimizers' ``step()`` and ``zero_grad()`` and gradient clipping record themselves.

What a trace cannot replay exactly raises :class:`TraceUnsupported`: a value read on the host
(``.item()``, a branch on a tensor), ``.grad`` read or set outside those calls (a torch
optimizer's ``step()``, clipping or unscaling by hand: each replica's parameters carry stand-in
gradients while the trace records, and a graph that reads one, or a step that replaces one, is
refused), a collective, a random op that only
torch's global generator can serve, a second derivative.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode

from mirrored._torch_internals import disable_torch_function
from mirrored._torch_tracing import (
    TorchDispatchMode,
    is_fake,
    outside_dispatch_modes,
    tree_flatten,
    tree_unflatten,
)
from mirrored.core.context import current_replica_context
from mirrored.core.trace_recording import HostCall, ResultSpec, TraceUnsupported, set_recording
from mirrored.random.activation_checkpoint import entered_streams
from mirrored.replication.global_batch_loss import check_loss_scaling
from mirrored.replication.gradient_reducer import hand_over
from mirrored.replication.outside_edits import has_program_hooks, program_hooks_suspended
from mirrored.tracing.host_op import HOST_CALL, fake_results, forget_fake_results

__all__ = ["GRAPH_OUTPUT", "CallInputs", "Capture", "capture"]

_keys = itertools.count()
GRAPH_OUTPUT = object()  # in a step's result, the place of a tensor the graph computes
# torch.fx's tracer keeps global state: one trace at a time in the process (replicas trace at
# once on their first call).
_tracing = threading.Lock()


@dataclasses.dataclass
class CallInputs:
    """The tensors of the call being replayed (host calls that accumulate into an input's
    ``.grad`` find it here)."""

    tensors: list[torch.Tensor] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Capture:
    """One replica's step as a graph: ``graph`` takes the call's tensors in order and returns
    the step's tensor results; ``host_calls`` by key; the rest rebuilds the result."""

    graph: fx.GraphModule | None  # None once a replay is built from it
    host_calls: dict[int, HostCall]
    inputs: CallInputs
    output_spec: Any  # torch pytree spec of the result
    output_leaves: list[Any]  # GRAPH_OUTPUT where a graph output goes, else the constant itself
    drawn_devices: tuple[torch.device, ...]
    called_modules: list[nn.Module]  # every module the step called (their flags are read)


def _stand_in(param: torch.Tensor) -> torch.Tensor:
    """A ``.grad`` for ``param`` while a trace records (uninitialised, a gradient's size for the
    trace's moment, as the first backward would allocate): a graph that reads it used a
    gradient outside the host calls."""
    return torch.empty_like(param, memory_format=torch.preserve_format)


_READS_GRAD = (
    "the step uses .grad outside a mirrored optimizer (a torch optimizer's step, unscaling, "
    "or clipping by hand); mirror the optimizer with strategy.mirror() and clip with "
    "torch.nn.utils.clip_grad_norm_"
)
_SETS_GRAD = (
    "the step sets .grad outside a mirrored optimizer (a torch optimizer's zero_grad(), or an "
    "assignment); call zero_grad() on the mirrored optimizer or module"
)


def _check_gradients_untouched(
    graph: fx.GraphModule, params: Sequence[torch.Tensor], stand_ins: Sequence[torch.Tensor]
) -> None:
    if any(p.grad is not s for p, s in zip(params, stand_ins, strict=True)):
        raise TraceUnsupported(_SETS_GRAD)
    held = {id(s) for s in stand_ins}
    for node in graph.graph.nodes:
        if node.op == "get_attr" and id(getattr(graph, node.target, None)) in held:
            raise TraceUnsupported(_READS_GRAD)


class _Recorder(TorchFunctionMode):
    """Records host calls, and ``backward()`` as gradients plus a host call."""

    def __init__(self, inputs: CallInputs, params: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.host_calls: dict[int, HostCall] = {}
        self.fake_inputs: dict[int, int] = {}  # id of a traced input -> its position
        self.inputs = inputs
        self._params = {id(p) for p in params}  # the replica's: their .grad has stand-ins

    def host_call(
        self,
        run: HostCall,
        tensors: Sequence[torch.Tensor] = (),
        results: Sequence[ResultSpec] = (),
    ) -> list[torch.Tensor]:
        key = next(_keys)
        self.host_calls[key] = run
        fake_results(key, list(results))
        return list(HOST_CALL(key, list(tensors)))

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            given = inspect.signature(func).bind(*args, **kwargs).arguments
            self._backward(
                given.get("self", given.get("tensors")),
                given.get("gradient", given.get("grad_tensors")),
                given.get("retain_graph"),
                bool(given.get("create_graph", False)),
                given.get("inputs"),
            )
            return None
        return func(*args, **kwargs)

    def _backward(
        self,
        roots: Any,
        gradient: Any,
        retain_graph: bool | None,
        create_graph: bool,
        inputs: Any,
    ) -> None:
        if create_graph:
            raise TraceUnsupported("backward(create_graph=True) takes a second derivative")
        roots = (roots,) if isinstance(roots, torch.Tensor) else tuple(roots)
        if gradient is not None:
            gradient = (gradient,) if isinstance(gradient, torch.Tensor) else tuple(gradient)
        replica = current_replica_context()
        if replica is not None and entered_streams():
            check_loss_scaling(roots, replica)  # as eager backward does with several replicas
        if inputs is None:
            leaves = _leaves_of(roots)
        else:  # a tensor given twice accumulates once, as in eager backward
            given = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
            leaves = list({id(leaf): leaf for leaf in given}.values())
        # The program's hooks on the leaves run at the replay's accumulation, not in the graph.
        with program_hooks_suspended([leaf for leaf in leaves if not is_fake(leaf)]):
            grads = torch.autograd.grad(
                roots, leaves, gradient, retain_graph=retain_graph, allow_unused=True
            )
        used = [(leaf, grad) for leaf, grad in zip(leaves, grads, strict=True) if grad is not None]
        targets = [self._target(leaf) for leaf, _ in used]
        call_inputs = self.inputs

        def accumulate(tensors: list[torch.Tensor]) -> None:
            leaves_now = [call_inputs.tensors[t] if isinstance(t, int) else t for t in targets]
            _accumulate(leaves_now, tensors)

        self.host_call(accumulate, [grad for _, grad in used])

    def _target(self, leaf: torch.Tensor) -> torch.Tensor | int:
        """Where a leaf's gradient goes at replay: an input's position, or the tensor itself."""
        position = self.fake_inputs.get(id(leaf))
        if position is not None:
            return position
        if is_fake(leaf):
            raise TraceUnsupported(
                "backward() accumulates into a tensor made inside the step (requires_grad=True "
                "on a new tensor); make it outside the step, or use torch.autograd.grad"
            )
        if id(leaf) not in self._params:
            raise TraceUnsupported(
                f"backward() accumulates into a tensor of shape {tuple(leaf.shape)} that is no "
                "parameter of a mirrored module (its .grad is read and set by the program, "
                "where a trace cannot follow it); mirror the module that holds it"
            )
        return leaf


def _accumulate(leaves: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """A replay's gradients for ``leaves`` where eager backward would leave them: handed to the
    gradient reducer in one call (``hand_over``), else through autograd's accumulation with the
    leaves' hooks. Eagerly a backward pass runs under the replica's random streams, for the
    random ops in it; with no hook of the program's on the leaves nothing in this one draws,
    and it runs without their routing (a Python call for each op in the reducer's hooks): the
    streams are only told of it, as of any backward pass."""
    streams = entered_streams()
    if not streams or any(has_program_hooks(leaf) for leaf in leaves):
        torch.autograd.backward(leaves, grads)
        return
    observe = streams[-1].on_backward
    if observe is not None:
        observe(tuple(leaves))
    with disable_torch_function():
        if not hand_over(leaves, grads):
            torch.autograd.backward(leaves, grads)


def _leaves_of(roots: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors ``backward()`` from ``roots`` accumulates into, in a fixed order."""
    leaves: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [root.grad_fn for root in reversed(roots)]
    for root in roots:
        if root.grad_fn is None and root.requires_grad:
            leaves.append(root)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in reversed(node.next_functions))
    return leaves


def capture(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    modules: Sequence[nn.Module],
) -> Capture:
    """Trace ``fn(*args, **kwargs)`` on this thread; ``modules``: the replica's mirrored
    modules, whose parameters' ``.grad`` only host calls may use. Raises
    :class:`TraceUnsupported` (or the step's own error) without having changed any state."""
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(flat) if isinstance(leaf, torch.Tensor)]
    inputs = CallInputs()
    recorder = _Recorder(inputs, params)
    writes = _RealWritesUndone()
    outputs: dict[str, Any] = {}

    def flat_fn(*tensors: torch.Tensor) -> list[torch.Tensor]:
        recorder.fake_inputs = {id(t): i for i, t in enumerate(tensors)}
        leaves = list(flat)
        for position, tensor in zip(positions, tensors, strict=True):
            leaves[position] = tensor
        call_args, call_kwargs = tree_unflatten(leaves, spec)
        with recorder, writes:
            result = fn(*call_args, **call_kwargs)
        out_leaves, outputs["spec"] = tree_flatten(result)
        outputs["leaves"] = [GRAPH_OUTPUT if isinstance(o, torch.Tensor) else o for o in out_leaves]
        return [o for o in out_leaves if isinstance(o, torch.Tensor)]

    called: dict[int, nn.Module] = {}
    with _tracing, _modules_kept(modules), _calls_of_modules(called):
        try:
            graph = _trace_under_stand_ins(flat_fn, [flat[i] for i in positions], recorder, params)
        finally:
            writes.undo()
            forget_fake_results(recorder.host_calls)
    streams = entered_streams()
    return Capture(
        called_modules=list(called.values()),
        graph=graph,
        host_calls=recorder.host_calls,
        inputs=inputs,
        output_spec=outputs["spec"],
        output_leaves=outputs["leaves"],
        drawn_devices=streams[-1].drawn_devices() if streams else (),
    )


class _RealWritesUndone(TorchDispatchMode):
    """Fake tensors run an op for real when none of its tensors is fake: an in-place op on
    tensors the step holds from outside (a parameter edited by hand, an EMA, a batch norm's
    ``num_batches_tracked``) would change them while tracing, and again at each replay. This
    keeps a copy of each real tensor an op writes, for :meth:`undo` to put back."""

    def __init__(self) -> None:
        super().__init__()
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.data_dependent_output in func.tags and not any(
            is_fake(t) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)
        ):
            raise TraceUnsupported(
                "the step reads the value of a tensor held outside it (.item(), float(), "
                ".tolist() of a parameter, a buffer, a global), which a replay would not read "
                "again; compute with the tensor instead, or pass the value as an argument"
            )
        schema = func._schema
        if schema.is_mutable:
            for position, argument in enumerate(schema.arguments):
                if argument.alias_info is None or not argument.alias_info.is_write:
                    continue
                value = args[position] if position < len(args) else kwargs.get(argument.name)
                for tensor in value if isinstance(value, (list, tuple)) else [value]:
                    self._keep(tensor)
        return func(*args, **kwargs)

    def _keep(self, tensor: Any) -> None:
        if (
            isinstance(tensor, torch.Tensor)
            and not is_fake(tensor)
            and id(tensor) not in self._saved
        ):
            with outside_dispatch_modes():
                self._saved[id(tensor)] = (tensor, tensor.detach().clone())

    def undo(self) -> None:
        with torch.no_grad():
            for tensor, value in self._saved.values():
                if not torch.equal(tensor, value):
                    tensor.copy_(value)
        self._saved.clear()


@contextlib.contextmanager
def _modules_kept(roots: Sequence[nn.Module]) -> Iterator[None]:
    """A tensor the step computes and stores on a module (a cache built on first use) would be
    a fake tensor left there by the trace, and never stored by a replay: the modules' tensors
    are put back as they were, and the step is refused."""
    modules = list({id(m): m for root in roots for m in root.modules()}.values())
    saved = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers)) for m in modules]
    try:
        yield
    finally:
        stored = any(_holds_fake(m) for m in modules)
        for module, attributes, parameters, buffers in saved if stored else ():
            module.__dict__.update(attributes)
            module._parameters.clear()
            module._parameters.update(parameters)
            module._buffers.clear()
            module._buffers.update(buffers)
    if stored:  # only when the trace itself went through: its own error goes first
        raise TraceUnsupported(
            "the step stores a tensor it computes on a module (a cache built on its first call), "
            "which a replay would not store; run the step once without mirrored.function first"
        )


def _holds_fake(module: nn.Module) -> bool:
    values = [*module.__dict__.values(), *module._parameters.values(), *module._buffers.values()]
    for value in values:
        inner = value.values() if isinstance(value, dict) else value
        items = inner if isinstance(value, (list, tuple, dict)) else [value]
        if any(is_fake(item) for item in items):
            return True
    return False


@contextlib.contextmanager
def _calls_of_modules(called: dict[int, nn.Module]) -> Iterator[None]:
    """Every module the step calls while it traces, into ``called`` (a module the strategy
    does not mirror, a teacher or a loss, is one whose training flag the trace reads)."""

    def record(module: nn.Module, _: Any) -> None:
        called[id(module)] = module

    handle = register_module_forward_pre_hook(record)
    try:
        yield
    finally:
        handle.remove()


def _trace_under_stand_ins(
    flat_fn: Callable[..., Any],
    tensors: list[torch.Tensor],
    recorder: _Recorder,
    params: Sequence[nn.Parameter],
) -> fx.GraphModule:
    saved = [(p, p.grad) for p in params]
    stand_ins = [_stand_in(p) for p in params]
    previous = set_recording(recorder)
    try:
        for p, stand_in in zip(params, stand_ins, strict=True):
            p.grad = stand_in
        graph = make_fx(flat_fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*tensors)
        _check_gradients_untouched(graph, params, stand_ins)
        return graph
    finally:
        set_recording(previous)
        for p, grad in saved:
            p.grad = grad
