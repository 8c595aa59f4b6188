"""Where ZeRO's pieces live: the tensors a :class:`~mirrored.replication.zero_plan.ZeroPlan` calls
for.

The plan says who owns what; this module allocates it. A whole parameter is stepped by its
owner's optimizer as it is. A cut one is stepped as pieces: parameters of their own over ranges
of its storage (no copy), with an optimizer of the same kind and hyperparameters, which the
update being elementwise makes exact. Across workers each dtype also needs staging for one
chunk of every worker's segment, sized by the plan's transfers and made for each step's
collectives only: never a buffer of the model's size (``benchmarks/RESULTS.md``, "ZeRO and peak
memory").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mirrored.core.param_groups import hyperparameters
from mirrored.replication.zero_plan import ReplicaShare, ZeroPlan

__all__ = ["ShardStorage"]


class ShardStorage:
    """Each local replica's parameters seen as the plan's pieces, the optimizers of the cut
    pieces it owns, and the buffers of the collectives across workers.

    Args:
        plan: this worker's ZeRO plan.
        params: each local replica's parameters, in the plan's positions.
        optimizers: each local replica's optimizer (its kind and param groups are the pieces').
    """

    def __init__(
        self,
        plan: ZeroPlan,
        params: Sequence[Sequence[nn.Parameter]],
        optimizers: Sequence[torch.optim.Optimizer],
    ) -> None:
        self.plan = plan
        self.params = params
        self.device = params[0][0].device
        # What each replica's own optimizer steps: the parameters it owns whole.
        self.whole_ids = [
            {id(replica[i]) for i in share.whole}
            for replica, share in zip(params, plan.shares, strict=True)
        ]
        self.piece_params = [
            _piece_params(plan, replica, share)
            for replica, share in zip(params, plan.shares, strict=True)
        ]
        self.piece_optimizers = [
            _piece_optimizer(optimizer, share, pieces)
            for optimizer, share, pieces in zip(
                optimizers, plan.shares, self.piece_params, strict=True
            )
        ]

    def staging(self, li: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Staging for one chunk of every worker's segment of transfer ``li``: what goes out (at
        stage 1 this worker's chunk only) and what comes in. Made for each step's collectives
        and dropped after them: between steps (and in backward, where the peak is) ZeRO holds
        no buffer, and no buffer ever holds a whole segment."""
        transfer, num_workers = self.plan.transfers[li], self.plan.num_workers
        outgoing = num_workers if self.plan.stage == 2 else 1
        dtype = transfer.layout.dtype
        return (
            torch.empty(outgoing * transfer.chunk, dtype=dtype, device=self.device),
            torch.empty(num_workers * transfer.chunk, dtype=dtype, device=self.device),
        )

    def flat(self, r: int, k: int) -> torch.Tensor:
        """Piece ``k`` of replica ``r``'s parameter, as a flat view (or a flat copy, for a
        whole parameter that is not contiguous)."""
        piece = self.plan.pieces[k]
        return self.params[r][piece.position].reshape(-1)[piece.start : piece.start + piece.numel]

    def read_range(self, r: int, k: int, lo: int, hi: int) -> torch.Tensor:
        """Elements ``lo`` to ``hi`` of piece ``k``'s parameter on replica ``r``, flat."""
        return self.params[r][self.plan.pieces[k].position].reshape(-1)[lo:hi]

    def write_range(self, r: int, k: int, lo: int, hi: int, values: torch.Tensor) -> None:
        """Set elements ``lo`` to ``hi`` of piece ``k``'s parameter on replica ``r``."""
        param = self.params[r][self.plan.pieces[k].position]
        if param.is_contiguous():
            param.view(-1)[lo:hi].copy_(values)
        else:  # a whole parameter (only contiguous ones are cut)
            flat = param.reshape(-1).clone()
            flat[lo:hi] = values
            param.copy_(flat.view_as(param))

    def write_piece(self, r: int, k: int, values: torch.Tensor) -> None:
        """Set piece ``k`` of replica ``r``'s parameter to ``values`` (flat or shaped)."""
        piece = self.plan.pieces[k]
        param = self.params[r][piece.position]
        if piece.whole:
            param.copy_(values.view_as(param))
        else:
            param.view(-1)[piece.start : piece.start + piece.numel].copy_(values.view(-1))

    def copy_piece(self, source: int, r: int, k: int) -> None:
        """Piece ``k`` from local replica ``source`` (its owner) into local replica ``r``."""
        piece = self.plan.pieces[k]
        if piece.whole:
            self.write_piece(r, k, self.params[source][piece.position])
        else:
            self.write_piece(r, k, self.flat(source, k))


def _piece_params(
    plan: ZeroPlan, replica: Sequence[nn.Parameter], share: ReplicaShare
) -> dict[int, nn.Parameter]:
    """The cut pieces ``share`` owns as parameters of their own over ``replica``'s storage."""
    views = {}
    for k in share.cut:
        piece = plan.pieces[k]
        storage = replica[piece.position].data.view(-1)
        views[k] = nn.Parameter(storage[piece.start : piece.start + piece.numel])
    return views


def _piece_optimizer(
    optimizer: torch.optim.Optimizer, share: ReplicaShare, pieces: dict[int, nn.Parameter]
) -> torch.optim.Optimizer | None:
    """An optimizer of ``optimizer``'s kind over ``pieces``, one group per param group of
    ``optimizer`` they come from (``share.piece_groups``, in order); None without pieces."""
    if not share.piece_groups:
        return None
    kind: Any = type(optimizer)  # torch's built-ins take their groups alone
    groups = [
        {
            **hyperparameters(optimizer.param_groups[group.param_group]),
            "params": [pieces[k] for k in group.pieces],
        }
        for group in share.piece_groups
    ]  # every hyperparameter given per group: the constructor's defaults go unused
    optimizer_of_pieces: torch.optim.Optimizer = kind(groups)
    return optimizer_of_pieces
