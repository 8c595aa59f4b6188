"""Copies of an optimizer over other parameters: each replica's optimizer, and a central one."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from mirrored.replication.sharded_update import load_own_copy

__all__ = ["replicate_optimizer"]


def replicate_optimizer(
    optimizer: torch.optim.Optimizer, mapping: dict[int, nn.Parameter]
) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` over other parameters (``mapping``: id of original -> new)."""
    memo: dict[int, Any] = dict(mapping)
    replica = copy.deepcopy(optimizer, memo)
    # torch's Optimizer pickles only its groups and state; what a subclass keeps besides (LBFGS's
    # _params, the list its first group holds) is copied over the same memo.
    for name, value in optimizer.__dict__.items():
        if name not in replica.__dict__:
            replica.__dict__[name] = copy.deepcopy(value, memo)
    # An LR scheduler wraps the original's bound step() in an instance attribute; the copy must
    # use its own class method, not the original's.
    replica.__dict__.pop("step", None)
    load_own_copy(replica, optimizer.state_dict())
    return replica
