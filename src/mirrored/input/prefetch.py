"""Reading, splitting and placing the next global batches while the replicas train.

``experimental_distribute_dataset(dataset, options=InputOptions(
experimental_per_replica_buffer_size=k))``: a background thread reads up to k global batches
ahead, splits each and copies the shards to their devices, so that a step never waits for its
input unless the input is slower than training. On CUDA the thread pins each batch and copies it
on side streams of its own, and hands a batch over only once its copies are done, so the
replicas never wait on a copy and never read one half done.

The batches come out in the dataset's order, an error of the dataset comes out at the batch
where it happened, and leaving the loop early stops the thread. What does not move to the
thread: the multi-worker checks that every worker reads the same steps (collectives, which must
keep their order with the training's), and the start of the dataset's iteration (a DataLoader's
shuffle draws its seed from torch's generator when the first batch is read).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

import torch

__all__ = ["Prefetcher", "ahead"]

T = TypeVar("T")

_END = object()
_POLL_SECONDS = 0.1
_JOIN_SECONDS = 5.0


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher(Generic[T]):
    """``items`` read by a background thread, up to ``depth`` ahead of the consumer.

    Args:
        items: an iterator; it runs on the background thread from the first ``next``.
        depth: how many items may wait in the buffer.
        cuda_devices: the CUDA devices the items' tensors are copied to while they are made.
    """

    def __init__(
        self, items: Iterator[T], depth: int, cuda_devices: Sequence[torch.device] = ()
    ) -> None:
        self._items = items
        self._buffer: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._streams = [torch.cuda.Stream(d) for d in dict.fromkeys(cuda_devices)]
        self._thread = threading.Thread(target=self._fill, name="mirrored-prefetch", daemon=True)
        self._thread.start()

    def _next_item(self) -> Any:
        if not self._streams:
            return next(self._items)
        with contextlib.ExitStack() as streams:
            for stream in self._streams:
                streams.enter_context(torch.cuda.stream(stream))
            item = next(self._items)
        for stream in self._streams:
            stream.synchronize()  # this thread waits for the copies; the replicas never do
        return item

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    item = self._next_item()
                except StopIteration:
                    self._put(_END)
                    return
                self._put(item)
        except BaseException as error:  # handed to the consumer, at its place in the order
            self._put(_Failure(error))
        finally:
            close = getattr(self._items, "close", None)
            if close is not None:
                close()

    def _put(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._buffer.put(item, timeout=_POLL_SECONDS)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        item = self._buffer.get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def close(self) -> None:
        """Stop reading ahead; waits a while for the thread (a dataset stuck in a read is left
        to finish on its own: the thread is a daemon)."""
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._buffer.get_nowait()
        if self._thread is not threading.current_thread():
            self._thread.join(_JOIN_SECONDS)


def ahead(items: Iterator[T], depth: int, devices: Sequence[torch.device | None]) -> Iterator[T]:
    """``items`` as they are (``depth`` 0), or read ``depth`` ahead by a ``Prefetcher`` that
    stops when the consumer does."""
    if not depth:
        yield from items
        return
    cuda = [d for d in devices if d is not None and d.type == "cuda"]
    prefetcher = Prefetcher(items, depth, cuda)
    try:
        yield from prefetcher
    finally:
        prefetcher.close()
