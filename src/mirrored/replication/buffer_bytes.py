"""Which buffers changed their bytes since a snapshot, in one concatenation and one comparison
however many there are.

A version counter does not tell every change: BatchNorm's kernel writes the running statistics
in place without moving it (through ``F.batch_norm`` too, from a module of the program's own),
and ``.data`` edits do not move it either. The bytes tell.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mirrored._torch_internals import tensor_bytes

__all__ = ["BytesSnapshot"]

# What a tensor's bytes are read through: where its data lives, and how it is laid out.
_Layout = tuple[tuple[int, ...], torch.dtype, torch.device, int] | None


class BytesSnapshot:
    """The bytes of ``tensors`` (None for a missing one) as they are now."""

    def __init__(self, tensors: Sequence[torch.Tensor | None]) -> None:
        self._layouts = [_layout(t) for t in tensors]
        # Views of the tensors' own memory (a copy where one is not contiguous): while the
        # layouts hold, a view reads the bytes as they are then.
        self._views = [None if t is None else tensor_bytes(t) for t in tensors]
        self._live = [t is not None and _viewable(t) for t in tensors]
        present = [v for v in self._views if v is not None]
        self._bytes = torch.cat(present) if present else None
        lengths = torch.tensor([0 if v is None else len(v) for v in self._views], dtype=torch.int64)
        owners = torch.repeat_interleave(torch.arange(len(tensors)), lengths)
        self._owners = owners if self._bytes is None else owners.to(self._bytes.device)

    def changed(self, tensors: Sequence[torch.Tensor | None]) -> list[bool]:
        """Per tensor (in the snapshot's order), whether its bytes or layout changed."""
        layouts = [_layout(t) for t in tensors]
        if layouts != self._layouts:
            return self._changed_one_by_one(tensors, layouts)
        if self._bytes is None:
            return [False] * len(tensors)
        now = [
            view if live and view is not None else tensor_bytes(tensor)
            for tensor, view, live in zip(tensors, self._views, self._live, strict=True)
            if tensor is not None
        ]
        differs = torch.cat(now) != self._bytes
        counts = torch.bincount(self._owners[differs], minlength=len(tensors))
        return [count > 0 for count in counts.tolist()]

    def _changed_one_by_one(
        self, tensors: Sequence[torch.Tensor | None], layouts: list[_Layout]
    ) -> list[bool]:
        changed = []
        start = 0
        for tensor, layout, then, view in zip(
            tensors, layouts, self._layouts, self._views, strict=True
        ):
            length = 0 if view is None else len(view)
            same = layout == then and (
                tensor is None
                or self._bytes is None
                or torch.equal(tensor_bytes(tensor), self._bytes[start : start + length])
            )
            changed.append(not same)
            start += length
        return changed


def _layout(tensor: torch.Tensor | None) -> _Layout:
    if tensor is None:
        return None
    return tuple(tensor.shape), tensor.dtype, tensor.device, tensor.data_ptr()


def _viewable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor_bytes(tensor)`` is a view of the tensor's memory, not a copy."""
    return tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()
