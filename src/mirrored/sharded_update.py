"""Updating each parameter once, on replicas that share one device's memory.

Replicas on logical devices of one physical device (the CPU, or one GPU) would otherwise all run
the full optimizer update at once on the same cores and memory: on the 2-core benchmark machine,
two concurrent Adam updates of the overhead MLP took about 4 ms each against 1.1 ms for one
(benchmarks/RESULTS.md). Instead each parameter gets one owner replica (balanced by size); only
the owner sums its gradient over the replicas, updates it, and copies the result to the others.
The optimizer state of a parameter is one set of tensors shared by every replica's optimizer, so
the user's optimizer (replica 0's) keeps the complete state and its ``state_dict()`` stays the
plain single-model one; that also makes optimizer memory 1/N of mirrored state.

Exact for optimizers whose update of a parameter reads only that parameter, its gradient and its
own state: torch's built-in optimizers listed below. Any other optimizer runs the full update on
every replica. Where the user left ``foreach`` to torch, the owner uses the foreach path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["PER_PARAMETER_OPTIMIZERS", "ShardedUpdate", "assign_owners"]

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
    the other; the foreach path does the same elementwise math in a few calls (measured 1.5 ms
    vs 0.9 ms per concurrent update of the overhead MLP)."""
    return (
        "foreach" in group
        and group["foreach"] is None
        and not group.get("fused")
        and not group.get("differentiable")
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

    def reduce_gradients(
        self, replica_id: int, everyone: Sequence[Sequence[torch.Tensor | None]]
    ) -> None:
        """Each owner sums the gradients of its parameters over all replicas, in replica order,
        reading its peers' gradients in place (``everyone``: each replica's gradients, as posted
        at the step's first sync point; no packing, nothing written to peers). Afterwards a
        replica's other gradients are its own share only, consumed by this step."""
        mine = self.params[replica_id]
        for index, owner in enumerate(self.owners):
            if owner != replica_id:
                continue
            parts: list[torch.Tensor] = [g for grads in everyone if (g := grads[index]) is not None]
            if not parts:
                continue
            if parts[0] is mine[index].grad:  # this replica's gradient comes first: add in place
                total, rest = parts[0], parts[1:]
            elif len(parts) == 1:
                total, rest = parts[0].clone(), []
            else:
                total, rest = parts[0] + parts[1], parts[2:]
            for part in rest:
                total.add_(part)
            mine[index].grad = total

    def step(self, replica_id: int) -> Any:
        """Update the parameters ``replica_id`` owns, publish new state, copy them to peers.

        The caller must make replicas wait for each other before the parameters are read again.
        """
        optimizer = self.optimizers[replica_id]
        owned = self._owned_ids[replica_id]
        saved = [(group["params"], group.get("foreach")) for group in optimizer.param_groups]
        try:
            for group, (params, _) in zip(optimizer.param_groups, saved, strict=True):
                group["params"] = [p for p in params if id(p) in owned]
                if _left_to_torch(group):
                    group["foreach"] = True
            result = optimizer.step()
        finally:
            for group, (params, foreach) in zip(optimizer.param_groups, saved, strict=True):
                group["params"] = params
                if "foreach" in group:
                    group["foreach"] = foreach
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
