"""The in-process strategies' base: replicas run by this process, written once.

A strategy of this kind owns replicas (one per device) and runs a step on all of them: ``run``
hands each replica its slice of the arguments, ``reduce`` / ``gather`` combine their results, and
datasets are split into per-replica shards. ``InProcessStrategy`` implements the ``Strategy``
contract (:mod:`mirrored.core.strategy`) for them, and the replica-set contract its replicas
talk through (:mod:`mirrored.core.replica_set`), and is abstract: a subclass says how replica
functions are executed (``_execute``), how a model is mirrored (``mirror``) and how it is closed.
The features of the replicated strategies (gradient accumulation, local SGD, ZeRO) live on their
family, :class:`mirrored.strategies.replicated.ReplicatedStrategy`.
"""

from __future__ import annotations

import abc
import functools
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from mirrored.comm.communicator import Communicator
from mirrored.comm.cross_device_ops import CrossDeviceOps
from mirrored.config import LogicalDevice
from mirrored.core import context
from mirrored.core.replica_failures import add_note, first_failure
from mirrored.core.replica_meeting import ReplicaExchange, ReplicaMeeting
from mirrored.core.replica_set import Participant, ReplicaSet, Replicated
from mirrored.core.replica_workers import Outcome
from mirrored.core.values import (
    PerReplica,
    ReduceOp,
    flatten,
    map_structure,
    regroup,
    select_replica,
)
from mirrored.input import (
    DistributedDataset,
    InputContext,
    InputOptions,
    ValueContext,
    distribute_global_batches,
    distribute_replica_batches,
    global_batch_size_of,
)
from mirrored.replication.buffer_sync import SyncsBuffers
from mirrored.replication.outside_edits import CarriesOutsideEdits

__all__ = ["InProcessStrategy", "add_note"]


class InProcessStrategy(ReplicaSet):
    """Base of the strategies whose replicas this process runs (``run`` on replica threads)."""

    def __init__(
        self,
        devices: Sequence[LogicalDevice],
        cross_device_ops: CrossDeviceOps,
        timeout_seconds: float | None,
    ) -> None:
        if timeout_seconds is not None and timeout_seconds <= 0:
            raise ValueError(
                f"timeout_seconds={timeout_seconds}: expected a positive number or None"
            )
        self.devices: tuple[LogicalDevice, ...] = tuple(devices)
        # Every collective goes through it; a multi-worker strategy's also crosses processes.
        self.communicator = Communicator(cross_device_ops, self.devices)
        self.timeout_seconds = timeout_seconds
        # Insertion-ordered (a dict), so resyncs can run newest first.
        self._replicated: weakref.WeakKeyDictionary[Replicated, None] = weakref.WeakKeyDictionary()
        self._run_lock = threading.Lock()
        # Each local replica's context while a run is under way (None between runs): autograd
        # hooks, which may run on autograd's device threads, find their step's exchange here.
        self._active_contexts: list[context.ReplicaContext | None] = [None] * len(self.devices)
        self._physical_gpus = tuple(
            sorted({d.physical.index for d in self.devices if d.device_type == "GPU"})
        )
        # What is released when the strategy closes (a mirrored optimizer's patches of torch),
        # held weakly: what is collected first has released already.
        self._at_close: list[weakref.WeakMethod[Callable[[], None]]] = []
        # Verify the replicas bit-identical before and after each run (a debugging aid).
        self.check_replicas = os.environ.get("MIRRORED_CHECK_REPLICAS", "") not in ("", "0")

    @property
    def cross_device_ops(self) -> CrossDeviceOps:
        """How a bucket is summed over this process's replicas (the communicator's)."""
        return self.communicator.cross_device_ops

    # -- identity ---------------------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas a step runs on (global batch = this x per-replica batch)."""
        return len(self.devices)

    @property
    def _first_replica_id(self) -> int:
        """The global id of this process's first replica (local replica i is this + i)."""
        return 0

    @property
    def should_checkpoint(self) -> bool:
        """Whether this process writes checkpoints, logs and summaries (TensorFlow's
        ``extended.should_checkpoint``): always in one process, the chief's among workers."""
        return True

    def save_on_chief(self, write: Callable[[], object]) -> None:
        """Run ``write`` (a checkpoint's write) where checkpoints are written, and return on
        every process only once it is written. Among workers: the chief writes, and every
        worker raises if the chief's write failed; call it on every worker at the same point."""
        write()

    def check_same_on_workers(self, value: Any, what: str) -> None:
        """Raise ``ValueError`` unless every worker holds the same tensors in ``value`` (after a
        restore: workers that read different files would train apart). In one process, nothing
        to check; call it on every worker at the same point."""

    @property
    def _input_devices(self) -> tuple[torch.device | None, ...]:
        """Where input shards go (None: stay where they are)."""
        return self.torch_devices

    @property
    def torch_devices(self) -> tuple[torch.device, ...]:
        """The torch device of each replica (logical devices of one GPU share one)."""
        return tuple(d.torch_device for d in self.devices)

    def __repr__(self) -> str:
        names = [d.short_name for d in self.devices]
        return f"{type(self).__name__}(devices={names}, cross_device_ops={self.cross_device_ops})"

    # -- running replicas -------------------------------------------------------------------------
    def run(
        self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Run ``fn`` once per replica, concurrently, each with its slice of PerReplica arguments.

        Returns the results regrouped: a PerReplica where replicas differ. An exception in a
        replica is raised here, naming the replica; the other replicas are released.
        """
        if context.current_replica_context() is not None or context.in_merge_call():
            raise RuntimeError(
                "strategy.run() was called inside a replica function; call it from the training "
                "loop (cross-replica context), once per step"
            )
        if not isinstance(args, (tuple, list)):
            raise TypeError(
                f"args must be a tuple or list of positional arguments, got "
                f"{type(args).__name__}; pass args=(batch,)"
            )
        kwargs = kwargs or {}
        global_batch_size = global_batch_size_of((tuple(args), kwargs))
        meeting = ReplicaMeeting(len(self.devices), self.timeout_seconds)
        buffers = [
            r for r in list(self._replicated) if isinstance(r, SyncsBuffers) and r.has_buffers
        ]
        tasks = [
            functools.partial(
                self._run_replica,
                replica_id,
                meeting,
                fn,
                select_replica(replica_id, tuple(args)),
                select_replica(replica_id, kwargs),
                global_batch_size,
                buffers if self.num_replicas_in_sync > 1 else [],
            )
            for replica_id in range(len(self.devices))
        ]
        # One run at a time, from any number of caller threads: a failed run's resync must not
        # touch the replicas of another caller's run.
        with self._run_lock:
            edited = self._carry_outside_edits()
            try:
                outcomes = self._execute(tasks, meeting)
            except BaseException as interrupted:
                self._resync_replicated(interrupted)
                raise
            failures = [(i, o[1]) for i, o in enumerate(outcomes) if not o[0]]
            if failures:
                root = self._root_error(failures, meeting)
                self._resync_replicated(root)
                raise root
            self._observe_run(meeting, (tuple(args), kwargs))
            self._mark_outside_edits(edited)
        try:
            return regroup([o[1] for o in outcomes])
        except (ValueError, KeyError) as mismatch:
            raise ValueError(
                "the replicas returned results of different structure; return the same "
                f"structure (same keys, lengths and nesting) from every replica: {mismatch!r}"
            ) from mismatch

    def track_replicated(self, replicated: Replicated) -> None:
        """Resync ``replicated`` from replica 0 whenever a run fails, so that a step that failed
        on some replicas after others had updated cannot leave them diverged; and carry what the
        program changes on its replica 0 between runs to the others."""
        self._replicated[replicated] = None
        if isinstance(replicated, CarriesOutsideEdits):
            replicated.mark_outside_edits()

    def _carry_outside_edits(self) -> list[CarriesOutsideEdits]:
        """Before a run: what the program changed on replica 0 of each mirrored module since the
        last run, onto every replica (and, with ``check_replicas``, verified)."""
        if len(self.devices) == 1:
            return []
        edited: list[CarriesOutsideEdits] = [
            r for r in list(self._replicated) if isinstance(r, CarriesOutsideEdits)
        ]
        for module in edited:
            module.carry_outside_edits()
            if self.check_replicas:
                module.check_replicas("before a run")
        return edited

    def _mark_outside_edits(self, edited: Sequence[CarriesOutsideEdits]) -> None:
        """After a run: what later edits are measured from (and, with ``check_replicas``,
        the replicas verified)."""
        for module in edited:
            module.mark_outside_edits()
            if self.check_replicas:
                module.check_replicas("after a run")

    def at_close(self, release: Callable[[], None]) -> None:
        """``release`` must be a bound method; it is held weakly."""
        self._at_close = [r for r in self._at_close if r() is not None]
        self._at_close.append(weakref.WeakMethod(release))

    def _release_at_close(self) -> None:
        """From ``close()``, however it ends: what only this strategy's replicas needed goes."""
        releases, self._at_close = self._at_close, []
        for reference in releases:
            release = reference()
            if release is not None:
                release()

    def untrack_replicated(self, replicated: Replicated) -> None:
        """Stop resyncing ``replicated`` (a released mirror)."""
        self._replicated.pop(replicated, None)

    def _resync_replicated(self, error: BaseException) -> None:
        """After a failed run; a failure to resync is noted on ``error``, never replaces it.
        Newest first: a mirrored optimizer before the module it was mirrored with, so that with
        ``zero_stage`` each owner hands its values over before the module copies replica 0's."""
        if not self._usable():
            return
        try:
            self._resync_now()
        except Exception as resync_error:
            add_note(error, f"and resyncing the replicas afterwards failed: {resync_error!r}")

    def _resync_now(self) -> None:
        """Every replicated module and optimizer from replica 0, newest first (also once the
        replicas a failed run gave up on have returned)."""
        for replicated in reversed(list(self._replicated)):
            replicated.resync()

    def _usable(self) -> bool:
        """False once replicas are stuck in user code (their state cannot be trusted)."""
        return True

    def _run_replica(
        self,
        replica_id: int,
        meeting: ReplicaMeeting,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        global_batch_size: int | None,
        buffers: Sequence[SyncsBuffers] = (),
    ) -> Any:
        exchange = ReplicaExchange(
            meeting, replica_id, self.devices[replica_id].torch_device, self._physical_gpus
        )
        replica = context.ReplicaContext(
            self, self._first_replica_id + replica_id, exchange, global_batch_size
        )
        self._active_contexts[replica_id] = replica
        meeting.begin(replica_id)
        try:
            with context.replica_scope(replica), self._replica_scope(replica_id):
                if exchange.device.type == "cuda":
                    for leaf in flatten((args, kwargs)):
                        if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
                            # Made on the caller's stream, used on this replica's: keep its
                            # memory from being reused before this replica is done with it.
                            leaf.record_stream(torch.cuda.current_stream())
                result = fn(*args, **kwargs)
                try:
                    for module in buffers:
                        module.sync_buffers(replica)
                except ValueError as error:
                    add_note(error, _AFTER_FN)
                    raise
                return result
        except BaseException as error:
            meeting.abort(error)
            raise
        finally:
            self._active_contexts[replica_id] = None
            meeting.finish(replica_id)

    def active_replica(self, local_replica_id: int) -> context.ReplicaContext | None:
        """The context of a local replica inside the current run (None outside one)."""
        return self._active_contexts[local_replica_id]

    def _root_error(
        self, failures: list[tuple[int, BaseException]], meeting: ReplicaMeeting
    ) -> BaseException:
        """The error to raise: the first real failure (not a released replica), annotated."""
        first = first_failure(failures, meeting.abort_reason)
        if first is None:
            assert meeting.abort_reason is not None
            return meeting.abort_reason
        replica_id, error = first
        note = (
            f"raised in replica {self._first_replica_id + replica_id} of "
            f"{self.num_replicas_in_sync} (device {self.devices[replica_id].short_name})"
        )
        add_note(error, note)
        return error

    @abc.abstractmethod
    def _execute(
        self, tasks: Sequence[Callable[[], Any]], meeting: ReplicaMeeting
    ) -> list[Outcome]:
        """Run one task per replica and return their outcomes: threads, a pipeline's stages, or
        the caller's thread."""

    @contextmanager
    def _replica_scope(self, replica_id: int) -> Iterator[None]:
        """Per-replica device state around a replica task (streams, RNG); none by default."""
        yield

    def all_reduce_tensors(
        self, replica: Participant, reduce_op: ReduceOp, tensors: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Collective: reduce a list of tensors across replicas, packed into buckets. Every
        replica must pass the same shapes and dtypes (a ValueError naming them otherwise)."""
        return self.communicator.all_reduce_tensors(replica, reduce_op, tensors)

    def all_gather_tensors(
        self, replica: Participant, tensors: Sequence[torch.Tensor], axis: int
    ) -> list[torch.Tensor]:
        """Collective: each tensor concatenated along ``axis`` over the replicas, in replica
        order, on this replica's device (sizes along ``axis`` may differ)."""
        return self.communicator.all_gather_tensors(replica, tensors, axis)

    # -- combining results ------------------------------------------------------------------------
    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """``value`` as each replica holds it: one structure per replica (a one-tuple when
        nothing in ``value`` is per-replica)."""
        if isinstance(value, PerReplica):
            return value.values
        if not any(isinstance(leaf, PerReplica) for leaf in flatten(value)):
            return (value,)
        return tuple(select_replica(i, value) for i in range(len(self.devices)))

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combine a PerReplica (or nested structure of them) across replicas (detached).

        ``axis=None`` combines the replicas' values elementwise; with an ``axis`` each replica's
        value is first summed along it, and MEAN divides by the total length along it, so a
        ragged split gives the same mean as one device.
        """
        op = ReduceOp.of(reduce_op)
        return map_structure(lambda v: self.communicator.reduce(op, v, axis), value)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate the per-replica parts along ``axis`` on the first replica's device
        (detached)."""
        return map_structure(
            lambda v: self.communicator.gather(self.experimental_local_results(v), axis), value
        )

    # -- input ------------------------------------------------------------------------------------
    def experimental_distribute_dataset(
        self, dataset: Iterable[Any], options: InputOptions | None = None
    ) -> DistributedDataset:
        """Split each global batch of ``dataset`` (a DataLoader or any iterable of batches) into
        per-replica shards on the replicas' devices; ``options``: ``InputOptions`` (reading
        ahead, the batch dimension)."""
        return distribute_global_batches(
            dataset,
            self._input_devices,
            sizes_of=self._balanced_sizes(),
            options=options,
        )

    def _balanced_sizes(self) -> Callable[[int], list[int]] | None:
        """How global batches are split when not evenly (None: evenly)."""
        return None

    def _observe_run(self, meeting: ReplicaMeeting, inputs: Any) -> None:
        """After a successful run on ``inputs`` (its positional and keyword arguments)."""

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]]
    ) -> DistributedDataset:
        """``dataset_fn(input_context)`` builds a dataset of per-replica batches; each step takes
        one batch per replica."""
        input_context = InputContext(1, 0, self.num_replicas_in_sync)
        return distribute_replica_batches([dataset_fn(input_context)], self._input_devices)

    def experimental_distribute_values_from_function(
        self, value_fn: Callable[[ValueContext], Any]
    ) -> Any:
        """A PerReplica of ``value_fn(ValueContext(replica_id, n))``, tensors on each device."""
        values = [
            _to_device(
                value_fn(ValueContext(self._first_replica_id + i, self.num_replicas_in_sync)),
                device,
            )
            for i, device in enumerate(self._input_devices)
        ]
        return regroup(values) if len(values) > 1 else PerReplica(values)


# Noted on an error of the buffers' sync, which runs once fn has returned.
_AFTER_FN = (
    "The buffers are compared as the run ends, after fn returned: the updates fn made (its "
    "optimizer.step()) were applied. Every replica is reset to replica 0's parameters, "
    "optimizer state and buffers, so the replicas agree; replica 0's copy of a buffer that "
    "differed is its own shard's."
)


def _to_device(structure: Any, device: torch.device | None) -> Any:
    if device is None:
        return structure
    return map_structure(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, structure)
