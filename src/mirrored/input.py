"""Distributing input: global batches split into per-replica shards.

A global batch of B examples is split along dim 0 into shards that differ by at most one example
(larger shards first); a batch smaller than the replica count gives empty shards, which contribute
zero gradient. No example is dropped or counted twice. Each shard is a ``PerReplicaShards`` that
remembers the global batch size, so ``compute_average_loss`` divides by it even for the ragged
last batch.
"""

from __future__ import annotations

import array
import dataclasses
import itertools
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, Sampler

from mirrored.prefetch import ahead
from mirrored.values import PerReplica, fingerprint, flatten, map_structure

__all__ = [
    "DistributedDataset",
    "InputContext",
    "InputOptions",
    "PerReplicaShards",
    "ValueContext",
    "global_batch_size_of",
    "prefetch_depth",
    "shard_sizes",
]


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What an input pipeline needs to know to produce its part of the data (TensorFlow's)."""

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The batch each replica gets; ``global_batch_size`` must divide evenly."""
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by "
                f"num_replicas_in_sync={self.num_replicas_in_sync}"
            )
        return global_batch_size // self.num_replicas_in_sync


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """How a distributed dataset is read (TensorFlow's ``tf.distribute.InputOptions``).

    Args:
        experimental_per_replica_buffer_size: global batches read, split and copied to the
            devices ahead of the training, on a background thread (:mod:`mirrored.prefetch`);
            0 reads each when the loop asks for it. Off by default: a dataset that draws from
            torch's global generator as it reads (random augmentation in the main process)
            would draw from it concurrently with the training, in no fixed order.
    """

    experimental_per_replica_buffer_size: int = 0

    def __post_init__(self) -> None:
        size = self.experimental_per_replica_buffer_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(
                f"InputOptions(experimental_per_replica_buffer_size={size!r}): expected a whole "
                "number >= 0 (0: no reading ahead)"
            )


def prefetch_depth(options: InputOptions | None) -> int:
    """How many batches ``options`` reads ahead (a TypeError for anything but InputOptions)."""
    if options is None:
        return 0
    if not isinstance(options, InputOptions):
        raise TypeError(
            f"options={options!r}: expected mirrored.InputOptions("
            "experimental_per_replica_buffer_size=...)"
        )
    return options.experimental_per_replica_buffer_size


@dataclasses.dataclass(frozen=True)
class ValueContext:
    """Passed to ``experimental_distribute_values_from_function``'s function."""

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1


class PerReplicaShards(PerReplica):
    """The shards of one tensor of a global batch, with the global batch size.

    Its ``len()`` is the global batch size, as the batch's is in a plain loop, so that progress
    lines such as pytorch/examples' ``batch_idx * len(data)`` count the same examples."""

    __slots__ = ("global_batch_size",)

    def __init__(self, values: Sequence[Any], global_batch_size: int) -> None:
        super().__init__(values)
        self.global_batch_size = global_batch_size

    def __len__(self) -> int:
        return self.global_batch_size


def global_batch_size_of(structure: Any) -> int | None:
    """The global batch size of the distributed batch in ``structure`` (None if there is none)."""
    for leaf in flatten(structure):
        if isinstance(leaf, PerReplicaShards):
            return leaf.global_batch_size
    return None


def shard_sizes(batch_size: int, num_shards: int) -> list[int]:
    """Split ``batch_size`` into ``num_shards`` sizes differing by at most one, larger first."""
    base, extra = divmod(batch_size, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


def _as_tensor(leaf: Any) -> Any:
    return torch.from_numpy(leaf) if isinstance(leaf, np.ndarray) else leaf


def batch_size_of(batch: Any) -> int:
    """Dim 0 of the tensors of a batch; they must all agree."""
    sizes = {t.shape[0] for t in flatten(batch) if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(
            "a batch must hold tensors with one common first (batch) dimension; got "
            f"{sorted(sizes) if sizes else 'no batched tensor'}"
        )
    return sizes.pop()


def _place(tensor: torch.Tensor, device: torch.device | None, pin: bool = False) -> torch.Tensor:
    if device is None:
        return tensor
    if pin and device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()  # a copy from pinned memory does not block the host
    return tensor.to(device, non_blocking=True)


def split_batch(
    batch: Any,
    devices: Sequence[torch.device | None],
    first_shard: int = 0,
    num_shards: int | None = None,
    global_batch_size: int | None = None,
    sizes_of: Callable[[int], list[int]] | None = None,
    pin: bool = False,
) -> Any:
    """One global batch -> the same structure with ``PerReplicaShards`` leaves on ``devices``
    (a None device leaves its shard where the batch is). ``sizes_of(batch_size)``: the shard
    sizes, when not as even as possible (:mod:`mirrored.load_balancing`). ``pin``: shards
    bound for CUDA go through pinned memory (when read ahead, off the training's path).

    Across workers the batch splits into ``num_shards`` (every replica of every worker) and this
    process keeps shards ``first_shard ..`` for its own devices. A worker that loaded only its
    own part passes that part and the ``global_batch_size`` it came from.
    """
    batch = map_structure(_as_tensor, batch)
    batch_size = batch_size_of(batch)
    if sizes_of is None:
        all_sizes = shard_sizes(batch_size, num_shards or len(devices))
    else:
        all_sizes = sizes_of(batch_size)
    global_batch_size = global_batch_size or batch_size
    start = sum(all_sizes[:first_shard])
    sizes = all_sizes[first_shard : first_shard + len(devices)]

    whole = sizes == [batch_size]  # one shard, the whole batch: the batch's own tensors

    def split(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            return leaf
        shards = (leaf,) if whole else torch.split(leaf.narrow(0, start, sum(sizes)), sizes)
        return PerReplicaShards(
            [_place(s, d, pin) for s, d in zip(shards, devices, strict=True)],
            global_batch_size,
        )

    return map_structure(split, batch)


def stack_replica_batches(
    batches: Sequence[Any],
    devices: Sequence[torch.device | None],
    global_batch_size: int | None = None,
) -> Any:
    """Per-replica batches (one per replica, missing ones at the end) -> PerReplicaShards leaves.

    Replicas without a batch get empty shards shaped like the last batch's. ``global_batch_size``
    defaults to the examples in ``batches`` (one process).
    """
    batches = [map_structure(_as_tensor, b) for b in batches]
    if global_batch_size is None:
        global_batch_size = sum(batch_size_of(b) for b in batches)
    last = batches[-1]
    padded = list(batches) + [
        map_structure(lambda t: t[:0] if isinstance(t, torch.Tensor) and t.dim() else t, last)
    ] * (len(devices) - len(batches))

    def combine(*leaves: Any) -> Any:
        if not isinstance(leaves[0], torch.Tensor) or leaves[0].dim() == 0:
            return leaves[0]
        return PerReplicaShards(
            [_place(t, d) for t, d in zip(leaves, devices, strict=True)],
            global_batch_size,
        )

    return map_structure(combine, *padded)


class DistributedDataset:
    """An iterable of distributed batches; iterate it once per epoch like the dataset it wraps.
    Its ``len()`` is the number of steps when the dataset it wraps has one."""

    def __init__(
        self, make_batches: Callable[[], Iterator[Any]], length: Callable[[], int] | None = None
    ) -> None:
        self._make_batches = make_batches
        self._length = length

    def __iter__(self) -> Iterator[Any]:
        return self._make_batches()

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("this distributed dataset has no len(): its input has none")
        return self._length()


class StepAgreement(Protocol):
    """How the workers of a multi-process job agree on each step of their input."""

    def begin(self, num_steps: int | None, first_batch: int | None = None) -> None:
        """An iteration starts; ``num_steps`` is its length when the dataset knows it (then the
        workers can agree once, instead of at every step); ``first_batch`` a fingerprint of the
        examples of its first global batch, when known (every worker must see the same)."""

    def batch(self, num_examples: int) -> int:
        """This worker has a batch of ``num_examples`` for the next step; returns the global
        batch size (raises if another worker's input ran out)."""

    def end(self) -> None:
        """This worker's input ran out; raises unless every worker's did."""


def distribute_global_batches(
    dataset: Iterable[Any],
    devices: Sequence[torch.device | None],
    first_shard: int = 0,
    num_shards: int | None = None,
    agreement: StepAgreement | None = None,
    sizes_of: Callable[[int], list[int]] | None = None,
    prefetch: int = 0,
) -> DistributedDataset:
    """Each global batch of ``dataset`` split into per-replica shards on ``devices`` (this
    worker's ``devices`` hold shards ``first_shard ..`` of ``num_shards``), as ``sizes_of``
    says when given (asked afresh for every batch); ``prefetch`` batches read ahead."""

    def batches() -> Iterator[Any]:
        iterator = iter(dataset)
        if agreement is not None:
            # The first batch is read now, so that the workers can check they read alike.
            first = next(iterator, _END)
            if first is not _END:
                iterator = itertools.chain([first], iterator)
            agreement.begin(
                len(dataset) if isinstance(dataset, Sequence) else None,
                None if first is _END else fingerprint(first),
            )
        prepared = (
            split_batch(
                batch, devices, first_shard, num_shards, sizes_of=sizes_of, pin=bool(prefetch)
            )
            for batch in iterator
        )
        for shards in ahead(prepared, prefetch, devices):
            if agreement is not None:
                agreement.batch(global_batch_size_of(shards) or 0)
            yield shards
        if agreement is not None:
            agreement.end()

    return DistributedDataset(batches, getattr(dataset, "__len__", None))


def distribute_replica_batches(
    datasets: Sequence[Iterable[Any]],
    devices: Sequence[torch.device | None],
    agreement: StepAgreement | None = None,
) -> DistributedDataset:
    """Input pipelines yielding per-replica batches; each step takes one batch per replica,
    dealt round-robin over the pipelines."""

    def batches() -> Iterator[Any]:
        if agreement is not None:
            agreement.begin(None)
        iterators = [iter(d) for d in datasets]
        exhausted = False
        while not exhausted:
            step: list[Any] = []
            for replica in range(len(devices)):
                try:
                    step.append(next(iterators[replica % len(iterators)]))
                except StopIteration:
                    exhausted = True
                    break
            if not step:
                break
            global_batch_size = None
            if agreement is not None:
                local = sum(batch_size_of(map_structure(_as_tensor, b)) for b in step)
                global_batch_size = agreement.batch(local)
            yield stack_replica_batches(step, devices, global_batch_size)
        if agreement is not None:
            agreement.end()

    return DistributedDataset(batches)


class _WorkerBatchSampler(Sampler[list[int]]):
    """A DataLoader's global batches of indices -> the indices of this worker's shards.

    Records (global batch size, examples kept) for every batch, in order, for the consumer; a
    worker whose part is empty loads one example and drops it (a batch cannot be empty).
    """

    def __init__(
        self,
        batch_sampler: Iterable[list[int]],
        first_shard: int,
        num_local: int,
        num_shards: int,
        sizes: deque[tuple[int, int]],
    ) -> None:
        self._batch_sampler = batch_sampler
        self._first, self._num_local, self._num_shards = first_shard, num_local, num_shards
        self._sizes = sizes
        self.first_batch: int | None = None  # a fingerprint of the first global batch's indices

    def __iter__(self) -> Iterator[list[int]]:
        for number, indices in enumerate(self._batch_sampler):
            indices = list(indices)
            if not number:
                self.first_batch = _fingerprint(indices)
            sizes = shard_sizes(len(indices), self._num_shards)
            start = sum(sizes[: self._first])
            kept = sum(sizes[self._first : self._first + self._num_local])
            self._sizes.append((len(indices), kept))
            yield indices[start : start + kept] if kept else indices[:1]

    def __len__(self) -> int:
        return len(self._batch_sampler)  # type: ignore[arg-type]


_END = object()


def _fingerprint(indices: Iterable[int]) -> int:
    """A checksum of a batch's example indices (equal lists, equal checksums)."""
    return zlib.crc32(array.array("q", indices).tobytes())


def refuse_distributed_sampler(dataset: Any) -> None:
    """A DistributedSampler gives each worker other examples, while every worker must iterate
    the same global batches (the strategy shards each of them): refuse it."""
    if not isinstance(dataset, DataLoader):
        return
    samplers = [dataset.sampler, getattr(dataset.batch_sampler, "sampler", None)]
    if any(isinstance(sampler, DistributedSampler) for sampler in samplers):
        raise ValueError(
            "the DataLoader uses a DistributedSampler, which gives each worker different "
            "examples; the strategy shards every global batch over the workers itself: pass a "
            "DataLoader over the whole dataset (shuffle=True is fine) with the global batch size"
        )


def shardable_loader(dataset: Any) -> bool:
    """A DataLoader over a map-style dataset, in order: each worker can load only its part."""
    return (
        isinstance(dataset, DataLoader)
        and not isinstance(dataset.dataset, IterableDataset)
        and dataset.batch_sampler is not None
        and getattr(dataset, "in_order", True)
    )


def distribute_loader_parts(
    loader: DataLoader[Any],
    devices: Sequence[torch.device | None],
    first_shard: int,
    num_shards: int,
    agreement: StepAgreement | None = None,
    prefetch: int = 0,
) -> DistributedDataset:
    """Like ``distribute_global_batches`` for a DataLoader, but this worker loads only the
    examples of its own shards (a clone of ``loader`` over the same dataset, sampler and
    settings, whose batches hold this worker's part of each global batch); ``prefetch``
    batches read ahead."""

    def batches() -> Iterator[Any]:
        sizes: deque[tuple[int, int]] = deque()
        assert loader.batch_sampler is not None
        sampler = _WorkerBatchSampler(
            loader.batch_sampler, first_shard, len(devices), num_shards, sizes
        )
        part_loader = DataLoader(
            loader.dataset,
            batch_sampler=sampler,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
            generator=loader.generator,
            prefetch_factor=loader.prefetch_factor,
            persistent_workers=loader.persistent_workers,
            pin_memory_device=loader.pin_memory_device,
        )

        def prepared() -> Iterator[tuple[Any, int]]:
            for part in part_loader:
                global_batch_size, kept = sizes.popleft()
                if not kept:
                    part = map_structure(
                        lambda t: t[:0] if isinstance(t, torch.Tensor) and t.dim() else t, part
                    )
                yield (
                    split_batch(
                        part, devices, global_batch_size=global_batch_size, pin=bool(prefetch)
                    ),
                    global_batch_size,
                )

        begun = False
        for shards, global_batch_size in ahead(prepared(), prefetch, devices):
            if agreement is not None and not begun:
                # Once the first global batch is drawn (drawing it before the loader starts
                # would change its use of its generator): the workers compare its examples.
                agreement.begin(len(part_loader), sampler.first_batch)
            begun = True
            if agreement is not None:
                agreement.batch(global_batch_size)
            yield shards
        if agreement is not None:
            if not begun:
                agreement.begin(0)
            agreement.end()

    return DistributedDataset(batches, loader.__len__)  # one part of every global batch
