"""What a program does to the model outside ``strategy.run``, carried to every replica.

Outside ``run`` the mirrored module hands out replica 0 (the user's module): a parameter frozen
by ``p.requires_grad = False``, an edit under ``torch.no_grad()`` (``p.mul_()``, ``p.copy_()``),
``p.data = ...``, a forward in training mode that moves BatchNorm's running statistics, a hook
registered with ``p.register_hook`` all change replica 0 alone. Before each run, what changed
on replica 0 since the last one is copied to the other replicas: a tensor whose version counter
or storage moved gets replica 0's values, a flag replica 0's flag, a hook registered on replica
0's parameter the same hook on the others' (and removed with it; one registered before
mirroring, which a deep copy does not copy, at the first run). Only what changed is touched,
so an untouched model costs one pass over its tensors' counters and hooks' ids per run.

An edit through ``p.data`` in place (``p.data.clamp_()``) does not move the version counter, by
torch's design: it reaches replica 0 only. ``check_replicas`` (:class:`ReplicaCheck`) finds it,
naming the tensor.
"""

from __future__ import annotations

import abc
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import nn

from mirrored._torch_internals import (
    HOOK_KINDS,
    NO_HOOK_IDS,
    backward_hooks_held,
    hook_ids,
    parameter_hooks,
    run_hooks_last,
)

__all__ = [
    "CarriesOutsideEdits",
    "OutsideEdits",
    "ReplicaCheck",
    "ReplicasDifferError",
    "has_program_hooks",
    "internal_hook",
    "program_hooks_suspended",
    "named_tensors",
    "tensors_of",
]

HookT = TypeVar("HookT", bound=Callable[..., Any])

# (version counter, storage address, requires_grad) of a tensor.
_Mark = tuple[int, int, bool]
_ABSENT = object()
# (tensor's index, hook kind, replica 0's hook id) -> the same hook's handles on the others.
_HookKey = tuple[int, str, int]


def named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters then buffers by name, in an order that is the same on every replica."""
    parameters = module.named_parameters(remove_duplicate=False)
    return [*parameters, *module.named_buffers(remove_duplicate=False)]


def tensors_of(module: nn.Module) -> list[torch.Tensor]:
    """``named_tensors``' tensors."""
    return [tensor for _, tensor in named_tensors(module)]


class CarriesOutsideEdits(abc.ABC):
    """A replicated module whose replica 0 the program may change between runs."""

    @abc.abstractmethod
    def carry_outside_edits(self) -> None:
        """Before a run: replica 0's changes since the last run onto every replica."""

    @abc.abstractmethod
    def mark_outside_edits(self) -> None:
        """After a run: what later changes are measured from."""

    @abc.abstractmethod
    def check_replicas(self, when: str) -> None:
        """Raise ``ReplicasDifferError`` unless every replica is bit-identical to replica 0."""


def _buffer_siblings(
    named: Sequence[tuple[str, torch.Tensor]], module: nn.Module
) -> dict[int, list[int]]:
    """For each buffer's index in ``named`` (``named_tensors(module)``: parameters, then
    buffers), the indices of the buffers of the same submodule."""
    num_parameters = len(list(module.named_parameters(remove_duplicate=False)))
    by_owner: dict[str, list[int]] = {}
    for index in range(num_parameters, len(named)):
        by_owner.setdefault(named[index][0].rpartition(".")[0], []).append(index)
    return {index: group for group in by_owner.values() for index in group}


def _mark(tensor: torch.Tensor) -> _Mark:
    return tensor._version, tensor.data_ptr(), tensor.requires_grad


class _Layout:
    """Where a module's submodules, parameters and buffers are held: each module's three dicts
    with their entries, so that whether any was added, removed or replaced since (what
    ``named_tensors`` would see differently) costs one identity check per entry, not a walk
    that names them all."""

    def __init__(self, root: nn.Module) -> None:
        self._sizes = [
            (holder, len(holder))
            for _, module in root.named_modules(remove_duplicate=False)
            for holder in (module._modules, module._parameters, module._buffers)
        ]
        self._entries = [
            (holder, key, value) for holder, _ in self._sizes for key, value in holder.items()
        ]

    def unchanged(self) -> bool:
        return all(len(holder) == size for holder, size in self._sizes) and all(
            holder.get(key, _ABSENT) is value for holder, key, value in self._entries
        )


class OutsideEdits:
    """Carries replica 0's changes made between runs to the other replicas."""

    def __init__(self, replicas: Sequence[nn.Module]) -> None:
        self._replicas = tuple(replicas)
        self._hooks: dict[_HookKey, list[Any]] = {}
        self._tensors: list[list[torch.Tensor]] = [[] for _ in self._replicas]
        self._names: list[str] = []
        self._layout: _Layout | None = None
        self._marks: list[_Mark] = []
        # Per tensor: the program's hooks on replica 0 that every replica has; the ids of
        # replica 0's hooks (hook_ids) when those were last reconciled with them, and when the
        # last run started.
        self._hook_ids: list[frozenset[_HookKey]] = []
        self._seen_hooks: list[tuple[tuple[int, ...], ...]] = []
        self._at_start: list[tuple[tuple[int, ...], ...]] = []
        self._siblings: dict[int, list[int]] = {}
        self._refresh_tensors()
        first = self._tensors[0]
        self._marks = [_mark(t) for t in first]
        # Taken as hookless: a deep copy of a module does not copy its tensors' hooks, so the
        # first run carries those the program registered before mirroring.
        self._seen_hooks = [NO_HOOK_IDS] * len(first)
        self._hook_ids = [frozenset()] * len(first)

    def mark(self, after_run: bool = True) -> None:
        """The state every later change is measured from: after a run, or (``after_run``
        False) once the replicas were made copies of replica 0 again (a resync). After a run
        also the hooks the replica function registered, on every replica: not to be carried."""
        self._refresh_tensors()
        first = self._tensors[0]
        self._marks = [_mark(t) for t in first]
        if not after_run:
            return
        for index, tensor in enumerate(first):
            if isinstance(tensor, nn.Parameter) and hook_ids(tensor) != self._at_start[index]:
                self._take_hooks_of_the_run(index, tensor)

    def _take_hooks_of_the_run(self, index: int, tensor: torch.Tensor) -> None:
        """The program's hooks on replica 0's parameter ``index`` that were not there when the
        run started: the replica function registered them on every replica."""
        before = {
            (kind, hook_id)
            for kind, ids in zip(HOOK_KINDS, self._at_start[index], strict=True)
            for hook_id in ids
        }
        added = {key for key in self._hook_keys(index, tensor) if key[1:] not in before}
        if added:
            self._hook_ids[index] = self._hook_ids[index] | added
            self._run_internal_hooks_last(index)
        self._at_start[index] = hook_ids(tensor)  # taken: a second mark finds nothing new

    def _refresh_tensors(self) -> None:
        """The replicas' tensors looked up again where replica 0's moved (a run may reassign
        a buffer). New tensors' hooks are taken as every replica's."""
        if self._layout is not None and self._layout.unchanged():
            return
        named = named_tensors(self._replicas[0])
        first = [t for _, t in named]
        cached = self._tensors[0]
        if len(first) != len(cached) or any(a is not b for a, b in zip(first, cached, strict=True)):
            self._tensors = [first] + [tensors_of(r) for r in self._replicas[1:]]
            self._names = [name for name, _ in named]
            self._siblings = _buffer_siblings(named, self._replicas[0])
            self._hook_ids = [self._hook_keys(i, t) for i, t in enumerate(first)]
            self._seen_hooks = [hook_ids(t) for t in first]
            self._at_start = list(self._seen_hooks)
        self._layout = _Layout(self._replicas[0])

    def _run_internal_hooks_last(self, index: int) -> None:
        """The gradient reducer's hook on tensor ``index`` sees what the program's made."""
        for tensors in self._tensors:
            run_hooks_last(tensors[index], _INTERNAL_HOOKS.__contains__)

    def carry(self) -> None:
        """Before a run: replica 0's changes since ``mark`` onto every other replica."""
        first = self._tensors[0]
        changed: dict[int, bool] = {}  # index -> whether its requires_grad changed
        for index, tensor in enumerate(first):
            mark = _mark(tensor)
            if mark != self._marks[index]:
                changed[index] = mark[2] != self._marks[index][2]
                # Some kernels write in place without counting a version (BatchNorm's running
                # statistics): a module's changed buffer stands for all of its buffers.
                changed.update((sibling, False) for sibling in self._siblings.get(index, ()))
        for index, changed_flag in changed.items():
            self._carry_tensor(index, first[index], changed_flag)
            self._marks[index] = _mark(first[index])
        # After the flags: torch registers no hook on a tensor that requires no gradient, so a
        # frozen parameter's hooks wait for the first run after it trains again.
        for index, tensor in enumerate(first):
            if not isinstance(tensor, nn.Parameter):
                continue
            ids = hook_ids(tensor)
            if ids != self._seen_hooks[index] and tensor.requires_grad:
                keys = self._hook_keys(index, tensor)
                if keys != self._hook_ids[index]:
                    self._carry_hooks(index, tensor, keys)
                ids = self._seen_hooks[index] = hook_ids(tensor)
            self._at_start[index] = ids

    def _carry_tensor(self, index: int, source: torch.Tensor, changed_flag: bool) -> None:
        with torch.no_grad():
            for tensors in self._tensors[1:]:
                target = tensors[index]
                if target.shape != source.shape or target.dtype != source.dtype:
                    raise ValueError(
                        f"replica 0's tensor #{index} became {tuple(source.shape)} "
                        f"{source.dtype} outside strategy.run; change a module's structure "
                        "before strategy.mirror(), or load a state into every replica with "
                        "model.load_state_dict()"
                    )
                target.copy_(source)
                if changed_flag:
                    target.requires_grad_(source.requires_grad)

    def _hook_keys(self, index: int, tensor: torch.Tensor) -> frozenset[_HookKey]:
        """The user's hooks on replica 0's tensor (mirrored's own are every replica's)."""
        return frozenset(
            (index, kind, hook_id)
            for kind, hooks in parameter_hooks(tensor).items()
            for hook_id, hook in hooks.items()
            if hook not in _INTERNAL_HOOKS
        )

    def _reduced_in_backward(self, index: int) -> bool:
        """Whether mirrored's gradient reducer watches the parameter at ``index``."""
        hooks = parameter_hooks(self._tensors[0][index])["backward"].values()
        return any(hook in _INTERNAL_HOOKS for hook in hooks)

    def _carry_hooks(self, index: int, tensor: torch.Tensor, keys: frozenset[_HookKey]) -> None:
        """Hooks registered on replica 0's parameter since ``mark`` onto the others'; the
        others' copies of hooks since removed from replica 0, removed."""
        hooks = parameter_hooks(tensor)
        new = keys - self._hook_ids[index]
        if any(kind == "post_accumulate_grad" for _, kind, _ in new) and self._reduced_in_backward(
            index
        ):  # refused before any hook is carried
            raise ValueError(
                "a hook registered with register_post_accumulate_grad_hook on mirrored parameter "
                f"{self._names[index]!r} runs before the replicas' gradients are summed (at the "
                "end of backward), and the sum replaces what it did; change the gradient inside "
                "the replica function after loss.backward(), or with register_hook"
            )
        for key in new:
            _, kind, hook_id = key
            register = _REGISTER[kind]
            hook = hooks[kind][hook_id]
            self._hooks[key] = [register(t[index], hook) for t in self._tensors[1:]]
        for key in self._hook_ids[index] - keys:
            for handle in self._hooks.pop(key, ()):
                handle.remove()
        self._hook_ids[index] = keys
        self._run_internal_hooks_last(index)


# Hooks mirrored registers on every replica's parameters itself (the gradient reducer's).
_INTERNAL_HOOKS: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


def has_program_hooks(tensor: torch.Tensor) -> bool:
    """Whether the program (not mirrored) registered a gradient hook on ``tensor``."""
    return any(
        hook not in _INTERNAL_HOOKS
        for hooks in parameter_hooks(tensor).values()
        for hook in hooks.values()
    )


@contextmanager
def program_hooks_suspended(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """The program's ``register_hook`` hooks on ``tensors`` suspended in the block (mirrored's
    own stay), then back in their order: a traced step's gradients are computed without them,
    which run when the replay hands the gradients to autograd's accumulation."""
    suspended = []
    for tensor in tensors:
        hooks = backward_hooks_held(tensor)
        if hooks and any(hook not in _INTERNAL_HOOKS for hook in hooks.values()):
            suspended.append((hooks, list(hooks.items())))
            for key, hook in list(hooks.items()):
                if hook not in _INTERNAL_HOOKS:
                    del hooks[key]
    try:
        yield
    finally:
        for hooks, items in suspended:
            hooks.clear()
            hooks.update(items)


def internal_hook(hook: HookT) -> HookT:
    """Mark ``hook`` as mirrored's own, registered on every replica: not carried."""
    _INTERNAL_HOOKS.add(hook)
    return hook


_REGISTER: dict[str, Callable[[torch.Tensor, Callable[..., Any]], Any]] = {
    "backward": lambda tensor, hook: tensor.register_hook(hook),
    "post_accumulate_grad": lambda tensor, hook: tensor.register_post_accumulate_grad_hook(hook),
}


class ReplicasDifferError(RuntimeError):
    """The replicas of a mirrored module hold different values where they must be identical."""


class ReplicaCheck:
    """``check_replicas``: every replica's parameters and buffers bit-identical to replica 0's,
    before and after each run, or an error naming the tensor. A debugging aid: it reads every
    tensor of every replica, twice a run."""

    def __init__(self, replicas: Sequence[nn.Module]) -> None:
        self._replicas = tuple(replicas)

    def verify(self, when: str) -> None:
        """``when``: "before a run" (after replica 0's outside edits were carried) or "after a
        run"; it says in the error what could have made them differ."""
        first = named_tensors(self._replicas[0])
        for replica_id, replica in enumerate(self._replicas[1:], start=1):
            for (name, source), (_, tensor) in zip(first, named_tensors(replica), strict=True):
                difference = _difference(source, tensor)
                if difference is not None:
                    raise ReplicasDifferError(
                        f"{when}, {name!r} {difference} on replica {replica_id} and replica 0. "
                        + _CAUSES[when]
                    )


_CAUSES = {
    "before a run": (
        "An edit through .data outside strategy.run (p.data.clamp_()) reaches replica 0 only: "
        "torch's version counter does not see it; edit under torch.no_grad() instead, or "
        "inside the replica function"
    ),
    "after a run": (
        "The replica function changed it differently on the replicas (an edit that depends on "
        "the replica's shard, or a parameter updated outside a mirrored optimizer)"
    ),
}


def _difference(source: torch.Tensor, tensor: torch.Tensor) -> str | None:
    """How ``tensor`` differs from ``source`` (flag or values), or None."""
    if source.requires_grad != tensor.requires_grad:
        return f"has requires_grad={tensor.requires_grad} and {source.requires_grad}"
    mine, theirs = tensor.detach().cpu(), source.detach().cpu()
    if torch.equal(mine, theirs):
        return None
    gap = (mine.double() - theirs.double()).abs().max().item()
    return f"differs by up to {gap:.3g}"
