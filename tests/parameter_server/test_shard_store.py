"""A ps task's shards: each update applied once, fenced workers refused, the optimizer's math
unchanged by sharding (no process: the store alone)."""

from __future__ import annotations

import pytest
import torch

from mirrored.parameter_server.shard_store import ShardStore


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


def _synchronous_store() -> ShardStore:
    shards = {"w/0": torch.ones(2, 3), "mean/0": torch.zeros(3)}
    return ShardStore(shards, torch.optim.SGD, [{"keys": ["w/0"], "lr": 0.5}], synchronous=True)


def test_a_synchronous_round_applies_the_mean_of_its_functions_once_per_step() -> None:
    store = _synchronous_store()
    # functions 4 and 5 step twice each; function 5 ran twice (a lost worker, then its retry)
    store.push("worker0", 4, 0, 0, {"w/0": torch.full((2, 3), 1.0)}, {"mean/0": torch.ones(3)})
    store.push("worker1", 5, 0, 0, {"w/0": torch.full((2, 3), 100.0)}, {})  # lost run
    store.push("worker2", 5, 0, 0, {"w/0": torch.full((2, 3), 3.0)}, {"mean/0": torch.zeros(3)})
    store.push("worker0", 4, 1, 0, {"w/0": torch.full((2, 3), 2.0)}, {})
    store.push("worker2", 5, 1, 0, {"w/0": torch.full((2, 3), 2.0)}, {})
    assert store.version == 0 and torch.equal(store.pull()[1]["w/0"], torch.ones(2, 3))
    store.commit([5, 4, 9])  # 9 never pushed (it raised before stepping)
    version, shards = store.pull()
    assert version == 2
    assert torch.equal(shards["w/0"], torch.full((2, 3), 1.0 - 0.5 * 2.0 - 0.5 * 2.0))
    assert torch.equal(shards["mean/0"], torch.ones(3))  # function 4's, the first in id order
    store.commit([4, 5])  # nothing left of them: no second application
    assert store.version == 2


def test_a_fenced_worker_s_push_does_not_join_a_synchronous_round() -> None:
    store = _synchronous_store()
    store.push("worker1", 1, 0, 0, {"w/0": torch.full((2, 3), 100.0)}, {})
    store.fence("worker1")
    store.push("worker0", 1, 0, 0, {"w/0": torch.ones(2, 3)}, {})  # the retry replaces it
    assert not store.push("worker1", 2, 0, 0, {"w/0": torch.full((2, 3), 100.0)}, {})
    store.commit([1, 2])
    assert torch.equal(store.pull()[1]["w/0"], torch.full((2, 3), 0.5))


def test_state_dict_round_trips_shards_and_optimizer_state() -> None:
    store = _store(torch.optim.Adam)
    for step in range(2):
        store.push("worker0", step, 0, 0, {"w/0": torch.ones(2, 3), "w/1": torch.ones(1, 3)}, {})
    saved = store.state_dict()
    assert set(saved["optimizer"]) == {"w/0", "w/1"}
    store.push("worker0", 9, 0, 0, {"w/0": torch.ones(2, 3)}, {})
    copy = _store(torch.optim.Adam)
    copy.load_state_dict(saved)
    store.load_state_dict(saved)
    for each in (store, copy):  # the same next step from the same state
        each.push("worker0", 10, 0, 0, {"w/0": torch.ones(2, 3), "w/1": torch.ones(1, 3)}, {})
    assert all(torch.equal(store.pull()[1][k], copy.pull()[1][k]) for k in saved["shards"])


def test_a_checkpoint_that_does_not_fit_loads_nothing() -> None:
    store = _store()
    before = store.pull()[1]
    saved = store.state_dict()
    saved["shards"] = {**saved["shards"], "w/0": torch.zeros(3, 3), "mean/0": torch.ones(3)}
    with pytest.raises(ValueError, match=r"shard 'w/0'.*\[3, 3\] is not \[2, 3\]"):
        store.load_state_dict(saved)
    missing = {**store.state_dict(), "shards": {"w/0": torch.zeros(2, 3)}}
    with pytest.raises(ValueError, match="this ps task holds"):
        store.load_state_dict(missing)
    assert all(torch.equal(before[k], v) for k, v in store.pull()[1].items())


def test_an_update_is_applied_with_the_hyperparameters_it_was_pushed_with() -> None:
    store = _store()  # lr 0.5
    store.push("worker0", 1, 0, 0, {"w/0": torch.ones(2, 3)}, {}, [{"lr": 0.25}])
    store.push("worker0", 2, 0, 0, {"w/0": torch.ones(2, 3)}, {})  # none sent: the last ones
    assert torch.equal(store.pull()[1]["w/0"], torch.full((2, 3), 0.5))
