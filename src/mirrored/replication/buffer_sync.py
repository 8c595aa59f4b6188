"""Buffers that a replica changes (an exponential moving average, a step counter): one rule keeps
every replica's copy the same after each ``strategy.run``, as TensorFlow requires an aggregation
for a variable updated in a replica.

At the end of a run every replica reports which buffers it changed (in place or reassigned); a
buffer changed anywhere is gathered from every replica, and where the copies differ its
aggregation decides: floating buffers default to ``MEAN`` (as BatchNorm's running statistics are
averaged), others to ``NONE``, under which differing copies are an error naming the buffer.
``set_buffer_aggregation`` chooses per buffer (``SUM`` adds up the replicas' changes: a count of
examples seen). Copies that agree are otherwise left untouched, so buffers every replica
updates alike stay bit for bit what one device computes. Buffers the optimizer's step has just
made the same everywhere (BatchNorm's running statistics, averaged) do not cross again unless
their module changed a buffer after it. An integer buffer changed without a
chosen aggregation warns once even where its copies agree (``BufferAggregationWarning``): an
example count on equal shards agrees and is still each shard's (TensorFlow refuses any update of
a variable without aggregation in a replica); BatchNorm's ``num_batches_tracked``, which counts
the forward passes every replica makes alike, is silent.
"""

from __future__ import annotations

import abc
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mirrored._torch_internals import BatchNormBase, all_plain, bookkeeping
from mirrored.core.values import ReduceOp, VariableAggregation
from mirrored.replication.buffer_bytes import BytesSnapshot

if TYPE_CHECKING:
    from mirrored.core.context import ReplicaContext

__all__ = ["BufferAggregationWarning", "BufferSync", "SyncsBuffers", "set_buffer_aggregation"]

# Set on the module that owns a buffer (so deep copies, the other replicas, carry it along).
_AGGREGATIONS = "_mirrored_buffer_aggregations"


class SyncsBuffers(abc.ABC):
    """A replicated module whose buffers replicas may change: synced at the end of each run."""

    @property
    @abc.abstractmethod
    def has_buffers(self) -> bool: ...

    @abc.abstractmethod
    def sync_buffers(self, replica: ReplicaContext) -> None:
        """Collective: called on every replica as its part of a run ends."""


class BufferAggregationWarning(UserWarning):
    """An integer buffer changed inside replicas without an aggregation chosen for it."""


def set_buffer_aggregation(
    module: Any, aggregations: Mapping[str, VariableAggregation | str]
) -> None:
    """How the replicas' copies of each named buffer of ``module`` are combined when they differ
    after a run (``"mean"``, ``"sum"`` of the changes since the last run, ``"only_first_replica"``,
    or ``"none"``: an error). Names are ``module.named_buffers()``'s; call it outside
    ``strategy.run``, before or after ``strategy.mirror`` (on the mirrored module or on the
    original one, replica 0, whose choice every replica follows)."""
    replicas = getattr(module, "replicas", None)
    targets = list(replicas) if replicas is not None else [module]
    if not isinstance(targets[0], nn.Module):
        raise TypeError(f"module={type(module).__name__}: expected a torch.nn.Module")
    names = dict(targets[0].named_buffers(remove_duplicate=False))
    chosen = {}
    for name, aggregation in aggregations.items():
        if name not in names:
            raise ValueError(
                f"{name!r} is not a buffer of the module; its buffers are {sorted(names)}"
            )
        chosen[name] = VariableAggregation.of(aggregation)
    owners = set()
    for target in targets:
        for name, aggregation in chosen.items():
            owner_name, _, local = name.rpartition(".")
            owner = target.get_submodule(owner_name)
            owner.__dict__.setdefault(_AGGREGATIONS, {})[local] = aggregation
            owners.add(id(owner))
    for sync in list(_LIVE_SYNCS):
        if sync.owns_any(owners):
            sync.rebase()  # a "sum" chosen after mirror() adds the changes from now on


# The BufferSync of every live mirrored module.
_LIVE_SYNCS: weakref.WeakSet[BufferSync] = weakref.WeakSet()


class BufferSync:
    """The buffers of a module's replicas, and what each replica last saw of them."""

    def __init__(self, replicas: Sequence[nn.Module]) -> None:
        # (owner module, local name, full name) of every buffer, in one order on every replica.
        self._slots = [
            [
                (r.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2], name)
                for name, _ in r.named_buffers(remove_duplicate=False)
            ]
            for r in replicas
        ]
        self._seen: list[list[tuple[int, int]]] = [[] for _ in replicas]
        self._snapshots: list[BytesSnapshot] = [BytesSnapshot([]) for _ in replicas]
        # Per replica: the buffers made the same on every replica during this run (averaged by
        # the optimizer), and their bytes then.
        self._agreed: list[tuple[list[int], BytesSnapshot]] = [
            ([], BytesSnapshot([])) for _ in replicas
        ]
        self._bases: list[dict[int, torch.Tensor]] = [{} for _ in replicas]
        self._warned: set[str] = set()  # integer buffers changed without an aggregation
        for replica_id in range(len(replicas)):
            self._record(replica_id)
        _LIVE_SYNCS.add(self)

    @property
    def empty(self) -> bool:
        return not self._slots[0]

    def _current(self, replica_id: int) -> list[torch.Tensor | None]:
        return [owner._buffers.get(local) for owner, local, _ in self._slots[replica_id]]

    def owns_any(self, module_ids: set[int]) -> bool:
        """Whether a buffer of these replicas belongs to a module whose id is in ``module_ids``."""
        return any(id(owner) in module_ids for slots in self._slots for owner, _, _ in slots)

    def rebase(self) -> None:
        """Take every replica's buffers as they are now as what a ``SUM`` adds changes to
        (outside a run, where the replicas' copies are the same)."""
        for replica_id in range(len(self._slots)):
            self._bases[replica_id] = self._sum_bases(replica_id)

    def _record(self, replica_id: int) -> None:
        """Remember each buffer as it is now (and the value a ``SUM`` adds changes to)."""
        current = self._current(replica_id)
        self._seen[replica_id] = [_state(t) for t in current]
        self._snapshots[replica_id] = BytesSnapshot(current)
        self._bases[replica_id] = self._sum_bases(replica_id)
        self._agreed[replica_id] = ([], BytesSnapshot([]))

    def agree(self, replica_id: int, tensors: Sequence[torch.Tensor]) -> None:
        """Inside a run, on every replica: ``tensors`` (buffers of replica ``replica_id``) were
        just made the same on every replica, as the optimizer's mean of BatchNorm's running
        statistics makes them. The end of the run leaves them out if their bytes are still
        those (a forward after the update moves the statistics again, often without moving a
        version counter: BatchNorm's kernel writes them in place uncounted)."""
        chosen = {id(t) for t in tensors}
        current = self._current(replica_id)
        indices = [
            index
            for index, tensor in enumerate(current)
            if id(tensor) in chosen and self._chosen(index) is not VariableAggregation.SUM
        ]
        self._agreed[replica_id] = (indices, BytesSnapshot([current[i] for i in indices]))

    def _sum_bases(self, replica_id: int) -> dict[int, torch.Tensor]:
        return {
            index: tensor.detach().clone()
            for index, tensor in enumerate(self._current(replica_id))
            if tensor is not None and self._chosen(index) is VariableAggregation.SUM
        }

    def _chosen(self, index: int) -> VariableAggregation | None:
        """The aggregation chosen for buffer ``index`` (on replica 0's module: a choice made on
        the original module after mirror() counts for every replica), or None."""
        owner, local, _ = self._slots[0][index]
        chosen: VariableAggregation | None = owner.__dict__.get(_AGGREGATIONS, {}).get(local)
        return chosen

    def _aggregation(self, index: int, tensor: torch.Tensor) -> VariableAggregation:
        chosen = self._chosen(index)
        if chosen is not None:
            return chosen
        if tensor.is_floating_point() or tensor.is_complex():
            return VariableAggregation.MEAN
        return VariableAggregation.NONE

    def sync(self, replica: ReplicaContext) -> None:
        """Collective, at the end of a run on every replica: make the buffers any replica
        changed the same everywhere (a ``ValueError`` naming a buffer that may not differ)."""
        current = self._current(replica.local_replica_id)
        with bookkeeping(all_plain(current)):
            self._sync(replica, current)

    def _sync(self, replica: ReplicaContext, current: list[torch.Tensor | None]) -> None:
        replica_id = replica.local_replica_id
        strategy = replica.strategy
        changed = self._changed(replica_id, current)
        flags = torch.tensor(changed, dtype=torch.int32, device=replica.device)
        (anywhere,) = strategy.all_reduce_tensors(replica, ReduceOp.SUM, [flags])
        indices = anywhere.nonzero().flatten().tolist()
        if indices:
            tensors = [_tensor(current[i], self._slots[replica_id][i][2]) for i in indices]
            for index, tensor, (rows, differ) in zip(
                indices, tensors, _every_copy(replica, tensors), strict=True
            ):
                aggregation = self._aggregation(index, tensor)
                if aggregation is not VariableAggregation.SUM and not differ:
                    if replica_id == 0:
                        self._warn_unchosen(index, tensor)
                    continue  # nothing to combine: every copy is the same
                value = self._combine(replica_id, index, aggregation, tensor, rows)
                with torch.no_grad():
                    tensor.copy_(value.reshape(tensor.shape))
        self._record(replica_id)

    def _changed(self, replica_id: int, current: list[torch.Tensor | None]) -> list[bool]:
        """Per buffer, whether this replica changed it since the last run, and it may differ."""
        seen = self._seen[replica_id]
        # Some kernels write in place without counting a version (BatchNorm's running
        # statistics): their bytes tell, and a module that changed one buffer counts as having
        # changed all of them.
        by_bytes = self._snapshots[replica_id].changed(current)
        changed = [
            _state(t) != then or moved
            for t, then, moved in zip(current, seen, by_bytes, strict=True)
        ]
        slots = self._slots[replica_id]
        owners = {id(slot[0]) for slot, flag in zip(slots, changed, strict=True) if flag}
        changed = [id(owner) in owners for owner, _, _ in slots]
        indices, agreed = self._agreed[replica_id]
        if indices and not any(agreed.changed([current[i] for i in indices])):
            for index in indices:  # as the update left them on every replica
                changed[index] = False
        return changed

    def _warn_unchosen(self, index: int, tensor: torch.Tensor) -> None:
        """Once per buffer: an integer buffer changed alike on every replica, with no
        aggregation chosen (BatchNorm's count of forward passes aside)."""
        owner, local, name = self._slots[0][index]
        if (
            self._chosen(index) is not None
            or tensor.is_floating_point()
            or tensor.is_complex()
            or (isinstance(owner, BatchNormBase) and local == "num_batches_tracked")
            or name in self._warned
        ):
            return
        self._warned.add(name)
        warnings.warn(
            f"buffer {name!r} ({tensor.dtype}) changed inside strategy.run and its copies agree, "
            "so each replica keeps its own value; an integer buffer has no aggregation unless "
            "you choose one. If it counts steps that every replica takes alike, that is right: "
            f"say so with mirrored.set_buffer_aggregation(module, {{{name!r}: "
            "'only_first_replica'}). If it counts examples, one device counts the whole batch: "
            f"mirrored.set_buffer_aggregation(module, {{{name!r}: 'sum'}})",
            BufferAggregationWarning,
            stacklevel=2,
        )

    def _combine(
        self,
        replica_id: int,
        index: int,
        aggregation: VariableAggregation,
        tensor: torch.Tensor,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            return rows[0]
        if aggregation is VariableAggregation.MEAN:
            mean = rows.double().mean(dim=0)
            return mean if tensor.is_floating_point() else mean.round()
        if aggregation is VariableAggregation.SUM:
            base = self._bases[replica_id][index].reshape(1, -1).to(rows.device)
            return base[0] + (rows - base).sum(dim=0)
        name = self._slots[replica_id][index][2]
        differing = [i for i, row in enumerate(rows) if not torch.equal(row, rows[0])]
        raise ValueError(
            f"buffer {name!r} ({tensor.dtype}) changed differently on the replicas (replica 0 "
            f"and replica {differing[0]} differ): its copies must agree, or be combined. Choose "
            f"how with mirrored.set_buffer_aggregation(module, {{{name!r}: 'mean'}}) (or 'sum' "
            "of the changes, or 'only_first_replica')"
        )


def _every_copy(
    replica: ReplicaContext, tensors: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, bool]]:
    """Collective: per tensor, every replica's copy as rows (in replica order) and whether the
    copies differ. The tensors of a dtype cross end to end and are compared in one pass: a
    gather and a comparison per dtype, not per buffer (a MobileNetV2 has 156)."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for position, tensor in enumerate(tensors):
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(position)
    groups = list(by_kind.values())
    flats = [torch.cat([tensors[p].detach().reshape(1, -1) for p in group], 1) for group in groups]
    gathered = replica.strategy.all_gather_tensors(replica, flats, 0)
    copies: dict[int, tuple[torch.Tensor, bool]] = {}
    for group, everyone in zip(groups, gathered, strict=True):
        sizes = [tensors[p].numel() for p in group]
        differs = (everyone != everyone[:1]).any(dim=0).cpu()  # NaN differs, as in torch.equal
        owner = torch.repeat_interleave(torch.arange(len(group)), torch.tensor(sizes))
        counts = torch.bincount(owner[differs], minlength=len(group)).tolist()
        parts = everyone.split(sizes, dim=1)
        for position, part, count in zip(group, parts, counts, strict=True):
            copies[position] = (part, count > 0)
    return [copies[position] for position in range(len(tensors))]


def _state(tensor: torch.Tensor | None) -> tuple[int, int]:
    """What tells a buffer's change: which tensor it is and its in-place version."""
    return (0, 0) if tensor is None else (id(tensor), tensor._version)


def _tensor(tensor: torch.Tensor | None, name: str) -> torch.Tensor:
    if tensor is None:  # a buffer set to None on one replica only
        raise ValueError(f"buffer {name!r} was set to None on some replicas only")
    return tensor
