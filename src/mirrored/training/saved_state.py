"""A model's saved state: what ``Model.save`` and ``save_weights`` write, checked whole on load.

``Model.load`` and ``BackupAndRestore`` restore the module, the optimizer, the learning-rate
schedule, the step count and the loss scale together. Each part is checked against the model
first (:mod:`mirrored.core.state_checks` for the module and the optimizer), so a state that does not
fit raises a ValueError naming the part and changes nothing. Weights that are not finite are
never written, so that a checkpoint on disk is always one training can go on from.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mirrored.core import state_checks
from mirrored.core.state_checks import (
    check_module_state,
    check_optimizer_state,
    check_scheduler_state,
)
from mirrored.parameter_server import checkpoint as parameter_server_checkpoint
from mirrored.training.float16_loss_scale import LossScale
from mirrored.training.steps import Steps

__all__ = [
    "MODEL_FORMAT",
    "ModelParts",
    "TrainingProgress",
    "TrainingState",
    "check_training_state",
    "load_training_state",
    "not_built",
    "refuse_non_finite",
    "training_state",
    "weights_in",
]

MODEL_FORMAT = "mirrored.model/1"  # the "format" entry of a Model.save file

_PARTS = ("model", "optimizer", "lr_scheduler", "iterations", "loss_scale")


@dataclasses.dataclass
class TrainingProgress:
    """What training has counted, carried from one fit to the next and saved with the model."""

    iterations: int = 0  # batches trained on since compile
    loss_scale: LossScale = dataclasses.field(default_factory=LossScale)


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """A compiled model's parts, as its training loop saves and loads them."""

    module: Any  # the module the user built (replica 0's)
    replicas: Any  # the mirrored module; None while lazy parameters wait for their first batch
    optimizer: Any  # the mirrored (or parameter-server) optimizer
    torch_optimizer: torch.optim.Optimizer  # replica 0's, which a saved state is checked against
    steps: Steps
    progress: TrainingProgress


def training_state(parts: ModelParts) -> dict[str, Any]:
    """Model, optimizer, schedule, step count and loss scale, as plain data (``Model``'s
    ``training_state``)."""
    scheduler = parts.steps.lr_scheduler
    return {
        "model": parts.module.state_dict(),
        "optimizer": parts.optimizer.state_dict(),
        "lr_scheduler": None if scheduler is None else scheduler.state_dict(),
        "iterations": parts.progress.iterations,
        "loss_scale": {
            "scale": parts.progress.loss_scale.scale,
            "good_steps": parts.progress.loss_scale.good_steps,
        },
    }


def not_built(module: Any) -> ValueError:
    """The error of a load into a model whose lazy parameters wait for their first batch: there
    is nothing of their shapes to load into yet (``load``, ``load_weights``, ``load_state_dict``
    and ``load_training_state`` alike)."""
    return ValueError(
        f"the module ({type(module).__name__}) has lazy parameters that are not built yet, so "
        "there is nothing of their shapes to load into; run the model once on an example batch "
        "before loading: model.predict(x[:1]) (fit and evaluate build them too)"
    )


def load_training_state(parts: ModelParts, state: Any, source: str) -> None:
    """Restore what ``training_state`` returned, all or nothing."""
    if parts.replicas is None:  # compiled with lazy parameters, not built yet
        raise not_built(parts.module)
    scheduler = parts.steps.lr_scheduler
    checked = check_training_state(state, parts.replicas, parts.torch_optimizer, scheduler, source)
    parts.optimizer.load_state_dict(checked.optimizer)
    parts.replicas.load_state_dict(checked.model)
    if scheduler is not None and checked.lr_scheduler is not None:
        scheduler.load_state_dict(checked.lr_scheduler)
    parts.progress.iterations = checked.iterations
    parts.progress.loss_scale = checked.loss_scale


def refuse_non_finite(weights: dict[str, Any], filepath: str | Path) -> None:
    """Raise on every worker alike (their weights are the same), before any collective."""
    entry = state_checks.first_non_finite(weights)
    if entry is not None:
        raise ValueError(
            f"not writing {str(filepath)!r}: the weights are not finite ({entry!r} holds a "
            "NaN or an infinity), and a checkpoint is never written from such weights (the "
            "file already there stays); pass allow_non_finite=True to write them anyway"
        )


def weights_in(saved: Any, filepath: str | Path) -> Any:
    """The module's state dict in a file from ``save_weights``, ``Model.save`` or a
    parameter-server job's ``Model.save``."""
    if isinstance(saved, dict) and saved.get("format") == MODEL_FORMAT:
        return saved["model"]
    if isinstance(saved, dict) and saved.get("format") == parameter_server_checkpoint.FORMAT:
        if len(saved["models"]) != 1:
            raise ValueError(
                f"{str(filepath)!r} holds {len(saved['models'])} models (a whole "
                "ClusterCoordinator.save): restore it with ClusterCoordinator.restore, or "
                "write this model alone with Model.save"
            )
        return saved["models"][0]["model"]
    return saved


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
    check_scheduler_state(
        scheduler, saved, source, "; compile with the scheduler the state was saved with"
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
