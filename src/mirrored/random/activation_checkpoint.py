"""Activation checkpointing that recomputes with the random numbers of the forward.

A checkpoint's recomputation in backward must draw the dropout masks its forward drew, or the
gradients are those of another forward. torch replays its global generators for that; inside a
replica the random ops draw from the replica's own streams (:mod:`mirrored.random.routing`), so
the replay here puts those streams back where they were at the forward instead. torch's own
``checkpoint`` arguments reach it through :mod:`mirrored.torch_patches.checkpoint`;
:func:`activation_checkpoint_contexts` is the ``context_fn`` that asks for it explicitly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch

from mirrored.random import rng_state

__all__ = ["ReplicaStreams", "activation_checkpoint_contexts", "entered_streams", "replica_replay"]


class ReplicaStreams(Protocol):
    """A replica's random streams (its ``ReplicaRandomness`` mode): where they are, and a way
    back there; which devices a step drew on, and their generators readied for a traced step's
    replay; what it is told as a backward pass starts."""

    on_backward: Callable[[tuple[torch.Tensor, ...]], None] | None

    def position(self) -> Any: ...

    def restore(self, position: Any) -> None: ...

    def drawn_devices(self) -> tuple[torch.device, ...]: ...

    def prepare(self, devices: Sequence[torch.device]) -> None: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc_info: Any) -> None: ...


_entered = threading.local()  # the replica streams this thread is in, innermost last


def entered_streams() -> list[ReplicaStreams]:
    """The replica streams the calling thread is in, innermost last (they push and pop
    themselves as they are entered and left)."""
    modes: list[ReplicaStreams] = _entered.__dict__.setdefault("modes", [])
    return modes


def activation_checkpoint_contexts() -> tuple[
    AbstractContextManager[None], AbstractContextManager[None]
]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False,
    context_fn=mirrored.activation_checkpoint_contexts)``: every recomputation in backward draws
    the random numbers the forward drew (its dropout masks), so the gradients are those of the
    forward, with ``preserve_rng_state`` on or off.

    Inside a replica it replays the replica's own streams, as torch's ``preserve_rng_state``
    does there too (:mod:`mirrored.torch_patches.checkpoint`); elsewhere (outside
    ``strategy.run``, or a ``MirroredStrategy`` of one replica) the states the CPU's and every
    initialised CUDA device's generators had at the forward, as ``preserve_rng_state`` would.
    It does not combine with torch's selective checkpointing
    (``create_selective_checkpoint_contexts``), which replays the replica's streams with
    ``preserve_rng_state`` alone."""
    replay = replica_replay()
    if replay is None:
        replay = _Replay(rng_state.capture_torch, rng_state.restore_torch, None)
    return nullcontext(), replay


def replica_replay() -> _Replay | None:
    """The replay of the calling thread's replica from its streams' position now: what a
    checkpoint beginning its forward recomputes inside; None outside replicas."""
    modes = entered_streams()
    if not modes:
        return None
    replica = modes[-1]
    # The mode is entered for the recomputation too: autograd's device threads, where a GPU
    # backward recomputes, have no streams entered of their own.
    return _Replay(replica.position, replica.restore, replica)


class _Replay:
    """The recompute context of one checkpoint, made as its forward begins: each time it is
    entered (every backward through the checkpoint recomputes) the streams ``position`` reads and
    ``restore`` sets draw from where they were at the forward, with ``mode`` (a replica's)
    entered, and go on from where they were afterwards."""

    def __init__(
        self,
        position: Callable[[], Any],
        restore: Callable[[Any], None],
        mode: ReplicaStreams | None,
    ) -> None:
        self._position = position
        self._restore = restore
        self._mode = mode
        self._forward = position()
        self._resume: list[Any] = []

    def __enter__(self) -> None:
        resume = self._position()
        self._restore(self._forward)
        self._resume.append(resume)
        if self._mode is not None:
            try:
                self._mode.__enter__()
            except BaseException:
                self._restore(self._resume.pop())
                raise

    def __exit__(self, *exc_info: Any) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc_info)
        finally:
            self._restore(self._resume.pop())
