"""The graph node a host call leaves in a trace: ``mirrored::host_call(key, tensors)``.

A trace records tensor ops only; a host call (an optimizer's ``step()``, ``zero_grad()``, the
gradients handed to autograd's accumulation) is a point of the step that acts on real state.
This op marks where it falls, which tensors it takes and what it returns, so that the replay
can cut the graph there and call the host function itself. It never runs: a replay calls the
host function directly, and while a trace records, only its fake form runs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mirrored.core.trace_recording import ResultSpec

__all__ = ["HOST_CALL", "fake_results", "forget_fake_results"]

_fake_results: dict[int, list[ResultSpec]] = {}


@torch.library.custom_op("mirrored::host_call", mutates_args=())
def _host_call(key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    raise RuntimeError(
        "mirrored::host_call ran outside a traced step's replay; it only marks a host call"
    )


@_host_call.register_fake
def _fake(key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [
        torch.empty(shape, dtype=dtype, device=device)
        for shape, dtype, device in _fake_results[key]
    ]


HOST_CALL = torch.ops.mirrored.host_call.default


def fake_results(key: int, results: list[ResultSpec]) -> None:
    """What the host call ``key`` returns while a trace records it."""
    _fake_results[key] = results


def forget_fake_results(keys: Iterable[int]) -> None:
    """A trace is recorded: its host calls' fake results are needed no more."""
    for key in keys:
        _fake_results.pop(key, None)
