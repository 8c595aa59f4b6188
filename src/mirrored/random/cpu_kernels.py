"""Dropout and attention dropout on the CPU with the mask drawn from a replica's generator.

ATen's CPU dropout and attention take no ``generator=``: left to torch, they would draw from the
process-wide generator, which replicas can only share under a lock (one replica's swapped stream
at a time). These kernels draw the mask from the replica's own generator instead, so replicas
drop out at once; they compute what torch's CPU kernels compute, with a mask of their own
(:func:`cpu_dropout`), and :mod:`mirrored.random.routing` sends them only the arguments they
cover (:func:`math_attention_fits`, :func:`is_plain`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mirrored._torch_internals import is_functorch_wrapped, safe_softmax
from mirrored._torch_tracing import is_fake

__all__ = ["cpu_attention", "cpu_dropout", "is_plain", "math_attention_fits"]


def is_plain(tensor: Any) -> bool:
    """A dense tensor of torch's own type: not nested, sparse, a subclass, or a tensor that
    ``vmap`` or ``grad`` wrapped (their random ops follow rules of their own: torch's kernels).
    A fake tensor is plain: a traced step records the ops its real tensor would run."""
    return (
        (type(tensor) in (torch.Tensor, torch.nn.Parameter) or is_fake(tensor))
        and tensor.layout == torch.strided
        and not tensor.is_nested
        and not is_functorch_wrapped(tensor)
    )


def math_attention_fits(
    query: Any, key: Any, value: Any, attn_mask: Any, is_causal: bool, gqa: bool
) -> bool:
    """Whether :func:`cpu_attention` computes what torch's CPU attention would for these
    arguments; for any other (other devices or dtypes, arguments torch refuses, or the math
    backend turned off with ``torch.nn.attention.sdpa_kernel``) torch's own kernel runs, and
    raises its own errors."""
    if not torch.backends.cuda.math_sdp_enabled():  # ATen's flag for every device's math path
        return False
    tensors = (query, key, value)
    if not all(is_plain(t) and t.device.type == "cpu" and t.dim() >= 2 for t in tensors):
        return False
    if query.dtype not in (torch.float32, torch.float64) or {t.dtype for t in tensors} != {
        query.dtype
    }:
        return False
    if attn_mask is not None and (
        is_causal or not is_plain(attn_mask) or attn_mask.dtype not in (torch.bool, query.dtype)
    ):
        return False
    return not gqa or (key.dim() >= 3 and query.size(-3) % key.size(-3) == 0)


def cpu_dropout(
    input: torch.Tensor, p: float, feature: bool, in_place: bool, generator: torch.Generator
) -> torch.Tensor:
    """Dropout on the CPU with the mask drawn from ``generator``: each element (each channel for
    feature dropout) is kept when a uniform 32-bit integer falls below ``(1 - p) * 2**32``, and
    kept ones are scaled by ``2**32 / that``, so the mean is kept exactly and ``p`` is honoured
    to 2**-31. One 32-bit draw per element (serial mt19937) makes the mask faster than ATen's
    ``bernoulli_``; its ops are ones a trace records and TorchScript replays
    (:mod:`mirrored.tracing`), which ``random_`` over the full range and a view of int64 words
    as int32 pairs are not."""
    shape = (input.size(0), input.size(1)) + (1,) * (input.dim() - 2) if feature else input.shape
    # All int32 values but the largest: a range under 2**32 takes one 32-bit draw per element.
    uniform = torch.randint(
        -(2**31), 2**31 - 1, shape, generator=generator, dtype=torch.int32, device=input.device
    )
    keep = min(max(round((1 - p) * 2**32), 1), 2**32 - 1)
    noise = (uniform < keep - 2**31).to(input.dtype).mul_(2**32 / keep)
    return input.mul_(noise) if in_place else input * noise


def cpu_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    generator: torch.Generator,
) -> torch.Tensor:
    """The math path of ``scaled_dot_product_attention``, which ATen takes on the CPU whenever
    dropout is on, with the dropout mask drawn from ``generator``."""
    if enable_gqa:
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    # ATen scales query and key by the square root each, for numerical stability.
    root = math.sqrt(1 / math.sqrt(query.size(-1)) if scale is None else scale)
    scores = (query * root) @ (key.transpose(-2, -1) * root)
    if is_causal:
        length, source = query.size(-2), key.size(-2)
        causal = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, -math.inf)
        else:
            scores = scores + attn_mask
    # A row with every position masked out gives what ATen gives on this torch (safe_softmax).
    weights = safe_softmax(scores, -1)
    return cpu_dropout(weights, dropout_p, False, False, generator) @ value
