"""Mirrored's own work inside a replica (the gradients summed in backward, the update, zero_grad,
the buffers checked at the end of a run) runs without torch-function modes: the replicas' random
streams see the program's ops alone, not a Python call per op and per attribute read of
mirrored's, under the GIL the replicas share."""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch import nn

import mirrored
from mirrored.random import routing
from tests.reference_loops import make_batches, replica_step

SOURCE = Path(mirrored.__file__).parent
# The mode's own calls, and compute_average_loss's ops: part of the program's loss, as
# F.cross_entropy's are.
THE_PROGRAM_S = (Path(routing.__file__), SOURCE / "replication" / "global_batch_loss.py")


class Scaled(torch.Tensor):
    """A tensor subclass whose torch functions are its own: mirrored leaves them to it."""

    calls: ClassVar[Counter[int]] = Counter()  # per thread: each replica's own

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        cls.calls[threading.get_ident()] += 1
        return super().__torch_function__(func, types, args, kwargs or {})

    def __deepcopy__(self, memo: dict[int, object]) -> Scaled:  # the replicas' copies
        with torch.no_grad():
            copied = self.clone().as_subclass(Scaled)
        return copied.requires_grad_(self.requires_grad)


def _callers(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Spy on the replicas' random-stream mode: the file and line of each call it sees."""
    callers: Counter[str] = Counter()
    seen = routing.ReplicaRandomness.__torch_function__

    def spied(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        frame = traceback.extract_stack(limit=2)[0]  # the op's caller: modes come from C
        callers[f"{frame.filename}:{frame.lineno}"] += 1
        return seen(self, func, types, args, kwargs)

    monkeypatch.setattr(routing.ReplicaRandomness, "__torch_function__", spied)
    return callers


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 5))


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_the_modes_see_the_program_s_ops_and_none_of_mirrored_s(monkeypatch, optimizer):
    module = _bn_net()
    make = torch.optim.Adam if optimizer == "adam" else torch.optim.SGD
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        model, opt = strategy.mirror(module, make(module.parameters(), lr=0.1))
        batches = list(strategy.experimental_distribute_dataset(make_batches(48, 16)))
        strategy.run(replica_step, args=(batches[0], model, opt))  # the first sets things up
        callers = _callers(monkeypatch)
        for batch in batches[1:]:
            strategy.run(replica_step, args=(batch, model, opt))
    ours = {
        where: count
        for where, count in callers.items()
        if where.startswith(str(SOURCE)) and not where.startswith(tuple(map(str, THE_PROGRAM_S)))
    }
    assert sum(callers.values()) > 0  # the program's forward is seen
    assert not ours, ours


def test_a_parameter_of_a_tensor_subclass_keeps_its_torch_function():
    module = nn.Linear(3, 2)
    module.weight = nn.Parameter(module.weight.detach().as_subclass(Scaled))
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        model, opt = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))

        def step(x):
            mirrored.compute_average_loss(model(x).sum(1)).backward()
            before = Scaled.calls[threading.get_ident()]
            opt.step()
            opt.zero_grad()
            return Scaled.calls[threading.get_ident()] - before

        (batch,) = strategy.experimental_distribute_dataset([torch.ones(4, 3)])
        seen = strategy.experimental_local_results(strategy.run(step, args=(batch,)))
    assert all(count > 0 for count in seen)  # the update went through the subclass
