"""The mirrored optimizer: ``step()`` inside a replica is the merge point of a training step.

``strategy.mirror(model, optimizer)`` returns a ``MirroredOptimizer`` beside the mirrored module.
The replicas' gradients are summed while backward runs (:mod:`mirrored.replication.
gradient_reducer`; with ``zero_stage=2``, or without a reducer, at ``step()``); ``step()``, inside
``strategy.run`` on every replica, then updates every replica alike: where the replicas share
one device's memory with a built-in per-parameter optimizer, each parameter once, by its owner,
copied to the others (:mod:`mirrored.replication.sharded_update`); under a central-storage
strategy, once on its parameter device (:mod:`mirrored.replication.central_update`); otherwise
every replica with its own optimizer. The strategy's features
(:mod:`mirrored.replication.mirror_features`) change which steps update and how: gradient
accumulation, local SGD, ZeRO sharding.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mirrored._torch_internals import all_plain, bookkeeping
from mirrored.core.context import ReplicaContext
from mirrored.core.param_groups import snapshot, take_group_hyperparameters
from mirrored.core.replica_meeting import SyncMismatchError
from mirrored.core.trace_recording import deferred_to_replay, refuse_while_recording
from mirrored.core.values import ReduceOp
from mirrored.replication.gradient_reducer import OverlappedGradientReducer, check_dense
from mirrored.replication.mirror_features import NO_FEATURES, MirrorFeatures
from mirrored.replication.mirrored_module import replica_context_of
from mirrored.replication.replica_optimizers import ReplicaOptimizers, holds_any
from mirrored.replication.sharded_update import load_own_copy, state_bytes
from mirrored.replication.update_plan import SyncPath, UpdatePlan, plan_updates
from mirrored.torch_patches import hold_optimizer_routes

if TYPE_CHECKING:
    from mirrored.core.replica_set import ReplicaSet
    from mirrored.replication.buffer_sync import BufferSync

__all__ = ["MirroredOptimizer"]


class MirroredOptimizer(ReplicaOptimizers):
    """One optimizer per replica; ``step()`` inside a replica reduces the gradients, then
    updates (with the strategy's ``zero_stage``, each replica updates only its share and the
    shares are gathered: :mod:`mirrored.replication.zero_redundancy`).

    It is a ``torch.optim.Optimizer`` so that torch's LR schedulers take it: they change the
    hyperparameters of ``param_groups`` (replica 0's), which every replica takes at its next
    step. ``scheduler.step()`` may be called outside ``strategy.run`` or inside it, on every
    replica: there replica 0's call alone advances the schedule
    (:mod:`mirrored.torch_patches.schedulers` routes every ``LRScheduler`` subclass's ``step``)."""

    def __init__(
        self,
        strategy: ReplicaSet,
        optimizers: Sequence[torch.optim.Optimizer],
        params: Sequence[Sequence[nn.Parameter]],
        running_stats: Sequence[Sequence[torch.Tensor]],
        features: MirrorFeatures = NO_FEATURES,
        buffer_sync: BufferSync | None = None,
    ) -> None:
        super().__init__(optimizers)
        self._strategy = strategy
        self.released = False
        # Per replica: all_reduce_gradients() made this step's gradients the update's already
        # (summed them; for a local SGD update, scaled them to the shard's mean).
        self._reduced_early = [False] * len(optimizers)
        # Per replica: whether the gradients are still those the last update used (no backward
        # has added to them since), to clip or log them after step().
        self._after_update = [False] * len(optimizers)
        self._torch_routes = hold_optimizer_routes(strategy, self, optimizers[0])
        strategy.at_close(self._torch_routes.release)  # torch is torch again once it closes
        self._params = [list(p) for p in params]
        self._running_stats = [list(b) for b in running_stats]
        self._plain_tensors = all_plain([*self._params[0], *self._running_stats[0]])
        self._buffer_sync = buffer_sync  # told which running statistics the update averaged
        # Accumulation, local SGD, ZeRO, the reducer and owner updates, planned once.
        self._plan = plan_updates(features, optimizers, params)
        self.forward_loads()  # the program's own optimizer.load_state_dict() reaches every replica
        strategy.at_close(self.stop_forwarding_loads)

    def release(self) -> None:
        """Its module was released: it can no longer step, and takes no part in clipping (the
        module mirrored again holds the same parameters in replica 0)."""
        self.released = True
        self._torch_routes.release()
        self.stop_forwarding_loads()
        self._strategy.untrack_replicated(self)

    @property
    def update_plan(self) -> UpdatePlan:
        """How this optimizer's updates run (accumulation, local SGD, ZeRO, where gradients are
        summed and who applies them), fixed when it was mirrored."""
        return self._plan

    @property
    def accumulation_steps(self) -> int:
        """How many ``step()`` calls make one update (the strategy's
        ``gradient_accumulation_steps``)."""
        return 1 if self._plan.window is None else self._plan.window.steps

    @property
    def step_updates(self) -> bool:
        """Whether the current replica's next ``step()`` reduces and updates (False for the
        first micro-steps of an accumulation window); replica 0's outside ``strategy.run``."""
        replica = replica_context_of(self._strategy)
        return self._plan.window is None or self._plan.window.final(
            0 if replica is None else replica.local_replica_id
        )

    def discard_gradients(self) -> None:
        """Drop the current replica's gradients without an update, as a skipped step does (a
        float16 overflow): a step that would update ends its accumulation window instead."""
        replica = replica_context_of(self._strategy)
        if replica is None:
            raise RuntimeError("discard_gradients() belongs inside strategy.run(), as step()")
        if self._plan.window is not None:
            self._plan.window.advance(replica.local_replica_id)
        self.optimizers[replica.local_replica_id].zero_grad(set_to_none=True)
        self._after_update[replica.local_replica_id] = False

    def all_reduce_gradients(self) -> None:
        """Inside ``strategy.run``, on every replica: make ``param.grad`` what the update uses,
        to clip, inspect or log it (torch's ``clip_grad_norm_`` and ``clip_grad_value_`` call
        it on a mirrored optimizer's parameters). The gradients are summed during backward
        already: nothing to do, but before a local SGD update, where each replica's gradient is
        made its shard's mean; with ``zero_stage=2``, or before an accumulation window's last
        micro-step, they cannot be the global batch's yet (a ``ValueError``)."""
        replica = replica_context_of(self._strategy)
        if replica is None:
            raise RuntimeError("all_reduce_gradients() belongs inside strategy.run(), as step()")
        replica_id = replica.local_replica_id
        if replica.backward_passes == 0 and self._after_update[replica_id]:
            return  # after step(), before the next backward: the gradients the update used
        if replica.num_replicas_in_sync == 1 or self._reduced_early[replica_id]:
            return
        if self._plan.window is not None and not self._plan.window.final(replica_id):
            raise ValueError(
                "the replicas' gradients are summed at the last micro-step of an "
                "accumulation window (gradient_accumulation_steps > 1), not before: clip "
                "or read them there (optimizer.step_updates is True)"
            )
        if self._plan.local is not None and self._plan.local.local(replica_id):
            self._scale_gradients(replica_id, replica.num_replicas_in_sync)  # the shard's mean
            self._reduced_early[replica_id] = True
        elif self._plan.reducer is None:
            raise ValueError(
                "the replicas' gradients cannot be summed before step() (to clip them) with "
                "zero_stage=2, where step() reduce-scatters them to their owners; clip with an "
                "optimizer that clips, or use zero_stage=1"
            )

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

        ``closure`` (LBFGS's): each replica's closure computes its shard's part of the loss and
        its backward; the optimizer sees the global batch's loss (the replicas' parts summed)
        and gradient, the same on every replica, so the replicas take the same steps.
        """
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
        if closure is not None:
            refuse_while_recording("optimizer.step(closure) re-evaluates the loss in Python")
        elif deferred_to_replay(self.step):  # a traced step: the update runs at each replay
            return None
        if closure is not None:
            return self._closure_step(replica, closure)
        with self._without_torch_function():
            return self._step(replica)

    def _closure_step(self, replica: ReplicaContext, closure: Any) -> Any:
        """``step(closure)``: every call of the closure re-evaluates each replica's shard; its
        gradients are summed in its backward (the reducer), its loss here."""
        replica_id = replica.local_replica_id
        if replica.num_replicas_in_sync == 1 and self._plan.central is None:
            return self.optimizers[replica_id].step(closure)
        refusal = self._plan.closure_refusal()
        if refusal is not None:
            raise ValueError(refusal)
        assert self._plan.reducer is not None

        def global_closure() -> Any:
            with torch.enable_grad():
                loss = closure()
            if not isinstance(loss, torch.Tensor):
                raise TypeError(
                    f"optimizer.step(closure): the closure returned {loss!r}; return the loss "
                    "tensor (this replica's part of the global batch's loss)"
                )
            (total,) = self._strategy.all_reduce_tensors(replica, ReduceOp.SUM, [loss.detach()])
            return total

        return self._step_reduced(replica, self._plan.reducer, global_closure)

    def _without_torch_function(self) -> AbstractContextManager[Any]:
        """The update is mirrored's bookkeeping: no torch-function mode for plain tensors."""
        return bookkeeping(self._plain_tensors)

    def _step(self, replica: ReplicaContext) -> Any:
        window, replica_id = self._plan.window, replica.local_replica_id
        if window is None:
            return self._update(replica)
        # A micro-step that does not end the window keeps the gradients in param.grad.
        result = self._update(replica) if window.final(replica_id) else None
        window.advance(replica_id)
        return result

    def _update(self, replica: ReplicaContext) -> Any:
        local, replica_id = self._plan.local, replica.local_replica_id
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
            take_group_hyperparameters(self.optimizers[replica_id].param_groups, posted[0][1])
        return [p for _, _, p in posted]

    def _local_update(self, replica: ReplicaContext, average: bool) -> Any:
        """Local SGD: this replica's own update with its own shard's gradient, then, every
        ``period`` updates, the mean of every replica's parameters
        (:mod:`mirrored.replication.local_sgd`)."""
        replica_id = replica.local_replica_id
        window_scale = 1.0 if self._plan.window is None else self._plan.window.scale
        if self._reduced_early[replica_id]:  # all_reduce_gradients() scaled them already
            self._reduced_early[replica_id] = False
        else:
            self._scale_gradients(replica_id, replica.num_replicas_in_sync * window_scale)
        self._after_update[replica_id] = True
        if len(self.optimizers) > 1:
            self._open_step(replica)
        result = self.optimizers[replica_id].step()
        if average:
            self._average(replica, [p.data for p in self._params[replica_id]])
        return result

    def _synchronous_update(self, replica: ReplicaContext) -> Any:
        if self._plan.path is not SyncPath.AT_STEP:
            assert self._plan.reducer is not None
            return self._step_reduced(replica, self._plan.reducer)
        # One replica, or zero_stage=2: each replica's gradients go to their owners here.
        replica_id = replica.local_replica_id
        if self._plan.window is not None:  # the window's mean, before any replica sums it
            self._scale_gradients(replica_id, self._plan.window.scale)
        self._after_update[replica_id] = True
        if replica.num_replicas_in_sync > 1:
            # The gradients travel with replica 0's hyperparameters: one sync point opens the
            # step.
            check_dense(self._params[replica_id])
            everyone = self._open_step(replica, [p.grad for p in self._params[replica_id]])
            assert self._plan.zero is not None and self._plan.zero.stage == 2, "summed in backward"
            self._plan.zero.reduce_gradients(replica, everyone)
            self._after_update[replica_id] = False  # each replica holds its share
            if self._running_stats[replica_id]:
                self._average(replica)
        if self._plan.zero is not None:
            return self._plan.zero.step(replica)
        if self._plan.central is not None:
            return self._plan.central.step(replica_id)
        return self.optimizers[replica_id].step()

    def _step_reduced(
        self, replica: ReplicaContext, reducer: OverlappedGradientReducer, closure: Any = None
    ) -> Any:
        """The step when backward reduces the gradients: every replica applies the update, or,
        where the replicas share one device's memory, each parameter's owner applies it and
        copies the result (``sharded_update.py``). ``closure`` (the replicas' loss summed):
        the optimizer re-evaluates through it, each backward reducing its gradients."""
        replica_id = replica.local_replica_id
        if closure is None:
            check_dense(self._params[replica_id])
            reducer.finish_pass(replica_id)  # a step with no backward: reduce what is there
            self._after_update[replica_id] = True
        if len(self.optimizers) > 1:
            self._open_step(replica)
        path = self._plan.path
        if path is SyncPath.REDUCED_ZERO:
            assert self._plan.zero is not None
            result = self._plan.zero.step(replica)
        elif path is SyncPath.REDUCED_ON_OWNERS:
            assert self._plan.sharded is not None
            # A per-parameter optimizer calls its closure once, before it updates.
            loss = None if closure is None else closure()
            result = self._plan.sharded.step(replica_id)
            replica.exchange.barrier("optimizer.step: parameters copied")
            if closure is not None:
                result = loss
        elif path is SyncPath.REDUCED_CENTRAL:
            assert self._plan.central is not None
            result = self._plan.central.update(replica_id)
            replica.exchange.barrier("optimizer.step: central update")
            self._plan.central.copy_out(replica_id)
            replica.exchange.barrier("optimizer.step: parameters copied")
        else:
            result = self.optimizers[replica_id].step(closure)
        if self._running_stats[replica_id]:  # after any forward the closure ran
            self._average(replica)
        reducer.end_step(replica_id)
        return result

    def _average(self, replica: ReplicaContext, tensors: Sequence[torch.Tensor] = ()) -> None:
        """``tensors`` and BatchNorm's running statistics made their mean over the replicas
        (TensorFlow's aggregation of the statistics). The all-reduce hands every replica the
        same sum, so the means agree bit for bit: the end of the run need not check them."""
        replica_id = replica.local_replica_id
        stats = self._running_stats[replica_id]
        everything = [*tensors, *stats]
        with self._without_torch_function():  # also after a closure, which needs the modes
            averaged = replica.strategy.all_reduce_tensors(replica, ReduceOp.MEAN, everything)
            with torch.no_grad():
                for tensor, value in zip(everything, averaged, strict=True):
                    tensor.copy_(value)
            if stats and self._buffer_sync is not None:
                self._buffer_sync.agree(replica_id, stats)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The current replica's gradients inside ``strategy.run``, every replica's outside;
        inside an accumulation window, nothing (the gradients are the window's so far)."""
        if deferred_to_replay(self.zero_grad, set_to_none):  # a traced step: at each replay
            return
        replica = replica_context_of(self._strategy)
        ids = range(len(self.optimizers)) if replica is None else [replica.local_replica_id]
        with self._without_torch_function():
            self._zero_grad(ids, set_to_none)

    def _zero_grad(self, ids: Sequence[int], set_to_none: bool) -> None:
        for replica_id in ids:
            if self._plan.window is None or not self._plan.window.holding(replica_id):
                self.optimizers[replica_id].zero_grad(set_to_none=set_to_none)
                self._reduced_early[replica_id] = False
                self._after_update[replica_id] = False

    def resync(self) -> None:
        """Give every replica's optimizer replica 0's state (after a step that failed midway;
        with ``zero_stage``, every replica each owner's values of what it owns instead); an
        unfinished accumulation window is dropped with its gradients."""
        with self._own_load():  # replica 0's state, not a load of the program's
            self._reduced_early = [False] * len(self.optimizers)
            self._after_update = [False] * len(self.optimizers)
            if self._plan.reducer is not None:
                self._plan.reducer.reset()
            if self._plan.window is not None:
                self._plan.window.reset()
                for optimizer in self.optimizers:
                    optimizer.zero_grad(set_to_none=True)
            if self._plan.local is not None:
                self._plan.local.align()
            if self._plan.zero is not None:
                self._plan.zero.resync()  # each owner's values go with its state
                return
            if self._plan.sharded is not None:
                self._plan.sharded.share_state()
                return
            if self._plan.central is not None:
                return  # one state, on the parameter device: nothing to align
            for optimizer in self.optimizers[1:]:
                load_own_copy(optimizer, self.optimizers[0].state_dict())

    def stepping(self) -> Sequence[torch.optim.Optimizer]:
        """The optimizers whose ``step()`` makes the updates: every replica's, or under a
        ``CentralStorageStrategy`` the parameter device's alone."""
        central = self._plan.central
        return self.optimizers if central is None else (central.optimizer,)

    @property
    def zero_stage(self) -> int:
        """The strategy's ``zero_stage`` this optimizer runs with (0: no sharding)."""
        return 0 if self._plan.zero is None else self._plan.zero.stage

    def state_bytes(self) -> list[int]:
        """Bytes of optimizer state (its tensors) each local replica holds: the whole state on
        every replica, or about 1/N of it with ``zero_stage`` (a tensor replicas share counts
        once, for the first; under a ``CentralStorageStrategy`` the state lives once, on the
        parameter device, and counts for replica 0, whose optimizer shows it)."""
        if self._plan.zero is not None:
            return self._plan.zero.state_bytes()
        return state_bytes(self.optimizers)

    def state_dict(self) -> dict[str, Any]:
        """The plain single-optimizer state (replica 0's; all replicas are identical; under a
        ``CentralStorageStrategy`` the parameter device's, which replica 0's shows). With
        ``zero_stage`` it is gathered from the owners of the parameters; across workers that
        is a collective: call it on every worker at the same point."""
        self._run_hooks("state_dict_pre")
        state = (
            self.optimizers[0].state_dict()
            if self._plan.zero is None
            else self._plan.zero.state_dict()
        )
        return self._run_hooks("state_dict_post", state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the same state into every replica's optimizer (moved to its device); with
        ``zero_stage``, each replica keeps the state of the parameters it owns; under a
        ``CentralStorageStrategy``, into the parameter device's optimizer alone."""
        state_dict = self._run_hooks("load_state_dict_pre", state_dict)
        with self._own_load():
            if self._plan.zero is not None:
                self._plan.zero.load_state_dict(state_dict)
            elif self._plan.central is not None:
                self._plan.central.load_state_dict(state_dict)
            else:
                for optimizer in self.optimizers:
                    load_own_copy(optimizer, state_dict)
                if self._plan.sharded is not None:
                    self._plan.sharded.share_state()
        self._run_hooks("load_state_dict_post")
