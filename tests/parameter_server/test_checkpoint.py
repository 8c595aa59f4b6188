"""A ps job's checkpoint put together from shards and cut again by another plan (no process:
shard stores and the plan alone)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mirrored.parameter_server.checkpoint import (
    MirroredModel,
    gather,
    load_hyperparameters,
    scatter,
)
from mirrored.parameter_server.shard_store import ShardStore
from mirrored.partitioners import FixedShardsPartitioner, Partitioner, plan_shards


def _module() -> nn.Module:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 3))
    module.register_buffer("scratch", torch.ones(2), persistent=False)
    return module


def _mirror(
    module: nn.Module, num_ps: int, partitioner: Partitioner | None
) -> tuple[MirroredModel, list[ShardStore]]:
    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    shards = plan_shards([(n, t.shape, t.dtype) for n, t in tensors.items()], num_ps, partitioner)
    names = tuple(name for name, _ in module.named_parameters())
    groups = ((names[:2], {"lr": 0.1}), (names[2:], {"lr": 0.01}))
    stores = []
    for ps in range(num_ps):
        mine = [s for s in shards if s.ps == ps]
        values = {
            s.key: tensors[s.name][s.start : s.stop] if s.num_shards > 1 else tensors[s.name]
            for s in mine
        }
        keys = [[s.key for s in mine if s.name in group] for group, _ in groups]
        stores.append(
            ShardStore(
                values,
                torch.optim.Adam,
                [{**hyper, "keys": k} for (_, hyper), k in zip(groups, keys, strict=True)],
            )
        )
    return MirroredModel(0, module, tuple(shards), groups), stores


def _train(model: MirroredModel, stores: list[ShardStore], steps: int) -> None:
    parameters = dict(model.module.named_parameters())
    for step in range(steps):
        for ps, store in enumerate(stores):
            gradients = {
                s.key: torch.full(s.shape, float(step + 1)) * (1 + s.index)
                for s in model.shards
                if s.ps == ps and s.name in parameters
            }
            store.push("worker0", step, 0, 0, gradients, {})


def test_a_sharded_checkpoint_is_the_single_process_state_and_restores_on_another_plan() -> None:
    model, stores = _mirror(_module(), 2, FixedShardsPartitioner(2))
    _train(model, stores, 3)
    saved = gather(model, [store.state_dict() for store in stores])
    assert saved["model"].keys() == model.module.state_dict().keys()  # no "scratch"
    plain = _module()
    plain.load_state_dict(saved["model"])
    parameters = list(plain.parameters())
    optimizer = torch.optim.Adam(
        [{"params": parameters[:2], "lr": 0.1}, {"params": parameters[2:], "lr": 0.01}]
    )
    optimizer.load_state_dict(saved["optimizer"])  # torch's own format
    assert saved["optimizer"]["state"][0]["exp_avg"].shape == (5, 4)
    assert float(saved["optimizer"]["state"][0]["step"]) == 3.0

    other, other_stores = _mirror(_module(), 3, None)  # 3 ps tasks, whole tensors
    for store, state in zip(other_stores, scatter(other, saved, 3), strict=True):
        store.load_state_dict(state)
    again = gather(other, [store.state_dict() for store in other_stores])
    for name, value in saved["model"].items():
        assert torch.equal(again["model"][name], value)
    for index, state in saved["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(again["optimizer"]["state"][index][key], value)


def test_a_checkpoint_that_does_not_fit_is_refused_naming_what() -> None:
    model, stores = _mirror(_module(), 2, FixedShardsPartitioner(2))
    saved = gather(model, [store.state_dict() for store in stores])
    wrong_shape = {**saved, "model": {**saved["model"], "0.weight": torch.zeros(6, 4)}}
    with pytest.raises(ValueError, match=r"0.weight: checkpoint \(6, 4\), model \(5, 4\)"):
        scatter(model, wrong_shape, 2)
    missing = {**saved, "model": {k: v for k, v in saved["model"].items() if k != "2.bias"}}
    with pytest.raises(ValueError, match=r"missing keys \['2.bias'\]"):
        scatter(model, missing, 2)
    groups = [{**saved["optimizer"]["param_groups"][0], "params": [0, 1, 2, 3, 4, 5]}]
    one_group = {**saved, "optimizer": {**saved["optimizer"], "param_groups": groups}}
    with pytest.raises(
        ValueError, match=r"groups of \[6\] parameters, the model's optimizer \[2, 4\]"
    ):
        scatter(model, one_group, 2)


def test_a_checkpoint_of_another_optimizer_or_with_a_non_tensor_is_refused_whole() -> None:
    model, stores = _mirror(_module(), 2, FixedShardsPartitioner(2))
    _train(model, stores, 2)
    saved = gather(model, [store.state_dict() for store in stores])
    listed = {**saved, "model": {**saved["model"], "2.bias": [0.0, 0.0, 0.0]}}
    with pytest.raises(ValueError, match=r"2\.bias: checkpoint list, model a tensor"):
        scatter(model, listed, 2)
    groups = [{k: v for k, v in g.items() if k != "lr"} for g in saved["optimizer"]["param_groups"]]
    without_lr = {**saved, "optimizer": {**saved["optimizer"], "param_groups": groups}}
    with pytest.raises(ValueError, match=r"parameter group 0 has no \['lr'\]"):
        scatter(model, without_lr, 2)
    state = {**saved["optimizer"]["state"], 3: torch.zeros(3)}
    not_a_dict = {**saved, "optimizer": {**saved["optimizer"], "state": state}}
    with pytest.raises(ValueError, match=r"parameter 3 is a tensor of shape \(3,\), not a dict"):
        scatter(model, not_a_dict, 2)


def test_the_hyperparameters_saved_are_the_handle_s_current_ones_and_restore_into_it() -> None:
    model, stores = _mirror(_module(), 2, None)
    model.param_groups[1][1]["lr"] = 0.003  # as ParameterServerOptimizer.param_groups[1]["lr"]
    saved = gather(model, [store.state_dict() for store in stores])
    assert [g["lr"] for g in saved["optimizer"]["param_groups"]] == [0.1, 0.003]
    model.param_groups[1][1]["lr"] = 0.5
    load_hyperparameters(model, saved)
    assert model.param_groups[1][1]["lr"] == 0.003


class _Tied(nn.Module):
    """An output layer that shares its weight with the embedding (as BERT's decoder does)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(6, 4)
        self.proj = nn.Linear(4, 4)
        self.out = nn.Linear(4, 6, bias=False)
        self.out.weight = self.embed.weight


def test_tied_weights_are_held_once_and_saved_under_every_name() -> None:
    model, stores = _mirror(_Tied(), 2, FixedShardsPartitioner(2))
    assert {s.name for s in model.shards} == {"embed.weight", "proj.weight", "proj.bias"}
    _train(model, stores, 2)
    saved = gather(model, [store.state_dict() for store in stores])
    assert saved["model"].keys() == _Tied().state_dict().keys()
    assert torch.equal(saved["model"]["out.weight"], saved["model"]["embed.weight"])
    assert not torch.equal(saved["model"]["embed.weight"], _Tied().embed.weight)  # trained
    plain = _Tied()
    plain.load_state_dict(saved["model"])
    for store, state in zip(stores, scatter(model, saved, 2), strict=True):
        store.load_state_dict(state)
    again = gather(model, [store.state_dict() for store in stores])
    assert all(torch.equal(again["model"][k], v) for k, v in saved["model"].items())
