"""``@mirrored.function``: a replica step traced once per replica and input signature, then
replayed, TensorFlow's ``tf.function`` for ``strategy.run``.

Replicas are threads of one process; eagerly, every op of every replica runs its Python (the
module's call, dispatch, autograd's recording, the replicas' random-stream mode) under one GIL.
A traced step runs those once, while tracing; a replay runs the recorded ops without them, in
TorchScript's interpreter, which releases the GIL, so replicas replay at once
(:mod:`mirrored.tracing.replay`).

What a signature is: the structure of the arguments, each tensor's shape, dtype, device and
``requires_grad``, every other argument's value; and, for the replica's mirrored modules, each
submodule's ``training`` flag, each parameter's ``requires_grad`` and which tensors the
modules hold. A new signature traces again (a ragged last batch is one); past
:data:`RETRACE_WARNING` traces of one replica a warning names the argument that keeps changing.

As with ``tf.function``, Python in the step runs while it traces, not at replays: a Python
value the step reads from outside (a global, a counter, an attribute that is not a tensor) is
the one it had then; pass it as an argument, where each new value traces again. Tensor ops on
anything the step reads (parameters, buffers, tensors held outside) read their values at each
replay. What a trace cannot replay exactly (:mod:`mirrored.tracing.capture`) runs as written,
with one warning naming the reason; it is never replayed stale.
"""

from __future__ import annotations

import enum
import functools
import traceback
import types
import warnings
import weakref
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, Protocol, TypeVar, overload, runtime_checkable

import torch
from torch import nn

from mirrored._torch_internals import all_plain, bookkeeping
from mirrored._torch_tracing import key_path_name, tree_flatten, tree_flatten_with_path
from mirrored.core.context import current_replica_context
from mirrored.core.trace_recording import TraceUnsupported
from mirrored.core.user_frames import user_stacklevel
from mirrored.random.activation_checkpoint import entered_streams
from mirrored.tracing.capture import capture
from mirrored.tracing.replay import Replay

__all__ = ["RETRACE_WARNING", "MirrorsModules", "TracedFunction", "function"]

RETRACE_WARNING = 5  # traces of one replica before a warning, as tf.function's

F = TypeVar("F", bound=Callable[..., Any])


class _Eager:
    """A signature that runs as written, and why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


@runtime_checkable
class MirrorsModules(Protocol):
    """A strategy whose replicas are copies of the modules it mirrored (the replicated family):
    the strategies a step traces under."""

    def replica_modules(self, local_replica_id: int) -> list[nn.Module]: ...

    def at_close(self, release: Callable[[], None]) -> None: ...


class _StrategyTraces(dict[int, "_Replica"]):
    """A function's traces on one strategy's replicas, by replica; dropped when the strategy
    closes (they hold its modules, optimizers and their closures)."""

    def release(self) -> None:
        self.clear()


class _Replica:
    """One replica's traces of a function."""

    def __init__(self) -> None:
        self.traces: dict[Hashable, Replay | _Eager] = {}
        # Modules the step calls beyond the mirrored ones (a teacher, a loss with dropout):
        # their flags and tensors are part of the signature from the first trace that met them.
        self.called: dict[int, nn.Module] = {}
        self.last: tuple[Hashable, ...] | None = None  # the last trace's signature


class _Signature:
    """What a trace depends on: ``key`` to look it up, and what changed since another."""

    def __init__(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], modules: list[nn.Module]
    ) -> None:
        leaves, spec = tree_flatten((args, kwargs))
        self.leaves = leaves
        self._given = (args, kwargs)
        # Each read of a tensor's attribute would run the replica's torch-function mode.
        plain = all_plain(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))
        with bookkeeping(plain):
            keys = [_leaf_key(leaf) for leaf in leaves]
            module_keys = tuple(_module_key(module) for module in modules)
        # An argument that is neither a tensor nor a value (a batch in a container torch's
        # pytrees do not open, a mutable object): a trace could neither key nor read it.
        self.refused = next(
            (self._names()[i] for i, key in enumerate(keys) if key is _NOT_A_VALUE), None
        )
        self.parts: tuple[Hashable, ...] = (
            spec,
            tuple(keys),
            _modes(),
            module_keys,
        )
        self.key = hash(self.parts), self.parts

    def _names(self) -> list[str]:
        return [
            "argument " + key_path_name(path[1:])
            for path, _ in tree_flatten_with_path(self._given)[0]
        ]

    def changes_since(self, other: tuple[Hashable, ...]) -> list[str]:
        """The parts that differ from ``other`` (an earlier signature's parts), named."""
        spec, leaves, grad_mode, modules = self.parts
        old_spec, old_leaves, old_grad_mode, old_modules = other
        if spec != old_spec:
            return ["the arguments' structure"]
        assert isinstance(leaves, tuple) and isinstance(old_leaves, tuple)
        changed = [
            name
            for name, new, old in zip(self._names(), leaves, old_leaves, strict=True)
            if new != old
        ]
        if grad_mode != old_grad_mode:
            changed.append("grad mode, inference mode or autocast")
        if modules != old_modules:
            changed.append("the mirrored modules (their training flags, tensors or requires_grad)")
        return changed


def _reason(error: Exception) -> str:
    """Why a trace failed, for a warning: a value read on the host named as such; any other
    error as its first line; each with the step's innermost line it came from."""
    text = str(error)
    blamed = _innermost_outside_libraries(error)
    where = f" ({blamed})" if blamed else ""
    if "data-dependent" in text or "tracing tensor" in text:
        return (
            "the step reads a tensor's value on the host (.item(), .tolist(), a Python branch or "
            f"a shape that depends on values){where}, which a replay could not follow"
        )
    lines = text.splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}{where}"


def _innermost_outside_libraries(error: Exception) -> str | None:
    """``file:line`` of the innermost frame of ``error``'s traceback outside torch and
    mirrored (the program's, or a library's it calls, such as Transformers')."""
    blamed = None
    for frame, line in traceback.walk_tb(error.__traceback__):
        filename = frame.f_code.co_filename
        if not filename.startswith(_LIBRARIES):
            blamed = f"{filename}:{line}"
    return blamed


_LIBRARIES = (str(Path(torch.__file__).parent), str(Path(__file__).parents[1]), "<")


def _called_beyond(state: _Replica, trace: Replay, modules: list[nn.Module]) -> bool:
    """Add the modules ``trace`` called that no mirrored module holds to ``state.called``;
    whether there were new ones."""
    held = {id(m) for root in modules for m in root.modules()}
    new = {
        id(m): m for m in trace.called_modules if id(m) not in held and id(m) not in state.called
    }
    state.called.update(new)
    return bool(new)


def _modes() -> Hashable:
    """The thread's modes a trace bakes in: grad mode, inference mode, autocast (each device
    type's on/off and dtype decide the casts the graph records)."""
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        tuple(
            (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in _AUTOCAST_DEVICES
        ),
    )


_AUTOCAST_DEVICES = ("cpu", "cuda")


# Arguments a trace keys by value; modules, optimizers and functions it keys by identity (held
# by the key, so an identity is never another object's), their Python state read at tracing.
_VALUES = (bool, int, float, complex, str, bytes, type(None), enum.Enum, torch.dtype, torch.device)
_PROGRAM_OBJECTS = (nn.Module, torch.optim.Optimizer, types.FunctionType, types.MethodType)
_NOT_A_VALUE = object()


def _leaf_key(leaf: Any) -> Hashable:
    """A tensor's shape, dtype, device, requires_grad and layout; a value's type and value; a
    module's, an optimizer's or a function's identity; else ``_NOT_A_VALUE``."""
    if isinstance(leaf, torch.Tensor):
        return (leaf.shape, leaf.dtype, leaf.device, leaf.requires_grad, leaf.layout)
    if isinstance(leaf, _VALUES):
        return (type(leaf), leaf)
    if isinstance(leaf, _PROGRAM_OBJECTS) or callable(leaf):
        return (type(leaf), _Held(leaf))
    return _NOT_A_VALUE


class _Held:
    """An object in a trace's key by identity, held so that its id is never another's."""

    def __init__(self, held: object) -> None:
        self.held = held

    def __hash__(self) -> int:
        return id(self.held)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Held) and other.held is self.held


def _module_key(module: nn.Module) -> Hashable:
    """The submodules' training flags, and which tensors they hold with ``requires_grad``."""
    submodules = list(module.modules())
    return (
        tuple(m.training for m in submodules),
        tuple(
            (id(t), t.requires_grad)
            for m in submodules
            for t in (*m._parameters.values(), *m._buffers.values())
            if t is not None
        ),
    )


class TracedFunction:
    """A replica step that traces once per replica and signature and replays after; call it
    where ``fn`` is called (inside ``strategy.run``). Outside a replica of a strategy that
    mirrors modules (``MirroredStrategy`` and the strategies built on it), it runs ``fn``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.python_function = fn
        self._name: str = getattr(fn, "__qualname__", repr(fn))
        functools.update_wrapper(self, fn)
        self._replicas: weakref.WeakKeyDictionary[Any, _StrategyTraces] = (
            weakref.WeakKeyDictionary()
        )
        self._warned: set[str] = set()
        self._warned_retrace = False
        self._tracing_count = 0

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as the function it traces (a ``ClusterCoordinator`` ships it to workers);
        the copy traces again where it runs."""
        return TracedFunction, (self.python_function,)

    def experimental_get_tracing_count(self) -> int:
        """How many times the step has been traced, over all replicas (``tf.function``'s)."""
        return self._tracing_count

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        replica = current_replica_context()
        strategy = None if replica is None else replica.strategy
        if replica is None or not isinstance(strategy, MirrorsModules):
            return self.python_function(*args, **kwargs)
        local_id = replica.local_replica_id
        replicas = self._replicas.get(strategy)
        if replicas is None:
            replicas = self._replicas[strategy] = _StrategyTraces()
            strategy.at_close(replicas.release)
        state = replicas.setdefault(local_id, _Replica())
        modules = strategy.replica_modules(local_id)
        signature = _Signature(args, kwargs, [*modules, *state.called.values()])
        if signature.refused is not None:
            self._eager(
                f"{signature.refused} is neither a tensor nor a value a trace can key (a number, "
                "a string, a module, a function); pass its tensors in a tuple, list or dict"
            )
            return self.python_function(*args, **kwargs)
        trace = state.traces.get(signature.key)
        if trace is None:
            trace = self._trace(state, signature, args, kwargs, modules)
            state.traces[signature.key] = trace
            if isinstance(trace, Replay) and _called_beyond(state, trace, modules):
                signature = _Signature(args, kwargs, [*modules, *state.called.values()])
                state.traces[signature.key] = trace
        if isinstance(trace, _Eager):
            return self.python_function(*args, **kwargs)
        tensors = [leaf for leaf in signature.leaves if isinstance(leaf, torch.Tensor)]
        return trace(tensors, _random_streams_ready(trace))

    def _trace(
        self,
        state: _Replica,
        signature: _Signature,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        modules: list[nn.Module],
    ) -> Replay | _Eager:
        self._tracing_count += 1
        self._warn_retracing(state, signature)
        try:
            return Replay(capture(self.python_function, args, kwargs, modules))
        except TraceUnsupported as unsupported:
            return self._eager(unsupported.reason)
        except Exception as error:  # the step's own error, or a value read on the host
            return self._eager(_reason(error))

    def _eager(self, reason: str) -> _Eager:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(
                f"mirrored.function({self._name}) runs as written: {reason}",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        return _Eager(reason)

    def _warn_retracing(self, state: _Replica, signature: _Signature) -> None:
        previous, state.last = state.last, signature.parts
        if self._warned_retrace or len(state.traces) < RETRACE_WARNING or previous is None:
            return
        self._warned_retrace = True
        changed = signature.changes_since(previous)
        warnings.warn(
            f"mirrored.function({self._name}) has traced {len(state.traces) + 1} times "
            f"on one replica; {', '.join(changed[:3]) or 'the arguments'} keeps changing. "
            "Pass tensors of fixed shapes (DataLoader(drop_last=True), padding), or Python values "
            "that repeat: each new one traces again",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )


def _random_streams_ready(trace: Replay) -> Callable[[], None]:
    streams = entered_streams()
    devices = trace.drawn_devices
    if not streams or not devices:
        return _nothing
    return functools.partial(streams[-1].prepare, devices)


def _nothing() -> None:
    return None


@overload
def function(fn: F) -> F: ...


@overload
def function(fn: None = None) -> Callable[[F], F]: ...


def function(fn: Callable[..., Any] | None = None) -> Any:
    """Trace a replica step once per replica and input signature and replay it after
    (``tf.function``'s counterpart): ``@mirrored.function`` above the function given to
    ``strategy.run``. See :mod:`mirrored.tracing.function` for what a trace keeps and
    docs/guides/fast-steps.md for what traces and what runs as written."""
    if fn is None:
        return function
    if not callable(fn):
        raise TypeError(f"mirrored.function expects a function, got {type(fn).__name__}")
    return TracedFunction(fn)
