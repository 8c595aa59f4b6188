"""Mirroring a PyTorch module and its optimizer: one replica per device, kept identical.

``strategy.mirror(model, optimizer)`` returns proxies. Inside ``strategy.run`` they resolve to the
current replica; outside, to replica 0 (the user's original module, moved to the first device).
``optimizer.step()`` inside a replica is the merge point of a step: the gradients of all replicas
are summed and every replica ends the step with the same parameters. Two ways:

- replicas that share one device's memory, with ``HierarchicalCopyAllReduce`` (the default there)
  and a built-in per-parameter optimizer: each parameter's gradient is summed and updated once,
  by its owner replica, which copies the result to the others (:mod:`mirrored.sharded_update`);
- otherwise: the gradients are packed into buckets and all-reduced with the strategy's
  cross-device op (:mod:`mirrored.cross_device_ops`), and every replica applies the same update
  with its own optimizer.

A run that fails midway resyncs every replica from replica 0, so they never diverge.
"""

from __future__ import annotations

import copy
import itertools
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from mirrored import torch_compat
from mirrored._torch_internals import disable_torch_function
from mirrored.batch_norm import convert_sync_batch_norm, running_stat_buffers
from mirrored.bucketing import PackedTensors
from mirrored.buffer_sync import BufferSync
from mirrored.context import ReplicaContext, current_replica_context
from mirrored.cross_device_ops import HierarchicalCopyAllReduce
from mirrored.gradient_reducer import OverlappedGradientReducer
from mirrored.param_groups import snapshot, take_hyperparameters
from mirrored.rendezvous import SyncMismatchError
from mirrored.sharded_update import (
    PER_PARAMETER_OPTIMIZERS,
    ShardedUpdate,
    load_own_copy,
    state_bytes,
)
from mirrored.strategy import SyncsBuffers
from mirrored.values import ReduceOp

if TYPE_CHECKING:
    from mirrored.strategy import Strategy

__all__ = [
    "MirroredModule",
    "MirroredOptimizer",
    "check_optimizer_params",
    "holds_any",
    "mirror_module",
    "replicate_optimizer",
    "tensors_of",
]


def _replica_context_of(strategy: Strategy) -> ReplicaContext | None:
    replica = current_replica_context()
    return replica if replica is not None and replica.strategy is strategy else None


def tensors_of(module: nn.Module) -> list[torch.Tensor]:
    """Parameters then buffers, in a fixed order that is the same on every replica."""
    return [p for _, p in module.named_parameters(remove_duplicate=False)] + [
        b for _, b in module.named_buffers(remove_duplicate=False)
    ]


class _Handles:
    """The hook handles of every replica, removed together."""

    def __init__(self, handles: Sequence[Any]) -> None:
        self.handles = list(handles)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def __enter__(self) -> _Handles:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


# What a MirroredModule sets on itself (a lookup of these must not reach a replica).
_OWN_ATTRIBUTES = {"_strategy", "replicas", "_optimizers", "released", "_buffer_sync"}
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


class MirroredModule(SyncsBuffers):
    """One replica of a module per device of a strategy; calls go to the current replica.

    Inside ``strategy.run`` attribute access reaches the current replica. Outside, reads reach
    replica 0, submodules come back mirrored (so ``model.encoder.requires_grad_(False)`` freezes
    every replica), changes of flags and hooks reach every replica, and ``apply(fn)`` runs on
    every replica and then copies replica 0's values to the others (so a random init stays
    identical). Moving or retyping one replica (``.to()``, ``.half()``) is an error: mirror the
    module after moving it. Buffers a replica changes are made the same on every replica after
    each run (:mod:`mirrored.buffer_sync`).
    """

    def __init__(self, strategy: Strategy, replicas: Sequence[nn.Module]) -> None:
        object.__setattr__(self, "_strategy", strategy)
        object.__setattr__(self, "replicas", tuple(replicas))
        object.__setattr__(self, "_optimizers", weakref.WeakSet())
        object.__setattr__(self, "released", False)
        object.__setattr__(self, "_buffer_sync", BufferSync(replicas))

    def _current(self) -> nn.Module:
        replica = _replica_context_of(self._strategy)
        if self.released and replica is not None:
            raise RuntimeError(
                "this mirrored module was released (its module was mirrored again since); "
                "train through the new mirrored module"
            )
        return self.replicas[0 if replica is None else replica.local_replica_id]

    @property
    def has_buffers(self) -> bool:
        return not self._buffer_sync.empty

    def sync_buffers(self, replica: ReplicaContext) -> None:
        """At the end of a run, on every replica: the buffers any replica changed made the
        same on all (:mod:`mirrored.buffer_sync`)."""
        self._buffer_sync.sync(replica)

    def release(self) -> None:
        """Give up these replicas, so that the module (replica 0) can be mirrored again; this
        mirrored module and its optimizers can no longer train. ``Model.compile`` releases the
        model's previous mirror itself."""
        _MIRRORED_BY.release(self)
        object.__setattr__(self, "released", True)
        for optimizer in list(self._optimizers):
            optimizer.release()
        self._strategy.untrack_replicated(self)

    def _in_replica(self) -> bool:
        return _replica_context_of(self._strategy) is not None

    def _cross_replica(self, parts: Sequence[Any]) -> Any:
        """A value read outside ``run``: submodules mirrored, anything else replica 0's."""
        return (
            MirroredModule(self._strategy, parts) if isinstance(parts[0], nn.Module) else parts[0]
        )

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
        return self if isinstance(results[0], nn.Module) else _Handles(results)

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
        """Copy replica 0's parameters and buffers into the other replicas."""
        first = tensors_of(self.replicas[0])
        with torch.no_grad():
            for replica in self.replicas[1:]:
                for mine, source in zip(tensors_of(replica), first, strict=True):
                    mine.copy_(source)

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
        replica = _replica_context_of(self._strategy)
        ids = range(len(self.replicas)) if replica is None else [replica.local_replica_id]
        for replica_id in ids:
            if not self._strategy.holding_gradients(replica_id):
                self.replicas[replica_id].zero_grad(set_to_none=set_to_none)


class MirroredOptimizer(torch.optim.Optimizer):
    """One optimizer per replica; ``step()`` inside a replica reduces the gradients, then
    updates (with the strategy's ``zero_stage``, each replica updates only its share and the
    shares are gathered: :mod:`mirrored.zero_redundancy`).

    It is a ``torch.optim.Optimizer`` so that torch's LR schedulers take it: they change the
    hyperparameters of ``param_groups`` (replica 0's), which every replica takes at its next
    step. ``scheduler.step()`` may be called outside ``strategy.run`` or inside it, on every
    replica: there replica 0's call alone advances the schedule (:mod:`mirrored.torch_compat`
    routes every ``LRScheduler`` subclass's ``step``)."""

    def __init__(
        self,
        strategy: Strategy,
        optimizers: Sequence[torch.optim.Optimizer],
        params: Sequence[Sequence[nn.Parameter]],
        running_stats: Sequence[Sequence[torch.Tensor]],
    ) -> None:
        # torch.optim.Optimizer.__init__ is not called: the replicas' optimizers hold the state.
        # Its state-dict hooks are this optimizer's own (its state_dict() is not replica 0's
        # with zero_stage, and the replicas' are read and loaded to resync them).
        self._hooks: dict[str, OrderedDict[int, Callable[..., Any]]] = {
            name: OrderedDict() for name in _STATE_DICT_HOOKS
        }
        self._strategy = strategy
        self.released = False
        self.optimizers = tuple(optimizers)
        # Per replica: all_reduce_gradients() made this step's gradients the update's already
        # (summed them; for a local SGD update, scaled them to the shard's mean).
        self._reduced_early = [False] * len(optimizers)
        # Per replica: how the last update left the gradients it used, while no backward has
        # added to them (to clip or log them after step()): None, _AS_USED or _ON_OWNERS.
        self._after_update: list[str | None] = [None] * len(optimizers)
        self._created = next(_CREATED)
        _LIVE_OPTIMIZERS[self._created] = self
        _ORIGINAL_OPTIMIZERS.add(optimizers[0])
        torch_compat.route_gradient_clipping(_reduce_before_clipping)
        torch_compat.route_scheduler_steps(_stepped_by_first_replica)
        torch_compat.route_grad_scaling(_refuse_grad_scaler_in_replicas)
        self._params = [list(p) for p in params]
        self._running_stats = [list(b) for b in running_stats]
        self._packed: list[dict[tuple[bool, ...], PackedTensors]] = [{} for _ in optimizers]
        self._plain_tensors = all(type(p.data) is torch.Tensor for p in self._params[0])
        # Replicas sharing one device's memory, with the slice-parallel HierarchicalCopyAllReduce,
        # reduce and update each parameter once, on its owner (sharded_update.py).
        shared_memory = len({p[0].device for p in self._params if p}) == 1
        self._sharded: ShardedUpdate | None = None
        # With gradient accumulation, most steps only keep the gradients (accumulation.py).
        self._window = strategy.accumulation_window()
        # With local SGD, most updates are each replica's own (local_sgd.py).
        self._local = strategy.local_steps()
        # With zero_stage, each parameter's owner alone updates it (zero_redundancy.py).
        self._zero = strategy.zero_redundancy(optimizers, params)
        # Across processes, gradients are reduced while backward runs (gradient_reducer.py).
        self._reducer = strategy.gradient_reducer(params, self._window, self._local)
        if (
            self._reducer is None
            and self._zero is None
            and self._local is None  # its replicas keep optimizer states of their own
            and len(optimizers) > 1
            and shared_memory
            and isinstance(strategy.cross_device_ops, HierarchicalCopyAllReduce)
            and type(optimizers[0]) in PER_PARAMETER_OPTIMIZERS
        ):
            self._sharded = ShardedUpdate(optimizers, params)

    def release(self) -> None:
        """Its module was released: it can no longer step, and takes no part in clipping (the
        module mirrored again holds the same parameters in replica 0)."""
        self.released = True
        _LIVE_OPTIMIZERS.pop(self._created, None)
        self._strategy.untrack_replicated(self)

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
        each holds its share: use ``state_dict()`` for all of it)."""
        return self.optimizers[0].state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: a group added to one replica's optimizer would update that replica only."""
        raise TypeError(
            "add_param_group() on a mirrored optimizer would reach replica 0 only; add the group "
            "to the optimizer before strategy.mirror()"
        )

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> _Handles:  # type: ignore[override]
        """``hook`` on every replica's optimizer (called with that replica's optimizer)."""
        return _Handles([o.register_step_pre_hook(hook) for o in self.optimizers])

    def register_step_post_hook(self, hook: Callable[..., Any]) -> _Handles:  # type: ignore[override]
        """``hook`` on every replica's optimizer (called with that replica's optimizer)."""
        return _Handles([o.register_step_post_hook(hook) for o in self.optimizers])

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

    @property
    def accumulation_steps(self) -> int:
        """How many ``step()`` calls make one update (the strategy's
        ``gradient_accumulation_steps``)."""
        return 1 if self._window is None else self._window.steps

    @property
    def step_updates(self) -> bool:
        """Whether the current replica's next ``step()`` reduces and updates (False for the
        first micro-steps of an accumulation window); replica 0's outside ``strategy.run``."""
        replica = _replica_context_of(self._strategy)
        return self._window is None or self._window.final(
            0 if replica is None else replica.local_replica_id
        )

    def discard_gradients(self) -> None:
        """Drop the current replica's gradients without an update, as a skipped step does (a
        float16 overflow): a step that would update ends its accumulation window instead."""
        replica = _replica_context_of(self._strategy)
        if replica is None:
            raise RuntimeError("discard_gradients() belongs inside strategy.run(), as step()")
        if self._window is not None:
            self._window.advance(replica.local_replica_id)
        self.optimizers[replica.local_replica_id].zero_grad(set_to_none=True)
        self._after_update[replica.local_replica_id] = None

    def all_reduce_gradients(self) -> None:
        """Inside ``strategy.run``, on every replica: sum the replicas' gradients now, in place,
        so that ``param.grad`` holds the global batch's gradient before ``step()`` (which then
        does not sum again): to clip, inspect or log it. torch's ``clip_grad_norm_`` and
        ``clip_grad_value_`` call it themselves on a mirrored optimizer's parameters. Where
        gradients are summed during backward (multi-worker), nothing to do; before a local SGD
        update, each replica's gradient is made its shard's mean (what the update uses); after
        ``step()``, before the next backward, they are what the update used already."""
        replica = _replica_context_of(self._strategy)
        if replica is None:
            raise RuntimeError("all_reduce_gradients() belongs inside strategy.run(), as step()")
        replica_id = replica.local_replica_id
        if replica.backward_passes == 0 and self._after_update[replica_id] is not None:
            self._gradients_of_last_update(replica)
            return
        if replica.num_replicas_in_sync == 1 or self._reduced_early[replica_id]:
            return
        local = self._local is not None and self._local.local(replica_id)
        if not local and self._reducer is not None:
            return
        if self._window is not None or (self._zero is not None and self._zero.stage == 2):
            raise ValueError(
                "the replicas' gradients cannot be summed before step() (to clip them) with "
                "gradient_accumulation_steps > 1 or zero_stage=2, where step() sums them its "
                "own way; clip with an optimizer that clips, or leave those options off"
            )
        if local:  # the local update's gradient: its shard's mean
            self._scale_gradients(replica_id, replica.num_replicas_in_sync)
            self._reduced_early[replica_id] = True
            return
        _check_dense(self._params[replica_id])
        grads = [p.grad for p in self._params[replica_id]]
        self._all_reduce_gradients(replica, self._open_step(replica, grads), in_place=True)
        self._reduced_early[replica_id] = True

    def _gradients_of_last_update(self, replica: ReplicaContext) -> None:
        """Where the last update summed each parameter's gradient on its owner only, copy the
        owners' sums to this replica's gradients (a collective), so that every replica holds
        the global batch's gradient again."""
        replica_id = replica.local_replica_id
        if self._after_update[replica_id] == _ON_OWNERS:
            assert self._sharded is not None
            grads = [p.grad for p in self._params[replica_id]]
            everyone = replica.exchange.all("all_reduce_gradients: the owners' sums", grads)
            self._sharded.copy_owned_gradients(replica_id, everyone)
            replica.exchange.barrier("all_reduce_gradients: the owners' sums copied")
            self._after_update[replica_id] = _AS_USED

    def holds_any(self, replica_id: int, tensor_ids: set[int]) -> bool:
        """Whether any of ``tensor_ids`` is a parameter of replica ``replica_id`` or the
        gradient of one."""
        return holds_any(self._params[replica_id], tensor_ids)

    def step(self, closure: Any = None) -> Any:
        """Sum the gradients of every replica, then update every replica (with ``zero_stage``:
        each its own share, then all of them are gathered).

        Call it inside ``strategy.run``, on every replica, once per step. With the strategy's
        ``gradient_accumulation_steps=k``, only every k-th call reduces and updates (with the
        mean of the k steps' gradients); the others keep the gradients for it.
        """
        if closure is not None:
            raise TypeError(
                "optimizer.step(closure) is not supported on a mirrored optimizer: the closure "
                "would re-run forward/backward outside the synchronised step"
            )
        replica = _replica_context_of(self._strategy)
        if replica is None:
            raise RuntimeError(
                "optimizer.step() of a mirrored optimizer must be called inside strategy.run(), "
                "where the gradients of all replicas can be all-reduced"
            )
        if self.released:
            raise RuntimeError(
                "this mirrored optimizer's module was released (mirrored again since); step the "
                "optimizer mirrored with the new mirrored module"
            )
        with self._without_torch_function():
            return self._step(replica)

    def _without_torch_function(self) -> AbstractContextManager[Any]:
        """Torch-function modes (the per-replica RNG's) cost a Python call per op and replicas
        share one GIL; the update of plain tensors needs none of them."""
        return disable_torch_function() if self._plain_tensors else nullcontext()

    def _step(self, replica: ReplicaContext) -> Any:
        window, replica_id = self._window, replica.local_replica_id
        if window is None:
            return self._update(replica)
        # A micro-step that does not end the window keeps the gradients in param.grad.
        result = self._update(replica) if window.final(replica_id) else None
        window.advance(replica_id)
        return result

    def _update(self, replica: ReplicaContext) -> Any:
        local, replica_id = self._local, replica.local_replica_id
        if local is None:
            return self._synchronous_update(replica)
        if local.local(replica_id):
            result = self._local_update(replica, average=local.averages(replica_id))
        else:
            result = self._synchronous_update(replica)
        local.advance(replica_id)
        return result

    def _scale_gradients(self, replica_id: int, factor: float) -> None:
        if factor != 1:
            for param in self._params[replica_id]:
                if param.grad is not None:
                    param.grad.mul_(factor)

    def _open_step(self, replica: ReplicaContext, payload: Any = None) -> list[Any]:
        """The update's first sync point among this process's replicas: each posts ``payload``
        and whether it ran a backward pass since its last update; replica 0 posts its
        hyperparameters as of this step (an LR schedule, a warm-up set inside the replica
        function), snapshotted so that no replica reads its groups while it changes them, and
        every replica takes them (a tensor into one of its own). Returns every replica's
        ``payload``.

        A replica that steps without a backward while others ran one would drop its shard's
        gradient: ``SyncMismatchError`` on every replica, before anything is updated."""
        replica_id = replica.local_replica_id
        ran_backward = replica.backward_passes > 0
        replica.backward_passes = 0
        settings = None if replica_id else snapshot(self.param_groups)
        posted = replica.exchange.all("optimizer.step", (ran_backward, settings, payload))
        ran = [flag for flag, _, _ in posted]
        if any(ran) and not all(ran):
            first = replica.replica_id_in_sync_group - replica_id
            idle = [first + i for i, flag in enumerate(ran) if not flag]
            busy = [first + i for i, flag in enumerate(ran) if flag]
            raise SyncMismatchError(
                f"optimizer.step() on replica(s) {idle} without a loss.backward() since the last "
                f"update, while replica(s) {busy} ran one: their shards' gradients would be "
                "dropped. Run the same forward and backward on every replica (a replica with "
                "an empty shard too: the scaled loss of no examples is 0)"
            )
        if replica_id:
            for group, values in zip(
                self.optimizers[replica_id].param_groups, posted[0][1], strict=True
            ):
                take_hyperparameters(group, values)
        return [p for _, _, p in posted]

    def _local_update(self, replica: ReplicaContext, average: bool) -> Any:
        """Local SGD: this replica's own update with its own shard's gradient, then, every
        ``period`` updates, the mean of every replica's parameters (:mod:`mirrored.local_sgd`)."""
        replica_id = replica.local_replica_id
        window_scale = 1.0 if self._window is None else self._window.scale
        if self._reduced_early[replica_id]:  # all_reduce_gradients() scaled them already
            self._reduced_early[replica_id] = False
        else:
            self._scale_gradients(replica_id, replica.num_replicas_in_sync * window_scale)
        self._after_update[replica_id] = _AS_USED
        if len(self.optimizers) > 1:
            self._open_step(replica)
        result = self.optimizers[replica_id].step()
        if average:
            tensors = [p.data for p in self._params[replica_id]] + self._running_stats[replica_id]
            averaged = self._strategy.all_reduce_tensors(replica, ReduceOp.MEAN, tensors)
            with torch.no_grad():
                for tensor, value in zip(tensors, averaged, strict=True):
                    tensor.copy_(value)
        return result

    def _synchronous_update(self, replica: ReplicaContext) -> Any:
        if self._reducer is not None:
            return self._step_reduced(replica, self._reducer)
        replica_id = replica.local_replica_id
        optimizer = self.optimizers[replica_id]
        if self._window is not None:  # the window's mean, before any replica sums it
            self._scale_gradients(replica_id, self._window.scale)
        summed: str | None = _AS_USED
        if self._reduced_early[replica_id]:  # all_reduce_gradients() opened the step
            self._reduced_early[replica_id] = False
        elif replica.num_replicas_in_sync > 1:
            # The gradients travel with replica 0's hyperparameters: one sync point opens the
            # step.
            _check_dense(self._params[replica_id])
            everyone = self._open_step(replica, [p.grad for p in self._params[replica_id]])
            if self._zero is not None and self._zero.stage == 2:
                self._zero.reduce_gradients(replica, everyone)
                summed = None  # each replica holds its share
            elif self._sharded is not None:
                self._sharded.reduce_gradients(replica_id, everyone)
                summed = _ON_OWNERS
            else:
                self._all_reduce_gradients(replica, everyone)
        self._after_update[replica_id] = summed
        if replica.num_replicas_in_sync > 1 and self._running_stats[replica_id]:
            self._average_running_stats(replica)
        if self._zero is not None:
            return self._zero.step(replica)
        if self._sharded is None:
            return optimizer.step()
        result = self._sharded.step(replica_id)
        replica.exchange.barrier("optimizer.step: parameters copied")
        return result

    def _step_reduced(self, replica: ReplicaContext, reducer: OverlappedGradientReducer) -> Any:
        """The step when backward already reduced the gradients (multi-worker)."""
        replica_id = replica.local_replica_id
        optimizer = self.optimizers[replica_id]
        _check_dense(self._params[replica_id])
        reducer.finish_pass(replica_id)  # a step with no backward: reduce what is there
        if len(self.optimizers) > 1:
            self._open_step(replica)
        if self._running_stats[replica_id]:
            self._average_running_stats(replica)
        result = optimizer.step() if self._zero is None else self._zero.step(replica)
        reducer.end_step(replica_id)
        return result

    def _all_reduce_gradients(
        self,
        replica: ReplicaContext,
        everyone: Sequence[Sequence[torch.Tensor | None]],
        in_place: bool = False,
    ) -> None:
        """Bucketed all-reduce of the gradients any replica has (``everyone``: each replica's
        gradients as posted at the step's first sync point); ``in_place``: written into the
        gradient tensors a replica has (which others may hold: a clipping function's list)."""
        replica_id = replica.local_replica_id
        params = self._params[replica_id]
        grads = everyone[replica_id]
        reduced = tuple(
            any(g is not None for g in column) for column in zip(*everyone, strict=True)
        )
        indices = [i for i, flag in enumerate(reduced) if flag]
        if not indices:
            return
        packed = self._packed[replica_id].get(reduced)
        if packed is None:
            tensors = [params[i] for i in indices]
            plan = self._strategy.cross_device_ops.plan(tensors)
            packed = PackedTensors(plan, [t.shape for t in tensors], replica.device)
            self._packed[replica_id][reduced] = packed
        packed.pack([grads[i] for i in indices])
        for buffer in packed.buffers:
            self._strategy.cross_device_ops.all_reduce(replica.exchange, buffer)
        for i, view in zip(indices, packed.unpacked(), strict=True):
            grad = params[i].grad
            if in_place and grad is not None:
                grad.copy_(view)
            else:
                params[i].grad = view

    def _average_running_stats(self, replica: ReplicaContext) -> None:
        """BatchNorm running statistics stay identical: their mean over replicas (TensorFlow)."""
        buffers = self._running_stats[replica.local_replica_id]
        averaged = replica.strategy.all_reduce_tensors(replica, ReduceOp.MEAN, buffers)
        with torch.no_grad():
            for buffer, value in zip(buffers, averaged, strict=True):
                buffer.copy_(value)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The current replica's gradients inside ``strategy.run``, every replica's outside;
        inside an accumulation window, nothing (the gradients are the window's so far)."""
        replica = _replica_context_of(self._strategy)
        ids = range(len(self.optimizers)) if replica is None else [replica.local_replica_id]
        for replica_id in ids:
            if self._window is None or not self._window.holding(replica_id):
                self.optimizers[replica_id].zero_grad(set_to_none=set_to_none)
                self._reduced_early[replica_id] = False
                self._after_update[replica_id] = None

    def resync(self) -> None:
        """Give every replica's optimizer replica 0's state (after a step that failed midway;
        with ``zero_stage``, every replica each owner's values of what it owns instead); an
        unfinished accumulation window is dropped with its gradients."""
        self._reduced_early = [False] * len(self.optimizers)
        self._after_update = [None] * len(self.optimizers)
        if self._window is not None:
            self._window.reset()
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
        if self._local is not None:
            self._local.align()
        if self._zero is not None:
            self._zero.resync()  # each owner's values go with its state
            return
        if self._sharded is not None:
            self._sharded.share_state()
            return
        for optimizer in self.optimizers[1:]:
            load_own_copy(optimizer, self.optimizers[0].state_dict())

    @property
    def zero_stage(self) -> int:
        """The strategy's ``zero_stage`` this optimizer runs with (0: no sharding)."""
        return 0 if self._zero is None else self._zero.stage

    def state_bytes(self) -> list[int]:
        """Bytes of optimizer state (its tensors) each local replica holds: the whole state on
        every replica, or about 1/N of it with ``zero_stage`` (a tensor replicas share counts
        once, for the first)."""
        if self._zero is not None:
            return self._zero.state_bytes()
        return state_bytes(self.optimizers)

    def state_dict(self) -> dict[str, Any]:
        """The plain single-optimizer state (replica 0's; all replicas are identical). With
        ``zero_stage`` it is gathered from the owners of the parameters; across workers that
        is a collective: call it on every worker at the same point."""
        self._run_hooks("state_dict_pre")
        state = self.optimizers[0].state_dict() if self._zero is None else self._zero.state_dict()
        return self._run_hooks("state_dict_post", state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the same state into every replica's optimizer (moved to its device); with
        ``zero_stage``, each replica keeps the state of the parameters it owns."""
        state_dict = self._run_hooks("load_state_dict_pre", state_dict)
        if self._zero is not None:
            self._zero.load_state_dict(state_dict)
        else:
            for optimizer in self.optimizers:
                load_own_copy(optimizer, state_dict)
            if self._sharded is not None:
                self._sharded.share_state()
        self._run_hooks("load_state_dict_post")


# The kinds of state-dict hooks a mirrored optimizer keeps (torch.optim.Optimizer's).
_STATE_DICT_HOOKS = (
    "state_dict_pre",
    "state_dict_post",
    "load_state_dict_pre",
    "load_state_dict_post",
)
# How an update left the gradients it used: each replica's as it used them, or each parameter's
# sum on its owner only (the others' are their own shares).
_AS_USED, _ON_OWNERS = "as used", "on owners"
# Live mirrored optimizers (not released) by creation (the order every replica visits them in),
# and the original optimizers they were built from (an LR scheduler may be attached to one).
_LIVE_OPTIMIZERS: weakref.WeakValueDictionary[int, MirroredOptimizer] = (
    weakref.WeakValueDictionary()
)
_CREATED = itertools.count()
_ORIGINAL_OPTIMIZERS: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def _reduce_before_clipping(tensors: list[torch.Tensor]) -> None:
    """torch's gradient clipping is about to read the gradients of ``tensors`` (parameters, or
    the gradients themselves): inside a replica, the mirrored optimizers holding them sum the
    replicas' gradients first, so it clips the global batch's gradient, as on one device (or
    refuse, where that cannot be done before ``step()``)."""
    replica = current_replica_context()
    if replica is None or not tensors:
        return
    tensor_ids = {id(t) for t in tensors}
    for _, optimizer in sorted(_LIVE_OPTIMIZERS.items()):
        if optimizer._strategy is replica.strategy and optimizer.holds_any(
            replica.local_replica_id, tensor_ids
        ):
            optimizer.all_reduce_gradients()


def _stepped_by_first_replica(scheduler: Any) -> bool:
    """Whether a torch LR scheduler's ``step()`` is skipped here: inside a replica other than
    this process's first, for a scheduler of a mirrored optimizer (or of the optimizer it was
    built from). Each replica calling it would advance the schedule once per replica; replica
    0 steps it, and the others take its hyperparameters at the next update."""
    replica = current_replica_context()
    if replica is None or replica.local_replica_id == 0:
        return False
    optimizer = getattr(scheduler, "optimizer", None)
    return isinstance(optimizer, MirroredOptimizer) or optimizer in _ORIGINAL_OPTIMIZERS


def holds_any(params: Iterable[nn.Parameter], tensor_ids: set[int]) -> bool:
    """Whether any of ``tensor_ids`` is one of ``params`` or the gradient of one."""
    return any(
        id(p) in tensor_ids or (p.grad is not None and id(p.grad) in tensor_ids) for p in params
    )


def _refuse_grad_scaler_in_replicas(scaler: Any) -> None:
    """A ``TypeError`` for an enabled ``torch.amp.GradScaler`` scaling a loss inside a run with
    several replicas in this process (its per-optimizer state is shared by their threads, and
    it unscales replica 0's gradients only), or on a strategy whose gradients come at
    ``step()``."""
    replica = current_replica_context()
    if replica is None or not scaler.is_enabled():
        return
    strategy = replica.strategy
    if replica.exchange.num_replicas > 1 or not strategy.gradients_after_backward:
        raise TypeError(
            f"torch.amp.GradScaler inside strategy.run of {type(strategy).__name__} with "
            f"{replica.exchange.num_replicas} replica(s) here: one scaler's state is shared by "
            "the replicas' threads, and its unscale_() and step() reach replica 0's gradients "
            "only, so the update would not be one device's. Train with mirrored.Model's "
            "compile(precision='16-mixed') (one loss scale for every replica; an overflow on "
            "any skips the update on all), or autocast to torch.bfloat16, which needs no loss "
            "scaling"
        )


def _refuse(name: str) -> None:
    raise TypeError(
        f"model.{name}() on a mirrored module would change one replica only; move or retype "
        "the module before strategy.mirror()"
    )


def _check_dense(params: Sequence[nn.Parameter]) -> None:
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            raise TypeError(
                f"a parameter of shape {tuple(p.shape)} has a sparse gradient; mirrored "
                "all-reduces dense gradients only (use nn.Embedding(sparse=False))"
            )


def replicate_optimizer(
    optimizer: torch.optim.Optimizer, mapping: dict[int, nn.Parameter]
) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` over other parameters (``mapping``: id of original -> new)."""
    memo: dict[int, Any] = dict(mapping)
    replica = copy.deepcopy(optimizer, memo)
    # An LR scheduler wraps the original's bound step() in an instance attribute; the copy must
    # use its own class method, not the original's.
    replica.__dict__.pop("step", None)
    load_own_copy(replica, optimizer.state_dict())
    return replica


def check_optimizer_params(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A ValueError if ``optimizer`` holds a parameter that is not ``module``'s."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer={type(optimizer).__name__}: expected a torch.optim.Optimizer")
    owned = {id(p) for p in module.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in owned:
                raise ValueError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not in "
                    "the module; build the optimizer on model.parameters()"
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


_MIRRORED_BY = _MirrorRegistry()


def _check_mirrorable(strategy: Strategy, module: nn.Module, optimizer: Any) -> None:
    if isinstance(module, MirroredModule):
        raise TypeError("module is already mirrored; pass the original nn.Module")
    if not isinstance(module, nn.Module):
        raise TypeError(f"module={type(module).__name__}: expected a torch.nn.Module")
    if isinstance(optimizer, MirroredOptimizer):
        raise TypeError("optimizer is already mirrored; pass the original torch optimizer")
    owner = _MIRRORED_BY.owner_of(module)
    if owner is not None:
        raise ValueError(
            f"this module (or one of its submodules) is already mirrored by {owner._strategy!r}, "
            "and training through a second mirror would leave the first one's replicas behind; "
            "train through the first mirrored module, or call its release() (or close its "
            "strategy) before mirroring again"
        )
    lazy = [
        name
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]
        if nn.parameter.is_lazy(tensor)
    ]
    if lazy:
        raise ValueError(
            f"the module's {', '.join(lazy[:4])}{' ...' if len(lazy) > 4 else ''} are not "
            "initialised yet (a lazy module such as nn.LazyLinear); run the module once on a "
            "batch (model(x)) so that torch materialises them, then strategy.mirror() it "
            "(mirrored.Model does this itself on the first batch)"
        )


def mirror_module(
    strategy: Strategy,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    sync_batch_norm: bool,
) -> Any:
    """Build the replicas of ``module`` (and ``optimizer``) on ``strategy``'s devices."""
    _check_mirrorable(strategy, module, optimizer)
    params = list(module.parameters())
    if optimizer is not None:
        check_optimizer_params(module, optimizer)
    if sync_batch_norm:
        module = convert_sync_batch_norm(module, strategy)
    devices = strategy.torch_devices
    first = module.to(devices[0])
    replicas = [first] + [copy.deepcopy(first).to(d) for d in devices[1:]]
    mirrored = MirroredModule(strategy, replicas)
    strategy.track_replicated(mirrored)
    _MIRRORED_BY.register(mirrored)
    if optimizer is None:
        return mirrored
    replica_params = [list(r.parameters()) for r in replicas]
    optimizers = [optimizer] + [
        replicate_optimizer(optimizer, {id(p): q for p, q in zip(params, rp, strict=True)})
        for rp in replica_params[1:]
    ]
    running = [running_stat_buffers(r) for r in replicas]
    mirrored_optimizer = MirroredOptimizer(strategy, optimizers, replica_params, running)
    strategy.track_replicated(mirrored_optimizer)
    mirrored._optimizers.add(mirrored_optimizer)
    return mirrored, mirrored_optimizer
