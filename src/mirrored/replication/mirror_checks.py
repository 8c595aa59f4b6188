"""The checks of a module and its optimizer before ``strategy.mirror()`` builds replicas of them.

A mistake found here (a module already mirrored, a lazy module, an optimizer over another
module's parameters) would otherwise surface steps later as replicas that silently differ; each
check names what it received and what to do instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mirrored.replication.mirrored_module import MIRRORED_BY, MirroredModule
from mirrored.replication.mirrored_optimizer import MirroredOptimizer

__all__ = [
    "SEVERAL_OPTIMIZERS",
    "check_mirrorable",
    "check_optimizer_params",
    "check_optimizers",
    "optimizers_given",
]

# The call that mirrors a module trained by several optimizers, as the errors name it.
SEVERAL_OPTIMIZERS = (
    "strategy.mirror(model, opt_a, opt_b), which returns the mirrored model, opt_a and opt_b"
)


def optimizers_given(optimizers: tuple[Any, ...], keywords: dict[str, Any]) -> tuple[Any, ...]:
    """The optimizers of ``strategy.mirror(module, *optimizers, **keywords)``: positional, or one
    as ``optimizer=``; a TypeError for a list of them or any other keyword."""
    if set(keywords) == {"optimizer"} and not optimizers:
        optimizers, keywords = (keywords["optimizer"],), {}
    if keywords:
        given = ", ".join(f"{name}={type(value).__name__}" for name, value in keywords.items())
        raise TypeError(
            f"strategy.mirror() got {given}: it takes its optimizers positionally, after the "
            f"module (and sync_batch_norm= as its only other keyword); for several: "
            f"{SEVERAL_OPTIMIZERS}"
        )
    if optimizers == (None,):
        return ()
    for optimizer in optimizers:
        if isinstance(optimizer, list | tuple):
            raise TypeError(
                f"optimizer={type(optimizer).__name__} of {len(optimizer)}: pass each optimizer "
                f"as an argument of its own, {SEVERAL_OPTIMIZERS} (or strategy.mirror(model, "
                "*optimizers))"
            )
    return optimizers


def check_optimizer_params(
    module: nn.Module, optimizer: torch.optim.Optimizer, position: int | None = None
) -> None:
    """A ValueError if ``optimizer`` (the ``position``-th of several) holds a parameter that is
    not ``module``'s."""
    named = "the optimizer" if position is None else f"optimizer {position}"
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{named}={type(optimizer).__name__}: expected a torch.optim.Optimizer")
    owned = {id(p) for p in module.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in owned:
                raise ValueError(
                    f"{named} holds a parameter of shape {tuple(p.shape)} that is not in the "
                    "module; build the optimizer on model.parameters() (or a part of them, "
                    "model.encoder.parameters()); an optimizer of another model is mirrored with "
                    "that model: strategy.mirror(net_d, opt_d)"
                )


def check_optimizers(module: nn.Module, optimizers: Sequence[Any]) -> None:
    """A TypeError or ValueError unless ``optimizers`` are torch optimizers over disjoint sets of
    ``module``'s parameters. Each mirrored optimizer sums the replicas' gradients of its own
    parameters at its ``step()``: a parameter two of them held would be summed twice."""
    several = len(optimizers) > 1
    for position, optimizer in enumerate(optimizers):
        check_optimizer_params(module, optimizer, position if several else None)
    names = {id(p): name for name, p in module.named_parameters()}
    holder: dict[int, int] = {}
    for position, optimizer in enumerate(optimizers):
        first = next((i for i in range(position) if optimizers[i] is optimizer), None)
        if first is not None:
            raise ValueError(
                f"optimizers {first} and {position} are the same optimizer twice; pass it once"
            )
        for group in optimizer.param_groups:
            for p in group["params"]:
                other = holder.setdefault(id(p), position)
                if other != position:
                    raise ValueError(
                        f"parameter {names[id(p)]!r} is in optimizers {other} and {position}: "
                        "each mirrored optimizer sums the replicas' gradients of its parameters "
                        "at its step(), so a parameter in two would have its gradient summed "
                        "twice; give each parameter to one optimizer (one optimizer takes "
                        "several param groups, each with its own lr)"
                    )


def check_mirrorable(module: nn.Module, optimizers: Sequence[Any]) -> None:
    """A TypeError or ValueError if ``module`` (and ``optimizers``) cannot be mirrored as given:
    already mirrored, not a module, or with parameters a lazy module has not made yet."""
    # A module's optimizers are mirrored with it, each over its own parameters: one added later
    # would share parameters with the first, whose step() sums all the gradients it holds.
    with_all = (
        "; to train a module with several optimizers, mirror it once with all of them: "
        + SEVERAL_OPTIMIZERS
    )
    if isinstance(module, MirroredModule):
        raise TypeError(
            "module is already mirrored; pass the original nn.Module"
            + (with_all + " (its release() frees the module)" if optimizers else "")
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"module={type(module).__name__}: expected a torch.nn.Module")
    if any(isinstance(optimizer, MirroredOptimizer) for optimizer in optimizers):
        raise TypeError("optimizer is already mirrored; pass the original torch optimizer")
    owner = MIRRORED_BY.owner_of(module)
    if owner is not None:
        raise ValueError(
            f"this module (or one of its submodules) is already mirrored by {owner._strategy!r}, "
            "and training through a second mirror would leave the first one's replicas behind; "
            "train through the first mirrored module, or call its release() (or close its "
            "strategy) before mirroring again" + (with_all if optimizers else "")
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
