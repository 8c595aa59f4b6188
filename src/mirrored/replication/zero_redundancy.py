"""ZeRO: each replica keeps the optimizer state of its share of the parameters only.

Mirrored training holds N copies of everything, and the optimizer state (Adam's: twice the
parameters) is the largest copy no replica needs whole. With ``zero_stage`` (MirroredStrategy and
MultiWorkerMirroredStrategy) the parameters the optimizer holds, end to end, are cut into one range
of nearly equal size per replica of every worker (:mod:`mirrored.replication.zero_plan`); only a
range's owner steps it and keeps its state (:mod:`mirrored.replication.zero_storage`), so
optimizer-state memory per replica is 1/N whatever the sizes of the tensors (one large embedding
included).

- Stage 1: gradients are reduced as without ZeRO (across workers while backward runs, so
  clipping or unscaling before ``optimizer.step()`` sees the sums). Each owner updates its
  ranges; in one process every replica then copies the others' ranges from their owners;
  across workers the owners' ranges are all-gathered a chunk of every worker's segment (one
  per dtype) at a time, packed from the parameters and written straight into them.
- Stage 2: gradients are reduce-scattered at ``optimizer.step()`` instead, in the same layout
  and chunks: each worker sums its replicas' gradients into a chunk, an all-to-all hands each
  worker its own segment's range from every worker, summed in rank order into the owners'
  reduced gradients; a parameter's gradients are dropped on every replica once its last chunk
  has crossed. In one process each owner sums its ranges over the replicas directly. Only
  owners keep a reduced gradient, and with no gradient buckets (nothing is reduced during
  backward) the peak is below stage 0's; reduce-scattering buckets from backward's hooks would
  lower it further and win back the overlap with backward.

Across workers no buffer of the model's size (a worker's segment, a flat copy of the
gradients) is made: the staging of each step's collectives holds one chunk of every worker's
segment (``_CHUNK_BYTES``, an eighth of the parameters for a smaller model) and is dropped
after them, so each process's peak is stage 0's less the optimizer state it no longer keeps
(``benchmarks/RESULTS.md``, "ZeRO and peak memory"). In one process the replicas of one device
already share one optimizer state (owner updates), so there stage 1 saves nothing.

The update is the one every replica would have made (the same gradient sum, the same state) for
optimizers whose update of a parameter is elementwise in that parameter, its gradient and its own
state: torch's built-ins in ``PER_PARAMETER_OPTIMIZERS``. ``state_dict()`` is the plain
single-optimizer one (:mod:`mirrored.replication.zero_state`); across workers that is a collective,
so every worker calls it at the same point (``Model.save`` does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mirrored.core.param_groups import hyperparameters
from mirrored.core.state_checks import check_optimizer_state
from mirrored.replication.sharded_update import (
    PER_PARAMETER_OPTIMIZERS,
    load_own_copy,
    state_bytes,
    step_owned,
    sum_owned_gradients,
)
from mirrored.replication.zero_plan import (
    ParameterSpec,
    Piece,
    capped_chunk_bytes,
    describe_parameters,
    plan_zero,
)
from mirrored.replication.zero_state import (
    consolidated_state,
    dtype_name,
    gather_state,
    local_entries,
    pieces_state,
)
from mirrored.replication.zero_storage import ShardStorage

if TYPE_CHECKING:
    from mirrored.comm.communicator import Communicator
    from mirrored.core.context import ReplicaContext

# What one gather or reduce-scatter across workers moves at most, every worker's chunk together:
# each of the two staging buffers per dtype holds this much, whatever the parameters' size.
# 8 MiB keeps a step's collectives few (benchmarks/zero.py) and the staging small beside the
# optimizer state sharding saves.
_CHUNK_BYTES = 8 * 2**20

__all__ = ["ZeroRedundancy", "check_zero_stage"]


def check_zero_stage(zero_stage: int) -> int:
    """``zero_stage`` if it is 0 (off), 1 or 2; a ValueError otherwise."""
    if type(zero_stage) is not int or zero_stage not in (0, 1, 2):
        raise ValueError(
            f"zero_stage={zero_stage!r}: expected 0 (every replica keeps the whole optimizer "
            "state), 1 (shard the optimizer state) or 2 (shard the gradients too)"
        )
    return zero_stage


def _chunk_bytes(parameters: Sequence[ParameterSpec]) -> int:
    """What one collective across workers moves: ``_CHUNK_BYTES`` (read now, not bound at
    import: the multi-process tests lower it), capped for a small model so that the staging
    stays well below the optimizer state each worker no longer keeps."""
    total = sum(
        s.numel * s.dtype.itemsize for s in parameters if s.trainable and s.state_index is not None
    )
    return capped_chunk_bytes(_CHUNK_BYTES, total)


def _check_optimizer(stage: int, optimizer: torch.optim.Optimizer) -> None:
    """A TypeError unless ``optimizer``'s update is elementwise (what makes owners exact)."""
    if type(optimizer) not in PER_PARAMETER_OPTIMIZERS:
        names = ", ".join(kind.__name__ for kind in PER_PARAMETER_OPTIMIZERS)
        raise TypeError(
            f"zero_stage={stage} needs an optimizer whose update of a parameter is "
            f"elementwise in that parameter, its gradient and its own state (one of "
            f"torch.optim's {names}); got {type(optimizer).__name__}. Use zero_stage=0 for it"
        )


class ZeroRedundancy:
    """The optimizer state of one mirrored optimizer, sharded over every replica of every worker.

    Args:
        stage: 1 (optimizer state) or 2 (optimizer state and gradients).
        optimizers: each local replica's optimizer (replica 0's is the user's).
        params: each local replica's parameters, in the same order.
        communicator: the strategy's: its worker layout places the owners, and its workers'
            group (None in one process) carries the collectives across workers.
    """

    def __init__(
        self,
        stage: int,
        optimizers: Sequence[torch.optim.Optimizer],
        params: Sequence[Sequence[nn.Parameter]],
        communicator: Communicator,
    ) -> None:
        _check_optimizer(stage, optimizers[0])
        self.stage = stage
        self.optimizers = list(optimizers)
        self.params = [list(p) for p in params]
        self._communicator = communicator
        self._concurrent = len(self.optimizers) > 1  # replica threads step at once
        layout = communicator.layout
        parameters = describe_parameters(self.params[0], optimizers[0])
        self.plan = plan_zero(
            stage, parameters, layout.replicas_per_worker, layout.rank, _chunk_bytes(parameters)
        )
        self._storage = ShardStorage(self.plan, self.params, self.optimizers)
        # Frozen parameters never change: they take no part (and must stay frozen).
        self._frozen = [[replica[i] for i in self.plan.frozen] for replica in self.params]
        # Per parameter, the pieces of it this worker's replicas own.
        self._pieces_here: dict[int, list[int]] = {}
        for k in sorted(k for share in self.plan.shares for k in share.owned):
            self._pieces_here.setdefault(self.plan.pieces[k].position, []).append(k)
        if optimizers[0].state:  # a state the user's optimizer already had: shard it
            self.load_state_dict(optimizers[0].state_dict())

    @property
    def pieces(self) -> tuple[Piece, ...]:
        """The pieces of the parameters, each owned by one replica (``plan.pieces``)."""
        return self.plan.pieces

    @property
    def owners(self) -> tuple[int, ...]:
        """Each piece's owner, a replica index over every worker (``plan.owners``)."""
        return self.plan.owners

    # -- the step ---------------------------------------------------------------------------------
    def reduce_gradients(
        self, replica: ReplicaContext, everyone: Sequence[list[torch.Tensor | None]]
    ) -> None:
        """Stage 2: give each owned parameter and piece the sum of its gradient over every
        replica of every worker and drop the other gradients (``everyone``: each local
        replica's gradients; across workers its entries are dropped too, as they are reduced,
        so that no reference keeps a whole gradient alive)."""
        r = replica.local_replica_id
        self._check_frozen(r)
        if self.plan.num_workers == 1:
            self._sum_owned(r, everyone)
        elif r == 0:
            self._reduce_scatter(everyone)
        # Owners have read every peer's gradient: the rest is no replica's to keep.
        replica.exchange.barrier("ZeRO: gradients reduced", cross_device=True)
        whole = self.plan.shares[r].whole
        for position in self.plan.positions:
            if position not in whole:
                self.params[r][position].grad = None

    def _sum_owned(self, r: int, everyone: Sequence[Sequence[torch.Tensor | None]]) -> None:
        """In one process: replica ``r``'s owned parameters and pieces get their gradients'
        sums over the replicas, in replica order."""
        sum_owned_gradients(self.params[r], self._storage.whole_ids[r], everyone)
        for k, piece_param in self._storage.piece_params[r].items():
            piece = self.plan.pieces[k]
            parts = [g for grads in everyone if (g := grads[piece.position]) is not None]
            piece_param.grad = _sum_range(
                parts, piece.start, piece.start + piece.numel, piece_param.device
            )

    def _check_frozen(self, r: int) -> None:
        """A RuntimeError if a parameter frozen at ``strategy.mirror()`` has a gradient: it has
        no owner, so it would never be updated."""
        for param in self._frozen[r]:
            if param.grad is not None:
                raise RuntimeError(
                    f"a parameter of shape {tuple(param.shape)} was frozen (requires_grad=False) "
                    f"when the model was mirrored with zero_stage={self.stage} and has a gradient "
                    "now; ZeRO shares out the trainable parameters at strategy.mirror(), so "
                    "unfreeze before mirroring (or mirror the model again with a new optimizer)"
                )

    def _reduce_scatter(self, everyone: Sequence[list[torch.Tensor | None]]) -> None:
        """Across workers, by local replica 0 while the others wait: every gradient summed over
        the local replicas, then over the workers in rank order, a chunk of every segment at a
        time, into the reduced gradients of the pieces this worker's replicas own. Once its
        last chunk has crossed, a parameter's gradients are dropped on every local replica
        (``param.grad`` and its entry in ``everyone``), so the owners' gradients take the place
        of the whole ones as they go."""
        plan = self.plan
        has = self._communicator.sum_across_workers(
            [float(any(grads[i] is not None for grads in everyone)) for i in plan.positions],
            "ZeRO: which parameters have gradients",
        )
        has_grad = dict(zip(plan.positions, (bool(c) for c in has), strict=True))
        reduced: dict[int, torch.Tensor] = {}
        for li, transfer in enumerate(plan.transfers):
            done_after: dict[int, list[int]] = {}
            for position, index in transfer.last_ranges(plan.pieces).items():
                done_after.setdefault(index, []).append(position)
            self._hand_over(done_after.pop(-1, []), has_grad, reduced, everyone)
            staging = self._storage.staging(li)
            for index, (a, b) in enumerate(transfer.ranges()):
                self._reduce_range(li, (a, b), staging, everyone, reduced, has_grad)
                self._hand_over(done_after.pop(index, []), has_grad, reduced, everyone)

    def _reduce_range(
        self,
        li: int,
        span: tuple[int, int],
        staging: tuple[torch.Tensor, torch.Tensor],
        everyone: Sequence[Sequence[torch.Tensor | None]],
        reduced: dict[int, torch.Tensor],
        has_grad: dict[int, bool],
    ) -> None:
        """Elements ``span`` (a to b) of every worker's segment of transfer ``li``, through
        ``staging`` (its outgoing and incoming buffers): the local sums go out, this worker's
        range comes back summed into ``reduced`` (piece -> its reduced gradient, made at its
        first range)."""
        plan, num_workers = self.plan, self.plan.num_workers
        (a, b), transfer = span, plan.transfers[li]
        n = b - a
        outgoing = staging[0][: num_workers * n]
        outgoing.zero_()
        for w in range(num_workers):
            for k, lo, hi, at in transfer.parts(plan.pieces, w, a, b):
                position = plan.pieces[k].position
                parts = [g for grads in everyone if (g := grads[position]) is not None]
                _sum_into(outgoing[w * n + at : w * n + at + hi - lo], parts, lo, hi)
        total = staging[0][:n]  # what went out is spent once the all-to-all is over
        label = f"ZeRO: gradients ({dtype_name(transfer.layout.dtype)}, from {a})"
        self._communicator.reduce_scatter_across_workers(
            outgoing, staging[1][: num_workers * n], total, label
        )
        for k, lo, hi, at in transfer.parts(plan.pieces, plan.worker, a, b):
            piece = plan.pieces[k]
            if not has_grad[piece.position]:
                continue
            if k not in reduced:
                owner = self.params[plan.owners[k] - plan.first_replica][piece.position]
                reduced[k] = torch.empty(piece.numel, dtype=owner.dtype, device=owner.device)
            reduced[k][lo - piece.start : hi - piece.start].copy_(total[at : at + hi - lo])

    def _hand_over(
        self,
        positions: Sequence[int],
        has_grad: dict[int, bool],
        reduced: dict[int, torch.Tensor],
        everyone: Sequence[list[torch.Tensor | None]],
    ) -> None:
        """The parameters at ``positions`` are reduced: their owners here take the reduced
        gradients, and no other local replica keeps one."""
        plan = self.plan
        for position in positions:
            for k in self._pieces_here.get(position, ()) if has_grad[position] else ():
                piece, r = plan.pieces[k], plan.owners[k] - plan.first_replica
                param = self.params[r][position]
                grad = reduced.pop(k, None)
                if grad is None:  # a parameter of no elements
                    grad = param.new_empty(0)
                if piece.whole:
                    param.grad = grad.view_as(param)
                else:
                    self._storage.piece_params[r][k].grad = grad
            for r, grads in enumerate(everyone):
                grads[position] = None
                if position not in plan.shares[r].whole:
                    self.params[r][position].grad = None

    def step(self, replica: ReplicaContext) -> Any:
        """Update the parameters and pieces this replica owns, then give every replica all of
        them."""
        r = replica.local_replica_id
        self._check_frozen(r)
        owned = self.plan.shares[r].owned
        result = step_owned(self.optimizers[r], self._storage.whole_ids[r], self._concurrent)
        self._step_pieces(r)
        with torch.no_grad():
            replica.exchange.barrier("ZeRO: parameters updated", cross_device=True)
            if self.plan.num_workers == 1:
                for k, owner in enumerate(self.plan.owners):
                    if k not in owned:
                        self._storage.copy_piece(owner - self.plan.first_replica, r, k)
                return result
            if r == 0:
                self._gather_parameters()
            replica.exchange.barrier("ZeRO: parameters gathered", cross_device=True)
        return result

    def _gather_parameters(self) -> None:
        """Every worker's updated ranges, a chunk of every segment at a time, into every local
        replica's parameters (by local replica 0, while the others wait): each chunk is packed
        from the owners' parameters and written straight into the others'."""
        plan, storage, num_workers = self.plan, self._storage, self.plan.num_workers
        for li, transfer in enumerate(plan.transfers):
            outgoing, incoming = storage.staging(li)
            for a, b in transfer.ranges():
                n = b - a
                mine = outgoing[:n]
                for k, lo, hi, at in transfer.parts(plan.pieces, plan.worker, a, b):
                    owner = plan.owners[k] - plan.first_replica
                    mine[at : at + hi - lo].copy_(storage.read_range(owner, k, lo, hi))
                gathered = incoming[: num_workers * n]
                label = f"ZeRO: parameters ({dtype_name(transfer.layout.dtype)}, from {a})"
                self._communicator.all_gather_across_workers(gathered, mine, label)
                for w in range(num_workers):
                    for k, lo, hi, at in transfer.parts(plan.pieces, w, a, b):
                        values = gathered[w * n + at : w * n + at + hi - lo]
                        for r, share in enumerate(plan.shares):
                            if k not in share.owned:
                                storage.write_range(r, k, lo, hi, values)

    def resync(self) -> None:
        """After a run that failed midway: give every local replica each owner's values of the
        ranges it owns (which go with the owner's optimizer state, whether or not its update
        ran), and leave no piece a gradient. Ranges owned by other workers are not reachable
        here; a failed worker group is restarted from a checkpoint anyway."""
        local = range(len(self.params))
        with torch.no_grad():
            for k, owner in enumerate(self.plan.owners):
                source = owner - self.plan.first_replica
                if source in local:
                    for r in local:
                        if r != source:
                            self._storage.copy_piece(source, r, k)
        for pieces in self._storage.piece_params:
            for piece_param in pieces.values():
                piece_param.grad = None

    def _step_pieces(self, r: int) -> None:
        """Step replica ``r``'s pieces with the hyperparameters its optimizer has now (at stage
        1 their gradients are ranges of the reduced ones)."""
        optimizer = self._storage.piece_optimizers[r]
        if optimizer is None:
            return
        groups = self.plan.shares[r].piece_groups
        for piece_group, group in zip(optimizer.param_groups, groups, strict=True):
            piece_group.update(hyperparameters(self.optimizers[r].param_groups[group.param_group]))
        pieces = self._storage.piece_params[r]
        if self.stage == 1:
            for k, piece_param in pieces.items():
                piece = self.plan.pieces[k]
                grad = self.params[r][piece.position].grad
                piece_param.grad = (
                    None
                    if grad is None
                    else grad.reshape(-1)[piece.start : piece.start + piece.numel]
                )
        step_owned(optimizer, {id(p) for p in pieces.values()}, self._concurrent)
        for piece_param in pieces.values():
            piece_param.grad = None

    # -- the state --------------------------------------------------------------------------------
    def state_bytes(self) -> list[int]:
        """Bytes of optimizer state each local replica holds, its pieces' included."""
        return [
            whole + (0 if pieces is None else state_bytes([pieces])[0])
            for whole, pieces in zip(
                state_bytes(self.optimizers), self._storage.piece_optimizers, strict=True
            )
        ]

    def state_dict(self) -> dict[str, Any]:
        """The plain single-optimizer state, gathered from every owner (a collective across
        workers)."""
        merged = self.optimizers[0].state_dict()
        mine = local_entries(self.optimizers, self._storage)
        if self.plan.num_workers == 1:
            gathered = mine
        else:
            workers = self._communicator.workers
            assert workers is not None
            device = self._storage.device
            gathered = gather_state(workers, self.plan.worker, device, mine, _CHUNK_BYTES)
        merged["state"] = consolidated_state(self.plan, gathered, self.params[0])
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Give each local replica's optimizer the hyperparameters and its owned share of
        ``state_dict``'s state (a plain single-optimizer state dict), its pieces' ranges
        included; torch's loading puts each tensor where the optimizer keeps it. The whole
        state is checked first: one that does not fit changes no replica."""
        check_optimizer_state(self.optimizers[0], state_dict, "the optimizer state")
        states = state_dict["state"]
        for r, (optimizer, share) in enumerate(zip(self.optimizers, self.plan.shares, strict=True)):
            owned = {self.plan.state_index[i] for i in share.whole}
            if r == 0:
                owned |= self.plan.kept_frozen_state
            own_share = {k: v for k, v in states.items() if int(k) in owned}
            load_own_copy(optimizer, {**state_dict, "state": own_share})
            piece_optimizer = self._storage.piece_optimizers[r]
            if piece_optimizer is not None:
                piece_optimizer.load_state_dict(pieces_state(self.plan, share, state_dict))


def _sum_into(out: torch.Tensor, parts: Sequence[torch.Tensor], lo: int, hi: int) -> None:
    """``out`` (zeros) becomes the sum, in order, of elements ``lo`` to ``hi`` of each
    flattened gradient in ``parts``, as :func:`_sum_range` adds them."""
    for i, part in enumerate(parts):
        flat = part.reshape(-1)[lo:hi]
        if i:
            out.add_(flat.to(out.device, non_blocking=True))
        else:
            out.copy_(flat)


def _sum_range(
    parts: Sequence[torch.Tensor], lo: int, hi: int, device: torch.device
) -> torch.Tensor | None:
    """The sum, in order, of elements ``lo`` to ``hi`` of each flattened gradient in ``parts``
    (None if there are none)."""
    if not parts:
        return None
    ranges = [p.reshape(-1)[lo:hi] for p in parts]
    total = ranges[0].to(device, copy=True)
    for part in ranges[1:]:
        total.add_(part.to(device, non_blocking=True))
    return total
