"""Reading input ahead: the same batches, in order, errors in place, nothing left running."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator

import pytest
import torch

import mirrored
from mirrored.input.prefetch import Prefetcher
from tests.reference_loops import (
    OPTIMIZERS,
    assert_same_parameters,
    make_batches,
    make_mlp,
    replica_step,
    train_plain,
)

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

DEVICES = ["cpu:0", "cpu:1"]


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mirrored-prefetch"]


class _Recording:
    """An iterable of numbered batches that records how far it has been read."""

    def __init__(self, num_batches: int, fail_at: int = -1) -> None:
        self.num_batches = num_batches
        self.fail_at = fail_at
        self.read = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(self.num_batches):
            if i == self.fail_at:
                raise ValueError(f"batch {i} is corrupt")
            self.read += 1
            yield torch.full((4, 3), float(i)), torch.full((4,), i)


def _options(depth: int) -> mirrored.InputOptions:
    return mirrored.InputOptions(experimental_per_replica_buffer_size=depth)


def _wait_until(condition: object, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.01)


def test_batches_read_ahead_come_out_in_order_and_split_alike() -> None:
    with mirrored.MirroredStrategy(DEVICES) as strategy:
        plain = list(strategy.experimental_distribute_dataset(make_batches()))
        ahead = list(strategy.experimental_distribute_dataset(make_batches(), _options(3)))
    assert len(ahead) == len(plain) == 13
    for (x, y), (px, py) in zip(ahead, plain, strict=True):
        for mine, theirs in [(x, px), (y, py)]:
            assert mine.global_batch_size == theirs.global_batch_size
            assert all(torch.equal(a, b) for a, b in zip(mine.values, theirs.values, strict=True))
    assert not _prefetch_threads()


def test_reading_runs_ahead_by_the_buffer_size_and_no_further() -> None:
    source = _Recording(20)
    with mirrored.MirroredStrategy(DEVICES) as strategy:
        batches = iter(strategy.experimental_distribute_dataset(source, _options(2)))
        next(batches)
        # Without asking for more: two batches wait in the buffer and the thread holds a third.
        _wait_until(lambda: source.read == 4)
        time.sleep(0.2)
        assert source.read == 4
        next(batches)
        _wait_until(lambda: source.read == 5)
        assert source.read == 5
        batches.close()  # leaving the loop early stops the thread
    assert not _prefetch_threads()
    assert source.read < 20


def test_an_error_of_the_dataset_comes_out_at_its_batch() -> None:
    source = _Recording(10, fail_at=3)
    seen = []
    strategy = mirrored.MirroredStrategy(DEVICES)
    with strategy, pytest.raises(ValueError, match="batch 3 is corrupt"):
        for x, _ in strategy.experimental_distribute_dataset(source, _options(4)):
            seen.append(int(x.values[0][0, 0]))
    assert seen == [0, 1, 2]
    assert not _prefetch_threads()


def test_an_abandoned_iteration_stops_its_thread() -> None:
    with mirrored.MirroredStrategy(DEVICES) as strategy:
        for _ in strategy.experimental_distribute_dataset(_Recording(100), _options(2)):
            break
        gc.collect()  # the abandoned generator is closed when collected
        _wait_until(lambda: not _prefetch_threads())
    assert not _prefetch_threads()


def test_training_on_batches_read_ahead_equals_one_device() -> None:
    expected = make_mlp()
    train_plain(expected, OPTIMIZERS["adam"](expected), make_batches())
    model = make_mlp()
    with mirrored.MirroredStrategy(DEVICES) as strategy:
        mirrored_model, optimizer = strategy.mirror(model, OPTIMIZERS["adam"](model))
        for batch in strategy.experimental_distribute_dataset(make_batches(), _options(2)):
            strategy.run(replica_step, args=(batch, mirrored_model, optimizer))
    assert_same_parameters(expected, mirrored_model.module)


def test_a_prefetcher_hands_over_a_keyboard_interrupt_too() -> None:
    def interrupted() -> Iterator[int]:
        yield 1
        raise KeyboardInterrupt

    prefetcher = Prefetcher(interrupted(), 1)
    assert next(prefetcher) == 1
    with pytest.raises(KeyboardInterrupt):
        next(prefetcher)
    assert not _prefetch_threads()


@pytest.mark.parametrize("size", [-1, 1.5, True])
def test_a_buffer_size_that_is_not_a_whole_number_is_refused(size: object) -> None:
    with pytest.raises(ValueError, match="experimental_per_replica_buffer_size="):
        mirrored.InputOptions(experimental_per_replica_buffer_size=size)  # type: ignore[arg-type]
    with mirrored.MirroredStrategy(DEVICES) as strategy, pytest.raises(TypeError, match="options="):
        strategy.experimental_distribute_dataset([], options={"prefetch": 2})  # type: ignore[arg-type]
