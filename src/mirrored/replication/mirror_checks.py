"""The checks of a module and its optimizer before ``strategy.mirror()`` builds replicas of them.

A mistake found here (a module already mirrored, a lazy module, an optimizer over another
module's parameters) would otherwise surface steps later as replicas that silently differ; each
check names what it received and what to do instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mirrored.replication.mirrored_module import MIRRORED_BY, MirroredModule
from mirrored.replication.mirrored_optimizer import MirroredOptimizer

__all__ = ["check_mirrorable", "check_optimizer_params"]


def check_optimizer_params(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A ValueError if ``optimizer`` holds a parameter that is not ``module``'s."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer={type(optimizer).__name__}: expected a torch.optim.Optimizer")
    owned = {id(p) for p in module.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in owned:
                raise ValueError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not in "
                    "the module; build the optimizer on model.parameters()"
                )


def check_mirrorable(module: nn.Module, optimizer: Any) -> None:
    """A TypeError or ValueError if ``module`` (and ``optimizer``) cannot be mirrored as given:
    already mirrored, not a module, or with parameters a lazy module has not made yet."""
    if isinstance(module, MirroredModule):
        raise TypeError("module is already mirrored; pass the original nn.Module")
    if not isinstance(module, nn.Module):
        raise TypeError(f"module={type(module).__name__}: expected a torch.nn.Module")
    if isinstance(optimizer, MirroredOptimizer):
        raise TypeError("optimizer is already mirrored; pass the original torch optimizer")
    owner = MIRRORED_BY.owner_of(module)
    if owner is not None:
        raise ValueError(
            f"this module (or one of its submodules) is already mirrored by {owner._strategy!r}, "
            "and training through a second mirror would leave the first one's replicas behind; "
            "train through the first mirrored module, or call its release() (or close its "
            "strategy) before mirroring again"
        )
    lazy = [
        name
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]
        if nn.parameter.is_lazy(tensor)
    ]
    if lazy:
        raise ValueError(
            f"the module's {', '.join(lazy[:4])}{' ...' if len(lazy) > 4 else ''} are not "
            "initialised yet (a lazy module such as nn.LazyLinear); run the module once on a "
            "batch (model(x)) so that torch materialises them, then strategy.mirror() it "
            "(mirrored.Model does this itself on the first batch)"
        )
