"""The one place mirrored reaches into torch's private names, each checked against the torch it
runs on.

Making torch's process-wide random generators per replica, reducing gradients during backward and
routing torch's checkpointing and clipping through the replicas need names torch does not promise
to keep: ``torch._C`` functions, private samplers and kernels, the private helpers of its
checkpoint and clipping modules (torch.distributed's private names are
:mod:`mirrored._torch_distributed`'s, checked the same way). Each is reached here only,
by an accessor that says what it reaches and checks once, by feature (the name is there, its
signature or code has the form this was written for), that it can: where it cannot, the accessor
raises an error that names the missing piece, or takes the fallback its docstring gives. Lightning
Fabric's ``utilities/imports.py`` checks torch the same way.

Written against torch 2.13, the release CI tests (``TESTED_TORCH``); ``import mirrored`` on any
other release gives one ``UserWarning`` (:func:`warn_if_untested_torch`).
"""

from __future__ import annotations

import gc
import inspect
import re
import sys
import warnings
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from types import CodeType, FrameType, FunctionType, ModuleType
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase

__all__ = [
    "BatchNormBase",
    "HOOK_KINDS",
    "NO_HOOK_IDS",
    "PRIVATE_SAMPLERS",
    "TESTED_TORCH",
    "amp_unscale_and_check_",
    "aten_takes_generator",
    "backward_hooks_held",
    "body_without_torch_function_check",
    "all_plain",
    "bookkeeping",
    "caller_frame",
    "code_of",
    "disable_torch_function",
    "foreach_mul_",
    "hook_ids",
    "is_functorch_wrapped",
    "mark_step_called",
    "node_hooked",
    "outside_functorch",
    "parameter_names",
    "parameter_hooks",
    "run_hooks_last",
    "queue_backward_callback",
    "replace_checkpoint_implementations",
    "replace_gradient_readers",
    "required",
    "safe_softmax",
    "share_step_hooks",
    "tensor_bytes",
    "unrecognised_checkpoint",
    "unrecognised_clipping",
    "untested_torch",
    "warn_if_untested_torch",
    "will_engine_execute_node",
]

# The torch release CI installs (scripts/test.sh pins torch==2.13.0), as (major, minor).
TESTED_TORCH = (2, 13)


def _release(version: str) -> tuple[int, int] | None:
    """``"2.13.0+cpu"`` -> ``(2, 13)``; None for a version string of another form."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


def untested_torch(version: str) -> str | None:
    """The warning for torch ``version`` when it is not a release CI tests; None when it is."""
    if _release(version) == TESTED_TORCH:
        return None
    tested = ".".join(map(str, TESTED_TORCH))
    return (
        f"mirrored is tested with torch {tested}.x, and torch {version} is installed: mirrored "
        "reaches into torch internals that change between releases (each is checked where it is "
        f"used, but not every behaviour can be); install torch=={tested}.* for tested results"
    )


_warned_untested = False


def warn_if_untested_torch() -> None:
    """One ``UserWarning`` a process when the installed torch is not the release CI tests;
    ``import mirrored`` calls it, and the warning points at the caller's import."""
    global _warned_untested
    message = untested_torch(torch.__version__)
    if message is not None and not _warned_untested:
        _warned_untested = True
        warnings.warn(message, UserWarning, stacklevel=3)


def required(owner: object, where: str, name: str, purpose: str) -> Callable[..., Any]:
    """``owner.name`` (looked up once); where this torch has no such function, one that raises
    an ``ImportError`` naming it when called, so that ``import mirrored`` still works and only
    the feature that needs it fails (not a ``RuntimeError``, which callers catch from torch)."""
    found = getattr(owner, name, None)
    if callable(found):
        return found

    def missing(*args: Any, **kwargs: Any) -> Any:
        tested = ".".join(map(str, TESTED_TORCH))
        raise ImportError(
            f"torch {torch.__version__} has no {where}.{name}, which mirrored uses to {purpose}; "
            f"mirrored is written against torch {tested}: install torch=={tested}.*"
        )

    return missing


# -- autograd, dispatch and optimizer kernels -------------------------------------------------

will_engine_execute_node: Callable[[Any], bool] = required(
    torch._C,
    "torch._C",
    "_will_engine_execute_node",
    "tell loss.backward() (gradients to reduce) from torch.autograd.grad (none)",
)
"""``torch._C._will_engine_execute_node(node)``: whether the running backward pass executes the
autograd ``node``."""

amp_unscale_and_check_: Callable[..., None] = required(
    torch,
    "torch",
    "_amp_foreach_non_finite_check_and_unscale_",
    "unscale a mixed-precision step's gradients",
)
"""``torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)``: multiplies
each gradient by ``inv_scale`` in place and sets ``found_inf`` to 1 where any is not finite (what
``torch.amp.GradScaler.unscale_`` runs)."""

foreach_mul_: Callable[..., None] = required(
    torch, "torch", "_foreach_mul_", "apply decoupled weight decay"
)
"""``torch._foreach_mul_(tensors, factor)``: each tensor multiplied in place, in one kernel per
device and dtype (what torch's own optimizers use for weight decay)."""

queue_backward_callback: Callable[[Callable[[], None]], None] = required(
    getattr(torch.autograd.Variable, "_execution_engine", None),
    "torch.autograd.Variable._execution_engine",
    "queue_callback",
    "reduce the last gradient buckets once a backward pass ends",
)
"""``torch.autograd.Variable._execution_engine.queue_callback(fn)``: run ``fn`` when the running
backward pass ends (what DistributedDataParallel's reducer uses)."""

# ``BatchNormBase`` (imported above): ``torch.nn.modules.batchnorm._BatchNorm``, the base of
# BatchNorm1d/2d/3d and of torch's own SyncBatchNorm, which mirrored's sync batch norm also
# extends and by which it recognises a batch-norm layer.

disable_torch_function: Callable[[], AbstractContextManager[Any]] = getattr(
    torch._C, "DisableTorchFunction", nullcontext
)
"""``torch._C.DisableTorchFunction()``: a context in which no torch-function mode or override
runs. Fallback, on a torch without it: a context that changes nothing (the modes then run, and
cost a Python call per op)."""


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def all_plain(tensors: Iterable[torch.Tensor | None]) -> bool:
    """Whether none of ``tensors`` is of a tensor subclass (whose ``__torch_function__`` is
    its own)."""
    return all(t is None or type(t) in _PLAIN for t in tensors)


def bookkeeping(plain: bool) -> AbstractContextManager[Any]:
    """Around mirrored's own work inside a replica (gradients summed, buffers checked, the
    update, ``.grad`` cleared) on tensors that are ``plain`` (``all_plain``): no torch-function
    mode runs, where each would cost a Python call per op and per attribute read (``t.grad``,
    ``t._version``) and the replicas share one GIL. So the replicas' random streams do not
    route what runs there: a torch optimizer whose ``step()`` draws random numbers (noise added
    to the update) draws from torch's global generator, not the replica's. Not plain (a tensor
    subclass keeps its ``__torch_function__``): nothing changes."""
    return disable_torch_function() if plain else nullcontext()


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as uint8, its elements in order: a view of its memory where it is
    contiguous and holds no lazy conjugation or negation (``Tensor.view(dtype)`` refuses those),
    a copy otherwise, of the values it shows."""
    flat = tensor.detach().resolve_conj().resolve_neg().reshape(-1).contiguous()
    return flat.view(torch.uint8)


def caller_frame(depth: int) -> FrameType:
    """The frame ``depth`` calls above the caller of this function (``sys._getframe``, CPython's,
    which mirrored's warnings use to point at the user's line)."""
    return sys._getframe(depth + 1)


# -- random ops (mirrored.random.routing, mirrored.random.cpu_kernels, mirrored.random.step_seeds)
# -----

# torch's samplers behind its distributions that are not in its public namespace: Gamma (and so
# Beta and Chi2) and Dirichlet sampling; those this torch has.
PRIVATE_SAMPLERS: list[Callable[..., Any]] = [
    sampler
    for sampler in (
        getattr(torch, "_standard_gamma", None),
        getattr(torch, "_sample_dirichlet", None),
    )
    if sampler is not None
]


def aten_takes_generator(name: str) -> bool:
    """Whether some overload of ``aten::name`` has a ``generator`` argument, from the overloads'
    ``_schema`` (``rand_like`` has one only in newer torch). Fallback, where torch has no such
    op or schema: False (the op then runs with the replica's stream swapped in)."""
    try:
        packet = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return False
    schemas = (
        getattr(getattr(packet, overload), "_schema", None) for overload in packet.overloads()
    )
    return any(
        argument.name == "generator"
        for schema in schemas
        if schema is not None
        for argument in schema.arguments
    )


_DISPATCH_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


def _never(*args: Any, **kwargs: Any) -> bool:
    return False


_bodies: dict[Callable[..., Any], Callable[..., Any] | None] = {}


def body_without_torch_function_check(func: Callable[..., Any]) -> Callable[..., Any] | None:
    """A copy of torch's Python function ``func`` (``F.dropout2d``, ``torch.autograd.backward``)
    built from its ``__code__``, with globals that say no override is active, so that under a
    torch-function mode it runs its body with the mode still on. Fallback: None when ``func``
    has no code or does not check through those globals. The copy's globals are a snapshot of
    its module's at the first call: a name that module rebinds later (a monkeypatch) is not seen
    by the copy."""
    if func not in _bodies:
        code = getattr(func, "__code__", None)
        body = None
        if code is not None and any(name in code.co_names for name in _DISPATCH_CHECKS):
            namespace = {**func.__globals__, **dict.fromkeys(_DISPATCH_CHECKS, _never)}
            body = FunctionType(code, namespace, func.__name__, func.__defaults__, func.__closure__)
            body.__kwdefaults__ = func.__kwdefaults__
        _bodies[func] = body
    return _bodies[func]


outside_functorch: Callable[[], AbstractContextManager[Any]] = getattr(
    torch._C, "_DisableFuncTorch", nullcontext
)
"""``torch._C._DisableFuncTorch()``: a context in which ``vmap`` and ``grad`` do not apply, so
that a draw inside a vmap-ped function is one draw, not one per example. Fallback: a context that
changes nothing."""

_functorch = getattr(torch._C, "_functorch", None)
_is_functorch_wrapped_tensor: Callable[[torch.Tensor], bool] = getattr(
    _functorch, "is_functorch_wrapped_tensor", lambda tensor: False
)


def is_functorch_wrapped(tensor: torch.Tensor) -> bool:
    """Whether ``vmap`` or ``grad`` wrapped ``tensor``
    (``torch._C._functorch.is_functorch_wrapped_tensor``). Fallback: False."""
    return _is_functorch_wrapped_tensor(tensor)


# Where a tensor keeps the hooks ``register_hook`` and ``register_post_accumulate_grad_hook``
# add: a dict (hook id -> function) once one was registered, else None.
_HOOK_ATTRIBUTES = {
    "backward": "_backward_hooks",
    "post_accumulate_grad": "_post_accumulate_grad_hooks",
}


def backward_hooks_held(tensor: torch.Tensor) -> dict[int, Callable[..., Any]] | None:
    """The dict autograd reads ``tensor``'s ``register_hook`` hooks from (None without any):
    removing an entry for a while, and putting it back, suspends that hook."""
    held: dict[int, Callable[..., Any]] | None = tensor._backward_hooks
    return held


# The kinds of hooks (``parameter_hooks``' keys), in ``hook_ids``' order; its value for a tensor
# without hooks.
HOOK_KINDS = tuple(_HOOK_ATTRIBUTES)
NO_HOOK_IDS: tuple[tuple[int, ...], ...] = tuple(() for _ in _HOOK_ATTRIBUTES)


def hook_ids(tensor: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """The ids of the hooks on ``tensor`` (``parameter_hooks``' keys, in autograd's order), by
    kind: a cheap check whether any was added, removed or reordered since an earlier call."""
    return tuple(
        tuple(getattr(tensor, attribute, None) or ()) for attribute in _HOOK_ATTRIBUTES.values()
    )


def node_hooked(node: Any, tensor: torch.Tensor) -> bool:
    """Whether a hook may be registered on the autograd node ``node`` (``tensor``'s gradient
    accumulator) itself (``register_hook``, ``register_prehook``: FSDP and Megatron hook a
    parameter's accumulator so). torch lists no node's hooks; its Python object holds each
    kind's dict of them, which ``gc.get_referents`` shows beside the dict of ``tensor``'s own
    ``register_hook`` hooks, but only while that object is the node's sole owner (a graph
    through the node hides them all, torch 2.13). So where ``tensor`` has hooks of its own
    and their dict is not shown either, this cannot tell: True."""
    own = getattr(tensor, "_backward_hooks", None)
    held = [value for value in gc.get_referents(node) if isinstance(value, dict)]
    if own and not any(value is own for value in held):
        return True
    return any(value and value is not own for value in held)


def parameter_hooks(tensor: torch.Tensor) -> dict[str, dict[int, Callable[..., Any]]]:
    """The hooks registered on ``tensor`` by kind (``"backward"``: ``register_hook``,
    ``"post_accumulate_grad"``), each by its id (``Tensor._backward_hooks``,
    ``Tensor._post_accumulate_grad_hooks``). Raises if torch keeps them elsewhere."""
    hooks = {}
    for kind, attribute in _HOOK_ATTRIBUTES.items():
        try:
            held = getattr(tensor, attribute)
        except AttributeError:
            tested = ".".join(map(str, TESTED_TORCH))
            raise ImportError(
                f"torch {torch.__version__} keeps a tensor's hooks in no Tensor.{attribute}, "
                "which mirrored uses to carry hooks registered outside strategy.run to every "
                f"replica; mirrored is written against torch {tested}: install torch=={tested}.*"
            ) from None
        hooks[kind] = dict(held) if held else {}
    return hooks


def run_hooks_last(tensor: torch.Tensor, last: Callable[[Callable[..., Any]], bool]) -> None:
    """Make the ``register_hook`` hooks of ``tensor`` for which ``last(hook)`` holds run after
    its others: autograd runs them in the order of ``Tensor._backward_hooks``' underlying dict,
    which only a removal and re-insertion (same id, so their handles still remove them)
    changes."""
    held = getattr(tensor, "_backward_hooks", None)
    if not held:
        return
    for hook_id in [hook_id for hook_id, hook in held.items() if last(hook)]:
        held[hook_id] = held.pop(hook_id)


_safe_softmax: Callable[..., torch.Tensor] | None = getattr(torch, "_safe_softmax", None)


def safe_softmax(scores: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch._safe_softmax``: a softmax that gives zeros, not NaN, for a row with every
    position masked out, as ATen's math attention does. Fallback: ``softmax`` (NaN there, as
    the math attention of torch releases without it)."""
    if _safe_softmax is None:
        return scores.softmax(dim)
    return _safe_softmax(scores, dim)


# -- torch.optim (mirrored.replication.central_update) -----------------------------------------


def share_step_hooks(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    """Make ``target.step()`` run the step hooks registered on ``source``, now and later: the
    two hold the same tables (``Optimizer._optimizer_step_pre_hooks`` and ``_post_hooks``);
    the hooks get ``target`` as their optimizer."""
    target._optimizer_step_pre_hooks = source._optimizer_step_pre_hooks
    target._optimizer_step_post_hooks = source._optimizer_step_post_hooks


def mark_step_called(optimizer: torch.optim.Optimizer) -> None:
    """Tell torch's LR schedulers that ``optimizer`` stepped (``_opt_called``, which the wrapper
    they put on its ``step`` sets), when another optimizer made its update."""
    optimizer._opt_called = True  # type: ignore[attr-defined]


# -- torch.utils.checkpoint and torch.nn.utils.clip_grad (mirrored.torch_patches) --------------


def parameter_names(function: Any) -> list[str]:
    try:
        return list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return []


def code_of(function: Any) -> CodeType | None:
    """The code object of ``function`` under its decorators (torch's checkpoint is wrapped in
    ``torch._disable_dynamo``, wrappers in ``functools.wraps``); None when it has none."""
    return getattr(inspect.unwrap(function), "__code__", None) if callable(function) else None


def unrecognised_checkpoint(module: ModuleType | Any) -> str | None:
    """What in torch's checkpoint ``module`` differs from what
    :func:`replace_checkpoint_implementations` relies on; None when nothing does: that
    ``checkpoint()`` looks both implementations up in the module at each call, that
    ``CheckpointFunction`` recomputes through ``ctx.run_function``, and that the non-reentrant
    generator recomputes by calling ``fn``."""
    entry = code_of(getattr(module, "checkpoint", None))
    implementations = {"CheckpointFunction", "_checkpoint_without_reentrant_generator"}
    if entry is None or not implementations <= set(entry.co_names):
        return "checkpoint() does not call " + " and ".join(sorted(implementations))
    function = getattr(module, "CheckpointFunction", None)
    backward = code_of(getattr(function, "backward", None))
    if (
        parameter_names(getattr(function, "forward", None))[:3]
        != ["ctx", "run_function", "preserve_rng_state"]
        or backward is None
        or "run_function" not in backward.co_names
    ):
        return "CheckpointFunction is not forward(ctx, run_function, preserve_rng_state, *args)"
    generator = getattr(module, "_checkpoint_without_reentrant_generator", None)
    code = code_of(generator)
    if (
        code is None
        or parameter_names(generator)[:3] != ["fn", "preserve_rng_state", "context_fn"]
        or "fn" not in code.co_cellvars
    ):
        return "_checkpoint_without_reentrant_generator is not (fn, preserve_rng_state, ...)"
    return None


def replace_checkpoint_implementations(
    module: Any,
    reentrant: Callable[[type], type],
    non_reentrant: Callable[[Callable[..., Any]], Callable[..., Any]],
    replace: Callable[[Any, str, Any], None],
) -> None:
    """Replace (``replace(module, name, new)``) what ``checkpoint()`` of a recognised ``module``
    calls: ``CheckpointFunction`` (``use_reentrant=True``) by ``reentrant(it)`` and
    ``_checkpoint_without_reentrant_generator`` by ``non_reentrant(it)``."""
    assert unrecognised_checkpoint(module) is None
    replace(module, "CheckpointFunction", reentrant(module.CheckpointFunction))
    generator = module._checkpoint_without_reentrant_generator
    replace(module, "_checkpoint_without_reentrant_generator", non_reentrant(generator))


def unrecognised_clipping(module: ModuleType | Any) -> str | None:
    """What in torch's clip_grad ``module`` differs from what :func:`replace_gradient_readers`
    relies on; None when nothing does."""
    for name in ("_get_total_norm", "_clip_grads_with_norm_", "clip_grad_value_"):
        code = code_of(getattr(module, name, None))
        if code is None or "_group_tensors_by_device_and_dtype" not in code.co_names:
            return f"{name} does not group gradients through _group_tensors_by_device_and_dtype"
    norm = code_of(getattr(module, "clip_grad_norm_", None))
    if norm is None or "_clip_grads_with_norm_" not in norm.co_names:
        return "clip_grad_norm_ does not hand its parameters to _clip_grads_with_norm_"
    if parameter_names(getattr(module, "_clip_grads_with_norm_", None))[:1] != ["parameters"]:
        return "_clip_grads_with_norm_ does not take the parameters first"
    return None


# A wrapper maker: (torch's function, what of its first argument are the tensors it reads) ->
# the function to put in its place.
GradientReaderWrap = Callable[[Callable[..., Any], Callable[[Any], Any]], Callable[..., Any]]


def replace_gradient_readers(
    module: Any, wrap: GradientReaderWrap, replace: Callable[[Any, str, Any], None]
) -> None:
    """Replace (``replace(module, name, new)``) the private functions through which a recognised
    clip_grad ``module`` reads gradients, whatever name its public functions were imported under:
    ``_group_tensors_by_device_and_dtype`` (the gradients: its first argument's first list) and
    ``_clip_grads_with_norm_`` (its first argument, the parameters)."""
    assert unrecognised_clipping(module) is None
    grouping = module._group_tensors_by_device_and_dtype
    replace(module, "_group_tensors_by_device_and_dtype", wrap(grouping, lambda lists: lists[0]))
    replace(module, "_clip_grads_with_norm_", wrap(module._clip_grads_with_norm_, lambda p: p))
