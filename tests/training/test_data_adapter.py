"""DataAdapter: arrays and iterables to global batches, epochs, skipping for resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from mirrored.training.data_adapter import DataAdapter, unpack_batch


def test_arrays_are_batched_with_a_ragged_last_batch() -> None:
    x, y = torch.arange(10.0).reshape(10, 1), torch.arange(10)
    adapter = DataAdapter(x, y, batch_size=4)
    batches = list(adapter.epoch())
    assert adapter.steps_per_epoch == 3
    assert [len(b[0]) for b in batches] == [4, 4, 2]
    assert torch.equal(torch.cat([b[1] for b in batches]), y)
    assert all(b[2] is None for b in batches)


def test_shuffle_draws_a_new_order_each_epoch_from_torch_generator() -> None:
    x, y = torch.arange(50.0).reshape(50, 1), torch.arange(50)
    adapter = DataAdapter(x, y, batch_size=8, shuffle=True)
    torch.manual_seed(3)
    first = torch.cat([b[1] for b in adapter.epoch()])
    second = torch.cat([b[1] for b in adapter.epoch()])
    torch.manual_seed(3)
    assert torch.equal(torch.cat([b[1] for b in adapter.epoch()]), first)
    assert not torch.equal(first, second)
    assert torch.equal(first.sort().values, y)


def test_numpy_float64_becomes_float32_and_structures_are_kept() -> None:
    x = {"a": np.zeros((6, 2)), "b": np.ones((6, 3), dtype=np.int64)}
    (batch_x, batch_y, weight), *_ = DataAdapter(x, np.arange(6), np.ones(6), batch_size=6).epoch()
    assert batch_x["a"].dtype == torch.float32 and batch_x["b"].dtype == torch.int64
    assert weight.dtype == torch.float32 and batch_y.shape == (6,)


@pytest.mark.usefixtures("float64")
def test_float64_stays_float64_where_it_is_torch_s_default_dtype() -> None:
    """Keras converts arrays to its floatx; torch's default dtype is ours: a program that set
    float64 trains its float64 model on float64 arrays."""
    x, y, weight = np.zeros((4, 2)), np.zeros((4, 1)), np.ones(4)
    (batch_x, _, weight), *_ = DataAdapter(x, y, weight, batch_size=4).epoch()
    assert batch_x.dtype == torch.float64 and weight.dtype == torch.float64


def test_skip_resumes_mid_epoch_and_on_ready_runs_before_the_next_batch() -> None:
    x, y = torch.arange(10.0).reshape(10, 1), torch.arange(10)
    events: list[str] = []
    adapter = DataAdapter(x, y, batch_size=2)
    iterator = adapter.epoch(skip=3, on_ready=lambda: events.append("ready"))
    first = next(iterator)
    assert events == ["ready"]
    assert first[1].tolist() == [6, 7]


def test_steps_limits_an_epoch_and_a_one_shot_iterator_continues() -> None:
    stream = iter([(torch.zeros(1), torch.tensor([i])) for i in range(7)])
    adapter = DataAdapter(stream, steps=3)
    assert adapter.one_shot
    assert [b[1].item() for b in adapter.epoch()] == [0, 1, 2]
    assert [b[1].item() for b in adapter.epoch()] == [3, 4, 5]
    assert adapter.consumed == 6
    assert [b[1].item() for b in adapter.epoch()] == [6]


def test_a_dataloader_starts_a_new_pass_every_epoch() -> None:
    loader = DataLoader(TensorDataset(torch.zeros(5, 1), torch.arange(5)), batch_size=2)
    adapter = DataAdapter(loader)
    assert adapter.steps_per_epoch == 3 and not adapter.one_shot
    assert len(list(adapter.epoch())) == len(list(adapter.epoch())) == 3


def test_unpack_batch() -> None:
    assert unpack_batch((1, 2), "fit") == (1, 2, None)
    assert unpack_batch([1, 2, 3], "fit") == (1, 2, 3)
    assert unpack_batch(torch.zeros(1), "predict")[1] is None
    inputs = {"input_ids": torch.zeros(2, 3), "labels": torch.zeros(2, 3)}
    assert unpack_batch(inputs, "fit") == (inputs, None, None)  # a Hugging Face batch
    with pytest.raises(ValueError, match="needs targets"):
        unpack_batch(torch.zeros(1), "fit")
    with pytest.raises(ValueError, match="4 items"):
        unpack_batch((1, 2, 3, 4), "fit")


def test_a_dict_of_arrays_needs_no_y() -> None:
    ids = torch.arange(12).reshape(6, 2)
    adapter = DataAdapter({"input_ids": ids, "labels": ids}, batch_size=4)
    (x, y, weight), _ = adapter.epoch()
    assert torch.equal(x["labels"], ids[:4]) and y is None and weight is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"x": None}, ValueError, "x=None"),
        ({"x": 3}, TypeError, "expected a tensor"),
        ({"x": torch.zeros(4, 1), "y": [1, 2, 3, 4]}, TypeError, "y is a list"),
        ({"x": torch.zeros(4, 1)}, ValueError, "no y"),
        ({"x": torch.zeros(4, 1), "y": torch.zeros(3)}, ValueError, "same number"),
        ({"x": torch.zeros(4, 1), "y": torch.zeros(4), "batch_size": 1.5}, ValueError, "batch"),
        ({"x": torch.zeros(4, 1), "y": torch.zeros(4), "steps": 0}, ValueError, "steps=0"),
        ({"x": torch.zeros(()), "y": torch.zeros(4)}, ValueError, "same number"),
    ],
)
def test_bad_input(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        DataAdapter(**kwargs)  # type: ignore[arg-type]


def _list_of_batches() -> list[tuple[torch.Tensor, ...]]:
    return [(torch.full((3, 2), float(i)), torch.full((3,), i)) for i in range(4)]


@pytest.mark.parametrize("container", [list, tuple])
def test_a_list_of_batches_is_an_iterable_of_batches(container: type) -> None:
    batches = container(_list_of_batches())
    adapter = DataAdapter(batches)
    assert adapter.steps_per_epoch == 4 and not adapter.one_shot
    for epoch in range(2):  # a list is re-iterable: every epoch starts again
        seen = list(adapter.epoch())
        assert [int(y[0]) for _, y, _ in seen] == [0, 1, 2, 3], epoch
        assert all(x.shape == (3, 2) and w is None for x, _, w in seen)
    weighted = [(x, y, torch.ones(3)) for x, y in _list_of_batches()]
    assert all(w is not None for _, _, w in DataAdapter(weighted, purpose="evaluate").epoch())


@pytest.mark.parametrize(
    "x",
    [
        [torch.zeros(4, 1), torch.zeros(4)],  # a multi-input x, no y
        [(torch.zeros(4, 1), torch.zeros(4)), torch.zeros(4, 1)],  # batches mixed with an array
    ],
    ids=["arrays", "mixed"],
)
def test_a_list_that_is_not_all_batches_names_both_readings(x: list[object]) -> None:
    with pytest.raises(ValueError, match="no y") as raised:
        DataAdapter(x)
    message = str(raised.value)
    assert "list of 2 items" in message
    assert "(x, y) or (x, y, sample_weight) tuples" in message


def test_with_y_a_list_of_pairs_stays_a_multi_input_x() -> None:
    a, b, y = torch.zeros(5, 2), torch.ones(5, 3), torch.arange(5)
    (x, batch_y, _), *_ = DataAdapter([a, b], y, batch_size=5).epoch()
    assert isinstance(x, list) and [t.shape for t in x] == [(5, 2), (5, 3)]
    pairs = [(a, b), (a, b)]  # y given: a multi-input x of (a, b) pairs, not two batches
    (x, batch_y, _), *_ = DataAdapter(pairs, y, batch_size=5).epoch()
    assert x[1][1].shape == (5, 3) and torch.equal(batch_y, y)
