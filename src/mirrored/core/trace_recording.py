"""Whether this thread is tracing a replica step (:func:`mirrored.function`), and what the parts
of the library that act on a step's state (mirrored optimizers, ``zero_grad``, clipping, the
gradient reducer, per-replica random streams, collectives) do then.

A trace runs the step once on fake tensors to record its tensor ops; nothing in it may act on
real state. What acts on it is recorded as a *host call* instead, run for real each time the
trace is replayed (an optimizer's ``step()``, a ``zero_grad()``); what cannot be recorded
raises :class:`TraceUnsupported`, and the step runs as written instead. This module sits in
the core so that every layer can ask, without importing the tracer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from mirrored._torch_tracing import tree_flatten, tree_unflatten

__all__ = [
    "HostCall",
    "HostCalls",
    "ResultSpec",
    "TraceUnsupported",
    "deferred_to_replay",
    "recording",
    "refuse_while_recording",
    "set_recording",
]

# A host call: given the tensors the trace handed it, it acts on real state and returns the
# tensors the rest of the step uses (none for most).
HostCall = Callable[[list[torch.Tensor]], Sequence[torch.Tensor] | None]
# What a host call returns, as the trace sees it: one (shape, dtype, device) per tensor.
ResultSpec = tuple[tuple[int, ...], torch.dtype, torch.device]


class TraceUnsupported(Exception):
    """A step does something a trace cannot replay exactly; ``reason`` says what."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class HostCalls(Protocol):
    """The trace being recorded on this thread."""

    def host_call(
        self,
        run: HostCall,
        tensors: Sequence[torch.Tensor] = (),
        results: Sequence[ResultSpec] = (),
    ) -> list[torch.Tensor]:
        """Record ``run`` at this point of the step, to be called with ``tensors`` at every
        replay; returns one traced tensor per entry of ``results`` standing for what it returns
        there."""
        ...


class _State(threading.local):
    recorder: HostCalls | None = None


_state = _State()


def recording() -> HostCalls | None:
    """The trace this thread is recording, or None."""
    return _state.recorder


def set_recording(recorder: HostCalls | None) -> HostCalls | None:
    """Make ``recorder`` this thread's trace (None: none); returns the previous one."""
    previous, _state.recorder = _state.recorder, recorder
    return previous


def deferred_to_replay(fn: Callable[..., object], *args: object, **kwargs: object) -> bool:
    """In a step being traced: record ``fn(*args, **kwargs)`` as a host call (the caller then
    returns at once) and say so; else False (the caller runs as usual). The tensors among the
    arguments (a metric for ``ReduceLROnPlateau``) are the replay's, the rest as given now."""
    recorder = _state.recorder
    if recorder is None:
        return False
    leaves, spec = tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def call(tensors: list[torch.Tensor]) -> None:
        given = list(leaves)
        for position, tensor in zip(positions, tensors, strict=True):
            given[position] = tensor
        call_args, call_kwargs = tree_unflatten(given, spec)
        fn(*call_args, **call_kwargs)

    recorder.host_call(call, [leaves[i] for i in positions])
    return True


def refuse_while_recording(what: str) -> None:
    """Raise :class:`TraceUnsupported` naming ``what`` if this thread is recording a trace."""
    if _state.recorder is not None:
        raise TraceUnsupported(what)
