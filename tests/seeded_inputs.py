"""Inputs drawn from a fixed seed, the same on every call: logits, class ids, uniform values."""

from __future__ import annotations

import torch


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def logits(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_generator()) * 3


def ids(*shape: int, classes: int) -> torch.Tensor:
    return torch.randint(0, classes, shape, generator=_generator())


def uniform(*shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=_generator())
