"""Which buffers changed their bytes since a snapshot, however they changed."""

from __future__ import annotations

import torch

from mirrored.replication.buffer_bytes import BytesSnapshot


def test_each_kind_of_change_is_told_and_nothing_else():
    tensors: list[torch.Tensor | None] = [
        torch.zeros(3),
        torch.arange(6.0).reshape(2, 3).t(),  # not contiguous: read through a copy
        torch.tensor(5),
        None,
        torch.zeros(0),
        torch.tensor([1 + 1j]).conj(),
    ]
    snapshot = BytesSnapshot(tensors)
    assert snapshot.changed(tensors) == [False] * 6
    tensors[0].data.add_(1)  # moves no version counter
    tensors[1].mul_(1.0)  # a version, the same bytes
    assert snapshot.changed(tensors) == [True, False, False, False, False, False]
    tensors[1].add_(1)
    assert snapshot.changed(tensors) == [True, True, False, False, False, False]
    changed = list(tensors)
    changed[2] = torch.tensor(5)  # another tensor, even of the same value
    changed[3] = torch.zeros(1)  # set where there was none
    assert snapshot.changed(changed) == [True, True, True, True, False, False]
    conjugated = tensors[5]
    assert conjugated is not None
    conjugated.conj().add_(1)  # through the view's conjugate: the memory it reads
    assert snapshot.changed(tensors) == [True, True, False, False, False, True]


def test_nothing_to_compare():
    assert BytesSnapshot([]).changed([]) == []
    assert BytesSnapshot([None]).changed([None]) == [False]
