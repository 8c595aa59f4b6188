"""Building a module's lazy parameters, as Keras builds a model on its first batch.

A module with lazy parameters (``nn.LazyLinear``, what a Keras ``Dense`` without an input shape
becomes) cannot be mirrored until its shapes are known; ``Model`` runs it once on the first
example fit, evaluate or predict see, before any replica exists.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from mirrored.core.values import map_structure
from mirrored.training.steps import call_module, cast_images, floating_dtype, to_device

__all__ = ["build", "has_lazy_parameters"]


def has_lazy_parameters(module: nn.Module) -> bool:
    return any(
        torch.nn.parameter.is_lazy(t)
        for t in itertools.chain(module.parameters(), module.buffers())
    )


def build(module: nn.Module, x: Any) -> None:
    """Materialise ``module``'s lazy parameters: it runs once on the first example of ``x``
    (no grad, in eval mode so that no dropout or batch statistics move)."""
    device = next(itertools.chain(module.parameters(), module.buffers())).device
    example = map_structure(lambda v: v[:1] if isinstance(v, torch.Tensor) and v.dim() else v, x)
    example = cast_images(to_device(example, device), floating_dtype(module))
    training = module.training
    module.train(False)
    try:
        with torch.no_grad():
            call_module(module, example)
    finally:
        module.train(training)
    if has_lazy_parameters(module):
        raise ValueError(
            f"the module ({type(module).__name__}) still has lazy parameters after a forward "
            "on the first example: a lazy layer its forward does not reach cannot be built; "
            "give that layer its input size"
        )
