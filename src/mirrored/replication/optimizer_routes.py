"""Which mirrored optimizer holds a tensor: what torch's clipping, patched inside replicas
(:mod:`mirrored.torch_patches`), asks of each mirrored optimizer before it reads gradients.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["holds_any"]


def holds_any(params: Iterable[nn.Parameter], tensor_ids: set[int]) -> bool:
    """Whether any of ``tensor_ids`` is one of ``params`` or the gradient of one."""
    return any(
        id(p) in tensor_ids or (p.grad is not None and id(p.grad) in tensor_ids) for p in params
    )
