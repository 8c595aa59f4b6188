"""``torch.amp.GradScaler.scale`` checked before it changes anything inside replicas.

A ``GradScaler`` keeps one state per optimizer, which the replicas' threads would share, and
unscales one replica's gradients: its ``scale`` (that of its subclasses which do not define their
own too) is wrapped so that a caller may refuse it there
(:mod:`mirrored.torch_patches.mirrored_optimizers`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from mirrored.torch_patches.holders import Installation, Patch

__all__ = ["GRAD_SCALER", "install_scale_check"]

GRAD_SCALER = Patch("GradScaler.scale")


def install_scale_check(installation: Installation, check: Callable[[Any], None]) -> None:
    """``torch.amp.GradScaler.scale`` that, while ``installation`` is in force, calls
    ``check(scaler)`` first."""
    scaler = torch.amp.grad_scaler.GradScaler
    original = scaler.scale

    @functools.wraps(original)
    def scale(self: Any, outputs: Any) -> Any:
        if installation.in_force:
            check(self)
        return original(self, outputs)

    installation.replace(scaler, "scale", scale)
