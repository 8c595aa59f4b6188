"""What ``fit``, ``evaluate`` and ``predict`` accept as data, turned into global batches.

Two kinds of input, as in Keras:
- arrays (tensors or numpy arrays; x may be a tuple or dict of them) with a ``batch_size``:
  batched here, reshuffled every epoch from torch's global generator when ``shuffle``;
- a DataLoader or any iterable of batches ``(x, y)`` / ``(x, y, sample_weight)``: used as given
  (a re-iterable one starts a new pass every epoch; a one-shot iterator continues across epochs).
  Without y, a list or tuple whose items are all such batches (or dicts) is an iterable of
  batches; with y it is arrays (a multi-input x, as in Keras).

Arrays are batched along ``batch_dim`` (``compile(input_options=InputOptions(batch_dim=1))``
for sequence-first data); a batch is normalised to ``(x, y, sample_weight)``. A dict x needs no
y (a Hugging Face model's inputs carry their ``labels``, or the model computes its own loss):
dict arrays without y, and batches that are dicts, are x alone. An epoch can start after its
first ``skip`` batches, which is how ``BackupAndRestore`` resumes mid-epoch.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from typing import Any

import numpy as np
import torch

from mirrored.core.values import flatten, map_structure

__all__ = ["DataAdapter", "unpack_batch"]

DEFAULT_BATCH_SIZE = 32


def _is_array(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, np.ndarray))


def _is_array_structure(value: Any) -> bool:
    """A tensor / numpy array, or a tuple, list or dict whose leaves all are."""
    if _is_array(value):
        return True
    if isinstance(value, (tuple, list, Mapping)):
        leaves = flatten(value)
        return bool(leaves) and all(_is_array(leaf) for leaf in leaves)
    return False


def _is_list_of_batches(value: Any) -> bool:
    """A list or tuple whose every item is a batch: an ``(x, y[, sample_weight])`` tuple or list,
    or a dict. Read so only without y: with y, a list of pairs is a multi-input x."""
    return (
        isinstance(value, (tuple, list))
        and not _is_namedtuple(value)
        and bool(value)
        and all(
            isinstance(item, Mapping)
            or (
                isinstance(item, (tuple, list)) and not _is_namedtuple(item) and len(item) in (2, 3)
            )
            for item in value
        )
    )


def _as_tensor(value: Any) -> Any:
    """numpy -> torch; float64 becomes torch's default dtype, float32 unless a program set
    another (Keras converts to floatx, its default dtype)."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, torch.Tensor) and value.dtype == torch.float64:
        value = value.to(torch.get_default_dtype())
    return value


def unpack_batch(batch: Any, purpose: str) -> tuple[Any, Any, Any]:
    """``(x, y, sample_weight)`` of one batch: a tuple or list of 2 or 3 is (x, y[, weight]); a
    dict (a Hugging Face batch) is x alone; anything else is x alone for ``predict`` only."""
    if isinstance(batch, (tuple, list)) and not _is_namedtuple(batch):
        if len(batch) in (2, 3):
            return batch[0], batch[1], batch[2] if len(batch) == 3 else None
        if len(batch) == 1:
            return batch[0], None, None
        raise ValueError(
            f"a batch of the data is a {type(batch).__name__} of {len(batch)} items; expected "
            "(x, y) or (x, y, sample_weight) (put several inputs in a tuple or dict as x)"
        )
    if purpose != "predict" and not isinstance(batch, Mapping):
        raise ValueError(
            f"{purpose}() needs targets, but a batch of the data is a single "
            f"{type(batch).__name__}; yield (x, y) or (x, y, sample_weight) batches, or dicts "
            "of inputs carrying 'labels'"
        )
    return batch, None, None


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


class DataAdapter:
    """Global batches ``(x, y, sample_weight)`` of one epoch at a time."""

    def __init__(
        self,
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        batch_size: int | None = None,
        shuffle: bool = False,
        steps: int | None = None,
        purpose: str = "fit",
        batch_dim: int = 0,
    ) -> None:
        self.purpose = purpose
        self.batch_dim = batch_dim
        if steps is not None and (not isinstance(steps, int) or steps <= 0):
            raise ValueError(f"steps={steps!r}: expected a positive int or None")
        if x is None:
            raise ValueError(f"{purpose}() got x=None; pass arrays or a DataLoader")
        if y is None and purpose != "predict" and _is_list_of_batches(x):
            self._init_iterable(x, y, sample_weight, batch_size)
        elif _is_array_structure(x):
            self._init_arrays(x, y, sample_weight, batch_size, shuffle)
        else:
            self._init_iterable(x, y, sample_weight, batch_size)
        self.steps_per_epoch = steps if steps is not None else self._num_batches
        self._limited = steps is not None
        self.consumed = 0  # batches taken from a one-shot iterator, for resuming

    def _init_arrays(
        self, x: Any, y: Any, sample_weight: Any, batch_size: int | None, shuffle: bool
    ) -> None:
        if batch_size is None:
            batch_size = DEFAULT_BATCH_SIZE
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
            raise ValueError(f"batch_size={batch_size!r}: expected a positive int")
        parts = {"x": x, "y": y, "sample_weight": sample_weight}
        for name, value in parts.items():
            if value is not None and not _is_array_structure(value):
                raise TypeError(
                    f"{name} is a {type(value).__name__}; with array x, {name} must be a tensor "
                    "or numpy array (or a tuple or dict of them)"
                )
        if y is None and self.purpose != "predict" and not isinstance(x, Mapping):
            listed = (
                f" (x is a {type(x).__name__} of {len(x)} items, not all of them batches: a "
                "list of batches must hold (x, y) or (x, y, sample_weight) tuples only)"
                if isinstance(x, (tuple, list))
                else ""
            )
            raise ValueError(
                f"{self.purpose}() got array x but no y{listed}; pass y=, a dict x carrying "
                "'labels', or a DataLoader of (x, y)"
            )
        self._arrays = map_structure(_as_tensor, (x, y, sample_weight))
        dim = self.batch_dim
        lengths = {
            f"{name}{tuple(t.shape)}": (t.shape[dim] if t.dim() > dim else None)
            for name, value in parts.items()
            if value is not None
            for t in flatten(map_structure(_as_tensor, value))
        }
        sizes = set(lengths.values())
        if None in sizes or len(sizes) != 1:
            raise ValueError(
                "x, y and sample_weight must have the same number of examples (dim "
                f"{dim}{', compile(input_options=InputOptions(batch_dim=...))' if dim else ''}); "
                "got " + ", ".join(lengths)
            )
        self.num_examples = int(sizes.pop() or 0)
        if self.num_examples == 0:
            raise ValueError(f"{self.purpose}() got empty arrays (0 examples)")
        self.batch_size = batch_size
        self._shuffle = shuffle
        self._iterable: Any = None
        self._num_batches: int | None = -(-self.num_examples // batch_size)

    def _init_iterable(self, x: Any, y: Any, sample_weight: Any, batch_size: int | None) -> None:
        kind = type(x).__name__
        if not isinstance(x, Iterable):
            raise TypeError(
                f"x is a {kind}; expected a tensor, numpy array (or a tuple or dict of them), a "
                "DataLoader, or an iterable of (x, y) batches"
            )
        for name, value in (("y", y), ("sample_weight", sample_weight)):
            if value is not None:
                raise ValueError(
                    f"{name} was given twice: x is a {kind} whose batches carry it; drop the "
                    f"{name}= argument (or pass arrays for x)"
                )
        if batch_size is not None:
            raise ValueError(
                f"batch_size={batch_size} with x a {kind}: the data is already batched; drop "
                "batch_size (set it on your DataLoader)"
            )
        self._iterable = x
        self._one_shot = isinstance(x, Iterator)  # continues where it stopped, epoch to epoch
        self._num_batches = None
        if not self._one_shot and isinstance(x, Sized):
            with contextlib.suppress(TypeError):  # an IterableDataset's DataLoader has no length
                self._num_batches = len(x)

    @property
    def one_shot(self) -> bool:
        """True for an iterator that cannot be restarted (continues across epochs)."""
        return self._iterable is not None and self._one_shot

    def epoch(
        self, skip: int = 0, on_ready: Callable[[], None] | None = None
    ) -> Iterator[tuple[Any, Any, Any]]:
        """The batches of one epoch, after its first ``skip`` ones; ``on_ready`` is called once
        they are skipped, before the next batch is read (to restore the random state there).

        For a one-shot iterator the skipped batches were consumed by an earlier run: call
        ``skip_consumed`` first; the epoch then only counts them against ``steps``."""
        if self.one_shot:
            if on_ready is not None:
                on_ready()
            limit = self.steps_per_epoch - skip if self.steps_per_epoch and self._limited else None
            for batch in itertools.islice(self._iterable, limit):
                self.consumed += 1
                yield unpack_batch(batch, self.purpose)
            return
        batches = iter(self._array_batches() if self._iterable is None else self._iterable)
        if self._limited:
            batches = itertools.islice(batches, self.steps_per_epoch)
        for _ in itertools.islice(batches, skip):
            pass
        if on_ready is not None:
            on_ready()
        for batch in batches:
            yield unpack_batch(batch, self.purpose)

    def skip_consumed(self, count: int) -> None:
        """Advance a one-shot iterator past the ``count`` batches an earlier run consumed."""
        if self.one_shot:
            for _ in itertools.islice(self._iterable, count):
                self.consumed += 1

    def _array_batches(self) -> Iterator[Any]:
        x, y, weight = self._arrays
        if self._shuffle:
            order: torch.Tensor | None = torch.randperm(self.num_examples)
        else:
            order = None
        for start in range(0, self.num_examples, self.batch_size):
            length = min(self.batch_size, self.num_examples - start)
            if order is None:
                take: Callable[[torch.Tensor], torch.Tensor] = functools.partial(
                    torch.narrow, dim=self.batch_dim, start=start, length=length
                )
            else:
                take = functools.partial(
                    _select, dim=self.batch_dim, index=order[start : start + length]
                )
            yield map_structure(
                lambda t, take=take: take(t) if isinstance(t, torch.Tensor) else t,
                (x, y, weight),
            )


def _select(tensor: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """The examples ``index`` (drawn on the CPU) of ``tensor``, wherever it lives."""
    return tensor.index_select(dim, index.to(tensor.device, non_blocking=True))
