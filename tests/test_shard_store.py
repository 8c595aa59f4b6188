"""A ps task's shards: each update applied once, fenced workers refused, the optimizer's math
unchanged by sharding (no process: the store alone)."""

from __future__ import annotations

import pytest
import torch

from mirrored.shard_store import ShardStore


def _store(optimizer: type[torch.optim.Optimizer] = torch.optim.SGD, **hyper: float) -> ShardStore:
    shards = {"w/0": torch.ones(2, 3), "w/1": torch.ones(1, 3), "mean/0": torch.zeros(3)}
    group = {"keys": ["w/0", "w/1"], "lr": 0.5, **hyper}
    return ShardStore(shards, optimizer, [group])


def test_an_update_is_applied_once_however_often_it_is_pushed() -> None:
    store = _store()
    gradient = {"w/0": torch.ones(2, 3)}
    assert store.push("worker0", 7, 0, 0, gradient, {})
    assert not store.push("worker1", 7, 0, 0, gradient, {})  # the function's retry elsewhere
    assert store.push("worker1", 7, 1, 0, gradient, {})  # its second step is another update
    version, shards = store.pull()
    assert version == 2
    assert torch.equal(shards["w/0"], torch.zeros(2, 3))  # 1 - 0.5 - 0.5
    assert torch.equal(shards["w/1"], torch.ones(1, 3))  # no gradient: untouched


def test_the_record_is_trimmed_below_the_watermark_only() -> None:
    store = _store()
    store.push("worker0", 1, 0, 0, {"w/1": torch.ones(1, 3)}, {})
    store.push("worker0", 2, 0, 2, {"w/1": torch.ones(1, 3)}, {})  # function 1 finished for good
    assert not store.push("worker0", 2, 0, 2, {"w/1": torch.ones(1, 3)}, {})
    assert store._applied.keys() == {2}


def test_a_fenced_worker_s_late_push_is_refused() -> None:
    store = _store()
    store.fence("worker0")
    assert not store.push("worker0", 1, 0, 0, {"w/0": torch.ones(2, 3)}, {})
    assert store.push("worker1", 1, 0, 0, {"w/0": torch.ones(2, 3)}, {})
    assert store.version == 1


def test_buffers_are_assigned_and_gradients_follow_the_optimizer_as_on_one_tensor() -> None:
    store = _store(torch.optim.Adam, weight_decay=0.1)
    whole = torch.ones(3, 3, requires_grad=True)
    reference = torch.optim.Adam([whole], lr=0.5, weight_decay=0.1)
    for step in range(3):
        gradient = torch.arange(9.0).view(3, 3) * (step + 1)
        store.push(
            "worker0",
            step,
            0,
            0,
            {"w/0": gradient[:2], "w/1": gradient[2:]},
            {"mean/0": torch.full((3,), float(step))},
        )
        whole.grad = gradient
        reference.step()
    _, shards = store.pull()
    torch.testing.assert_close(torch.cat([shards["w/0"], shards["w/1"]]), whole.detach())
    assert torch.equal(shards["mean/0"], torch.full((3,), 2.0))


def test_gradients_for_a_model_without_optimizer_are_refused() -> None:
    store = ShardStore({"w/0": torch.ones(2)}, None, [])
    with pytest.raises(ValueError, match="without optimizer"):
        store.push("worker0", 1, 0, 0, {"w/0": torch.ones(2)}, {})
