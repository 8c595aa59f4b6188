"""Grounded tolerances for "N replicas give the plain loop's result" tests.

A fixed float32 tolerance after several steps of training is luck: the gap between an exact
N-replica run and the plain loop is the float32 rounding of summing the global batch in N
shards instead of one, which training then amplifies, and its size depends on the CPU's kernels
and on N (1.2e-5 on one Intel Xeon at 3 replicas where an AMD EPYC gives 7e-8). Two yardsticks
mean the same thing on every CPU:

- **float64** (``float64_tolerance``): the same reordering moves the result by about 1e-15 per
  step; the tolerance, 1e-9 relative, is over a million times that and still a hundred times
  below float32's resolution (1.2e-7), so an exact run passes anywhere while a wrong one (a lost
  1/N, a shard's gradient missing, a silent float32 cast) fails.
- **the plain loop's own rounding** (``assert_within_reordering``): the plain loop run again
  with each batch's gradient summed over the N shards the strategy would give the replicas
  (``sharded_forward``); the N-replica run must be as close to the plain one as that run is,
  times ``REORDERING_FACTOR``. This serves float32 programs nobody here wrote.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from mirrored.input.batch_split import shard_sizes

# float64: ~1e-15 of reordering noise per step, far below; float32's resolution (1.2e-7), far above.
FLOAT64_RTOL = 1e-9
FLOAT64_ATOL = 1e-12

# The yardstick's gap is the largest over all tensors, each relative to its own scale; the
# N-replica run's gaps must stay within ten times it. Measured on pytorch/examples' MNIST (AMD
# EPYC): the yardstick 1.1e-5, 1.8e-4 and 1.1e-5 at 2, 3 and 4 shards, the port 1.0e-6, 3.4e-7
# and 1.1e-5. This catches what is wrong in a whole program (a loss scaled by the shard, a
# gradient not summed, a learning rate off by 1%); the float64 tests, not this, catch a subtle
# error in one tensor.
REORDERING_FACTOR = 10.0

# Where the sharded plain run happens to round exactly like the plain one, a few float32 ulps of
# each tensor's scale still count as rounding.
_FLOAT32_ULPS = 8 * torch.finfo(torch.float32).eps


@pytest.fixture
def float64(request: pytest.FixtureRequest) -> Iterator[None]:
    """The test's tensors and modules in float64 (``torch.set_default_dtype``), restored after;
    a test marked ``float32`` (mixed precision, byte counts) keeps torch's default."""
    if request.node.get_closest_marker("float32") is not None:
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def float64_tolerance(*tensors: torch.Tensor) -> dict[str, float]:
    """``rtol``/``atol`` for an exactness comparison of float64 tensors; refuses other dtypes,
    whose rounding a fixed tolerance does not bound (use ``assert_within_reordering``)."""
    for tensor in tensors:
        if tensor.is_floating_point() and tensor.dtype != torch.float64:
            raise TypeError(
                f"an exactness check got a {tensor.dtype} tensor: run the test in float64 "
                "(the `float64` fixture) or compare against the plain loop's own rounding "
                "(tests.exactness.assert_within_reordering)"
            )
    return {"rtol": FLOAT64_RTOL, "atol": FLOAT64_ATOL}


def assert_close_float64(actual: Any, expected: Any, msg: str = "") -> None:
    """``actual`` is ``expected`` up to the reordering of float64 sums; Python floats (a loss's
    ``item()``) count as float64."""
    actual, expected = (
        value.cpu() if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float64)
        for value in (actual, expected)
    )
    tolerance = float64_tolerance(actual, expected)
    torch.testing.assert_close(actual, expected, msg=msg or None, **tolerance)


def _state(source: Any) -> dict[str, torch.Tensor]:
    """A module's (plain or mirrored) state dict, or a state dict, on the CPU."""
    state = source if isinstance(source, Mapping) else source.state_dict()
    return {name: value.detach().cpu() for name, value in state.items()}


def _relative_gaps(
    reference: Mapping[str, torch.Tensor], other: Mapping[str, torch.Tensor]
) -> dict[str, float]:
    """Each floating tensor's largest difference, relative to the tensor's own scale."""
    gaps = {}
    for name, expected in reference.items():
        if not expected.is_floating_point() or expected.numel() == 0:
            continue
        scale = expected.abs().max().item() or 1.0
        gaps[name] = (other[name] - expected).abs().max().item() / scale
    return gaps


def assert_within_reordering(expected: Any, actual: Any, reordered: Any) -> None:
    """``actual`` (the N-replica run) is as close to ``expected`` (the plain loop) as
    ``reordered`` (the plain loop with each batch summed in the same N shards) is, times
    ``REORDERING_FACTOR``: relative to each tensor's scale, against the largest such gap of the
    reordered run over all tensors. Non-floating entries (counters) must be equal."""
    expected, actual, reordered = _state(expected), _state(actual), _state(reordered)
    assert list(actual) == list(expected), "the runs hold different entries"
    for name, value in expected.items():
        if not value.is_floating_point():
            assert torch.equal(actual[name], value), f"{name}: {actual[name]} != {value}"
    noise = max([*_relative_gaps(expected, reordered).values(), _FLOAT32_ULPS])
    bound = REORDERING_FACTOR * noise
    gaps = _relative_gaps(expected, actual)
    over = {name: gap for name, gap in gaps.items() if gap > bound}
    assert not over, (
        f"beyond the plain loop's own rounding ({noise:.2e} relative, x{REORDERING_FACTOR:g}): "
        + ", ".join(f"{name} {gap:.2e}" for name, gap in over.items())
    )


def assert_values_within_reordering(
    actual: Sequence[float], expected: Sequence[float], reordered: Sequence[float]
) -> None:
    """Numbers a run reports (its losses) are the plain loop's to within ``REORDERING_FACTOR``
    times the gap of the reordered plain run's, or a few float32 ulps of their scale."""
    noise = max(abs(r - e) for r, e in zip(reordered, expected, strict=True))
    scale = max(abs(e) for e in expected)
    bound = REORDERING_FACTOR * max(noise, _FLOAT32_ULPS * scale)
    assert list(actual) == pytest.approx(list(expected), abs=bound)


def reversed_examples(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A dict batch with its examples in reverse order: the same sums in another order, for a
    model whose loss is computed inside its forward (a Hugging Face model's own loss)."""
    return {key: value.flip(0) for key, value in batch.items()}


def sharded_forward(forward: Callable[..., torch.Tensor], num_shards: int) -> Callable[..., Any]:
    """``forward`` applied to each of ``num_shards`` shards of its input (dim 0, split as a
    strategy splits a batch) and the outputs concatenated: autograd then sums each parameter's
    gradient over the shards, in the plain loop, as the replicas' all-reduce does. The yardstick
    of ``assert_within_reordering``, set as a module class's ``forward``; not for modules whose
    forward mixes examples (batch norm in training mode)."""

    def forward_in_shards(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        shards = torch.split(x, shard_sizes(len(x), num_shards))
        return torch.cat([forward(module, shard) for shard in shards if len(shard)])

    return forward_in_shards
