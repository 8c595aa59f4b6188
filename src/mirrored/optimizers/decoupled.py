"""Torch's SGD and RMSprop with Keras's decoupled weight decay.

Keras decays every weight that has a gradient before the update, ``w -= learning_rate *
weight_decay * w`` (``BaseOptimizer._apply_weight_decay``), the "decoupled" decay of Loshchilov &
Hutter (arXiv:1711.05101). Torch has it only in ``AdamW``: ``SGD`` and ``RMSprop`` add
``weight_decay * w`` to the gradient (L2), which then feeds the momentum buffer and, for RMSprop,
the second-moment average. ``SGDW`` and ``RMSpropW`` are torch's classes unchanged but for that
decay, applied by a step pre-hook, so the update itself stays torch's (foreach path included).

Each parameter's decay reads only that parameter: the classes are per-parameter optimizers like
their bases. The hook is registered again on unpickling and deep copy, which drop a torch
optimizer's hooks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from mirrored._torch_internals import foreach_mul_
from mirrored.optimizers._checks import non_negative

__all__ = ["DECOUPLED_WEIGHT_DECAY", "RMSpropW", "SGDW", "apply_decoupled_weight_decay"]

# The param-group key of the decoupled rate (the group's "weight_decay", torch's L2, stays 0).
DECOUPLED_WEIGHT_DECAY = "decoupled_weight_decay_rate"


def apply_decoupled_weight_decay(
    optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Step pre-hook: ``p *= 1 - lr * rate`` for each parameter of a group that has a gradient.

    With ``step(closure)`` it runs before the closure, on the gradients present then.
    """
    with torch.no_grad():
        for group in optimizer.param_groups:
            rate = group.get(DECOUPLED_WEIGHT_DECAY, 0.0)
            if not rate:
                continue
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                foreach_mul_(params, 1.0 - group["lr"] * rate)


def _add_decoupled_weight_decay(optimizer: torch.optim.Optimizer, rate: float | None) -> None:
    """Give every group the rate (``None``: the defaults', for groups loaded from a state dict
    that has none) and register the hook once (``load_state_dict`` calls ``__setstate__`` too)."""
    if rate is not None:
        optimizer.defaults[DECOUPLED_WEIGHT_DECAY] = rate
    for group in optimizer.param_groups:
        group.setdefault(
            DECOUPLED_WEIGHT_DECAY, optimizer.defaults.get(DECOUPLED_WEIGHT_DECAY, 0.0)
        )
    if apply_decoupled_weight_decay not in optimizer._optimizer_step_pre_hooks.values():
        optimizer.register_step_pre_hook(apply_decoupled_weight_decay)


class SGDW(torch.optim.SGD):
    """``torch.optim.SGD`` whose ``weight_decay`` is decoupled (Keras's, and SGDW's in
    arXiv:1711.05101), not L2 added to the gradient. Other arguments are torch's."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        **kwargs: Any,
    ) -> None:
        rate = non_negative(type(self).__name__, "weight_decay", weight_decay)
        super().__init__(
            params, lr, momentum, dampening, weight_decay=0.0, nesterov=nesterov, **kwargs
        )
        _add_decoupled_weight_decay(self, rate)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        _add_decoupled_weight_decay(self, None)


class RMSpropW(torch.optim.RMSprop):
    """``torch.optim.RMSprop`` whose ``weight_decay`` is decoupled (Keras's), not L2 added to
    the gradient. Other arguments are torch's."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
        **kwargs: Any,
    ) -> None:
        rate = non_negative(type(self).__name__, "weight_decay", weight_decay)
        super().__init__(
            params,
            lr,
            alpha,
            eps,
            weight_decay=0.0,
            momentum=momentum,
            centered=centered,
            **kwargs,
        )
        _add_decoupled_weight_decay(self, rate)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        _add_decoupled_weight_decay(self, None)
