"""Where mirrored reaches into torch's internals, each piece checked against the torch it runs on.

Activation checkpointing (``torch.utils.checkpoint``) saves torch's global generators as a
checkpoint's forward begins and restores them around each recomputation in backward; replicas
draw from generators of their own (:mod:`mirrored.randomness`). ``checkpoint()`` reaches its two
implementations through its module's globals at every call: ``CheckpointFunction``
(``use_reentrant=True``) and ``_checkpoint_without_reentrant_generator`` (``use_reentrant=False``).
Both are replaced by wrappers that, inside a replica, turn torch's save and restore off (it would
read and write the process-wide generators from several replica threads) and run each
recomputation inside the replica's replay instead; elsewhere they call torch's own, unchanged.
Callers that bound ``checkpoint`` before (Hugging Face's models) go through them too.

On a torch whose checkpoint module is not what these wrappers expect nothing is wrapped, and
``torch.get_rng_state`` refuses on a replica's thread: every checkpoint that preserves the random
state calls it as its forward begins, so it raises there rather than recompute other masks.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any

import torch
import torch.utils.checkpoint

__all__ = ["refusing_in_replicas", "route_checkpoint_recomputes", "unrecognised_checkpoint"]

# The replay of the calling thread's replica, made as a checkpoint's forward begins; None
# outside replicas.
Replay = Callable[[], AbstractContextManager[None] | None]

_install_lock = threading.Lock()
_installed = False


def _parameters(function: Any) -> list[str]:
    try:
        return list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return []


def _code(function: Any) -> Any:
    """The code object of ``function`` under its decorators (torch's checkpoint is wrapped in
    ``torch._disable_dynamo``, our wrappers in ``functools.wraps``); None when it has none."""
    return getattr(inspect.unwrap(function), "__code__", None) if callable(function) else None


def unrecognised_checkpoint(module: ModuleType | Any) -> str | None:
    """What in torch's checkpoint ``module`` differs from what the wrappers rely on; None when
    nothing does. They rely on ``checkpoint()`` looking both implementations up in the module at
    each call, on ``CheckpointFunction`` recomputing through ``ctx.run_function``, and on the
    non-reentrant generator recomputing by calling ``fn``."""
    entry = _code(getattr(module, "checkpoint", None))
    implementations = {"CheckpointFunction", "_checkpoint_without_reentrant_generator"}
    if entry is None or not implementations <= set(entry.co_names):
        return "checkpoint() does not call " + " and ".join(sorted(implementations))
    function = getattr(module, "CheckpointFunction", None)
    backward = _code(getattr(function, "backward", None))
    if (
        _parameters(getattr(function, "forward", None))[:3]
        != ["ctx", "run_function", "preserve_rng_state"]
        or backward is None
        or "run_function" not in backward.co_names
    ):
        return "CheckpointFunction is not forward(ctx, run_function, preserve_rng_state, *args)"
    generator = getattr(module, "_checkpoint_without_reentrant_generator", None)
    code = _code(generator)
    if (
        code is None
        or _parameters(generator)[:3] != ["fn", "preserve_rng_state", "context_fn"]
        or "fn" not in code.co_cellvars
    ):
        return "_checkpoint_without_reentrant_generator is not (fn, preserve_rng_state, ...)"
    return None


class _Recompute:
    """A checkpointed function as a recomputation calls it: inside ``replay``."""

    def __init__(self, function: Callable[..., Any], replay: AbstractContextManager[None]) -> None:
        self._function = function
        self._replay = replay

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._replay:
            return self._function(*args, **kwargs)


def _reentrant(base: Any, replay: Replay) -> Any:
    class ReplicaCheckpointFunction(base):
        """torch's reentrant checkpoint; inside a replica, with ``preserve_rng_state``, its
        recomputations replay the replica's streams instead of torch's global generators."""

        @staticmethod
        def forward(
            ctx: Any, run_function: Callable[..., Any], preserve_rng_state: bool, *args: Any
        ) -> Any:
            recompute_in = replay() if preserve_rng_state else None
            if recompute_in is None:
                return base.forward(ctx, run_function, preserve_rng_state, *args)
            outputs = base.forward(ctx, run_function, False, *args)
            ctx.run_function = _Recompute(run_function, recompute_in)  # what backward calls
            return outputs

    return ReplicaCheckpointFunction


def _non_reentrant(original: Callable[..., Any], replay: Replay) -> Callable[..., Any]:
    @functools.wraps(original)
    def checkpoint_without_reentrant(
        fn: Callable[..., Any], preserve_rng_state: bool = True, *args: Any, **kwargs: Any
    ) -> Any:
        # torch's generator calls fn only to recompute (checkpoint() runs the forward itself).
        recompute_in = replay() if preserve_rng_state else None
        if recompute_in is not None:
            fn, preserve_rng_state = _Recompute(fn, recompute_in), False
        return original(fn, preserve_rng_state, *args, **kwargs)

    return checkpoint_without_reentrant


def refusing_in_replicas(
    get_rng_state: Callable[..., torch.Tensor], reason: str, replay: Replay
) -> Callable[..., torch.Tensor]:
    """``get_rng_state`` that raises ``ValueError`` on a replica's thread (where ``replay()`` is
    not None: the global generator is not the replica's, and others use it), for a torch whose
    checkpoint module is not recognised (``reason``)."""

    @functools.wraps(get_rng_state)
    def refusing(*args: Any, **kwargs: Any) -> torch.Tensor:
        if replay() is not None:
            raise ValueError(
                f"torch.get_rng_state() on a replica's thread: torch {torch.__version__} is not "
                f"the torch mirrored knows ({reason}), so a checkpoint's preserve_rng_state "
                "would restore torch's global generators, which replicas do not draw from. Pass "
                "use_reentrant=False, preserve_rng_state=False, "
                "context_fn=mirrored.activation_checkpoint_contexts to "
                "torch.utils.checkpoint.checkpoint (Hugging Face models: as "
                "gradient_checkpointing_kwargs)"
            )
        return get_rng_state(*args, **kwargs)

    return refusing


def route_checkpoint_recomputes(replay: Replay) -> None:
    """From now on, checkpoints inside replicas recompute inside ``replay()``'s context (once a
    process; see the module's docstring)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        module = torch.utils.checkpoint
        reason = unrecognised_checkpoint(module)
        if reason is None:
            module.CheckpointFunction = _reentrant(module.CheckpointFunction, replay)  # type: ignore[misc]
            module._checkpoint_without_reentrant_generator = _non_reentrant(
                module._checkpoint_without_reentrant_generator, replay
            )
        else:
            torch.get_rng_state = refusing_in_replicas(torch.get_rng_state, reason, replay)
        _installed = True
