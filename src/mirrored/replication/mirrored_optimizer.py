"""The mirrored optimizer: ``step()`` inside a replica is the merge point of a training step.

``strategy.mirror(model, optimizer)`` returns a ``MirroredOptimizer`` beside the mirrored module.
Its ``step()``, called inside ``strategy.run`` on every replica, sums the replicas' gradients and
updates every replica, so that all end the step with the same parameters. Two ways:

- replicas that share one device's memory, with ``HierarchicalCopyAllReduce`` (the default there)
  and a built-in per-parameter optimizer: each parameter's gradient is summed and updated once, by
  its owner replica, which copies the result to the others
  (:mod:`mirrored.replication.sharded_update`);
- otherwise: the gradients are packed into buckets and all-reduced with the strategy's
  cross-device op (:mod:`mirrored.comm.cross_device_ops`), and every replica applies the same update
  with its own optimizer.

The features the strategy hands over (:mod:`mirrored.replication.mirror_features`) change which
steps update and how: gradient accumulation, local SGD, ZeRO sharding, and gradients reduced during
backward across processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mirrored._torch_internals import disable_torch_function
from mirrored.comm.bucketing import PackedTensors
from mirrored.comm.cross_device_ops import HierarchicalCopyAllReduce
from mirrored.core.context import ReplicaContext
from mirrored.core.param_groups import snapshot, take_hyperparameters
from mirrored.core.rendezvous import SyncMismatchError
from mirrored.core.values import ReduceOp
from mirrored.replication.gradient_reducer import OverlappedGradientReducer
from mirrored.replication.mirror_features import NO_FEATURES, MirrorFeatures
from mirrored.replication.mirrored_module import replica_context_of
from mirrored.replication.optimizer_routes import holds_any, route_torch_calls, stop_routing
from mirrored.replication.replica_optimizers import ReplicaOptimizers
from mirrored.replication.sharded_update import (
    PER_PARAMETER_OPTIMIZERS,
    ShardedUpdate,
    load_own_copy,
    state_bytes,
)

if TYPE_CHECKING:
    from mirrored.strategies.in_process import InProcessStrategy

__all__ = ["MirroredOptimizer"]

# How an update left the gradients it used: each replica's as it used them, or each parameter's
# sum on its owner only (the others' are their own shares).
_AS_USED, _ON_OWNERS = "as used", "on owners"


class MirroredOptimizer(ReplicaOptimizers):
    """One optimizer per replica; ``step()`` inside a replica reduces the gradients, then
    updates (with the strategy's ``zero_stage``, each replica updates only its share and the
    shares are gathered: :mod:`mirrored.replication.zero_redundancy`).

    It is a ``torch.optim.Optimizer`` so that torch's LR schedulers take it: they change the
    hyperparameters of ``param_groups`` (replica 0's), which every replica takes at its next
    step. ``scheduler.step()`` may be called outside ``strategy.run`` or inside it, on every
    replica: there replica 0's call alone advances the schedule (:mod:`mirrored.random.torch_compat`
    routes every ``LRScheduler`` subclass's ``step``)."""

    def __init__(
        self,
        strategy: InProcessStrategy,
        optimizers: Sequence[torch.optim.Optimizer],
        params: Sequence[Sequence[nn.Parameter]],
        running_stats: Sequence[Sequence[torch.Tensor]],
        features: MirrorFeatures = NO_FEATURES,
    ) -> None:
        super().__init__(optimizers)
        self._strategy = strategy
        self.released = False
        # Per replica: all_reduce_gradients() made this step's gradients the update's already
        # (summed them; for a local SGD update, scaled them to the shard's mean).
        self._reduced_early = [False] * len(optimizers)
        # Per replica: how the last update left the gradients it used, while no backward has
        # added to them (to clip or log them after step()): None, _AS_USED or _ON_OWNERS.
        self._after_update: list[str | None] = [None] * len(optimizers)
        self._created = route_torch_calls(strategy, self, optimizers[0])
        self._params = [list(p) for p in params]
        self._running_stats = [list(b) for b in running_stats]
        self._packed: list[dict[tuple[bool, ...], PackedTensors]] = [{} for _ in optimizers]
        self._plain_tensors = all(type(p.data) is torch.Tensor for p in self._params[0])
        # Replicas sharing one device's memory, with the slice-parallel HierarchicalCopyAllReduce,
        # reduce and update each parameter once, on its owner (sharded_update.py).
        shared_memory = len({p[0].device for p in self._params if p}) == 1
        self._sharded: ShardedUpdate | None = None
        # With gradient accumulation, most steps only keep the gradients (accumulation.py).
        self._window = features.accumulation_window()
        # With local SGD, most updates are each replica's own (local_sgd.py).
        self._local = features.local_steps()
        # With zero_stage, each parameter's owner alone updates it (zero_redundancy.py).
        self._zero = features.zero_redundancy(optimizers, params)
        # Across processes, gradients are reduced while backward runs (gradient_reducer.py).
        self._reducer = features.gradient_reducer(params, self._window, self._local)
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
        stop_routing(self._strategy, self._created)
        self._strategy.untrack_replicated(self)

    @property
    def accumulation_steps(self) -> int:
        """How many ``step()`` calls make one update (the strategy's
        ``gradient_accumulation_steps``)."""
        return 1 if self._window is None else self._window.steps

    @property
    def step_updates(self) -> bool:
        """Whether the current replica's next ``step()`` reduces and updates (False for the
        first micro-steps of an accumulation window); replica 0's outside ``strategy.run``."""
        replica = replica_context_of(self._strategy)
        return self._window is None or self._window.final(
            0 if replica is None else replica.local_replica_id
        )

    def discard_gradients(self) -> None:
        """Drop the current replica's gradients without an update, as a skipped step does (a
        float16 overflow): a step that would update ends its accumulation window instead."""
        replica = replica_context_of(self._strategy)
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
        replica = replica_context_of(self._strategy)
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
        replica = replica_context_of(self._strategy)
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
        ``period`` updates, the mean of every replica's parameters
        (:mod:`mirrored.replication.local_sgd`)."""
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
        replica = replica_context_of(self._strategy)
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


def _check_dense(params: Sequence[nn.Parameter]) -> None:
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            raise TypeError(
                f"a parameter of shape {tuple(p.shape)} has a sparse gradient; mirrored "
                "all-reduces dense gradients only (use nn.Embedding(sparse=False))"
            )
