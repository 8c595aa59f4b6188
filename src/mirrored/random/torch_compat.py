"""torch's process-wide helpers made to work inside replicas: activation checkpointing, gradient
clipping, ``GradScaler`` and LR schedulers, wrapped where torch looks them up.

Activation checkpointing (``torch.utils.checkpoint``) saves torch's global generators as a
checkpoint's forward begins and restores them around each recomputation in backward; replicas
draw from generators of their own (:mod:`mirrored.random.routing`). ``checkpoint()`` reaches its
two implementations through its module's globals at every call: ``CheckpointFunction``
(``use_reentrant=True``) and ``_checkpoint_without_reentrant_generator`` (``use_reentrant=False``).
Both are replaced by wrappers that, inside a replica, turn torch's save and restore off (it would
read and write the process-wide generators from several replica threads) and run each
recomputation inside the replica's replay instead; elsewhere they call torch's own, unchanged.
Callers that bound ``checkpoint`` before (Hugging Face's models) go through them too.

Gradient clipping (``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``) between
``backward()`` and ``step()`` in a replica would clip the replica's part of the gradient. Both
functions group the gradients through their module's ``_group_tensors_by_device_and_dtype``
at every call, whatever name they were imported under, and ``clip_grad_norm_`` hands the
parameters to the module's ``_clip_grads_with_norm_``: wrappers there (and around the public
functions, for callers that look them up at the call) let the mirrored optimizers sum the
replicas' gradients first, in place, so that the clipping sees the global batch's gradient, or
refuse where that cannot be done (a pipeline's parameters, whose gradients come at ``step()``).
``torch.amp.GradScaler`` keeps one state per optimizer, which the replicas' threads would share:
its ``scale`` is wrapped so that a caller may refuse it there, before anything changes. LR
schedulers stepped inside replicas would advance once per replica: the ``step`` methods of
torch's and of every other subclass of its ``LRScheduler`` (defined before or after) are wrapped
so that a caller may skip them there.

On a torch whose checkpoint module is not what these wrappers expect nothing is wrapped, and
``torch.get_rng_state`` refuses on a replica's thread: every checkpoint that preserves the random
state calls it as its forward begins, so it raises there rather than recompute other masks. On a
torch whose clipping module is not, only the public functions are wrapped, and a warning says
that a clipping function imported by name earlier clips each replica's part. The private names of
both modules are reached, and recognised, in :mod:`mirrored._torch_internals`.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any

import torch
import torch.utils.checkpoint

from mirrored._torch_internals import (
    replace_checkpoint_implementations,
    replace_gradient_readers,
    unrecognised_checkpoint,
    unrecognised_clipping,
)

__all__ = [
    "refusing_in_replicas",
    "route_checkpoint_recomputes",
    "route_grad_scaling",
    "route_gradient_clipping",
    "route_scheduler_steps",
    "route_steps_of_subclasses",
]

# The replay of the calling thread's replica, made as a checkpoint's forward begins; None
# outside replicas.
Replay = Callable[[], AbstractContextManager[None] | None]

_install_lock = threading.Lock()
_installed = False


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
            replace_checkpoint_implementations(
                module,
                lambda base: _reentrant(base, replay),
                lambda original: _non_reentrant(original, replay),
            )
        else:
            torch.get_rng_state = refusing_in_replicas(torch.get_rng_state, reason, replay)
        _installed = True


_routed: set[str] = set()


def _once(name: str, install: Callable[[], None]) -> None:
    with _install_lock:
        if name not in _routed:
            install()
            _routed.add(name)


# What the clipping route hands ``before``: the parameters, or the gradients, about to be read.
Clipped = Callable[[list[torch.Tensor]], None]


def route_gradient_clipping(before: Clipped) -> None:
    """From now on, torch's gradient clipping calls ``before(tensors)`` with the parameters, or
    the gradients, whose gradients it is about to read (once a process; see the module's
    docstring)."""
    _once("clipping", lambda: route_clipping_of(torch.nn.utils.clip_grad, torch.nn.utils, before))


def route_clipping_of(module: ModuleType | Any, package: ModuleType | Any, before: Clipped) -> None:
    """The clipping route on torch's clip_grad ``module`` (whose public functions ``package``
    exports too); on a module that is not recognised, the public functions only, with a
    warning."""
    for name in ("clip_grad_norm_", "clip_grad_value_"):
        wrapper = _calling_first(getattr(module, name), before, _as_list)
        setattr(module, name, wrapper)
        setattr(package, name, wrapper)
    reason = unrecognised_clipping(module)
    if reason is not None:
        warnings.warn(
            f"torch {torch.__version__}'s gradient clipping is not the one mirrored knows "
            f"({reason}): torch.nn.utils.clip_grad_norm_ and clip_grad_value_ clip the global "
            "batch's gradient inside strategy.run when looked up at the call, but a clipping "
            "function imported by name before mirrored's first mirror() clips each replica's "
            "part; call optimizer.all_reduce_gradients() before clipping with it",
            RuntimeWarning,
            stacklevel=2,
        )
        return

    def reading_after_before(function: Callable[..., Any], read: Callable[[Any], Any]) -> Any:
        return _calling_first(function, before, lambda first: _as_list(read(first)))

    replace_gradient_readers(module, reading_after_before)


def _as_list(tensors: Any) -> list[torch.Tensor]:
    """A clipping function's tensor or iterable of tensors as a list of tensors."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def _calling_first(
    function: Callable[..., Any], before: Clipped, tensors_of: Callable[[Any], list[torch.Tensor]]
) -> Callable[..., Any]:
    """``function`` that first calls ``before`` with the tensors of its first argument (a
    generator of parameters is listed once, and handed on as that list)."""

    @functools.wraps(function)
    def calling_first(first: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(first, torch.Tensor) and not isinstance(first, (list, tuple)):
            first = list(first)
        before(tensors_of(first))
        return function(first, *args, **kwargs)

    return calling_first


def route_scheduler_steps(skip: Callable[[Any], bool]) -> None:
    """From now on, LR schedulers' ``step`` does nothing where ``skip(scheduler)`` (once a
    process): torch's, and those of every other subclass of its ``LRScheduler`` that defines
    its own ``step`` (a third party's), whenever the class is defined."""
    _once(
        "schedulers",
        lambda: route_steps_of_subclasses(torch.optim.lr_scheduler.LRScheduler, skip),
    )


def route_steps_of_subclasses(base: type, skip: Callable[[Any], bool]) -> None:
    """Route the ``step`` of ``base`` and of each of its subclasses that defines one: those that
    exist now, and, through ``base.__init_subclass__``, those defined later."""
    pending = [base]
    while pending:
        cls = pending.pop()
        _route_step(cls, skip)
        pending.extend(cls.__subclasses__())
    previous = base.__dict__.get("__init_subclass__")

    def init_subclass(cls: type, **kwargs: Any) -> None:
        if previous is not None:
            previous.__func__(cls, **kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)  # type: ignore[arg-type]
        _route_step(cls, skip)

    base.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]


def _route_step(cls: type, skip: Callable[[Any], bool]) -> None:
    """``cls.step``, if ``cls`` defines its own, made to do nothing where ``skip(self)``."""
    original = cls.__dict__.get("step")
    if not callable(original) or getattr(original, "_mirrored_routed", False):
        return

    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if skip(self):
            return None
        return original(self, *args, **kwargs)

    step._mirrored_routed = True  # type: ignore[attr-defined]
    cls.step = step  # type: ignore[attr-defined]


def route_grad_scaling(check: Callable[[Any], None]) -> None:
    """From now on, ``torch.amp.GradScaler.scale`` calls ``check(scaler)`` first (once a
    process; subclasses that do not define their own ``scale`` included)."""

    def install() -> None:
        scaler = torch.amp.grad_scaler.GradScaler
        original = scaler.scale

        @functools.wraps(original)
        def scale(self: Any, outputs: Any) -> Any:
            check(self)
            return original(self, outputs)

        scaler.scale = scale  # type: ignore[method-assign]

    _once("grad_scaler", install)
