"""An optimizer's parameter groups: their hyperparameters, as the replicas take them from replica 0.

At each update every replica's optimizer takes replica 0's hyperparameters (an LR schedule, a
warm-up set inside the replica function). A hyperparameter may be a tensor (a learning rate that a
torch scheduler moves in place): each replica keeps a tensor of its own, on its device, so that no
replica reads a tensor that another changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "hyperparameters",
    "plain_settings",
    "settings_of",
    "snapshot",
    "take_group_hyperparameters",
    "take_hyperparameters",
]


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's settings: everything but its parameters."""
    return {key: value for key, value in group.items() if key != "params"}


def snapshot(groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The hyperparameters of ``groups`` as they are now, their tensors copied: their owner may
    go on changing its own while other replicas read the copies."""
    return [
        {key: _copied(value, None) for key, value in hyperparameters(group).items()}
        for group in groups
    ]


def take_hyperparameters(group: dict[str, Any], values: Mapping[str, Any]) -> None:
    """``values`` (a ``snapshot``) into ``group``: a tensor into the group's own tensor of that
    name, or into a new one on the device of the group's parameters where the value is not on
    the CPU; anything else as it is."""
    params = group.get("params") or []
    device = params[0].device if params else None
    for key, value in values.items():
        group[key] = _own(group.get(key), value, device)


def take_group_hyperparameters(
    groups: Sequence[dict[str, Any]], values: Sequence[Mapping[str, Any]]
) -> None:
    """Each group's ``values`` (a ``snapshot`` of groups laid out alike) into it."""
    for group, group_values in zip(groups, values, strict=True):
        take_hyperparameters(group, group_values)


def _copied(value: Any, device: torch.device | None) -> Any:
    """``value`` with each tensor in it (or in a tuple of them) copied, to ``device`` where the
    tensor is not on the CPU and ``device`` is given."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(_target(value, device), copy=True)
    if isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value):
        return tuple(_copied(v, device) for v in value)
    return value


def _target(value: torch.Tensor, device: torch.device | None) -> torch.device:
    return value.device if device is None or value.device.type == "cpu" else device


def _own(mine: Any, value: Any, device: torch.device | None) -> Any:
    """``value`` as the group holding ``mine`` keeps it: written into ``mine`` where that is a
    tensor of the group's own that fits, else a copy."""
    if isinstance(value, tuple) and isinstance(mine, tuple) and len(mine) == len(value):
        return tuple(_own(m, v, device) for m, v in zip(mine, value, strict=True))
    if (
        isinstance(value, torch.Tensor)
        and isinstance(mine, torch.Tensor)
        and mine is not value
        and (mine.shape, mine.dtype, mine.device)
        == (value.shape, value.dtype, _target(value, device))
    ):
        with torch.no_grad():
            mine.copy_(value)
        return mine
    return _copied(value, device)


def settings_of(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's kind and every group's hyperparameters, flat and JSON-plain
    (``plain_settings``): what workers compare so that none trains with other settings."""
    settings: dict[str, Any] = {"class": type(optimizer).__qualname__}
    for index, group in enumerate(optimizer.param_groups):
        for key, value in sorted(hyperparameters(group).items()):
            settings[f"param_groups[{index}][{key!r}]"] = value
    return plain_settings(settings)


def plain_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` with each value as JSON can carry it: tensors as lists, tuples as lists,
    numbers, strings, booleans and None as they are, anything else by its ``repr``."""
    return {str(key): _plain(value) for key, value in settings.items()}


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)
