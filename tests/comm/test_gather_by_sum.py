"""A gather as one integer sum of slotted bytes, with the workers' sums stood in for by one
process (tests/multiprocess covers the shared-memory transport between processes)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from mirrored.comm.gather_by_sum import PendingGather, gather_by_sum
from mirrored.core.replica_meeting import SyncMismatchError


class _Done:
    def succeeded(self) -> bool:
        return True

    def wait(self) -> None:
        return None


def _gather(tensors: Sequence[torch.Tensor]) -> list[tuple[list[torch.Tensor], PendingGather]]:
    """Each worker's call, then the sum every worker's block receives."""
    blocks: list[torch.Tensor] = []

    def start_sum(block: torch.Tensor) -> _Done:
        assert block.dtype == torch.int64
        blocks.append(block)
        return _Done()

    calls = [
        gather_by_sum(t, rank, len(tensors), start_sum, "test") for rank, t in enumerate(tensors)
    ]
    total = torch.stack(blocks).sum(0)
    for block in blocks:
        block.copy_(total)
    return calls


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_worker_gets_every_part_bit_for_bit(world_size: int) -> None:
    nan = torch.tensor([0x7FF8_0000_DEAD_BEEF], dtype=torch.int64).view(torch.float64)
    kinds = [
        lambda r: torch.cat([torch.tensor([-0.0, 0.0, r / 3], dtype=torch.float64), nan]),
        lambda r: torch.tensor([True, r == 1]),
        lambda r: torch.tensor([1 + 2j, r - 1j], dtype=torch.complex128).conj(),  # a view
        lambda r: -torch.arange(3.0) * (r + 1),
        lambda r: (torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) + r).t(),  # strided
        lambda r: torch.tensor(r * 7),
        lambda r: torch.zeros(2, 0),
        lambda r: torch.arange(5, dtype=torch.int8) - r,
    ]
    for make in kinds:
        tensors = [make(rank) for rank in range(world_size)]
        for parts, pending in _gather(tensors):
            assert pending.succeeded()
            pending.wait()
            assert len(parts) == world_size
            for part, expected in zip(parts, tensors, strict=True):
                assert part.dtype == expected.dtype and part.shape == expected.shape
                assert torch.equal(_bytes(part), _bytes(expected.resolve_conj()))


def test_workers_that_gather_different_tensors_fail_alike_naming_them() -> None:
    # 5 and 6 float32s fill slots of one size: only the headers tell them apart.
    calls = _gather([torch.zeros(5), torch.zeros(6)])
    for _, pending in calls:
        assert not pending.succeeded()  # its parts cannot be read
        with pytest.raises(SyncMismatchError, match=r"worker 0: 5 x float32, worker 1: 6 x fl"):
            pending.wait()
    for _, pending in _gather([torch.zeros(4), torch.zeros(2, dtype=torch.float64)]):
        with pytest.raises(SyncMismatchError, match=r"4 x float32, worker 1: 2 x float64"):
            pending.wait()
