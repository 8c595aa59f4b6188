"""Updating each parameter once, on replicas that share one device's memory.

Replicas on logical devices of one physical device (the CPU, or one GPU) would otherwise all run the
full optimizer update at once on the same cores and memory, each update several times slower than
one alone (benchmarks/RESULTS.md, "sharded_update.py"). Instead each parameter gets one owner
replica (balanced by size); only the owner updates it (with the gradient summed during
backward) and copies the result to the others. The optimizer state of a parameter is one set of
tensors shared by every replica's optimizer, so the user's optimizer (replica 0's) keeps the
complete state and its ``state_dict()`` stays the plain single-model one; that also makes
optimizer memory 1/N of mirrored state.

Exact for optimizers whose update of a parameter reads only that parameter, its gradient and its
own state: torch's built-in optimizers listed below. Any other optimizer runs the full update on
every replica. Where the user left ``foreach`` to torch, the owner uses the foreach path.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mirrored.core.state_checks import check_optimizer_state

__all__ = [
    "PER_PARAMETER_OPTIMIZERS",
    "ShardedUpdate",
    "assign_owners",
    "load_own_copy",
    "state_bytes",
    "step_owned",
    "sum_owned_gradients",
]

PER_PARAMETER_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
)


def _left_to_torch(group: dict[str, Any]) -> bool:
    """The user left the implementation to torch (``foreach=None``), which on the CPU picks a
    Python loop over tensors. Replica threads share one GIL, so N of those loops run one after
    the other; the foreach path does the same elementwise math in a few calls, and so runs
    concurrent updates faster (benchmarks/RESULTS.md). Not with a tensor learning rate,
    which torch's foreach path takes only with ``capturable``."""
    return (
        "foreach" in group
        and group["foreach"] is None
        and not group.get("fused")
        and not group.get("differentiable")
        and not isinstance(group.get("lr"), torch.Tensor)
    )


def assign_owners(numels: Sequence[int], num_replicas: int) -> list[int]:
    """Owner replica of each parameter: largest first, to the least-loaded replica."""
    load = [0] * num_replicas
    owners = [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        owner = min(range(num_replicas), key=lambda r: (load[r], r))
        owners[index] = owner
        load[owner] += numels[index]
    return owners


def sum_owned_gradients(
    mine: Sequence[nn.Parameter],
    owned: set[int],
    everyone: Sequence[Sequence[torch.Tensor | None]],
) -> None:
    """Make the gradient of each parameter of ``mine`` whose id is in ``owned`` the sum of every
    replica's (``everyone``: each replica's gradients, in replica order), reading the peers'
    gradients in place (copied over when they live on another device) and adding in replica
    order. A parameter no replica has a gradient for keeps ``grad=None``."""
    for index, param in enumerate(mine):
        if id(param) not in owned:
            continue
        parts = [g for grads in everyone if (g := grads[index]) is not None]
        if not parts:
            continue
        device = param.device
        if parts[0] is param.grad:  # this replica's gradient comes first: add in place
            total, rest = parts[0], parts[1:]
        elif len(parts) == 1:
            total, rest = parts[0].to(device, copy=True), []
        else:
            total, rest = parts[0].to(device) + parts[1].to(device), parts[2:]
        for part in rest:
            total.add_(part.to(device, non_blocking=True))
        param.grad = total


def step_owned(optimizer: torch.optim.Optimizer, owned: set[int], concurrent: bool) -> Any:
    """``optimizer.step()`` over the parameters whose ids are in ``owned`` only (the others keep
    their values and get no state); the groups are restored afterwards. ``concurrent``: other
    replica threads step at the same time, so the foreach path pays for its temporaries (one
    tensor per parameter stepped, alive at once); a lone replica keeps torch's choice (on the
    CPU a loop, one temporary at a time: benchmarks/RESULTS.md, "ZeRO and peak memory")."""
    saved = [(group["params"], group.get("foreach")) for group in optimizer.param_groups]
    try:
        for group, (params, _) in zip(optimizer.param_groups, saved, strict=True):
            group["params"] = [p for p in params if id(p) in owned]
            if concurrent and _left_to_torch(group):
                group["foreach"] = True
        return optimizer.step()
    finally:
        for group, (params, foreach) in zip(optimizer.param_groups, saved, strict=True):
            group["params"] = params
            if "foreach" in group:
                group["foreach"] = foreach


def load_own_copy(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Load ``state_dict`` into ``optimizer`` without sharing its tensors, once it is checked
    to fit (``state_checks.check_optimizer_state``: a state that does not fit changes nothing).

    ``Optimizer.load_state_dict`` keeps tensors already on the right device, so replicas on
    logical devices of one physical device would share (and update N times) the same state.
    """
    check_optimizer_state(optimizer, state_dict, "the optimizer state")
    optimizer.load_state_dict(copy.deepcopy(state_dict))


def state_bytes(optimizers: Sequence[torch.optim.Optimizer]) -> list[int]:
    """Bytes of state tensors each optimizer holds; a tensor several hold (state shared by
    replicas of one device) counts once, for the first."""
    seen: set[int] = set()
    sizes = []
    for optimizer in optimizers:
        size = 0
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and id(value) not in seen:
                    seen.add(id(value))
                    size += value.numel() * value.element_size()
        sizes.append(size)
    return sizes


class ShardedUpdate:
    """Owner-only updates with shared optimizer state, for one mirrored optimizer."""

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        params: Sequence[Sequence[nn.Parameter]],
    ) -> None:
        self.optimizers = list(optimizers)
        self.params = [list(p) for p in params]
        self.owners = assign_owners([p.numel() for p in self.params[0]], len(self.optimizers))
        self._owned_ids = [
            {id(p) for p, owner in zip(replica_params, self.owners, strict=True) if owner == r}
            for r, replica_params in enumerate(self.params)
        ]
        self.share_state()

    def share_state(self) -> None:
        """Make every replica's optimizer use the primary's state dict of each parameter."""
        primary = self.optimizers[0]
        for index, first in enumerate(self.params[0]):
            if first not in primary.state:
                continue
            for optimizer, replica_params in zip(self.optimizers[1:], self.params[1:], strict=True):
                optimizer.state[replica_params[index]] = primary.state[first]

    def step(self, replica_id: int) -> Any:
        """Update the parameters ``replica_id`` owns, publish new state, copy them to peers.

        The caller must make replicas wait for each other before the parameters are read again.
        """
        optimizer = self.optimizers[replica_id]
        result = step_owned(optimizer, self._owned_ids[replica_id], concurrent=True)
        mine = self.params[replica_id]
        peers = [r for r in range(len(self.optimizers)) if r != replica_id]
        with torch.no_grad():
            for index, owner in enumerate(self.owners):
                param = mine[index]
                if owner != replica_id or param.grad is None:  # not updated: nothing to share
                    continue
                state = optimizer.state.get(param)
                for peer in peers:
                    if state is not None:
                        self.optimizers[peer].state[self.params[peer][index]] = state
                    self.params[peer][index].copy_(param)
        return result
