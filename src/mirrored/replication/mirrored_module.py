"""The mirrored module: one replica of a module per device, standing for the module itself.

``strategy.mirror(model)`` returns a ``MirroredModule``. Calls and attribute reads inside
``strategy.run`` reach the current replica; outside, replica 0 (the user's module), with changes
of flags and hooks reaching every replica, so that the replicas never differ. This module also
keeps the registry of which module is replica 0 of which live mirror, so that a module is not
mirrored twice.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mirrored.core.context import ReplicaContext, current_replica_context
from mirrored.core.trace_recording import deferred_to_replay
from mirrored.replication.buffer_sync import BufferSync, SyncsBuffers
from mirrored.replication.mirror_features import NO_FEATURES, MirrorFeatures
from mirrored.replication.outside_edits import (
    CarriesOutsideEdits,
    OutsideEdits,
    ReplicaCheck,
    tensors_of,
)

if TYPE_CHECKING:
    from mirrored.core.replica_set import ReplicaSet

__all__ = ["MIRRORED_BY", "MirroredModule", "ReplicaHandles", "replica_context_of", "tensors_of"]


def replica_context_of(strategy: ReplicaSet) -> ReplicaContext | None:
    """The current replica's context if it is one of ``strategy``'s replicas, else None."""
    replica = current_replica_context()
    return replica if replica is not None and replica.strategy is strategy else None


class ReplicaHandles:
    """The hook handles of every replica, removed together."""

    def __init__(self, handles: Sequence[Any]) -> None:
        self.handles = list(handles)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def __enter__(self) -> ReplicaHandles:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


# What a MirroredModule sets on itself (a lookup of these must not reach a replica).
_OWN_ATTRIBUTES = {
    "_strategy",
    "replicas",
    "_features",
    "_optimizers",
    "released",
    "_buffer_sync",
    "_outside_edits",
    "_reducers",
}
# nn.Module methods that would move or retype one replica only.
_FORBIDDEN = {"to", "cuda", "cpu", "xpu", "half", "float", "double", "bfloat16", "type", "to_empty"}
# nn.Module methods that must reach every replica (flags, hooks). Structural changes
# (register_buffer, add_module) belong before strategy.mirror().
_BROADCAST = {
    "requires_grad_",
    "register_forward_hook",
    "register_forward_pre_hook",
    "register_full_backward_hook",
    "register_full_backward_pre_hook",
}


class MirroredModule(SyncsBuffers, CarriesOutsideEdits):
    """One replica of a module per device of a strategy; calls go to the current replica.

    Inside ``strategy.run`` attribute access reaches the current replica. Outside, reads reach
    replica 0, submodules come back mirrored (so ``model.encoder.requires_grad_(False)`` freezes
    every replica), changes of flags and hooks reach every replica, and ``apply(fn)`` runs on
    every replica and then copies replica 0's values to the others (so a random init stays
    identical). Moving or retyping one replica (``.to()``, ``.half()``) is an error: mirror the
    module after moving it. Buffers a replica changes are made the same on every replica after
    each run (:mod:`mirrored.replication.buffer_sync`); what the program changes on replica 0
    between runs reaches every replica before the next (:mod:`mirrored.replication.outside_edits`).
    """

    def __init__(
        self,
        strategy: ReplicaSet,
        replicas: Sequence[nn.Module],
        features: MirrorFeatures = NO_FEATURES,
    ) -> None:
        object.__setattr__(self, "_strategy", strategy)
        object.__setattr__(self, "replicas", tuple(replicas))
        object.__setattr__(self, "_features", features)  # its optimizers' (accumulation)
        object.__setattr__(self, "_optimizers", weakref.WeakSet())
        object.__setattr__(self, "released", False)
        object.__setattr__(self, "_buffer_sync", BufferSync(replicas))
        object.__setattr__(self, "_outside_edits", None)  # made when a strategy tracks it
        object.__setattr__(self, "_reducers", [])  # what sums its gradients in backward

    def _current(self) -> nn.Module:
        replica = replica_context_of(self._strategy)
        if self.released and replica is not None:
            raise RuntimeError(
                "this mirrored module was released (its module was mirrored again since); "
                "train through the new mirrored module"
            )
        return self.replicas[0 if replica is None else replica.local_replica_id]

    @property
    def has_buffers(self) -> bool:
        return not self._buffer_sync.empty

    @property
    def buffer_sync(self) -> BufferSync:
        """What keeps the replicas' buffers the same after each run."""
        buffer_sync: BufferSync = self._buffer_sync
        return buffer_sync

    def sync_buffers(self, replica: ReplicaContext) -> None:
        """At the end of a run, on every replica: the buffers any replica changed made the
        same on all (:mod:`mirrored.replication.buffer_sync`)."""
        self._buffer_sync.sync(replica)

    def keep_reducer(self, reducer: Any) -> None:
        """Hold what sums (some of) the replicas' gradients in backward for as long as the
        module trains: a module mirrored without an optimizer has one of its own, and one whose
        mirrored optimizer the program dropped (``model, _ = strategy.mirror(m, opt)``) still
        gets the global batch's gradients (the parameters' hooks hold reducers weakly)."""
        if reducer is not None:
            self._reducers.append(reducer)

    def carry_outside_edits(self) -> None:
        if self._outside_edits is None:  # a submodule's mirror: its root carries for it
            return
        self._outside_edits.carry()

    def mark_outside_edits(self) -> None:
        if self._outside_edits is None:
            object.__setattr__(self, "_outside_edits", OutsideEdits(self.replicas))
        else:
            self._outside_edits.mark()

    def check_replicas(self, when: str) -> None:
        ReplicaCheck(self.replicas).verify(when)

    def release(self) -> None:
        """Give up these replicas, so that the module (replica 0) can be mirrored again; this
        mirrored module and its optimizers can no longer train. ``Model.compile`` releases the
        model's previous mirror itself."""
        MIRRORED_BY.release(self)
        object.__setattr__(self, "released", True)
        for optimizer in list(self._optimizers):
            optimizer.release()
        self._strategy.untrack_replicated(self)

    def _in_replica(self) -> bool:
        return replica_context_of(self._strategy) is not None

    def _cross_replica(self, parts: Sequence[Any]) -> Any:
        """A value read outside ``run``: submodules mirrored (with this module's features, so
        that their ``zero_grad`` keeps the gradients an accumulation window holds), anything
        else replica 0's."""
        if isinstance(parts[0], nn.Module):
            return MirroredModule(self._strategy, parts, self._features)
        return parts[0]

    @property
    def module(self) -> nn.Module:
        """Replica 0: the original module."""
        return self.replicas[0]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._current()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in _OWN_ATTRIBUTES:
            raise AttributeError(name)  # copy/pickle probes, or a half-built object
        if name in _FORBIDDEN:
            return lambda *args, **kwargs: _refuse(name)
        if self._in_replica():
            return getattr(self._current(), name)
        if name in _BROADCAST:
            return lambda *args, **kwargs: self._broadcast(name, args, kwargs)
        return self._cross_replica([getattr(r, name) for r in self.replicas])

    def _broadcast(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        results = [getattr(r, name)(*args, **kwargs) for r in self.replicas]
        return self if isinstance(results[0], nn.Module) else ReplicaHandles(results)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise TypeError(
            "a mirrored module stands for N replicas and cannot be deep-copied; copy "
            "model.module (replica 0) or save model.state_dict()"
        )

    def __reduce__(self) -> Any:
        raise TypeError(
            "a mirrored module cannot be pickled; save model.state_dict() (or model.module)"
        )

    def __bool__(self) -> bool:
        return True

    def __getitem__(self, index: Any) -> Any:
        if self._in_replica():
            return self._current()[index]  # type: ignore[index]
        return self._cross_replica([r[index] for r in self.replicas])

    def __len__(self) -> int:
        return len(self.replicas[0])

    def __iter__(self) -> Any:
        if self._in_replica():
            return iter(self._current())  # type: ignore[call-overload]
        children = zip(*self.replicas, strict=True)
        return (self._cross_replica(parts) for parts in children)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"cannot set {name!r} on a mirrored module (it stands for {len(self.replicas)} "
            "replicas); set it on the module before strategy.mirror(), or on each of .replicas"
        )

    def __repr__(self) -> str:
        return f"MirroredModule(replicas={len(self.replicas)}, module={self.replicas[0]!r})"

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The plain single-model state (replica 0's; all replicas are identical)."""
        return self.replicas[0].state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Load the same state into every replica."""
        results = [r.load_state_dict(state_dict, strict=strict) for r in self.replicas]
        return results[0]

    def apply(self, fn: Any) -> MirroredModule:
        """``fn`` on every submodule of every replica, then replica 0's values to all."""
        for replica in self.replicas:
            replica.apply(fn)
        self.resync()
        return self

    def resync(self) -> None:
        """Copy replica 0's parameters, buffers and gradients (or their absence) into the other
        replicas: after a failed run, each replica's gradients are summed onto what it holds."""
        first = tensors_of(self.replicas[0])
        first_params = list(self.replicas[0].parameters())
        with torch.no_grad():
            for replica in self.replicas[1:]:
                for mine, source in zip(tensors_of(replica), first, strict=True):
                    mine.copy_(source)
                for param, source in zip(replica.parameters(), first_params, strict=True):
                    param.grad = (
                        None if source.grad is None else source.grad.to(param.device, copy=True)
                    )
        for reducer in self._reducers:
            reducer.reset()
        if self._outside_edits is not None:  # hooks still to be carried stay so
            self._outside_edits.mark(after_run=False)

    def train(self, mode: bool = True) -> MirroredModule:
        """Set training mode on every replica."""
        for replica in self.replicas:
            replica.train(mode)
        return self

    def eval(self) -> MirroredModule:
        """Set evaluation mode on every replica."""
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The current replica's gradients inside ``strategy.run``, every replica's outside;
        not a replica's inside a mirrored optimizer's accumulation window (they are the
        window's so far)."""
        if deferred_to_replay(self.zero_grad, set_to_none):  # a traced step: at each replay
            return
        replica = replica_context_of(self._strategy)
        ids = range(len(self.replicas)) if replica is None else [replica.local_replica_id]
        for replica_id in ids:
            if not self._features.holding_gradients(replica_id):
                self.replicas[replica_id].zero_grad(set_to_none=set_to_none)


def _refuse(name: str) -> None:
    raise TypeError(
        f"model.{name}() on a mirrored module would change one replica only; move or retype "
        "the module before strategy.mirror()"
    )


class _MirrorRegistry:
    """The live mirrored module each module (and each of its submodules) is replica 0 of. A
    module mirrored twice would have two sets of replicas, and training through one would leave
    the other's behind: the second ``mirror()`` is refused until the first is released."""

    def __init__(self) -> None:
        self._owners: weakref.WeakKeyDictionary[nn.Module, weakref.ref[MirroredModule]] = (
            weakref.WeakKeyDictionary()
        )

    def owner_of(self, module: nn.Module) -> MirroredModule | None:
        """The live mirrored module that ``module`` or one of its submodules belongs to."""
        for sub in module.modules():
            ref = self._owners.get(sub)
            owner = None if ref is None else ref()
            if owner is not None and not owner.released and not owner._strategy.closed:
                return owner
        return None

    def register(self, mirrored: MirroredModule) -> None:
        for sub in mirrored.replicas[0].modules():
            self._owners[sub] = weakref.ref(mirrored)

    def release(self, mirrored: MirroredModule) -> None:
        for sub in mirrored.replicas[0].modules():
            ref = self._owners.get(sub)
            if ref is not None and ref() is mirrored:
                del self._owners[sub]


# Process-wide: a module may be mirrored by any strategy of the process, and the refusal of a
# second mirror must see them all. Weak both ways: it keeps no module and no mirror alive.
MIRRORED_BY = _MirrorRegistry()
