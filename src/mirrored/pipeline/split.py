"""Cutting a model into pipeline stages, placing them, and checking that the stages chain.

Where to cut is a plan computed from the layers alone (no devices): contiguous runs of layers
whose largest cost is as small as possible, cost being a layer's parameter count or its measured
forward + backward time (``balance_by_time``). Whether the stages chain is checked on the meta
device, with the real input shapes, before any compute; a parameter shared by stages on two
devices is refused when the stages are placed.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mirrored.config import LogicalDevice
from mirrored.core.values import flatten, map_structure
from mirrored.replication.mirrored_module import MirroredModule

__all__ = [
    "StageShapeError",
    "balance_by_time",
    "balanced_split_points",
    "check_stages_chain",
    "meta_copy",
    "parameter_costs",
    "place_stages",
    "plan_stages",
    "split_sequential",
]


class StageShapeError(ValueError):
    """A stage cannot take the output of the stage before it (or the model's input)."""


def parameter_costs(layers: Sequence[nn.Module]) -> list[float]:
    """Each layer's number of parameter elements."""
    return [float(sum(p.numel() for p in layer.parameters())) for layer in layers]


def balanced_split_points(costs: Sequence[float], num_stages: int) -> list[int]:
    """Where stages 2..``num_stages`` begin: the contiguous split of ``costs`` into
    ``num_stages`` non-empty runs whose largest sum is smallest.

    Among splits with the same largest stage, the next largest is made smallest, and so on (a
    784-512-256-10 MLP on three stages gets a Linear each, not one stage holding the last two);
    remaining ties cut later, so that a layer without cost (an activation) stays with the layer
    before it.
    """
    num_layers = len(costs)
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages}: expected at least 1")
    if num_layers < num_stages:
        raise ValueError(
            f"the model has {num_layers} layer(s), fewer than the {num_stages} stages; use fewer "
            "stages (devices per pipeline) or a model with more layers in its nn.Sequential"
        )
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    # best[s][i]: the stage costs of the first i layers in s stages, largest first, smallest in
    # that order (adding the same stage to two such lists keeps their order: the DP is exact).
    best: list[list[tuple[float, ...] | None]] = [
        [None] * (num_layers + 1) for _ in range(num_stages + 1)
    ]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = ()
    for s in range(1, num_stages + 1):
        for i in range(s, num_layers - (num_stages - s) + 1):
            for j in range(s - 1, i):
                before = best[s - 1][j]
                if before is None:  # j layers cannot make s - 1 stages
                    continue
                value = tuple(sorted((*before, prefix[i] - prefix[j]), reverse=True))
                current = best[s][i]
                if current is None or value <= current:
                    best[s][i], cut[s][i] = value, j
    points: list[int] = []
    i = num_layers
    for s in range(num_stages, 1, -1):
        i = cut[s][i]
        points.append(i)
    return sorted(points)


def split_sequential(module: nn.Sequential, points: Sequence[int]) -> list[nn.Sequential]:
    """The stages of ``module`` cut before each index of ``points`` (its layers, not copies)."""
    layers = list(module)
    bounds = [0, *points, len(layers)]
    if any(b <= a for a, b in itertools.pairwise(bounds)) or bounds[-2] >= len(layers):
        raise ValueError(
            f"split points {list(points)}: expected increasing indices in 1..{len(layers) - 1} "
            f"(the model has {len(layers)} layers), each stage at least one layer"
        )
    return [nn.Sequential(*layers[a:b]) for a, b in itertools.pairwise(bounds)]


def balance_by_time(
    module: nn.Sequential, sample_input: Any, num_stages: int, repeats: int = 3
) -> list[int]:
    """Split points that balance the stages' measured time: each layer runs forward and
    backward on ``sample_input`` (one micro-batch, a tensor or a tuple of positional inputs)
    ``repeats`` times on the module's current device; the fastest run counts. Pass the result
    as ``PipelineStrategy(split=...)``."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module={type(module).__name__}: expected an nn.Sequential")
    costs: list[float] = []
    value = sample_input
    for layer in module:
        best = float("inf")
        output: Any = None
        for _ in range(max(1, repeats)):
            inputs = map_structure(_fresh_leaf, value)
            start = time.perf_counter()
            output = layer(*inputs) if isinstance(inputs, tuple) else layer(inputs)
            outputs = [t for t in flatten(output) if isinstance(t, torch.Tensor) and t.grad_fn]
            if outputs:
                torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
            best = min(best, time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        costs.append(best)
        value = map_structure(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, output)
    return balanced_split_points(costs, num_stages)


def _fresh_leaf(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().requires_grad_()
    return value


def _describe(value: Any) -> str:
    shapes = [
        f"{tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
        for v in flatten(value)
        if isinstance(v, torch.Tensor)
    ]
    return ", ".join(shapes) or repr(value)


def meta_copy(stage: nn.Module) -> nn.Module:
    """A copy of ``stage`` whose parameters and buffers live on the meta device (no memory)."""
    memo: dict[int, Any] = {}
    for p in stage.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in stage.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(stage, memo)


def check_stages_chain(
    meta_stages: Sequence[nn.Module],
    layer_ranges: Sequence[tuple[int, int]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Run ``meta_stages`` (from ``meta_copy``) on meta tensors shaped like the input; a
    ``StageShapeError`` names the first stage that cannot take its input. A stage the meta
    device cannot run (data-dependent ops), or that raises anything but torch's RuntimeError, ends
    the check: the real run reports it."""
    to_meta = lambda v: (  # noqa: E731
        torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v
    )
    value: Any = None
    for index, (stage, (first, last)) in enumerate(zip(meta_stages, layer_ranges, strict=True)):
        inputs = map_structure(to_meta, (args, kwargs) if index == 0 else value)
        try:
            with torch.no_grad():
                value = stage(*inputs[0], **inputs[1]) if index == 0 else stage(inputs)
        except RuntimeError as error:  # what torch raises for shapes that do not fit
            if "meta" in str(error).lower():
                return
            given = _describe((args, kwargs) if index == 0 else value)
            source = "the model's input" if index == 0 else f"stage {index - 1}'s output"
            raise StageShapeError(
                f"stage {index} (layers {first}..{last - 1}) cannot take {source} ({given}): "
                f"{error}. Check the split points or the layers' sizes"
            ) from error
        except Exception:  # NotImplementedError on meta, or the model's own checks: the run tells
            return


def plan_stages(
    module: nn.Module | Sequence[nn.Module],
    num_stages: int,
    num_pipelines: int,
    split: str | Sequence[int],
) -> tuple[nn.Sequential, list[int]]:
    """The model as one ``nn.Sequential`` and where its stages 2.. begin: a list of stage modules
    as given, an ``nn.Sequential`` at ``split`` ("parameters": balanced parameter counts)."""
    if isinstance(module, (list, tuple)):
        if len(module) != num_stages or not all(isinstance(m, nn.Module) for m in module):
            raise ValueError(
                f"got {len(module)} stage module(s) for {num_stages} stages "
                f"({num_stages * num_pipelines} devices / {num_pipelines} "
                "pipeline(s)); pass one nn.Module per stage"
            )
        return nn.Sequential(*module), list(range(1, num_stages))
    if isinstance(module, MirroredModule):
        raise TypeError("module is already mirrored; pass the original nn.Module")
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"module={type(module).__name__}: PipelineStrategy cuts an nn.Sequential (or a "
            "list of stage modules) into stages; express the model as nn.Sequential"
        )
    if isinstance(split, str):
        return module, balanced_split_points(parameter_costs(list(module)), num_stages)
    if len(split) != num_stages - 1:
        raise ValueError(f"split={split}: {num_stages} stages need {num_stages - 1} split point(s)")
    return module, list(split)


def place_stages(stages: Sequence[nn.Module], devices: Sequence[LogicalDevice]) -> None:
    """Move each stage to its device; a parameter shared by stages on different devices is an
    error (it would sit on one of them only)."""
    home: dict[int, tuple[int, torch.device]] = {}
    for s, (stage, device) in enumerate(zip(stages, devices, strict=True)):
        for param in stage.parameters():
            previous = home.setdefault(id(param), (s, device.torch_device))
            if previous[1] != device.torch_device:
                raise ValueError(
                    f"a parameter of shape {tuple(param.shape)} is shared by stages {previous[0]} "
                    f"and {s}, which sit on different devices ({previous[1]} and "
                    f"{device.torch_device}); put the layers that share it in one stage"
                )
        stage.to(device.torch_device)
