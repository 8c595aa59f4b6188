"""ZeRO: each replica keeps the optimizer state of its share of the parameters only.

Mirrored training holds N copies of everything, and the optimizer state (Adam's: twice the
parameters) is the largest copy no replica needs whole. With ``zero_stage`` (MirroredStrategy and
MultiWorkerMirroredStrategy) the parameters the optimizer holds, end to end, are cut into one
range of nearly equal size per replica of every worker (:func:`plan_pieces`); only a range's
owner steps it and keeps its state, so optimizer-state memory per replica is 1/N whatever the
sizes of the tensors (one large embedding included). A parameter inside one range stays whole
and is stepped by the owner's optimizer; the few cut between ranges (at most N-1) are stepped as
pieces: parameters of their own over ranges of its storage, with an optimizer of the same kind
and hyperparameters, which the updates being elementwise makes exact.

- Stage 1: gradients are reduced as without ZeRO (across workers while backward runs, so
  clipping or unscaling before ``optimizer.step()`` sees the sums). Each owner updates its
  ranges; in one process every replica then copies the others' ranges from their owners;
  across workers each worker packs what its replicas own into its segment (one per dtype,
  :func:`plan_segments`) and all-gathers the segments a range of at most ``_CHUNK_BYTES`` per
  worker at a time, so no staging buffer grows with the model.
- Stage 2: gradients are reduce-scattered at ``optimizer.step()`` instead, in the same layout
  and ranges: each worker sums its replicas' gradients, an all-to-all hands each worker its
  own segment's range from every worker, summed in rank order; in one process each owner sums
  its ranges over the replicas directly. Only owners keep a reduced gradient. This does not
  lower the peak (backward still produces whole gradients on every replica) and gives up the
  overlap with backward; reduce-scattering buckets from backward's hooks is what would.

The update is the one every replica would have made (the same gradient sum, the same state) for
optimizers whose update of a parameter is elementwise in that parameter, its gradient and its
own state: torch's built-ins in ``PER_PARAMETER_OPTIMIZERS``. ``state_dict()`` is the plain
single-optimizer one, gathered from the owners (pieces' states joined back into whole
tensors); across workers that is a collective, so every
worker calls it at the same point (``Model.save`` does).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mirrored.param_groups import hyperparameters
from mirrored.sharded_update import (
    PER_PARAMETER_OPTIMIZERS,
    load_own_copy,
    state_bytes,
    step_owned,
    sum_owned_gradients,
)
from mirrored.state_checks import check_optimizer_state

if TYPE_CHECKING:
    from mirrored.context import ReplicaContext
    from mirrored.worker_group import WorkerGroup

# What one gather or reduce-scatter across workers moves per worker at most: the staging
# buffers are this times the worker count, not the parameters' size.
_CHUNK_BYTES = 32 * 2**20

__all__ = [
    "Piece",
    "SegmentLayout",
    "ZeroRedundancy",
    "check_zero_stage",
    "plan_pieces",
    "plan_segments",
]


def check_zero_stage(zero_stage: int) -> int:
    """``zero_stage`` if it is 0 (off), 1 or 2; a ValueError otherwise."""
    if type(zero_stage) is not int or zero_stage not in (0, 1, 2):
        raise ValueError(
            f"zero_stage={zero_stage!r}: expected 0 (every replica keeps the whole optimizer "
            "state), 1 (shard the optimizer state) or 2 (shard the gradients too)"
        )
    return zero_stage


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements ``start`` to ``start + numel`` of the flattened parameter at ``position``."""

    position: int
    start: int
    numel: int
    whole: bool


def plan_pieces(
    numels: dict[int, int], splittable: set[int], num_replicas: int
) -> tuple[list[Piece], list[int]]:
    """The pieces of the parameters at the positions of ``numels`` (position -> numel) and the
    replica that owns each: the parameters, end to end in position order, cut into
    ``num_replicas`` ranges of nearly equal size, replica ``r`` owning range ``r``. A parameter
    inside one range stays whole; at most ``num_replicas - 1`` are cut. One not in
    ``splittable`` (not contiguous) stays whole with the range it starts in."""
    total = sum(numels.values())
    bounds = [math.ceil(total * (r + 1) / num_replicas) for r in range(num_replicas)]
    last = num_replicas - 1
    pieces: list[Piece] = []
    owners: list[int] = []
    replica = filled = 0
    for position, numel in sorted(numels.items()):
        whole = position not in splittable or numel == 0
        if whole:
            pieces.append(Piece(position, 0, numel, True))
            owners.append(replica)
            filled += numel
        start = numel if whole else 0
        while start < numel:
            room = bounds[replica] - filled
            if room <= 0 and replica < last:
                replica += 1
                continue
            size = numel - start if replica == last else min(room, numel - start)
            pieces.append(Piece(position, start, size, size == numel))
            owners.append(replica)
            start += size
            filled += size
        while replica < last and filled >= bounds[replica]:
            replica += 1
    return pieces, owners


@dataclasses.dataclass(frozen=True)
class SegmentLayout:
    """Where the pieces of one dtype sit in a flat buffer of one equal segment per worker:
    segment ``w`` holds, in order, the pieces worker ``w``'s replicas own."""

    dtype: torch.dtype
    segment: int
    slots: tuple[tuple[int, int], ...]  # (piece index, offset in the whole buffer)


def plan_segments(
    pieces: Sequence[Piece],
    dtypes: Sequence[torch.dtype],
    worker_of: Sequence[int],
    num_workers: int,
) -> list[SegmentLayout]:
    """One layout per dtype (``dtypes``, ``worker_of``: each piece's dtype and the worker that
    owns it); segments are as long as the longest worker's share."""
    shares: dict[torch.dtype, list[list[int]]] = {}
    for index, (dtype, worker) in enumerate(zip(dtypes, worker_of, strict=True)):
        shares.setdefault(dtype, [[] for _ in range(num_workers)])[worker].append(index)
    layouts = []
    for dtype, lists in shares.items():
        segment = max(sum(pieces[i].numel for i in share) for share in lists)
        slots = []
        for worker, share in enumerate(lists):
            offset = worker * segment
            for index in share:
                slots.append((index, offset))
                offset += pieces[index].numel
        layouts.append(SegmentLayout(dtype, segment, tuple(slots)))
    return layouts


class ZeroRedundancy:
    """The optimizer state of one mirrored optimizer, sharded over every replica of every worker.

    Args:
        stage: 1 (optimizer state) or 2 (optimizer state and gradients).
        optimizers: each local replica's optimizer (replica 0's is the user's).
        params: each local replica's parameters, in the same order.
        replicas_per_worker: how many replicas each worker runs, in rank order.
        worker: this worker's rank.
        group: the workers' process group (None: one process).
    """

    def __init__(
        self,
        stage: int,
        optimizers: Sequence[torch.optim.Optimizer],
        params: Sequence[Sequence[nn.Parameter]],
        replicas_per_worker: Sequence[int],
        worker: int,
        group: WorkerGroup | None,
    ) -> None:
        if type(optimizers[0]) not in PER_PARAMETER_OPTIMIZERS:
            names = ", ".join(kind.__name__ for kind in PER_PARAMETER_OPTIMIZERS)
            raise TypeError(
                f"zero_stage={stage} needs an optimizer whose update of a parameter is "
                f"elementwise in that parameter, its gradient and its own state (one of "
                f"torch.optim's {names}); got {type(optimizers[0]).__name__}. Use zero_stage=0 "
                "for it"
            )
        self.stage = stage
        self.optimizers = list(optimizers)
        self.params = [list(p) for p in params]
        self._group = group
        self._worker = worker
        self._num_workers = len(replicas_per_worker)
        first = self.params[0]
        # Each held parameter's index in the optimizer's state_dict and its group.
        order = [p for group_ in optimizers[0].param_groups for p in group_["params"]]
        index_of = {id(p): k for k, p in enumerate(order)}
        group_of = {
            id(p): g
            for g, group_ in enumerate(optimizers[0].param_groups)
            for p in group_["params"]
        }
        # Frozen parameters never change: they take no part (and must stay frozen).
        positions = [i for i, p in enumerate(first) if id(p) in index_of and p.requires_grad]
        frozen = [i for i, p in enumerate(first) if id(p) in index_of and not p.requires_grad]
        self._frozen = [[replica[i] for i in frozen] for replica in self.params]
        # Their state (from before they were frozen) stays as it is, with the chief's replica 0.
        self._frozen_indices = {index_of[id(first[i])] for i in frozen} if worker == 0 else set()
        self._index = {i: index_of[id(first[i])] for i in positions}
        self._positions = positions
        # The pieces and the global replica that owns each.
        self.pieces, self.owners = plan_pieces(
            {i: first[i].numel() for i in positions},
            {i for i in positions if first[i].is_contiguous()},
            sum(replicas_per_worker),
        )
        first_replica = sum(replicas_per_worker[:worker])
        self._owned = [
            {k for k, owner in enumerate(self.owners) if owner == first_replica + r}
            for r in range(len(self.params))
        ]
        # Whole parameters each replica owns (stepped by its optimizer) ...
        self._whole = [
            {self.pieces[k].position for k in owned if self.pieces[k].whole}
            for owned in self._owned
        ]
        self._whole_ids = [
            {id(replica[i]) for i in whole}
            for replica, whole in zip(self.params, self._whole, strict=True)
        ]
        # ... and pieces of larger ones: parameters of their own over the same storage, stepped
        # by an optimizer of the same kind.
        self._piece_params: list[dict[int, nn.Parameter]] = [
            {
                k: nn.Parameter(
                    replica[self.pieces[k].position].data.view(-1)[
                        self.pieces[k].start : self.pieces[k].start + self.pieces[k].numel
                    ]
                )
                for k in sorted(owned)
                if not self.pieces[k].whole
            }
            for replica, owned in zip(self.params, self._owned, strict=True)
        ]
        self._piece_optimizers: list[tuple[torch.optim.Optimizer, list[int]] | None] = []
        kind: Any = type(optimizers[0])  # torch's built-ins take their groups alone
        for optimizer, pieces in zip(self.optimizers, self._piece_params, strict=True):
            by_group: dict[int, list[nn.Parameter]] = {}
            for k, piece in pieces.items():
                group_index = group_of[id(first[self.pieces[k].position])]
                by_group.setdefault(group_index, []).append(piece)
            groups = [
                {**hyperparameters(optimizer.param_groups[g]), "params": ps}
                for g, ps in by_group.items()
            ]  # every hyperparameter given per group: the constructor's defaults go unused
            self._piece_optimizers.append((kind(groups), list(by_group)) if groups else None)
        worker_of_replica = [w for w, n in enumerate(replicas_per_worker) for _ in range(n)]
        self._layouts = plan_segments(
            self.pieces,
            [first[p.position].dtype for p in self.pieces],
            [worker_of_replica[owner] for owner in self.owners],
            self._num_workers,
        )
        self._device = first[0].device
        self._first_replica = first_replica
        # Across workers: this worker's segment per dtype, and staging for the collectives,
        # which move at most _CHUNK_BYTES per worker at a time. In one process replicas copy
        # from the owners directly.
        layouts = self._layouts if self._num_workers > 1 else []
        self._sends = [
            torch.empty(layout.segment, dtype=layout.dtype, device=self._device)
            for layout in layouts
        ]
        self._chunks = [
            min(
                layout.segment,
                max(1, _CHUNK_BYTES // (self._num_workers * layout.dtype.itemsize)),
            )
            for layout in layouts
        ]
        self._staging = [
            torch.empty(self._num_workers * chunk, dtype=layout.dtype, device=self._device)
            for layout, chunk in zip(layouts, self._chunks, strict=True)
        ]
        self._received = [torch.empty_like(s) for s in self._staging] if stage == 2 else []
        # Per layout and worker: its slots (piece, offset in its segment).
        self._worker_slots = [
            [
                [
                    (k, offset - w * layout.segment)
                    for k, offset in layout.slots
                    if w * layout.segment <= offset < (w + 1) * layout.segment
                ]
                for w in range(self._num_workers)
            ]
            for layout in layouts
        ]
        self._has_grad: dict[int, bool] = {}
        if optimizers[0].state:  # a state the user's optimizer already had: shard it
            self.load_state_dict(optimizers[0].state_dict())

    def _flat(self, r: int, k: int) -> torch.Tensor:
        """Piece ``k`` of replica ``r``'s parameter, as a flat view (or a flat copy, for a
        whole parameter that is not contiguous)."""
        piece = self.pieces[k]
        return self.params[r][piece.position].reshape(-1)[piece.start : piece.start + piece.numel]

    # -- the step ---------------------------------------------------------------------------------
    def reduce_gradients(
        self, replica: ReplicaContext, everyone: Sequence[Sequence[torch.Tensor | None]]
    ) -> None:
        """Stage 2: give each owned parameter and piece the sum of its gradient over every
        replica of every worker and drop the other gradients (``everyone``: each local
        replica's gradients)."""
        r = replica.local_replica_id
        self._check_frozen(r)
        mine = self.params[r]
        if self._num_workers == 1:
            sum_owned_gradients(mine, self._whole_ids[r], everyone)
            for k, piece_param in self._piece_params[r].items():
                piece = self.pieces[k]
                parts = [g for grads in everyone if (g := grads[piece.position]) is not None]
                piece_param.grad = _sum_range(
                    parts, piece.start, piece.start + piece.numel, piece_param.device
                )
        else:
            if r == 0:
                self._reduce_scatter(everyone)
            replica.exchange.barrier("ZeRO: gradients reduce-scattered", cross_device=True)
            for layout, send in zip(self._layouts, self._sends, strict=True):
                for k, offset in layout.slots:
                    piece = self.pieces[k]
                    if k not in self._owned[r] or not self._has_grad[piece.position]:
                        continue
                    local = offset - self._worker * layout.segment
                    param = mine[piece.position]
                    grad = send[local : local + piece.numel].to(param.device, copy=True)
                    if piece.whole:
                        param.grad = grad.view_as(param)
                    else:
                        self._piece_params[r][k].grad = grad
        # Owners have read every peer's gradient: the rest is no replica's to keep.
        replica.exchange.barrier("ZeRO: gradients read", cross_device=True)
        for position in self._positions:
            if position not in self._whole[r]:
                mine[position].grad = None

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

    def _reduce_scatter(self, everyone: Sequence[Sequence[torch.Tensor | None]]) -> None:
        """Sum the local replicas' gradients into the buffers, then every worker's into the
        segment this worker owns (``self._sends``), in rank order."""
        assert self._group is not None
        has = torch.tensor(
            [float(any(grads[i] is not None for grads in everyone)) for i in self._positions],
            device=self._group.meta_device,
        )
        self._group.all_reduce(has, "ZeRO: which parameters have gradients")
        self._has_grad = dict(zip(self._positions, (bool(c) for c in has.tolist()), strict=True))
        for li, layout in enumerate(self._layouts):
            send, staging, received = self._sends[li], self._staging[li], self._received[li]
            for a, b in self._chunk_ranges(li):
                n = b - a
                outgoing = staging[: self._num_workers * n]
                outgoing.zero_()
                for w in range(self._num_workers):
                    for k, lo, hi, at in self._parts(li, w, a, b):
                        position = self.pieces[k].position
                        parts = [g for grads in everyone if (g := grads[position]) is not None]
                        total = _sum_range(parts, lo, hi, self._device)
                        if total is not None:
                            outgoing[w * n + at : w * n + at + hi - lo].copy_(total)
                incoming = received[: self._num_workers * n]
                label = f"ZeRO: gradients ({_name(layout.dtype)}, from {a})"
                self._group.all_to_all_async(incoming, outgoing, label).wait()
                chunks = incoming.view(self._num_workers, n)
                send[a:b].copy_(chunks[0])
                for chunk in chunks[1:]:
                    send[a:b].add_(chunk)

    def _chunk_ranges(self, li: int) -> list[tuple[int, int]]:
        """The ranges of every worker's segment of layout ``li`` that one collective moves."""
        segment, chunk = self._layouts[li].segment, self._chunks[li]
        return [(a, min(a + chunk, segment)) for a in range(0, segment, chunk)]

    def _parts(self, li: int, worker: int, a: int, b: int) -> list[tuple[int, int, int, int]]:
        """The pieces in elements ``a`` to ``b`` of ``worker``'s segment of layout ``li``: (piece,
        first and last + 1 element of its parameter, place in the range)."""
        parts = []
        for k, local in self._worker_slots[li][worker]:
            lo, hi = max(a, local), min(b, local + self.pieces[k].numel)
            if lo < hi:
                start = self.pieces[k].start + lo - local
                parts.append((k, start, start + hi - lo, lo - a))
        return parts

    def step(self, replica: ReplicaContext) -> Any:
        """Update the parameters and pieces this replica owns, then give every replica all of
        them."""
        r = replica.local_replica_id
        self._check_frozen(r)
        owned = self._owned[r]
        result = step_owned(self.optimizers[r], self._whole_ids[r])
        self._step_pieces(r)
        with torch.no_grad():
            if self._num_workers == 1:
                replica.exchange.barrier("ZeRO: parameters updated", cross_device=True)
                for k, owner in enumerate(self.owners):
                    if k not in owned:
                        self._copy_piece(owner - self._first_replica, r, k)
                return result
            for li, send in enumerate(self._sends):
                for k, local in self._worker_slots[li][self._worker]:
                    if k in owned:
                        send[local : local + self.pieces[k].numel].copy_(self._flat(r, k))
            replica.exchange.barrier("ZeRO: updated parameters packed", cross_device=True)
            if r == 0:
                self._gather_parameters()
            replica.exchange.barrier("ZeRO: parameters gathered", cross_device=True)
        return result

    def _gather_parameters(self) -> None:
        """Every worker's segments, a range at a time, into every local replica's parameters
        (by local replica 0, while the others wait)."""
        assert self._group is not None
        for li, layout in enumerate(self._layouts):
            send, staging = self._sends[li], self._staging[li]
            for a, b in self._chunk_ranges(li):
                n = b - a
                gathered = staging[: self._num_workers * n]
                label = f"ZeRO: parameters ({_name(layout.dtype)}, from {a})"
                self._group.all_gather_into_async(gathered, send[a:b], label).wait()
                for w in range(self._num_workers):
                    for k, lo, hi, at in self._parts(li, w, a, b):
                        values = gathered[w * n + at : w * n + at + hi - lo]
                        for r, owned in enumerate(self._owned):
                            if k not in owned:
                                self._write_range(r, k, lo, hi, values)

    def _write_range(self, r: int, k: int, lo: int, hi: int, values: torch.Tensor) -> None:
        """Set elements ``lo`` to ``hi`` of piece ``k``'s parameter on replica ``r``."""
        param = self.params[r][self.pieces[k].position]
        if param.is_contiguous():
            param.view(-1)[lo:hi].copy_(values)
        else:  # a whole parameter (only contiguous ones are cut)
            flat = param.reshape(-1).clone()
            flat[lo:hi] = values
            param.copy_(flat.view_as(param))

    def _write_piece(self, r: int, k: int, values: torch.Tensor) -> None:
        """Set piece ``k`` of replica ``r``'s parameter to ``values`` (flat or shaped)."""
        piece = self.pieces[k]
        param = self.params[r][piece.position]
        if piece.whole:
            param.copy_(values.view_as(param))
        else:
            param.view(-1)[piece.start : piece.start + piece.numel].copy_(values.view(-1))

    def _copy_piece(self, source: int, r: int, k: int) -> None:
        """Piece ``k`` from local replica ``source`` (its owner) into local replica ``r``."""
        piece = self.pieces[k]
        if piece.whole:
            self._write_piece(r, k, self.params[source][piece.position])
        else:
            self._write_piece(r, k, self._flat(source, k))

    def resync(self) -> None:
        """After a run that failed midway: give every local replica each owner's values of the
        ranges it owns (which go with the owner's optimizer state, whether or not its update
        ran), and leave no piece a gradient. Ranges owned by other workers are not reachable
        here; a failed worker group is restarted from a checkpoint anyway."""
        local = range(len(self.params))
        with torch.no_grad():
            for k, owner in enumerate(self.owners):
                source = owner - self._first_replica
                if source in local:
                    for r in local:
                        if r != source:
                            self._copy_piece(source, r, k)
        for pieces in self._piece_params:
            for piece_param in pieces.values():
                piece_param.grad = None

    def _step_pieces(self, r: int) -> None:
        """Step replica ``r``'s pieces with the hyperparameters its optimizer has now (at stage
        1 their gradients are ranges of the reduced ones)."""
        entry = self._piece_optimizers[r]
        if entry is None:
            return
        optimizer, groups = entry
        for piece_group, g in zip(optimizer.param_groups, groups, strict=True):
            piece_group.update(hyperparameters(self.optimizers[r].param_groups[g]))
        pieces = self._piece_params[r]
        if self.stage == 1:
            for k, piece_param in pieces.items():
                piece = self.pieces[k]
                grad = self.params[r][piece.position].grad
                piece_param.grad = (
                    None
                    if grad is None
                    else grad.reshape(-1)[piece.start : piece.start + piece.numel]
                )
        step_owned(optimizer, {id(p) for p in pieces.values()})
        for piece_param in pieces.values():
            piece_param.grad = None

    # -- the state --------------------------------------------------------------------------------
    def state_bytes(self) -> list[int]:
        """Bytes of optimizer state each local replica holds, its pieces' included."""
        return [
            whole + (0 if entry is None else state_bytes([entry[0]])[0])
            for whole, entry in zip(
                state_bytes(self.optimizers), self._piece_optimizers, strict=True
            )
        ]

    def state_dict(self) -> dict[str, Any]:
        """The plain single-optimizer state, gathered from every owner (a collective across
        workers)."""
        merged = self.optimizers[0].state_dict()
        mine: dict[str, dict[str, Any]] = {}
        for optimizer in self.optimizers:
            for index, state in optimizer.state_dict()["state"].items():
                mine[f"w{index}"] = state
        for entry, pieces in zip(self._piece_optimizers, self._piece_params, strict=True):
            for k, piece_param in pieces.items():
                if entry is not None and piece_param in entry[0].state:
                    mine[f"p{k}"] = dict(entry[0].state[piece_param])
        gathered = mine if self._num_workers == 1 else self._gather_state(mine)
        state = {int(key[1:]): value for key, value in gathered.items() if key[0] == "w"}
        split: dict[int, list[int]] = {}
        for k, piece in enumerate(self.pieces):
            if not piece.whole:
                split.setdefault(piece.position, []).append(k)
        for position, ks in split.items():
            parts = [gathered[f"p{k}"] for k in ks if f"p{k}" in gathered]
            if len(parts) < len(ks):
                continue  # never stepped: no state, as on one device
            state[self._index[position]] = _joined(parts, self.params[0][position])
        merged["state"] = dict(sorted(state.items()))
        return merged

    def _gather_state(self, mine: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Every worker's state entries, sent as JSON (layout, plain values) and one flat
        tensor per dtype (no pickle on the wire)."""
        assert self._group is not None
        entries: list[list[Any]] = []
        for slot in sorted(mine):
            for key, value in sorted(mine[slot].items()):
                if isinstance(value, torch.Tensor):
                    where = "cpu" if value.device.type == "cpu" else "device"
                    description = {"tensor": [list(value.shape), _name(value.dtype), where]}
                else:
                    description = {"value": value}
                entries.append([slot, key, description])
        try:
            everyone = self._group.all_gather_json(entries, "ZeRO: optimizer state entries")
        except TypeError as error:
            raise TypeError(
                f"ZeRO gathers an optimizer's state across workers as tensors and JSON values; "
                f"{error}"
            ) from error
        dtypes = sorted({_tensor_dtype(e) for w in everyone for e in w} - {""})
        flats: dict[str, list[torch.Tensor]] = {}
        for name in dtypes:
            sizes = [
                sum(math.prod(e[2]["tensor"][0]) for e in w if _tensor_dtype(e) == name)
                for w in everyone
            ]
            flat = torch.zeros(max(sizes), dtype=getattr(torch, name), device=self._device)
            offset = 0
            for entry in (e for e in entries if _tensor_dtype(e) == name):
                value = mine[entry[0]][entry[1]]
                flat[offset : offset + value.numel()].copy_(value.reshape(-1))
                offset += value.numel()
            flats[name] = self._group.all_gather(flat, f"ZeRO: optimizer state ({name})")
        gathered: dict[str, dict[str, Any]] = {}
        for worker, worker_entries in enumerate(everyone):
            offsets = dict.fromkeys(dtypes, 0)
            for slot, key, description in worker_entries:
                state = gathered.setdefault(slot, {})
                if "value" in description:
                    state[key] = description["value"]
                    continue
                shape, name, where = description["tensor"]
                numel = math.prod(shape)
                if worker == self._worker:
                    state[key] = mine[slot][key]
                else:  # where its owner keeps it (torch keeps Adam's step count on the CPU)
                    part = flats[name][worker][offsets[name] : offsets[name] + numel]
                    device = torch.device("cpu") if where == "cpu" else self._device
                    state[key] = part.view(shape).to(device, copy=True)
                offsets[name] += numel
        return gathered

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Give each local replica's optimizer the hyperparameters and its owned share of
        ``state_dict``'s state (a plain single-optimizer state dict), its pieces' ranges
        included; torch's loading puts each tensor where the optimizer keeps it. The whole
        state is checked first: one that does not fit changes no replica."""
        check_optimizer_state(self.optimizers[0], state_dict, "the optimizer state")
        states = state_dict["state"]
        for r, optimizer in enumerate(self.optimizers):
            owned = {self._index[i] for i in self._whole[r]}
            if r == 0:
                owned |= self._frozen_indices
            share = {k: v for k, v in states.items() if int(k) in owned}
            load_own_copy(optimizer, {**state_dict, "state": share})
            self._load_pieces(r, state_dict)

    def _load_pieces(self, r: int, state_dict: dict[str, Any]) -> None:
        """Replica ``r``'s pieces' ranges of ``state_dict``, loaded into its piece optimizer
        as torch's own state dict (so torch places and casts each tensor)."""
        entry = self._piece_optimizers[r]
        if entry is None:
            return
        piece_optimizer, groups = entry
        piece_of = {id(q): k for k, q in self._piece_params[r].items()}
        piece_state: dict[int, dict[str, Any]] = {}
        piece_groups = []
        j = 0
        for piece_group, g in zip(piece_optimizer.param_groups, groups, strict=True):
            indices = []
            for piece_param in piece_group["params"]:
                piece = self.pieces[piece_of[id(piece_param)]]
                whole = state_dict["state"].get(self._index[piece.position])
                if whole is not None:
                    piece_state[j] = _sliced(whole, piece)
                indices.append(j)
                j += 1
            settings = hyperparameters(state_dict["param_groups"][g])
            piece_groups.append({**settings, "params": indices})
        piece_optimizer.load_state_dict({"state": piece_state, "param_groups": piece_groups})


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


def _joined(parts: Sequence[dict[str, Any]], param: nn.Parameter) -> dict[str, Any]:
    """One parameter's state from its pieces' (in order): their per-element tensors end to end,
    shaped as the parameter; the rest (the step count) is the same in every piece."""
    joined = {}
    for key, value in parts[0].items():
        if isinstance(value, torch.Tensor) and value.dim() == 1:
            pieces = [part[key].to(value.device) for part in parts]
            joined[key] = torch.cat(pieces).view(param.shape)
        else:
            joined[key] = value
    return joined


def _sliced(state: dict[str, Any], piece: Piece) -> dict[str, Any]:
    """A piece's share of a whole parameter's ``state``: its range of each per-element tensor;
    the rest (the step count) as it is."""
    return {
        key: value.reshape(-1)[piece.start : piece.start + piece.numel].clone()
        if isinstance(value, torch.Tensor) and value.dim() > 0
        else copy.deepcopy(value)
        for key, value in state.items()
    }


def _name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (``getattr(torch, name)`` turns it back)."""
    return str(dtype).removeprefix("torch.")


def _tensor_dtype(entry: list[Any]) -> str:
    """The dtype name of a gathered state entry that is a tensor ("": a plain value)."""
    description = entry[2]
    return str(description["tensor"][1]) if "tensor" in description else ""
