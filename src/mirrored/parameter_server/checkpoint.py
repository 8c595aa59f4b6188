"""A parameter-server job's checkpoint: the shards of every ps task put back into whole tensors.

The coordinator reads each mirrored model's shards and their optimizer state from the ps tasks
(``mirrored.parameter_server.shard_store``) and writes one file in the formats of a single process:
the model's ``state_dict()`` and the optimizer's ``state_dict()`` as ``torch.optim`` writes it
(state by parameter index, the parameter groups with their hyperparameters). So a checkpoint
restores with any number of ps tasks and any partitioner, and loads into the plain module and
optimizer too (``torch.load(path, weights_only=True)["models"][0]``). Restoring cuts the tensors
again by the current plan and checks everything (:mod:`mirrored.core.state_checks`) before any ps
task receives anything.

Optimizer state is reassembled per parameter: a tensor with one row per row of the shard (Adam's
moments) is concatenated along dim 0; any other value (a step count) must be the same in every
shard of the parameter, and is kept once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mirrored.core.state_checks import check_module_state, check_optimizer_groups_state
from mirrored.partitioners import ShardSpec

__all__ = ["FORMAT", "MirroredModel", "gather", "load_hyperparameters", "scatter"]

FORMAT = "mirrored.strategies.parameter_server/1"


@dataclass(frozen=True)
class MirroredModel:
    """What the coordinator knows of a model it mirrored: where its shards are, and its
    optimizer's parameter groups (the parameters' names, and the hyperparameters: the dicts
    of the optimizer handle's ``param_groups``, current whenever they are read)."""

    model_id: int
    module: nn.Module
    shards: tuple[ShardSpec, ...]
    param_groups: tuple[tuple[tuple[str, ...], dict[str, Any]], ...]

    def parameter_names(self) -> list[str]:
        """The optimizer's parameters in ``torch.optim``'s index order."""
        return [name for names, _ in self.param_groups for name in names]


def gather(model: MirroredModel, states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The model's and its optimizer's state dicts from the state of each ps task (by index)."""
    parts: dict[str, list[ShardSpec]] = {}
    for shard in model.shards:
        parts.setdefault(shard.name, []).append(shard)
    whole = {
        name: torch.cat([states[s.ps]["shards"][s.key] for s in shards])
        if len(shards) > 1
        else states[shards[0].ps]["shards"][shards[0].key]
        for name, shards in parts.items()
    }
    # A tied tensor has one canonical name (the ps tasks hold it once) and aliases in the
    # state dict: each key takes the value of the tensor it names.
    canonical = {
        id(tensor): name
        for name, tensor in [*model.module.named_parameters(), *model.module.named_buffers()]
    }
    model_state = {
        key: whole[canonical[id(tensor)]]
        for key, tensor in model.module.state_dict(keep_vars=True).items()
    }
    optimizer_state = {}
    for index, name in enumerate(model.parameter_names()):
        per_shard = [states[s.ps]["optimizer"].get(s.key) for s in parts[name]]
        if all(state is None for state in per_shard):
            continue
        if any(state is None for state in per_shard):
            raise ValueError(f"the optimizer has state for only some shards of {name!r}")
        optimizer_state[index] = {
            key: _join_values(name, key, parts[name], [state[key] for state in per_shard])
            for key in per_shard[0]
        }
    groups, first = [], 0
    for names, hyper in model.param_groups:
        groups.append({**hyper, "params": list(range(first, first + len(names)))})
        first += len(names)
    return {"model": model_state, "optimizer": {"state": optimizer_state, "param_groups": groups}}


def scatter(model: MirroredModel, saved: Mapping[str, Any], num_ps: int) -> list[dict[str, Any]]:
    """Each ps task's state (``ShardStore.load_state_dict``) from a model's saved entry; raises
    before returning anything when the entry does not fit the model."""
    if not isinstance(saved, Mapping) or not {"model", "optimizer"} <= set(saved):
        raise ValueError(
            f"the checkpoint's entry for the model is {type(saved).__name__} "
            f"{sorted(saved) if isinstance(saved, Mapping) else ''}, expected a dict of 'model' "
            "and 'optimizer'"
        )
    state_dict, optimizer = saved["model"], saved["optimizer"]
    check_module_state(model.module, state_dict, "the checkpoint")
    parameters = dict(model.module.named_parameters())
    check_optimizer_groups_state(
        [
            {**hyper, "params": [parameters[name] for name in names]}
            for names, hyper in model.param_groups
        ],
        optimizer,
        "the checkpoint",
    )
    names = model.parameter_names()
    saved_ids = [i for group in optimizer["param_groups"] for i in group["params"]]
    by_name = {names[saved_ids.index(i)]: state for i, state in optimizer["state"].items()}
    current = dict(model.module.named_parameters()) | dict(model.module.named_buffers())
    tasks: list[dict[str, Any]] = [{"shards": {}, "optimizer": {}} for _ in range(num_ps)]
    for shard in model.shards:
        full = state_dict.get(shard.name, current[shard.name])  # non-persistent buffers: as now
        task = tasks[shard.ps]
        task["shards"][shard.key] = _rows(full, shard, full.shape[0] if full.dim() else 1)
        if shard.name in by_name:
            rows = current[shard.name].shape[0] if current[shard.name].dim() else 1
            task["optimizer"][shard.key] = {
                key: _rows(value, shard, rows) for key, value in by_name[shard.name].items()
            }
    return tasks


def load_hyperparameters(model: MirroredModel, saved: Mapping[str, Any]) -> None:
    """Set the optimizer handle's hyperparameters to a checkpoint's (after ``scatter``)."""
    for (_, hyper), group in zip(
        model.param_groups, saved["optimizer"]["param_groups"], strict=True
    ):
        hyper.update({k: v for k, v in group.items() if k != "params"})


def _rows(value: Any, shard: ShardSpec, rows: int) -> Any:
    """The shard's rows of a whole parameter's tensor (state with other shapes is kept whole)."""
    if (
        shard.num_shards > 1
        and isinstance(value, torch.Tensor)
        and value.dim()
        and value.shape[0] == rows
    ):
        return value[shard.start : shard.stop].clone()
    return value


def _join_values(name: str, key: str, shards: Sequence[ShardSpec], values: Sequence[Any]) -> Any:
    if len(values) == 1:
        return values[0]
    if all(
        isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == s.stop - s.start
        for v, s in zip(values, shards, strict=True)
    ):
        return torch.cat(list(values))
    first = values[0]
    same = all(
        torch.equal(v, first) if isinstance(first, torch.Tensor) else v == first for v in values[1:]
    )
    if not same:
        raise ValueError(
            f"the optimizer's {key!r} differs between the shards of {name!r} and is not one row "
            "per row: it cannot be saved as one tensor (keep the parameter whole: no partitioner)"
        )
    return first
