"""PowerSGD's plan and arithmetic on one worker (the sums across workers: tests/multiprocess)."""

from __future__ import annotations

import pytest
import torch

import mirrored
from mirrored.comm.powersgd import PowerSGDBucket, PowerSGDSum


class _OneWorker:
    """A group of one worker: every sum is the tensor itself."""

    world_size = 1

    def all_reduce_async(self, tensor: torch.Tensor, label: str) -> _OneWorker:
        return self

    def all_reduce(self, tensor: torch.Tensor, label: str) -> None:
        pass

    def wait(self) -> None:
        pass


def _sum(bucket: torch.Tensor, plan: PowerSGDBucket) -> torch.Tensor:
    """One step: what the bucket holds after its compressed sum."""
    result = bucket.clone()
    PowerSGDSum(_OneWorker(), result, plan, "test").wait()  # type: ignore[arg-type]
    return result


# A bucket as the reducer lays it out: a 12 x 10 weight, its bias, a 3 x 2 weight (too small to
# gain from rank 2: 2 * (3 + 2) >= 6), then one replica count per tensor.
LAYOUT = [(0, torch.Size([12, 10])), (120, torch.Size([12])), (132, torch.Size([3, 2]))]
NUMEL = 138 + 3


def test_only_matrices_that_gain_go_as_factors() -> None:
    plan = PowerSGDBucket(mirrored.PowerSGD(rank=2), LAYOUT, NUMEL, seed=0)
    assert [(m.offset, m.rows, m.cols, m.rank) for m in plan.matrices] == [(0, 12, 10, 2)]
    assert plan.whole == [(120, NUMEL)]  # the bias, the small weight and the counts, whole
    assert not PowerSGDBucket(mirrored.PowerSGD(rank=5), LAYOUT[1:], NUMEL, seed=0).compressed


def test_whole_tensors_pass_unchanged_and_a_low_rank_gradient_is_found_exactly() -> None:
    generator = torch.Generator().manual_seed(0)
    bucket = torch.randn(NUMEL, generator=generator)
    low_rank = torch.randn(12, 2, generator=generator) @ torch.randn(2, 10, generator=generator)
    bucket[:120] = low_rank.reshape(-1)
    plan = PowerSGDBucket(mirrored.PowerSGD(rank=2), LAYOUT, NUMEL, seed=0)
    result = _sum(bucket, plan)
    assert torch.equal(result[120:], bucket[120:])
    # A rank-2 gradient lies in the span P = M Q: its projection is itself.
    torch.testing.assert_close(result[:120].view(12, 10), low_rank)
    assert plan.matrices[0].error is not None
    assert plan.matrices[0].error.abs().max() < 1e-5


def test_what_is_not_sent_is_kept_and_sent_later() -> None:
    generator = torch.Generator().manual_seed(1)
    bucket = torch.randn(NUMEL, generator=generator)  # a full-rank 12 x 10 gradient
    plan = PowerSGDBucket(mirrored.PowerSGD(rank=1), LAYOUT, NUMEL, seed=0)
    sent = torch.zeros(12, 10)
    first = _sum(bucket, plan)[:120].view(12, 10)
    assert not torch.allclose(first, bucket[:120].view(12, 10), atol=1e-3)  # compressed
    sent += first
    gradient = bucket[:120].view(12, 10)
    for step in range(2, 201):
        sent += _sum(bucket, plan)[:120].view(12, 10)
        # Error feedback: after any number of steps, what was applied plus what is kept is
        # every gradient in full.
        error = plan.matrices[0].error
        assert error is not None
        torch.testing.assert_close(sent + error, step * gradient, rtol=1e-4, atol=1e-3)
    # The part kept back stays bounded (about 5x one gradient here, where sending nothing
    # would keep 200x), so the applied mean approaches the gradient.
    assert error.norm() < 10 * gradient.norm()
    assert (sent / 200 - gradient).norm() < 0.05 * gradient.norm()


def test_the_first_q_is_the_same_on_every_worker() -> None:
    plans = [PowerSGDBucket(mirrored.PowerSGD(rank=2), LAYOUT, NUMEL, seed=3) for _ in range(2)]
    q = [p.first_q(p.matrices[0], torch.device("cpu"), torch.float32) for p in plans]
    assert torch.equal(q[0], q[1])


@pytest.mark.parametrize("rank", [0, -1, 1.5, True])
def test_a_rank_below_one_is_refused(rank: object) -> None:
    with pytest.raises(ValueError, match=r"PowerSGD\(rank=.*expected a whole number >= 1"):
        mirrored.PowerSGD(rank=rank)  # type: ignore[arg-type]
