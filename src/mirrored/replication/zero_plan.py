"""Which replica owns which part of the parameters under ZeRO, computed before anything exists.

ZeRO (:mod:`mirrored.replication.zero_redundancy`) gives every replica of every worker one range of
nearly equal size of the parameters the optimizer holds, end to end, so optimizer-state memory per
replica is 1/N whatever the tensors' sizes. Deciding who owns what, where each owner's share sits in
the buffers workers exchange, and how many elements one collective moves needs only the parameters'
sizes, dtypes and the worker layout: :func:`plan_zero` computes it as a frozen :class:`ZeroPlan` (no
tensor allocated, no communication), the same on every worker, so it can be tested alone and read
before training starts.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping, Sequence

import torch
from torch import nn

__all__ = [
    "MIN_CHUNKS",
    "ParameterSpec",
    "Piece",
    "PieceGroup",
    "ReplicaShare",
    "SegmentLayout",
    "SegmentTransfer",
    "ZeroPlan",
    "capped_chunk_bytes",
    "describe_parameters",
    "plan_pieces",
    "plan_segments",
    "plan_zero",
]


# What crosses workers in chunks crosses in this many at least: staging of a chunk of every
# worker's share then stays a fraction of what it moves, whatever the model's size.
MIN_CHUNKS = 8


def capped_chunk_bytes(chunk_bytes: int, total_bytes: int) -> int:
    """``chunk_bytes``, or ``total_bytes`` (what the chunks move) over ``MIN_CHUNKS`` where
    that is less (at least 1)."""
    return max(1, min(chunk_bytes, total_bytes // MIN_CHUNKS))


@dataclasses.dataclass(frozen=True)
class ParameterSpec:
    """What the plan needs of one parameter (the same on every replica): its size, whether it
    can be cut (contiguous), whether it trains, and where the optimizer holds it."""

    numel: int
    dtype: torch.dtype
    contiguous: bool = True
    trainable: bool = True
    _: dataclasses.KW_ONLY
    state_index: int | None  # its index in the optimizer's state_dict; None: not held
    param_group: int = 0  # the optimizer's param group that holds it


def describe_parameters(
    params: Sequence[nn.Parameter], optimizer: torch.optim.Optimizer
) -> tuple[ParameterSpec, ...]:
    """``params`` (one replica's) as :func:`plan_zero` takes them; ``optimizer`` holds them."""
    held: dict[int, tuple[int, int]] = {}
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            held[id(p)] = (len(held), g)
    return tuple(
        ParameterSpec(
            numel=p.numel(),
            dtype=p.dtype,
            contiguous=p.is_contiguous(),
            trainable=p.requires_grad,
            state_index=held[id(p)][0] if id(p) in held else None,
            param_group=held[id(p)][1] if id(p) in held else 0,
        )
        for p in params
    )


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
    segment ``w`` holds, in order, the pieces worker ``w``'s replicas own (the segments are as
    long as the longest share; the rest of a shorter one is padding)."""

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


@dataclasses.dataclass(frozen=True)
class SegmentTransfer:
    """How the segments of one dtype cross workers: ``chunk`` elements of every worker's segment
    per collective, so staging buffers hold ``chunk`` times the worker count, not the model."""

    layout: SegmentLayout
    chunk: int
    worker_slots: tuple[tuple[tuple[int, int], ...], ...]  # per worker: (piece, offset in segment)

    def ranges(self) -> list[tuple[int, int]]:
        """The ranges of every worker's segment that one collective moves, in order."""
        segment = self.layout.segment
        return [(a, min(a + self.chunk, segment)) for a in range(0, segment, self.chunk)]

    def last_ranges(self, pieces: Sequence[Piece]) -> dict[int, int]:
        """Per parameter (position) with pieces in these segments: the index in ``ranges()`` of
        the last range that moves any of its elements (-1: it has none), after which no
        collective reads its gradients again."""
        last: dict[int, int] = {}
        for slots in self.worker_slots:
            for k, local in slots:
                numel = pieces[k].numel
                index = (local + numel - 1) // self.chunk if numel else -1
                position = pieces[k].position
                last[position] = max(last.get(position, -1), index)
        return last

    def parts(
        self, pieces: Sequence[Piece], worker: int, a: int, b: int
    ) -> list[tuple[int, int, int, int]]:
        """The pieces in elements ``a`` to ``b`` of ``worker``'s segment: (piece, first and last
        + 1 element of its parameter, place in the range)."""
        parts = []
        for k, local in self.worker_slots[worker]:
            lo, hi = max(a, local), min(b, local + pieces[k].numel)
            if lo < hi:
                start = pieces[k].start + lo - local
                parts.append((k, start, start + hi - lo, lo - a))
        return parts


@dataclasses.dataclass(frozen=True)
class PieceGroup:
    """Cut pieces a replica owns that belong to one param group of the optimizer: they are
    stepped together, with that group's hyperparameters."""

    param_group: int
    pieces: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ReplicaShare:
    """What one local replica owns: the pieces (indices into ``ZeroPlan.pieces``), the
    parameters among them it owns whole (positions), and its cut pieces by param group."""

    owned: frozenset[int]
    whole: frozenset[int]
    piece_groups: tuple[PieceGroup, ...]

    @property
    def cut(self) -> tuple[int, ...]:
        """The pieces of cut parameters this replica owns, in order."""
        return tuple(sorted(k for group in self.piece_groups for k in group.pieces))


@dataclasses.dataclass(frozen=True)
class ZeroPlan:
    """Who owns what under ZeRO, for one worker of the group (pieces, owners and layouts are the
    same on every worker; shares are this worker's local replicas')."""

    stage: int
    pieces: tuple[Piece, ...]
    owners: tuple[int, ...]  # each piece's owner, a replica index over every worker
    positions: tuple[int, ...]  # the trainable parameters the optimizer holds
    frozen: tuple[int, ...]  # held but frozen: no owner, their state stays as it is
    # position -> index in the optimizer's state_dict (read-only; left out of the plan's hash)
    state_index: Mapping[int, int] = dataclasses.field(hash=False)
    kept_frozen_state: frozenset[int]  # frozen ones' state indices, kept by the chief's replica 0
    worker: int
    num_workers: int
    first_replica: int  # the replica index over every worker of local replica 0
    shares: tuple[ReplicaShare, ...]  # per local replica
    transfers: tuple[SegmentTransfer, ...]  # per dtype across workers; none in one process


def plan_zero(
    stage: int,
    parameters: Sequence[ParameterSpec],
    replicas_per_worker: Sequence[int],
    worker: int,
    chunk_bytes: int,
) -> ZeroPlan:
    """The ZeRO plan of one worker (``worker``, a rank) for one replica's ``parameters``, with
    ``replicas_per_worker`` replicas on each worker in rank order; a collective across workers
    moves at most ``chunk_bytes`` per worker."""
    held = {i: s.state_index for i, s in enumerate(parameters) if s.state_index is not None}
    positions = tuple(i for i in held if parameters[i].trainable)
    frozen = tuple(i for i in held if not parameters[i].trainable)
    pieces, owners = plan_pieces(
        {i: parameters[i].numel for i in positions},
        {i for i in positions if parameters[i].contiguous},
        sum(replicas_per_worker),
    )
    first_replica = sum(replicas_per_worker[:worker])
    shares = tuple(
        _share(pieces, owners, parameters, first_replica + r)
        for r in range(replicas_per_worker[worker])
    )
    worker_of_replica = [w for w, n in enumerate(replicas_per_worker) for _ in range(n)]
    layouts = plan_segments(
        pieces,
        [parameters[p.position].dtype for p in pieces],
        [worker_of_replica[owner] for owner in owners],
        len(replicas_per_worker),
    )
    num_workers = len(replicas_per_worker)
    return ZeroPlan(
        stage=stage,
        pieces=tuple(pieces),
        owners=tuple(owners),
        positions=positions,
        frozen=frozen,
        state_index=types.MappingProxyType({i: held[i] for i in positions + frozen}),
        kept_frozen_state=frozenset(held[i] for i in frozen if worker == 0),
        worker=worker,
        num_workers=num_workers,
        first_replica=first_replica,
        shares=shares,
        transfers=tuple(_transfer(layout, num_workers, chunk_bytes) for layout in layouts)
        if num_workers > 1
        else (),
    )


def _share(
    pieces: Sequence[Piece], owners: Sequence[int], parameters: Sequence[ParameterSpec], owner: int
) -> ReplicaShare:
    """What replica ``owner`` (over every worker) owns."""
    owned = [k for k, o in enumerate(owners) if o == owner]
    by_group: dict[int, list[int]] = {}
    for k in owned:
        if not pieces[k].whole:
            by_group.setdefault(parameters[pieces[k].position].param_group, []).append(k)
    return ReplicaShare(
        owned=frozenset(owned),
        whole=frozenset(pieces[k].position for k in owned if pieces[k].whole),
        piece_groups=tuple(PieceGroup(g, tuple(ks)) for g, ks in by_group.items()),
    )


def _transfer(layout: SegmentLayout, num_workers: int, chunk_bytes: int) -> SegmentTransfer:
    """How ``layout``'s segments cross ``num_workers`` workers, ``chunk_bytes`` per worker at
    most per collective."""
    per_worker = max(1, chunk_bytes // (num_workers * layout.dtype.itemsize))
    chunk = max(1, min(layout.segment, per_worker))  # at least 1: a range(0, 0, 0) would raise
    worker_slots = tuple(
        tuple(
            (k, offset - w * layout.segment)
            for k, offset in layout.slots
            if w * layout.segment <= offset < (w + 1) * layout.segment
        )
        for w in range(num_workers)
    )
    return SegmentTransfer(layout, chunk, worker_slots)
