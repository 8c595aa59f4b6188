"""Does a saved state fit this module or this optimizer? Checked before anything is loaded.

``nn.Module.load_state_dict`` copies the tensors that fit before it reports those that do not,
and ``Optimizer.load_state_dict`` takes another optimizer's state, replaces the hyperparameters,
then fails halfway (or at the next step). Every load in mirrored runs these checks first, so a
load changes all or nothing, and its error names the entry and what was expected. Which state
an optimizer keeps is learnt from the optimizer itself: one step of a scratch copy, with the
same hyperparameters, on a tiny parameter.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from typing import Any

import torch

from mirrored.core.param_groups import hyperparameters

__all__ = [
    "check_module_state",
    "check_optimizer_groups_state",
    "check_optimizer_state",
    "check_scheduler_state",
    "first_non_finite",
]

_LIKE_PARAMETER = "a tensor of the parameter's shape"
_NUMBER = "a number"
# A probe's sizes, as many as the parameter has dimensions: all different, so that an entry per
# element is told from one per row or per column.
_PROBE_SIZES = (2, 3, 4, 5, 6, 7, 8, 9)


def check_module_state(module: Any, state_dict: Any, source: str) -> None:
    """Raise a ValueError naming every missing key, unexpected key, non-tensor and shape
    mismatch between ``state_dict`` and ``module`` (an ``nn.Module`` or a mirrored one)."""
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"{source}: expected a state dict (a mapping), got {type(state_dict)}")
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    mismatched = []
    for key, value in expected.items():
        if key not in state_dict or not isinstance(value, torch.Tensor):
            continue  # extra state (get_extra_state) is whatever its module makes of it
        saved = state_dict[key]
        if not isinstance(saved, torch.Tensor):
            mismatched.append(f"{key}: checkpoint {type(saved).__name__}, model a tensor")
        elif saved.shape != value.shape:
            mismatched.append(f"{key}: checkpoint {tuple(saved.shape)}, model {tuple(value.shape)}")
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    if mismatched:
        problems.append(f"different shapes or types ({'; '.join(mismatched)})")
    if problems:
        raise ValueError(
            f"{source} does not fit this model: {', '.join(problems)}. Load weights saved from "
            "the same architecture; nothing was loaded"
        )


def check_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: Any, source: str) -> None:
    """Raise a ValueError unless ``optimizer.load_state_dict(state_dict)`` would load it whole
    into an optimizer that can step: the same number and sizes of parameter groups, every
    hyperparameter, and for each parameter with state every entry this kind of optimizer keeps,
    of the parameter's shape where it is per element."""
    _check_optimizer(type(optimizer), optimizer.param_groups, state_dict, source)


def check_optimizer_groups_state(
    param_groups: Sequence[Mapping[str, Any]], state_dict: Any, source: str
) -> None:
    """``check_optimizer_state`` for an optimizer known by its parameter groups alone (its
    parameters and hyperparameters; a ps job's optimizers live on the ps tasks): each
    parameter's state is checked to be a dict, not for the entries of a kind."""
    _check_optimizer(None, param_groups, state_dict, source)


def _check_optimizer(
    builder: Callable[..., torch.optim.Optimizer] | None,
    groups: Sequence[Mapping[str, Any]],
    state_dict: Any,
    source: str,
) -> None:
    kind = "optimizer" if builder is None else getattr(builder, "__name__", str(builder))
    _check_layout(state_dict, source)
    saved_groups = state_dict["param_groups"]
    _check_groups(builder, kind, groups, saved_groups, source)
    params = {
        saved_id: (g, param)
        for g, (group, saved) in enumerate(zip(groups, saved_groups, strict=True))
        for saved_id, param in zip(saved["params"], group["params"], strict=True)
    }
    kept: dict[tuple[int, int], dict[str, str | None] | None] = {}
    for saved_id, entry in state_dict["state"].items():
        if saved_id not in params:
            listed = list(chain.from_iterable(g["params"] for g in saved_groups))
            raise ValueError(
                f"{source}: the optimizer state has state for parameter {saved_id!r}, which no "
                f"parameter group lists ({listed})"
            )
        g, param = params[saved_id]
        if (g, param.dim()) not in kept:
            kept[g, param.dim()] = _kept_state(builder, groups[g], param)
        where = f"{source}: optimizer state for parameter {saved_id}"
        _check_parameter_state(kind, kept[g, param.dim()], entry, param, where)


def _check_layout(state_dict: Any, source: str) -> None:
    """A ValueError unless ``state_dict`` is laid out as a torch optimizer's."""
    if (
        not isinstance(state_dict, Mapping)
        or not isinstance(state_dict.get("state"), Mapping)
        or not isinstance(state_dict.get("param_groups"), list)
        or not all(
            isinstance(g, Mapping) and isinstance(g.get("params"), list)
            for g in state_dict["param_groups"]
        )
    ):
        raise ValueError(
            f"{source}: the optimizer state is not a torch optimizer's state_dict() (a dict of "
            f"'state' and 'param_groups', each group with its 'params'); got "
            f"{_describe(state_dict)}"
        )


# Keys torch adds to a parameter group after it is made: a scheduler's starting rate.
_ADDED_BY_TORCH = {"initial_lr"}


def _check_groups(
    builder: Callable[..., torch.optim.Optimizer] | None,
    kind: str,
    groups: Sequence[Mapping[str, Any]],
    saved_groups: Sequence[Mapping[str, Any]],
    source: str,
) -> None:
    """A ValueError unless the saved groups have the groups' sizes and, once loaded, every
    hyperparameter they have."""
    sizes = [len(g["params"]) for g in groups]
    saved_sizes = [len(g["params"]) for g in saved_groups]
    if sizes != saved_sizes:
        raise ValueError(
            f"{source}: the optimizer state has parameter groups of {saved_sizes} parameters, "
            f"the model's {kind} {sizes}; save and load the same model and optimizer"
        )
    for g, (group, saved) in enumerate(zip(groups, saved_groups, strict=True)):
        where = f"{source}: the optimizer state's parameter group {g}"
        missing = sorted(
            set(hyperparameters(group)) - _loaded_hyperparameters(builder, group, saved, where)
        )
        if missing:
            raise ValueError(
                f"{where} has no {missing} ({_saved_by_hyperparameters(saved)}); the model's "
                f"optimizer is {kind}"
            )
        # Loaded, a key the optimizer does not have would join its group, and the model would
        # then refuse its own earlier checkpoints. LR schedulers add 'initial_lr' to a group.
        extra = sorted(set(hyperparameters(saved)) - set(hyperparameters(group)) - _ADDED_BY_TORCH)
        if extra:
            raise ValueError(
                f"{where} has {extra}, which the model's {kind} does not have "
                f"({_saved_by_hyperparameters(saved)}); save and load the same optimizer"
            )


def _check_parameter_state(
    kind: str,
    rules: dict[str, str | None] | None,
    entry: Any,
    param: torch.Tensor,
    where: str,
) -> None:
    """A ValueError unless ``entry``, one parameter's saved state, holds every entry of
    ``rules`` (what this kind of optimizer keeps; None: unknown, unchecked), each fitting it."""
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where} is {_describe(entry)}, not a dict of its state")
    for key, rule in (rules or {}).items():
        if key not in entry:
            raise ValueError(
                f"{where} has no {key!r} ({_saved_by_state(entry)}); the model's optimizer "
                f"is {kind}"
            )
        problem = _breaks(rule, entry[key], param)
        if problem:
            raise ValueError(f"{where}: {key!r} is {problem}; the model's {kind} expects {rule}")


def check_scheduler_state(scheduler: Any, state: Any, source: str, fix: str = "") -> None:
    """A ``ValueError`` naming ``source`` unless ``state`` holds every entry of the LR
    ``scheduler``'s own state dict; ``fix`` ends the message."""
    expected = scheduler.state_dict()
    if not isinstance(state, Mapping) or not set(expected) <= set(state):
        keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(
            f"{source}: the learning-rate schedule's state has {keys}, the "
            f"{type(scheduler).__name__} keeps {sorted(expected)}{fix}"
        )


def first_non_finite(state_dict: Mapping[str, Any]) -> str | None:
    """The key of the first floating tensor of ``state_dict`` holding a NaN or an infinity
    (None if there is none): what a checkpoint must not hold."""
    for key, value in state_dict.items():
        floating = isinstance(value, torch.Tensor) and value.is_floating_point()
        if floating and not bool(torch.isfinite(value).all()):
            return key
    return None


# -- what an optimizer keeps ----------------------------------------------------------------------
def _scratch(
    kind: Callable[..., torch.optim.Optimizer] | None,
    hyperparameters: Mapping[str, Any],
    like: Any = None,
) -> tuple[torch.optim.Optimizer, torch.Tensor] | None:
    """An optimizer of ``kind`` with ``hyperparameters`` on a tiny parameter with a gradient,
    with as many dimensions as ``like`` (two without it), on its device, of its floating dtype;
    None for an unknown kind, or one that cannot be built from its parameter groups alone."""
    if kind is None:
        return None
    floating = isinstance(like, torch.Tensor) and like.is_floating_point()
    probe = torch.zeros(
        _PROBE_SIZES[: like.dim() if isinstance(like, torch.Tensor) else 2],
        dtype=like.dtype if floating else torch.float32,
        device=like.device if floating else "cpu",
        requires_grad=True,
    )
    probe.grad = torch.ones_like(probe)
    try:
        return kind([{**hyperparameters, "params": [probe]}]), probe
    except Exception:
        return None


def _loaded_hyperparameters(
    kind: Callable[..., torch.optim.Optimizer] | None,
    group: Mapping[str, Any],
    saved: Mapping[str, Any],
    where: str,
) -> set[str]:
    """The hyperparameters a group has once ``saved`` is loaded into it: the saved ones, and
    those torch fills in for state dicts of older versions (a scratch optimizer's load tells)."""
    made = _scratch(kind, hyperparameters(group), next(iter(group["params"]), None))
    if made is None:
        return set(hyperparameters(saved))
    scratch, _ = made
    try:
        scratch.load_state_dict({"state": {}, "param_groups": [{**saved, "params": [0]}]})
    except Exception as error:  # the real load would fail the same way, halfway
        raise ValueError(
            f"{where} does not load into a {type(scratch).__name__}: {error!r}"
        ) from error
    return set(hyperparameters(scratch.param_groups[0]))


def _kept_state(
    kind: Callable[..., torch.optim.Optimizer] | None,
    group: Mapping[str, Any],
    param: torch.Tensor,
) -> dict[str, str | None] | None:
    """Each entry the state of ``param`` (of ``group``) holds once the optimizer has stepped
    it, with what it must be (None: anything); None where a scratch copy cannot step (an
    optimizer that needs a closure or other arguments)."""
    made = _scratch(kind, hyperparameters(group), param)
    if made is None:
        return None
    scratch, probe = made
    try:
        scratch.step()
    except Exception:
        return None
    rules: dict[str, str | None] = {}
    for key, value in scratch.state[probe].items():
        if isinstance(value, torch.Tensor) and value.shape == probe.shape:
            rules[key] = _LIKE_PARAMETER
        elif isinstance(value, (int, float)) or (
            isinstance(value, torch.Tensor) and value.numel() == 1
        ):
            rules[key] = _NUMBER
        else:
            rules[key] = None
    return rules


@functools.cache
def _known_kinds() -> tuple[tuple[str, frozenset[str], frozenset[str]], ...]:
    """(name, hyperparameter names, state entries) of torch.optim's optimizers, with their
    defaults and, where they have momentum, with it on: what a saved state is compared with to
    say which optimizer saved it."""
    kinds = []
    for kind in vars(torch.optim).values():
        if not isinstance(kind, type) or not issubclass(kind, torch.optim.Optimizer):
            continue
        for settings in ({}, {"momentum": 0.9}):
            made = _scratch(kind, settings)
            if made is None or (settings and "momentum" not in made[0].defaults):
                continue
            scratch, probe = made
            try:
                scratch.step()
            except Exception:
                continue
            names = frozenset(hyperparameters(scratch.param_groups[0]))
            kinds.append((kind.__name__, names, frozenset(scratch.state[probe])))
    return tuple(kinds)


def _saved_by_state(entry: Mapping[str, Any]) -> str:
    names = sorted({name for name, _, keys in _known_kinds() if keys == set(entry)})
    guess = f": saved by {' or '.join(names)}?" if names else ""
    return f"it holds {sorted(entry)}{guess}"


def _saved_by_hyperparameters(saved: Mapping[str, Any]) -> str:
    saved_names = set(hyperparameters(saved))
    names = sorted({name for name, keys, _ in _known_kinds() if keys == saved_names})
    guess = f": saved by {' or '.join(names)}?" if names else ""
    return f"it has {sorted(saved_names)}{guess}"


def _breaks(rule: str | None, value: Any, param: torch.Tensor) -> str | None:
    """What is wrong with a saved state ``value`` under ``rule`` (None: nothing)."""
    if rule == _LIKE_PARAMETER:
        if not isinstance(value, torch.Tensor):
            return _describe(value)
        if value.shape != param.shape:
            return f"of shape {tuple(value.shape)} for a parameter of shape {tuple(param.shape)}"
    if rule == _NUMBER:
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            return f"a tensor of shape {tuple(value.shape)}"
        if not isinstance(value, (torch.Tensor, int, float)) or isinstance(value, bool):
            return _describe(value)
        if not isinstance(value, torch.Tensor) and not math.isfinite(value):
            return repr(value)
    return None


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
