"""torch's gradient clipping made to clip the global batch's gradient inside replicas.

``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` between ``backward()`` and ``step()``
in a replica would clip the replica's part of the gradient. Both functions group the gradients
through their module's ``_group_tensors_by_device_and_dtype`` at every call, whatever name they
were imported under, and ``clip_grad_norm_`` hands the parameters to the module's
``_clip_grads_with_norm_``: wrappers there (and around the public functions, for callers that
look them up at the call) call ``before`` with the tensors about to be read, so that the mirrored
optimizers can sum the replicas' gradients first, in place
(:mod:`mirrored.torch_patches.mirrored_optimizers`).

On a torch whose clipping module is not what these wrappers expect, only the public functions
are wrapped, and a warning says that a clipping function imported by name earlier clips each
replica's part. The private names are reached, and recognised, in
:mod:`mirrored._torch_internals`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from mirrored._torch_internals import replace_gradient_readers, unrecognised_clipping
from mirrored.core.trace_recording import recording
from mirrored.torch_patches.holders import Installation, Patch

__all__ = ["CLIPPING", "Clipped", "install_clipping_routes"]

CLIPPING = Patch("gradient clipping")

# What the clipping route hands ``before``: the parameters, or the gradients, about to be read.
Clipped = Callable[[list[torch.Tensor]], None]


def install_clipping_routes(
    installation: Installation, module: ModuleType | Any, package: ModuleType | Any, before: Clipped
) -> None:
    """The clipping route on torch's clip_grad ``module`` (whose public functions ``package``
    exports too); on a module that is not recognised, the public functions only, with a
    warning."""
    for name in ("clip_grad_norm_", "clip_grad_value_"):
        wrapper = _recorded(
            _calling_first(getattr(module, name), before, _as_list, installation),
            returns_norm=name == "clip_grad_norm_",
        )
        installation.replace(module, name, wrapper)
        installation.replace(package, name, wrapper)
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
        return _calling_first(function, before, lambda first: _as_list(read(first)), installation)

    replace_gradient_readers(module, reading_after_before, installation.replace)


def _as_list(tensors: Any) -> list[torch.Tensor]:
    """A clipping function's tensor or iterable of tensors as a list of tensors."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def _recorded(function: Callable[..., Any], returns_norm: bool) -> Callable[..., Any]:
    """``function`` that, in a step being traced (:func:`mirrored.function`), is recorded to run
    at each replay, on the gradients of that replay: the trace has none to clip."""

    @functools.wraps(function)
    def recorded(first: Any, *args: Any, **kwargs: Any) -> Any:
        recorder = recording()
        if recorder is None:
            return function(first, *args, **kwargs)
        params = _as_list(first if isinstance(first, (torch.Tensor, list, tuple)) else list(first))

        def clip(_: list[torch.Tensor]) -> list[torch.Tensor]:
            result = function(params, *args, **kwargs)
            return [result] if returns_norm else []

        where = (params[0].dtype, params[0].device) if params else (torch.float32, "cpu")
        results = [((), *where)] if returns_norm else []
        norm = recorder.host_call(clip, results=results)
        return norm[0] if returns_norm else None

    return recorded


def _calling_first(
    function: Callable[..., Any],
    before: Clipped,
    tensors_of: Callable[[Any], list[torch.Tensor]],
    installation: Installation,
) -> Callable[..., Any]:
    """``function`` that, while ``installation`` is in force, first calls ``before`` with the
    tensors of its first argument (a generator of parameters is listed once, and handed on as
    that list)."""

    @functools.wraps(function)
    def calling_first(first: Any, *args: Any, **kwargs: Any) -> Any:
        if not installation.in_force:
            return function(first, *args, **kwargs)
        if not isinstance(first, torch.Tensor) and not isinstance(first, (list, tuple)):
            first = list(first)
        before(tensors_of(first))
        return function(first, *args, **kwargs)

    return calling_first
