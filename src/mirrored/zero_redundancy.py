"""ZeRO: each replica keeps the optimizer state of its share of the parameters only.

Mirrored training holds N copies of everything, and the optimizer state (Adam's: twice the
parameters) is the largest copy no replica needs whole. With ``zero_stage`` (MirroredStrategy and
MultiWorkerMirroredStrategy) every parameter the optimizer holds gets one owner among all replicas
of all workers, balanced by size (:func:`mirrored.sharded_update.assign_owners`): only the owner's
optimizer steps it and keeps its state, so optimizer-state memory per replica is about 1/N, but
never below the largest parameter's share: owners are whole parameters (on benchmarks/zero.py's
MLP, whose 784x512 weight is 60% of it, each replica keeps at most 0.6 at 2 and at 4 replicas).
Splitting large parameters between owners is the next step.

- Stage 1: gradients are reduced as without ZeRO (across workers while backward runs, so
  clipping or unscaling before ``optimizer.step()`` sees the sums). Each owner updates its
  parameters; then every worker packs those its replicas own into its segment of one flat buffer
  per dtype (:func:`plan_segments`) and an all-gather hands every worker all of them.
- Stage 2: gradients are reduce-scattered at ``optimizer.step()`` instead, in the same layout:
  each worker sums its replicas' gradients into the buffer, an all-to-all hands each worker its
  own segment from every worker, summed in rank order; in one process each owner sums its
  parameters' gradients over the replicas directly. Only owners keep a reduced gradient; the
  others drop theirs at the step, so between steps each replica holds 1/N of the gradients too.
  Communication is one all-reduce's worth (a reduce-scatter and an all-gather), but it starts at
  the step rather than during backward.

The update is the one every replica would have made (the same gradient sum, the same state) for
optimizers whose update of a parameter reads only that parameter, its gradient and its own
state: torch's built-ins in ``PER_PARAMETER_OPTIMIZERS``. ``state_dict()`` is the plain
single-optimizer one, gathered from the owners; across workers that is a collective, so every
worker calls it at the same point (``Model.save`` does).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mirrored.sharded_update import (
    PER_PARAMETER_OPTIMIZERS,
    assign_owners,
    load_own_copy,
    step_owned,
    sum_owned_gradients,
)

if TYPE_CHECKING:
    from mirrored.context import ReplicaContext
    from mirrored.worker_group import WorkerGroup

__all__ = ["SegmentLayout", "ZeroRedundancy", "check_zero_stage", "plan_segments"]


def check_zero_stage(zero_stage: int) -> int:
    """``zero_stage`` if it is 0 (off), 1 or 2; a ValueError otherwise."""
    if type(zero_stage) is not int or zero_stage not in (0, 1, 2):
        raise ValueError(
            f"zero_stage={zero_stage!r}: expected 0 (every replica keeps the whole optimizer "
            "state), 1 (shard the optimizer state) or 2 (shard the gradients too)"
        )
    return zero_stage


@dataclasses.dataclass(frozen=True)
class SegmentLayout:
    """Where the parameters of one dtype sit in a flat buffer of one equal segment per worker:
    segment ``w`` holds, in parameter order, the parameters worker ``w``'s replicas own."""

    dtype: torch.dtype
    segment: int
    slots: tuple[tuple[int, int, int], ...]  # (position, offset in the whole buffer, numel)


def plan_segments(
    params: Sequence[nn.Parameter], worker_of: dict[int, int], num_workers: int
) -> list[SegmentLayout]:
    """One layout per dtype for the parameters at the positions of ``worker_of`` (position ->
    the worker that owns it); segments are as long as the longest worker's share."""
    shares: dict[torch.dtype, list[list[int]]] = {}
    for position in sorted(worker_of):
        lists = shares.setdefault(params[position].dtype, [[] for _ in range(num_workers)])
        lists[worker_of[position]].append(position)
    layouts = []
    for dtype, lists in shares.items():
        segment = max(sum(params[i].numel() for i in share) for share in lists)
        slots = []
        for worker, share in enumerate(lists):
            offset = worker * segment
            for position in share:
                slots.append((position, offset, params[position].numel()))
                offset += params[position].numel()
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
                f"zero_stage={stage} needs an optimizer whose update of a parameter reads only "
                f"that parameter, its gradient and its own state (one of torch.optim's {names}); "
                f"got {type(optimizers[0]).__name__}. Use zero_stage=0 for it"
            )
        self.stage = stage
        self.optimizers = list(optimizers)
        self.params = [list(p) for p in params]
        self._group = group
        self._worker = worker
        self._num_workers = len(replicas_per_worker)
        first_replica = sum(replicas_per_worker[:worker])
        held = {id(p) for group_ in optimizers[0].param_groups for p in group_["params"]}
        positions = [i for i, p in enumerate(self.params[0]) if id(p) in held]
        owners = assign_owners(
            [self.params[0][i].numel() for i in positions], sum(replicas_per_worker)
        )
        # The global replica that owns the parameter at each position the optimizer holds.
        self.owners = dict(zip(positions, owners, strict=True))
        worker_of_replica = [w for w, n in enumerate(replicas_per_worker) for _ in range(n)]
        self._owned = [
            {i for i, owner in self.owners.items() if owner == first_replica + r}
            for r in range(len(self.params))
        ]
        self._owned_ids = [
            {id(replica[i]) for i in owned}
            for replica, owned in zip(self.params, self._owned, strict=True)
        ]
        self._layouts = plan_segments(
            self.params[0],
            {i: worker_of_replica[owner] for i, owner in self.owners.items()},
            self._num_workers,
        )
        self._device = self.params[0][0].device
        self._buffers = [
            torch.empty(self._num_workers * layout.segment, dtype=layout.dtype, device=self._device)
            for layout in self._layouts
        ]
        # What this worker sends: its own segment (in one process, the whole buffer).
        self._sends = [
            buffer
            if self._num_workers == 1
            else torch.empty(layout.segment, dtype=layout.dtype, device=self._device)
            for layout, buffer in zip(self._layouts, self._buffers, strict=True)
        ]
        for optimizer, owned_ids in zip(self.optimizers, self._owned_ids, strict=True):
            for param in list(optimizer.state):
                if id(param) not in owned_ids:  # a state the user's optimizer already had
                    del optimizer.state[param]

    # -- the step ---------------------------------------------------------------------------------
    def reduce_gradients(
        self, replica: ReplicaContext, everyone: Sequence[Sequence[torch.Tensor | None]]
    ) -> None:
        """Stage 2: make each owned parameter's gradient the sum over every replica of every
        worker and drop the others (``everyone``: each local replica's gradients)."""
        r = replica.local_replica_id
        mine = self.params[r]
        if self._num_workers == 1:
            sum_owned_gradients(mine, self._owned_ids[r], everyone)
        else:
            if r == 0:
                self._reduce_scatter(everyone)
            replica.exchange.barrier("ZeRO: gradients reduce-scattered", cross_device=True)
            start = self._worker
            for layout, send in zip(self._layouts, self._sends, strict=True):
                for position, offset, numel in layout.slots:
                    if position in self._owned[r] and self._has_grad[position]:
                        param, local = mine[position], offset - start * layout.segment
                        grad = send[local : local + numel].view_as(param)
                        param.grad = grad.to(param.device, copy=True)
        # Owners have read every peer's gradient: the rest is no replica's to keep.
        replica.exchange.barrier("ZeRO: gradients read", cross_device=True)
        for position in self.owners:
            if position not in self._owned[r]:
                mine[position].grad = None

    def _reduce_scatter(self, everyone: Sequence[Sequence[torch.Tensor | None]]) -> None:
        """Sum the local replicas' gradients into the buffers, then every worker's into the
        segment this worker owns (``self._sends``), in rank order."""
        assert self._group is not None
        positions = sorted(self.owners)
        has = torch.tensor(
            [float(any(grads[i] is not None for grads in everyone)) for i in positions],
            device=self._group.meta_device,
        )
        self._group.all_reduce(has, "ZeRO: which parameters have gradients")
        self._has_grad = dict(zip(positions, (bool(c) for c in has.tolist()), strict=True))
        for layout, buffer, send in zip(self._layouts, self._buffers, self._sends, strict=True):
            for position, offset, numel in layout.slots:
                view = buffer[offset : offset + numel]
                parts = [g for grads in everyone if (g := grads[position]) is not None]
                if not parts:
                    view.zero_()
                    continue
                view.copy_(parts[0].reshape(-1))
                for part in parts[1:]:
                    view.add_(part.reshape(-1).to(self._device, non_blocking=True))
            received = torch.empty_like(buffer)
            label = f"ZeRO: gradients ({_name(layout.dtype)})"
            self._group.all_to_all_async(received, buffer, label).wait()
            chunks = received.view(self._num_workers, layout.segment)
            send.copy_(chunks[0])
            for chunk in chunks[1:]:
                send.add_(chunk)

    def step(self, replica: ReplicaContext) -> Any:
        """Update the parameters this replica owns, then give every replica all of them."""
        r = replica.local_replica_id
        mine, owned = self.params[r], self._owned[r]
        result = step_owned(self.optimizers[r], self._owned_ids[r])
        with torch.no_grad():
            start = 0 if self._num_workers == 1 else self._worker
            for layout, send in zip(self._layouts, self._sends, strict=True):
                for position, offset, numel in layout.slots:
                    if position in owned:
                        local = offset - start * layout.segment
                        send[local : local + numel].copy_(mine[position].reshape(-1))
            replica.exchange.barrier("ZeRO: updated parameters packed", cross_device=True)
            if r == 0 and self._num_workers > 1:
                assert self._group is not None
                pending = [
                    self._group.all_gather_into_async(
                        buffer, send, f"ZeRO: parameters ({_name(layout.dtype)})"
                    )
                    for layout, buffer, send in zip(
                        self._layouts, self._buffers, self._sends, strict=True
                    )
                ]
                for collective in pending:
                    collective.wait()
            replica.exchange.barrier("ZeRO: parameters gathered", cross_device=True)
            for layout, buffer in zip(self._layouts, self._buffers, strict=True):
                for position, offset, numel in layout.slots:
                    if position not in owned:
                        param = mine[position]
                        param.copy_(buffer[offset : offset + numel].view_as(param))
        return result

    # -- the state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The plain single-optimizer state, gathered from every owner (a collective across
        workers)."""
        merged = self.optimizers[0].state_dict()
        state = dict(merged["state"])
        for optimizer in self.optimizers[1:]:
            state.update(optimizer.state_dict()["state"])
        if self._num_workers > 1:
            state = self._gather_state(state)
        merged["state"] = dict(sorted(state.items()))
        return merged

    def _gather_state(self, mine: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Every worker's owned state entries, sent as JSON (layout, plain values) and one flat
        tensor per dtype (no pickle on the wire)."""
        assert self._group is not None
        entries: list[list[Any]] = []
        for index in sorted(mine):
            for key, value in sorted(mine[index].items()):
                if isinstance(value, torch.Tensor):
                    description = {"tensor": [list(value.shape), _name(value.dtype)]}
                else:
                    description = {"value": value}
                entries.append([index, key, description])
        try:
            everyone = self._group.all_gather_json(entries, "ZeRO: optimizer state entries")
        except TypeError as error:
            raise TypeError(
                f"ZeRO gathers an optimizer's state across workers as tensors and JSON values; "
                f"{error}"
            ) from error
        gathered: dict[int, dict[str, Any]] = {}
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
        for worker, worker_entries in enumerate(everyone):
            offsets = dict.fromkeys(dtypes, 0)
            for index, key, description in worker_entries:
                slot = gathered.setdefault(int(index), {})
                if "value" in description:
                    slot[key] = description["value"]
                    continue
                shape, name = description["tensor"]
                numel = math.prod(shape)
                if worker == self._worker:
                    slot[key] = mine[index][key]
                else:
                    part = flats[name][worker][offsets[name] : offsets[name] + numel]
                    slot[key] = part.view(shape).clone()
                offsets[name] += numel
        return gathered

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Give each local replica's optimizer the hyperparameters and its owned share of
        ``state_dict``'s state (a plain single-optimizer state dict)."""
        for optimizer, owned_ids in zip(self.optimizers, self._owned_ids, strict=True):
            order = [p for group in optimizer.param_groups for p in group["params"]]
            owned = {k for k, p in enumerate(order) if id(p) in owned_ids}
            share = {k: v for k, v in state_dict["state"].items() if int(k) in owned}
            load_own_copy(optimizer, {**state_dict, "state": share})


def _name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (``getattr(torch, name)`` turns it back)."""
    return str(dtype).removeprefix("torch.")


def _tensor_dtype(entry: list[Any]) -> str:
    """The dtype name of a gathered state entry that is a tensor ("": a plain value)."""
    description = entry[2]
    return str(description["tensor"][1]) if "tensor" in description else ""
