"""A model's saved training state, checked whole before any of it is loaded.

``Model.load`` and ``BackupAndRestore`` restore the module, the optimizer, the learning-rate
schedule, the step count and the loss scale together. Each part is checked against the model
first (:mod:`mirrored.state_checks` for the module and the optimizer), so a state that does not
fit raises a ValueError naming the part and changes nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from mirrored.state_checks import check_module_state, check_optimizer_state
from mirrored.training.loss_scale import LossScale

__all__ = ["TrainingState", "check_training_state"]

_PARTS = ("model", "optimizer", "lr_scheduler", "iterations", "loss_scale")


@dataclasses.dataclass(frozen=True)
class TrainingState:
    """A saved training state that fits the model: loading it cannot fail halfway."""

    model: Mapping[str, Any]
    optimizer: Mapping[str, Any]
    lr_scheduler: dict[str, Any] | None  # None: keep the schedule's own (none was saved or used)
    iterations: int
    loss_scale: LossScale


def check_training_state(
    state: Any,
    module: Any,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    source: str,
) -> TrainingState:
    """``state`` (what ``Model.training_state`` returned), checked against the model's
    ``module``, ``optimizer`` and ``lr_scheduler``; a ValueError naming what does not fit."""
    if not isinstance(state, Mapping) or any(part not in state for part in _PARTS):
        present = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(
            f"{source} is not a training state: expected the parts {list(_PARTS)}, got "
            f"{present}; load files written by Model.save or BackupAndRestore"
        )
    check_module_state(module, state["model"], source)
    check_optimizer_state(optimizer, state["optimizer"], source)
    return TrainingState(
        model=state["model"],
        optimizer=state["optimizer"],
        lr_scheduler=_scheduler_state(state["lr_scheduler"], lr_scheduler, source),
        iterations=_count(state["iterations"], f"{source}: 'iterations'"),
        loss_scale=_loss_scale(state["loss_scale"], source),
    )


def _scheduler_state(
    saved: Any, scheduler: torch.optim.lr_scheduler.LRScheduler | None, source: str
) -> dict[str, Any] | None:
    if saved is None or scheduler is None:
        return None
    expected = scheduler.state_dict()
    if not isinstance(saved, Mapping) or not set(expected) <= set(saved):
        keys = sorted(saved) if isinstance(saved, Mapping) else type(saved).__name__
        raise ValueError(
            f"{source}: the learning-rate schedule's state has {keys}, the model's "
            f"{type(scheduler).__name__} keeps {sorted(expected)}; compile with the scheduler "
            "the state was saved with"
        )
    return dict(saved)


def _loss_scale(saved: Any, source: str) -> LossScale:
    if not isinstance(saved, Mapping) or not {"scale", "good_steps"} <= set(saved):
        raise ValueError(
            f"{source}: 'loss_scale' is {saved!r}, expected a dict of 'scale' and 'good_steps'"
        )
    scale = saved["scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"{source}: the loss scale is {scale!r}, expected a finite number")
    return LossScale(
        scale=float(scale), good_steps=_count(saved["good_steps"], f"{source}: 'good_steps'")
    )


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} is {value!r}, expected an int >= 0")
    return value
