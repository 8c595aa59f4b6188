"""Summing the replicas' gradients while backward still runs.

So that after ``loss.backward()`` every replica's ``.grad`` is the global batch's (the contract
DistributedDataParallel gives, which clipping, logging and updates by hand rely on), and, across
processes, where a step's communication costs far more than within one, to start it early:
gradients are packed into buckets in the order backward produces them (last layer first, a small
first bucket), and a bucket's sum starts as soon as every local replica has packed it. Buckets
start in the same fixed order on every worker (bucket ``i`` only after bucket ``i-1``), so the
workers' c10d collectives always pair up. With several local replicas a bucket is summed over
them first, in replica order, and one all-reduce per bucket crosses processes (hierarchical
all-reduce).

When a replica's backward ends (autograd's final callback) the sums are waited for and become the
parameters' gradients: after ``loss.backward()`` every replica holds the gradient of the whole
global batch, so clipping or unscaling before ``optimizer.step()`` sees the reduced values.

A traced step's replay (:mod:`mirrored.tracing`) has every gradient at once, computed by its
graph: ``hand_over`` packs them in one copy and ends the pass, what the hooks and the pass's end
would do, without autograd's engine and a hook per parameter. Where the pass would do more than
that (a gradient already there, an accumulation window, local SGD, a parameter not watched yet, a
hook on a parameter's gradient accumulator), it declines and the replay runs the autograd pass.

Exactness beyond one backward per step, without DDP's restrictions:

- each bucket carries, per parameter, the number of replicas that produced a gradient for it,
  so a parameter no replica used keeps ``grad=None`` (as on one device) and one used anywhere
  gets the sum;
- a second backward before ``optimizer.step()`` (gradient accumulation, a GAN's two losses, not
  zeroing gradients) contributes only its new gradient: the hook sends it and hands autograd a
  zero to accumulate, and the reduced sum is added to the gradient already there;
- gradients assigned by hand (``torch.autograd.grad``) with no backward in the step are reduced
  at ``optimizer.step()``;
- with gradient accumulation (:mod:`mirrored.replication.accumulation`) the backward passes of a
  window's first micro-steps send nothing (autograd sums them in ``param.grad``); the last
  micro-step's pass sends each parameter's window sum, its own gradient included, divided by the
  window's length.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from mirrored._torch_internals import (
    all_plain,
    bookkeeping,
    node_hooked,
    queue_backward_callback,
    will_engine_execute_node,
)
from mirrored.comm.bucketing import plan_gradient_buckets
from mirrored.comm.wire_compression import bucket_compressor
from mirrored.replication.outside_edits import internal_hook

if TYPE_CHECKING:
    from mirrored.comm.communicator import Communicator
    from mirrored.comm.powersgd import PowerSGD
    from mirrored.comm.wire_compression import PendingSum
    from mirrored.core.replica_set import ReplicaSet
    from mirrored.replication.accumulation import AccumulationWindow
    from mirrored.replication.local_sgd import LocalSteps

__all__ = [
    "BYTES_PER_PACK",
    "FIRST_PACK_BYTES",
    "OverlappedGradientReducer",
    "check_dense",
    "hand_over",
    "sparse_gradient_error",
]

# DistributedDataParallel's bucket sizes: a 1 MiB first bucket starts communication early in
# backward, 25 MiB buckets after it keep the number of collectives low.
FIRST_PACK_BYTES = 1 << 20
BYTES_PER_PACK = 25 << 20

# Which reducer watches a parameter: mirroring it again (a new optimizer) hands it over.
_OWNERS = WeakIdKeyDictionary()  # parameter -> weakref.ref to its reducer


class OverlappedGradientReducer:
    """The gradients of one mirrored optimizer's parameters, reduced over all replicas of all
    workers as backward produces them.

    Args:
        strategy: the multi-worker strategy (its active replica contexts give each hook the
            current step's exchange).
        params: each local replica's trainable parameters, in the same order.
        communicator: the strategy's; its workers' group carries the buckets across workers.
        window: the optimizer's accumulation window (None: every step reduces).
        local: the optimizer's local SGD schedule (None: every update reduces).
        compression: ``CommunicationOptions.compression`` (:mod:`mirrored.comm.wire_compression`).
        bytes_per_pack: bucket size in bytes; ``first_pack_bytes`` caps the first bucket.

    Its buckets are ``plan`` (:func:`mirrored.comm.bucketing.plan_gradient_buckets`).
    """

    def __init__(
        self,
        strategy: ReplicaSet,
        params: Sequence[Sequence[nn.Parameter]],
        communicator: Communicator,
        window: AccumulationWindow | None,
        local: LocalSteps | None,
        compression: str | PowerSGD | None,
        bytes_per_pack: int,
        first_pack_bytes: int,
    ) -> None:
        self._strategy = strategy
        self._communicator = communicator
        self._window = window
        self._local = local
        self._params = [list(p) for p in params]
        self._plain = all_plain(p for ps in self._params for p in ps)  # bookkeeping(), once
        first = self._params[0]
        self.plan = plan_gradient_buckets(
            [p.shape for p in first], [p.dtype for p in first], bytes_per_pack, first_pack_bytes
        )
        lengths = [self.plan.length(b) for b in range(len(self.plan.buckets))]
        self._compressor = bucket_compressor(compression, self.plan.layouts(), lengths)
        self._allocate()
        self._cuda = any(p.is_cuda for replica in self._params for p in replica[:1])
        self._lock = threading.Lock()
        self.reset()
        self._watch()

    def _allocate(self) -> None:
        """Per replica, the plan's buckets (gradients end to end, then one count per parameter),
        each gradient's view of them, and the zero a hook hands autograd instead of a gradient
        already sent."""
        self._buffers = [
            [
                torch.zeros(self.plan.length(b), dtype=bucket.dtype, device=replica[0].device)
                for b, bucket in enumerate(self.plan.buckets)
            ]
            for replica in self._params
        ]
        self._views: list[list[torch.Tensor]] = []
        for buffers in self._buffers:
            views: list[torch.Tensor] = [torch.empty(0)] * len(self.plan.shapes)
            for bucket, buffer in zip(self.plan.buckets, buffers, strict=True):
                for index, offset in zip(bucket.indices, bucket.offsets, strict=True):
                    shape = self.plan.shapes[index]
                    views[index] = buffer[offset : offset + shape.numel()].view(shape)
            self._views.append(views)
        self._zeros = [
            [torch.zeros((), dtype=p.dtype, device=p.device) for p in replica]
            for replica in self._params
        ]

    def _watch(self) -> None:
        """Hook every replica's parameters, taking them over from the reducer of an earlier
        mirroring of them."""
        num_local, num_params = len(self._params), len(self._params[0])
        self._handles: list[Any] = []
        self._hooked = [[False] * num_params for _ in range(num_local)]
        self._accumulators: list[list[Any]] = [[None] * num_params for _ in range(num_local)]
        self._places = {
            id(param): (r, i)
            for r, replica in enumerate(self._params)
            for i, param in enumerate(replica)
        }
        for r, replica in enumerate(self._params):
            for i, param in enumerate(replica):
                owner = _OWNERS.get(param)
                previous = owner() if owner is not None else None
                if previous is not None and previous is not self:
                    previous.remove_hooks()
                _OWNERS[param] = weakref.ref(self)
                self._hook(r, i)

    def reset(self) -> None:
        """Forget the current pass (a failed run may have left it half done): nothing packed,
        nothing in flight."""
        num_local, num_params = len(self._params), len(self._params[0])
        # Per replica.
        self._passes = [0] * num_local  # backward passes since the last optimizer.step()
        self._in_pass = [False] * num_local
        self._fired = [[False] * num_params for _ in range(num_local)]
        self._fresh = [[False] * num_params for _ in range(num_local)]
        self._left = [[len(m.indices) for m in self.plan.buckets] for _ in range(num_local)]
        self._events: list[list[Any]] = [[None] * len(self.plan.buckets) for _ in range(num_local)]
        # Shared by the local replicas.
        self._packed = [0] * len(self.plan.buckets)
        self._next_launch = 0
        self._pending: list[PendingSum | None] = [None] * len(self.plan.buckets)

    def _hook(self, r: int, i: int) -> None:
        """Watch parameter ``i`` of replica ``r`` (only possible while it requires grad)."""
        param = self._params[r][i]
        if param.requires_grad and not self._hooked[r][i]:
            self._accumulators[r][i] = _accumulator(param)
            hook = internal_hook(functools.partial(_on_grad_of, weakref.ref(self), r, i))
            self._handles.append(param.register_hook(hook))
            self._hooked[r][i] = True

    def remove_hooks(self) -> None:
        """Stop reducing (the parameters were mirrored again, with a new optimizer)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- during backward --------------------------------------------------------------------------
    def _on_grad(self, r: int, i: int, grad: torch.Tensor) -> torch.Tensor | None:
        if self._strategy.active_replica(r) is None or not _accumulates(self._accumulators[r][i]):
            return None  # backward outside strategy.run, or autograd.grad: nothing to reduce
        if self._window is not None and not self._window.final(r):
            return None  # an accumulation window's micro-step: autograd sums it in param.grad
        if self._local is not None and self._local.local(r):
            return None  # a local SGD update uses this replica's own gradient
        if grad.is_sparse:
            raise sparse_gradient_error(grad.shape)
        if not self._in_pass[r]:
            self._in_pass[r] = True
            queue_backward_callback(functools.partial(self.finish_pass, r))
        param = self._params[r][i]
        held = self._holding(r) and param.grad is not None
        fresh = param.grad is None or held
        self._keep_grad(r, param)
        view = self._views[r][i]
        view.copy_(grad)
        if held and param.grad is not None:
            view.add_(param.grad)
        self._send(r, i, fresh)
        # A gradient already there stays as it is; the reduced sum is added at the pass's end
        # (or, for a window's sum, replaces it).
        return None if param.grad is None else self._zeros[r][i].expand_as(grad)

    def _holding(self, r: int) -> bool:
        """Whether replica ``r``'s ``param.grad`` holds its accumulation window's unreduced sum
        (the window's last micro-step, before its first pass is reduced)."""
        return self._window is not None and self._window.holding(r) and self._passes[r] == 0

    def _send(self, r: int, i: int, fresh: bool) -> None:
        """Parameter ``i``'s gradient is in replica ``r``'s bucket view: scale it to the
        window's mean and count it packed."""
        if self._window is not None:
            self._views[r][i].mul_(self._window.scale)
        self._fired[r][i] = True
        self._fresh[r][i] = fresh
        self._param_packed(r, i)

    def _keep_grad(self, r: int, param: nn.Parameter) -> bool:
        """Before the pass writes into the buffers: a ``param.grad`` that is a view of them (the
        sum of an earlier pass) becomes a tensor of its own, or the pass would overwrite it.
        Returns whether it was such a sum (already reduced)."""
        grad = param.grad
        if grad is None:
            return False
        pointer = grad.data_ptr()
        if any(
            b.data_ptr() <= pointer < b.data_ptr() + b.numel() * b.element_size()
            for b in self._buffers[r]
        ):
            param.grad = grad.clone()
            return True
        return False

    def _param_packed(self, r: int, i: int) -> None:
        b = self.plan.bucket_of[i]
        self._left[r][b] -= 1
        if self._left[r][b] or self._communicator.workers is None:
            return  # (in one process, the buckets are summed when the pass ends)
        self._write_counts(r, b)
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
            self._events[r][b] = event
        with self._lock:
            self._packed[b] += 1
            while self._next_launch < len(self.plan.buckets) and self._packed[
                self._next_launch
            ] == len(self._params):
                self._launch(self._next_launch)
                self._next_launch += 1

    def _write_counts(self, r: int, b: int) -> None:
        bucket = self.plan.buckets[b]
        tail = self._buffers[r][b][bucket.numel :]
        counts = [1.0 if self._fired[r][j] else 0.0 for j in bucket.indices]
        if all(counts):  # the usual case: one fill, no host-to-device tensor
            tail.fill_(1.0)
        else:
            tail.copy_(torch.tensor(counts))

    def _launch(self, b: int) -> None:
        """Sum bucket ``b`` over the local replicas (in replica order) and start its all-reduce."""
        total = self._buffers[0][b]
        if self._cuda:
            for events in self._events:
                if events[b] is not None:
                    torch.cuda.current_stream(total.device).wait_event(events[b])
        for buffers in self._buffers[1:]:
            total.add_(buffers[b].to(total.device, non_blocking=True))
        label = f"gradients: bucket {b + 1} of {len(self.plan.buckets)}"
        self._pending[b] = self._communicator.all_reduce_across_workers_async(
            total, label, self._compressor, b
        )

    def _counts(self, buffer: torch.Tensor, bucket: Any) -> list[float]:
        """How many replicas produced each of ``bucket``'s gradients: in one process, from the
        replicas' flags on the host (no wait for the device); across workers, the counts the
        bucket carried."""
        if self._communicator.workers is None:
            return [sum(fired[j] for fired in self._fired) for j in bucket.indices]
        counts: list[float] = buffer[bucket.numel :].tolist()
        return counts

    # -- a traced step's pass ---------------------------------------------------------------------
    def _take(self, leaves: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> bool:
        """A backward pass whose gradients are ``grads`` for ``leaves`` (all of them parameters
        of one replica, none holding a gradient), packed and reduced in one call: what the
        pass's hooks and its end would do, without autograd. False, having done nothing, where
        only that pass would do what eager backward does (module docstring)."""
        places = [self._places.get(id(leaf)) for leaf in leaves]
        replicas = {place[0] for place in places if place is not None}
        if None in places or len(replicas) != 1:
            return False  # a leaf another reducer watches, or none
        (r,) = replicas
        indices = [place[1] for place in places if place is not None]
        if (
            self._window is not None
            or self._local is not None
            or self._in_pass[r]
            or self._passes[r]
            or self._strategy.active_replica(r) is None
            or not all(self._hooked[r][i] for i in indices)
            or any(leaf.grad is not None for leaf in leaves)
            or any(
                node_hooked(self._accumulators[r][i], leaf)
                for i, leaf in zip(indices, leaves, strict=True)
            )
        ):
            return False
        for grad in grads:
            if grad.is_sparse:
                raise sparse_gradient_error(grad.shape)
        with bookkeeping(self._plain and all_plain(grads)):
            torch._foreach_copy_([self._views[r][i] for i in indices], list(grads))
            self._in_pass[r] = True
            for i in indices:
                self._send(r, i, fresh=True)
            self._finish_pass(r)
        return True

    # -- the end of a pass ------------------------------------------------------------------------
    def finish_pass(self, r: int) -> None:
        """Replica ``r``'s backward is over (or ``optimizer.step()`` came without one): pack
        what it did not produce, wait for every bucket, and make the sums its gradients."""
        with bookkeeping(self._plain):
            self._finish_pass(r)

    def _finish_pass(self, r: int) -> None:
        replica = self._strategy.active_replica(r)
        if replica is None:
            return
        manual = not self._in_pass[r] and self._passes[r] == 0
        if not self._in_pass[r] and not manual:
            return  # this step's gradients are already reduced
        holding = self._holding(r)
        self._in_pass[r] = True
        for i, fired in enumerate(self._fired[r]):
            if fired:
                continue
            param = self._params[r][i]
            reduced = self._keep_grad(r, param)
            # Assigned by hand with no backward in this step, or produced by a backward the
            # parameter was frozen for when mirrored (it is watched from now on), or summed
            # over an accumulation window's micro-steps: reduce it now. A sum left from an
            # earlier step (no zero_grad) is not reduced twice.
            if param.grad is not None and (
                holding or (not reduced and (manual or not self._hooked[r][i]))
            ):
                self._views[r][i].copy_(param.grad)
                self._hook(r, i)
                self._send(r, i, fresh=True)
            else:
                self._views[r][i].zero_()
                self._param_packed(r, i)
        exchange = replica.exchange
        one_process = self._communicator.workers is None
        if one_process:
            # Each bucket summed over the replicas, in place in every replica's copy (with
            # HierarchicalCopyAllReduce each replica sums a slice, at once).
            for buffer in self._buffers[r]:
                self._communicator.all_reduce_buffer(exchange, buffer)
        else:
            self._wait_across_workers(r, exchange)
        for b, bucket in enumerate(self.plan.buckets):
            counts = self._counts(self._buffers[r][b], bucket)
            for index, count in zip(bucket.indices, counts, strict=True):
                if not count:
                    continue  # no replica anywhere has a gradient for it: it stays None
                param, view = self._params[r][index], self._views[r][index]
                if self._fresh[r][index] or param.grad is None:
                    param.grad = view
                else:
                    param.grad.add_(view)
        # No replica starts over (clears its flags, refills the leader's buffers) before every
        # replica has read them.
        exchange.barrier("gradients unpacked", cross_device=True)
        self._in_pass[r] = False
        self._fired[r] = [False] * len(self._fired[r])
        self._fresh[r] = [False] * len(self._fresh[r])
        self._left[r] = [len(m.indices) for m in self.plan.buckets]
        self._passes[r] += 1

    def _wait_across_workers(self, r: int, exchange: Any) -> None:
        """Every local replica has packed every bucket, so every all-reduce across the workers
        has started: the leader waits for them, and each replica copies the leader's sums."""
        exchange.barrier("gradients packed", cross_device=True)
        if r == 0:
            pending, self._pending = self._pending, [None] * len(self.plan.buckets)
            self._packed = [0] * len(self.plan.buckets)
            self._next_launch = 0
            for collective in pending:
                if collective is not None:
                    collective.wait()
        exchange.barrier("gradients reduced", cross_device=True)
        if r:
            for buffer, leader in zip(self._buffers[r], self._buffers[0], strict=True):
                buffer.copy_(leader, non_blocking=True)

    def end_step(self, r: int) -> None:
        """After ``optimizer.step()`` on replica ``r``: the next step starts counting passes."""
        self._passes[r] = 0


def sparse_gradient_error(shape: torch.Size) -> TypeError:
    """The error for a sparse gradient, which no all-reduce of mirrored sums."""
    return TypeError(
        f"a parameter of shape {tuple(shape)} has a sparse gradient; mirrored all-reduces dense "
        "gradients only (use nn.Embedding(sparse=False))"
    )


def check_dense(params: Sequence[nn.Parameter]) -> None:
    """Refuse a sparse gradient among ``params``' (a ``TypeError``)."""
    for param in params:
        if param.grad is not None and param.grad.is_sparse:
            raise sparse_gradient_error(param.shape)


def hand_over(leaves: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> bool:
    """Give a traced step's gradients for ``leaves`` to the reducer that watches them, as the
    backward pass into them would: summed over every replica and left in ``.grad``, with no
    autograd pass and no hook per parameter. False, having done nothing, where that pass is
    needed: a leaf no reducer watches (yet: frozen when mirrored) or watched by another, a
    gradient already there, a hook on a leaf's gradient accumulator, an accumulation window or
    local SGD (their hooks decide what is sent)."""
    owner = _OWNERS.get(leaves[0]) if leaves else None
    reducer = owner() if owner is not None else None
    return reducer is not None and reducer._take(leaves, grads)


def _on_grad_of(
    reducer: weakref.ref[OverlappedGradientReducer], r: int, i: int, grad: torch.Tensor
) -> torch.Tensor | None:
    """A parameter's hook, holding its reducer weakly: the reducer keeps the parameter's
    accumulator node, whose reference to the parameter (and so to its hooks) the garbage
    collector cannot see, so a strong reference back would keep the reducer, its strategy and
    the strategy's replica threads alive for as long as the process runs."""
    alive = reducer()
    if alive is None:
        return None
    with bookkeeping(alive._plain and all_plain((grad,))):
        return alive._on_grad(r, i, grad)


def _accumulator(param: nn.Parameter) -> Any:
    """The autograd node that accumulates into ``param.grad`` (kept alive by the caller, so that
    autograd keeps using this one)."""
    with torch.enable_grad():
        view = param.view_as(param)
    assert view.grad_fn is not None
    return view.grad_fn.next_functions[0][0]


def _accumulates(accumulator: Any) -> bool:
    """Whether the running backward accumulates through ``accumulator`` (``loss.backward()``),
    as opposed to ``torch.autograd.grad``, whose results the hooks must leave alone."""
    try:
        return bool(will_engine_execute_node(accumulator))
    except RuntimeError:  # torch refuses the question during autograd.grad
        return False
