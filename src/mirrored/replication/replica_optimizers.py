"""The ``torch.optim.Optimizer`` face of N replicas' optimizers, one per replica.

A mirrored optimizer is a ``torch.optim.Optimizer`` so that what takes one (torch's LR schedulers,
hooks, ``repr``) takes it. This base class is that face: the hyperparameters and state are replica
0's (the original optimizer's, which every replica takes at its next step), step hooks reach every
optimizer that steps, and state-dict hooks are its own, since its ``state_dict()`` is not always
replica 0's. What a step does is :mod:`mirrored.replication.mirrored_optimizer`'s.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from mirrored.core.state_checks import check_optimizer_state
from mirrored.replication.mirrored_module import ReplicaHandles

__all__ = ["ReplicaOptimizers", "holds_any"]

# The kinds of state-dict hooks a mirrored optimizer keeps (torch.optim.Optimizer's).
_STATE_DICT_HOOKS = (
    "state_dict_pre",
    "state_dict_post",
    "load_state_dict_pre",
    "load_state_dict_post",
)


class ReplicaOptimizers(torch.optim.Optimizer):
    """One optimizer per replica, shown as replica 0's (the original)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        # torch.optim.Optimizer.__init__ is not called: the replicas' optimizers hold the state.
        # Its state-dict hooks are this optimizer's own (its state_dict() is not replica 0's
        # with zero_stage, and the replicas' are read and loaded to resync them).
        self._hooks: dict[str, OrderedDict[int, Callable[..., Any]]] = {
            name: OrderedDict() for name in _STATE_DICT_HOOKS
        }
        self.optimizers = tuple(optimizers)
        self._user_load_hooks: list[RemovableHandle] = []
        self._loading = False  # inside this optimizer's own load_state_dict()

    def forward_loads(self) -> None:
        """From now on, a state loaded into the original optimizer loads into this one."""
        self._user_load_hooks = _forward_user_loads(self)

    @contextmanager
    def _own_load(self) -> Iterator[None]:
        """This optimizer's own load, which reaches the original optimizer without being
        forwarded back."""
        self._loading = True
        try:
            yield
        finally:
            self._loading = False

    def stop_forwarding_loads(self) -> None:
        """Leave the original optimizer's loads to it alone (this one was released, or its
        strategy closed)."""
        _remove_all(self._user_load_hooks)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """Replica 0's optimizer: the original one; its hyperparameters drive every replica."""
        return self.optimizers[0]

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The original optimizer's groups: change hyperparameters here (schedulers do)."""
        return self.optimizers[0].param_groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The original optimizer's defaults."""
        return self.optimizers[0].defaults

    @property
    def state(self) -> Any:  # type: ignore[override]
        """Replica 0's per-parameter state (every replica holds the same; with ``zero_stage``
        each holds its share: use ``state_dict()`` for all of it; under a
        ``CentralStorageStrategy`` replica 0's shows the parameter device's)."""
        return self.optimizers[0].state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: a group added to one replica's optimizer would update that replica only."""
        raise TypeError(
            "add_param_group() on a mirrored optimizer would reach replica 0 only; add the group "
            "to the optimizer before strategy.mirror()"
        )

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> ReplicaHandles:  # type: ignore[override]
        """``hook`` on every optimizer that steps (called with that optimizer)."""
        return ReplicaHandles([o.register_step_pre_hook(hook) for o in self.stepping()])

    def register_step_post_hook(self, hook: Callable[..., Any]) -> ReplicaHandles:  # type: ignore[override]
        """``hook`` on every optimizer that steps (called with that optimizer)."""
        return ReplicaHandles([o.register_step_post_hook(hook) for o in self.stepping()])

    def stepping(self) -> Sequence[torch.optim.Optimizer]:
        """The optimizers whose ``step()`` makes the updates: every replica's."""
        return self.optimizers

    def register_state_dict_pre_hook(
        self, hook: Callable[..., Any], prepend: bool = False
    ) -> RemovableHandle:
        """``hook(optimizer)`` before each ``state_dict()`` of this mirrored optimizer."""
        return self._register("state_dict_pre", hook, prepend)

    def register_state_dict_post_hook(
        self, hook: Callable[..., Any], prepend: bool = False
    ) -> RemovableHandle:
        """``hook(optimizer, state_dict)`` after each ``state_dict()``; a dict it returns is
        the state dict."""
        return self._register("state_dict_post", hook, prepend)

    def register_load_state_dict_pre_hook(
        self, hook: Callable[..., Any], prepend: bool = False
    ) -> RemovableHandle:
        """``hook(optimizer, state_dict)`` before each ``load_state_dict()``; a dict it returns
        is loaded instead."""
        return self._register("load_state_dict_pre", hook, prepend)

    def register_load_state_dict_post_hook(
        self, hook: Callable[..., Any], prepend: bool = False
    ) -> RemovableHandle:
        """``hook(optimizer)`` after each ``load_state_dict()`` (into every replica)."""
        return self._register("load_state_dict_post", hook, prepend)

    def _register(self, kind: str, hook: Callable[..., Any], prepend: bool) -> RemovableHandle:
        hooks = self._hooks[kind]
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        if prepend:
            hooks.move_to_end(handle.id, last=False)
        return handle

    def _run_hooks(self, kind: str, *args: Any) -> Any:
        """Each ``kind`` hook with this optimizer (and the state dict, which one may replace);
        returns the state dict."""
        state = args[0] if args else None
        for hook in list(self._hooks[kind].values()):
            result = hook(self, *([state] if args else []))
            if result is not None:
                state = result
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise TypeError(
            "a mirrored optimizer stands for N replicas' optimizers and cannot be copied; "
            "save optimizer.state_dict()"
        )

    def __reduce__(self) -> Any:
        raise TypeError("a mirrored optimizer cannot be pickled; save optimizer.state_dict()")

    def __repr__(self) -> str:
        return f"MirroredOptimizer(replicas={len(self.optimizers)}, optimizer={self.optimizer!r})"


def _forward_user_loads(mirrored: ReplicaOptimizers) -> list[RemovableHandle]:
    """Make a state loaded into the original optimizer (the program's, which ``Model.optimizer``
    returns) a load into ``mirrored``, which reaches every replica's update: torch's own load
    would reach replica 0 alone, silently. A state that does not fit is refused before torch
    changes anything. The hooks hold ``mirrored`` weakly and go with it; while it loads (into
    replica 0's optimizer too: ``_own_load``) they stand aside."""
    me = weakref.ref(mirrored)
    pending: list[dict[str, Any] | None] = [None]  # the state torch is loading

    def before(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        target = me()
        pending[0] = None
        if target is not None and not target._loading:
            check_optimizer_state(optimizer, state_dict, "the optimizer state")
            pending[0] = state_dict

    def after(optimizer: torch.optim.Optimizer) -> None:
        target, state_dict = me(), pending[0]
        pending[0] = None
        if target is not None and state_dict is not None and not target._loading:
            target.load_state_dict(state_dict)

    original = mirrored.optimizers[0]
    handles = [
        original.register_load_state_dict_pre_hook(before),
        original.register_load_state_dict_post_hook(after),
    ]
    weakref.finalize(mirrored, _remove_all, handles)
    return handles


def _remove_all(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()


def holds_any(params: Iterable[nn.Parameter], tensor_ids: set[int]) -> bool:
    """Whether any of ``tensor_ids`` is one of ``params`` or the gradient of one: what torch's
    clipping, patched inside replicas (:mod:`mirrored.torch_patches`), asks of each mirrored or
    pipelined optimizer before it reads gradients."""
    return any(
        id(p) in tensor_ids or (p.grad is not None and id(p.grad) in tensor_ids) for p in params
    )
