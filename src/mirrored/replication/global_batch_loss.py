"""Loss scaling for synchronous data parallelism, and the check that a replica's loss has it.

Each replica's loss must be its part of the mean over the *global* batch: the strategy sums the
replicas' gradients, so a loss averaged over one replica's shard (``F.cross_entropy(out, y)``, a
Hugging Face model's ``out.loss``) gives N times the single-device gradient, and mis-weighs
uneven shards. The helpers here scale a loss correctly and mark the result (in its autograd
node's ``metadata``); ``check_loss_scaling``, called by a strategy when a replica starts a
backward pass, refuses a loss that reduces its shard with a mean anywhere outside a helper (a
mean of parameters alone, a weight penalty, reads no shard), accepts a loss summed over its shard
(exact under the sum of gradients: the VAE's ``reduction="sum"``) and warns once about any other
loss that did not come through a helper (TensorFlow refuses losses with automatic reduction in a
strategy's custom loop for the same reason).
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from mirrored._torch_internals import caller_frame
from mirrored.core.context import ReplicaContext, current_replica_context
from mirrored.core.values import ReduceOp

__all__ = [
    "LossScalingWarning",
    "check_loss_scaling",
    "compute_average_loss",
    "compute_weighted_average_loss",
    "scale_regularization_loss",
    "scale_shard_mean",
]

_SCALED = "mirrored.scaled_loss"
# How many autograd nodes next to the loss the check looks at: a scaled loss is found within a
# few (a sum of terms, a loss scale); the check must stay cheap for every step.
_NODES_CHECKED = 64


class LossScalingWarning(UserWarning):
    """A replica's loss did not come through one of mirrored's scaling helpers."""


def compute_average_loss(
    per_example_loss: torch.Tensor,
    sample_weight: torch.Tensor | float | None = None,
    global_batch_size: int | None = None,
) -> torch.Tensor:
    """Sum of (weighted) per-example losses divided by the global batch size.

    The global batch size is, in order: the argument; the size of the distributed batch passed to
    ``strategy.run``; the sum of the replicas' example counts (one all-reduce). Outside a replica
    function it is this batch's size, which makes this the plain mean.
    """
    if not isinstance(per_example_loss, torch.Tensor) or per_example_loss.dim() == 0:
        raise ValueError(
            "per_example_loss must be a tensor with a batch dimension (one loss per example); "
            "compute it with reduction='none'"
        )
    loss = per_example_loss if sample_weight is None else per_example_loss * sample_weight
    total = loss.sum()
    if global_batch_size is None:
        replica = _distributed_replica()
        local = per_example_loss.shape[0]
        if replica is None:
            global_batch_size = local
        elif replica.global_batch_size is not None:
            global_batch_size = replica.global_batch_size
        else:
            global_batch_size = int(replica.all_reduce(ReduceOp.SUM, local))
    elif not isinstance(global_batch_size, int) or global_batch_size <= 0:
        raise ValueError(f"global_batch_size={global_batch_size!r}: expected a positive int")
    return _mark_scaled(total / max(global_batch_size, 1))


def compute_weighted_average_loss(
    per_element_loss: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum of ``per_element_loss * weights`` divided by the sum of the weights over the *global*
    batch (one all-reduce of this replica's sum): the mean over every valid token of the global
    batch, for token-level losses whose count of valid elements differs between shards.

    ``weights``: the same shape as the loss, or broadcastable to it (a bool mask of valid
    tokens, or float weights); None counts every element. A global batch with no weight at all
    gives 0. For a masked language model with labels of -100 where nothing is predicted:

    ```python
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    loss = mirrored.compute_weighted_average_loss(per_token, labels.flatten() != -100)
    ```
    """
    if not isinstance(per_element_loss, torch.Tensor):
        raise TypeError(
            f"per_element_loss is a {type(per_element_loss).__name__}: expected a tensor of "
            "unreduced losses (reduction='none')"
        )
    if weights is None:
        weights = torch.ones((), dtype=torch.int64, device=per_element_loss.device).expand(
            per_element_loss.shape
        )
    elif not isinstance(weights, torch.Tensor):
        raise TypeError(f"weights is a {type(weights).__name__}: expected a tensor or None")
    try:
        weights = weights.expand(per_element_loss.shape)
    except RuntimeError as error:
        raise ValueError(
            f"weights of shape {list(weights.shape)} do not broadcast to the loss's shape "
            f"{list(per_element_loss.shape)}; pass one weight per loss element"
        ) from error
    weights = weights.detach()
    total = (per_element_loss * weights.to(per_element_loss.dtype)).sum()
    return _mark_scaled(total / _global_sum(weights.sum()).to(total.dtype))


def scale_shard_mean(shard_mean: torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
    """A loss that is already a mean over ``count`` elements of this replica's shard (a model's
    own loss, such as a Hugging Face model's ``out.loss``) as this replica's part of the mean over
    the global batch: ``shard_mean * count / (the sum of the replicas' counts)``. Exact when
    ``count`` is the number of terms the model averaged (its valid labels, its examples)."""
    if not isinstance(shard_mean, torch.Tensor) or shard_mean.numel() != 1:
        raise ValueError(
            f"shard_mean must be a one-element loss tensor, got "
            f"{getattr(shard_mean, 'shape', type(shard_mean).__name__)}"
        )
    local = torch.as_tensor(count, device=shard_mean.device).detach()
    share = local.to(torch.float64) / _global_sum(local).to(torch.float64)
    if not bool(local > 0):
        # A mean of nothing is NaN, and so may be its gradient: this shard takes no part.
        return shard_mean.new_zeros(()).requires_grad_()
    return _mark_scaled(shard_mean.reshape(()) * share.to(shard_mean.dtype))


def scale_regularization_loss(regularization_loss: torch.Tensor) -> torch.Tensor:
    """A loss computed from the parameters alone (a weight penalty), which every replica computes
    in full, divided by the number of replicas so that their summed gradients count it once
    (TensorFlow's ``tf.nn.scale_regularization_loss``)."""
    replica = _distributed_replica()
    replicas = 1 if replica is None else replica.num_replicas_in_sync
    return _mark_scaled(regularization_loss / replicas)


def _distributed_replica() -> ReplicaContext | None:
    """This thread's replica context when it is one of several replicas, else None."""
    replica = current_replica_context()
    return replica if replica is not None and replica.num_replicas_in_sync > 1 else None


def _global_sum(local: torch.Tensor) -> torch.Tensor:
    """``local`` summed over the replicas (itself outside a strategy's replicas); a sum of 0
    counts as 1, so that a global batch with nothing in it gives a loss of 0, not NaN."""
    replica = _distributed_replica()
    total = local if replica is None else replica.all_reduce(ReduceOp.SUM, local)
    return torch.where(total == 0, torch.ones_like(total), total)


def _mark_scaled(loss: torch.Tensor) -> torch.Tensor:
    node: Any = loss.grad_fn
    if node is not None:
        node.metadata[_SCALED] = True
    return loss


def _reduction_of(node: object) -> str | None:
    """How an autograd node reduces its input: "mean", "sum", or None (not a reduction)."""
    name = type(node).__name__
    if name.startswith("MeanBackward"):
        return "mean"
    if name.startswith("SumBackward"):
        return "sum"
    reduction = getattr(node, "_saved_reduction", None)  # torch's loss functions: 1 mean, 2 sum
    return {1: "mean", 2: "sum"}.get(reduction) if isinstance(reduction, int) else None


def _how_reduced(root: torch.Tensor) -> str:
    """The name of the autograd node where some path from ``root`` that did not come through a
    scaling helper first reduces a batch with a mean (this shard's); else "scaled" when some path
    came through a helper; else "summed" when every path ends in a sum over the shard reached
    through ``_keeps_a_sum`` nodes only; else "unscaled". A mean of values computed from
    parameters alone (a weight penalty) reduces no batch."""
    queue: deque[tuple[object, bool]] = deque([(root.grad_fn, True)])
    seen: set[int] = set()
    scaled, explained = False, True
    while queue and len(seen) < _NODES_CHECKED:
        node, summable = queue.popleft()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.metadata.get(_SCALED):  # type: ignore[attr-defined]
            scaled = True  # what is below was scaled: the other terms are still to check
            continue
        reduction = _reduction_of(node)
        if reduction == "mean" and not _of_parameters_alone(node):
            return type(node).__name__
        if reduction == "sum":
            explained &= summable and not _of_parameters_alone(node)
        elif reduction is not None or not node.next_functions:  # type: ignore[attr-defined]
            explained = False  # a mean of parameters alone, or a leaf: no sum of the shard
        else:  # arithmetic on the loss: look further down
            keeps = summable and _keeps_a_sum(node)
            queue.extend((child, keeps) for child, _ in node.next_functions)  # type: ignore[attr-defined]
    if scaled:
        return "scaled"
    return "summed" if explained and not queue else "unscaled"


# Nodes through which a sum over the shard stays exact under the replicas' sum of gradients.
_SUM_PRESERVING = (
    "AddBackward",
    "SubBackward",
    "NegBackward",
    "MulBackward",
    "ToCopyBackward",
    "CloneBackward",
    "ViewBackward",
    "ReshapeAliasBackward",
    "SqueezeBackward",
)


def _keeps_a_sum(node: object) -> bool:
    """Whether a sum over the shard below ``node`` stays one: additions, negation, casts, and
    products with one constant that is negative or at least 1 (the VAE's ``-0.5 * sum``, a loss
    scale). A division, or a constant factor in (0, 1), may be a mean over the shard written by
    hand (``loss.sum() / len(x)``), so it keeps the warning."""
    name = type(node).__name__
    if not name.startswith(_SUM_PRESERVING):
        return False
    alpha = getattr(node, "_saved_alpha", 1)
    if isinstance(alpha, (int, float)) and 0 < alpha < 1:
        return False
    if not name.startswith("MulBackward"):
        return True
    children = [child for child, _ in node.next_functions]  # type: ignore[attr-defined]
    if len(children) != 2 or children.count(None) != 1:
        return False  # a product of two terms of the loss, or of two constants
    factor = getattr(node, "_saved_other" if children[1] is None else "_saved_self", None)
    if not isinstance(factor, torch.Tensor) or factor.numel() != 1:
        return False
    value = float(factor)
    return value < 0 or value >= 1


def _of_parameters_alone(node: object) -> bool:
    """Whether everything below autograd ``node`` is computed from tensors that require grad
    (parameters) and numbers: no input enters it, neither as an operand without grad (a
    ``None`` among its next functions) nor as a tensor it saved (indices, a mask, an input).
    Anything larger than the check's budget counts as reading an input."""
    queue: deque[object] = deque([node])
    seen: set[int] = set()
    while queue:
        current = queue.popleft()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if len(seen) > _NODES_CHECKED:
            return False
        children = [child for child, _ in current.next_functions]  # type: ignore[attr-defined]
        if any(child is None for child in children) or _saves_an_input(current):
            return False
        queue.extend(children)
    return True


def _saves_an_input(node: object) -> bool:
    """Whether ``node`` saved for backward a tensor that does not require grad."""
    for name in dir(node):
        if name.startswith("_saved_"):
            value = getattr(node, name)
            values = value if isinstance(value, (tuple, list)) else (value,)
            if any(isinstance(v, torch.Tensor) and not v.requires_grad for v in values):
                return True
    return False


_warned = False


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside mirrored and torch: the user's
    ``loss.backward()``."""
    level, frame = 2, caller_frame(2)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith(
        ("mirrored.", "torch")
    ):
        level, frame = level + 1, frame.f_back
    return level


def check_loss_scaling(roots: Sequence[torch.Tensor], replica: ReplicaContext) -> None:
    """Called as ``replica`` starts a backward pass from ``roots``: a ``ValueError`` for a loss
    averaged over this replica's shard, a ``LossScalingWarning`` (once a process) for a loss that
    did not come through a scaling helper. Only one-element roots are losses; nothing to check
    with one replica."""
    global _warned
    if replica.num_replicas_in_sync == 1:
        return
    for root in roots:
        if root.grad_fn is None or root.numel() != 1:
            continue
        how = _how_reduced(root)
        if how == "summed":
            continue  # a sum over the shard: the replicas' sum of gradients is the global one
        if how == "unscaled" and not _warned:
            _warned = True
            warnings.warn(
                "a replica's loss.backward() runs on a loss that did not come through "
                "mirrored.compute_average_loss (or compute_weighted_average_loss, "
                "scale_shard_mean, scale_regularization_loss): make sure it is divided by the "
                "global batch size, not the replica's. Silence this warning with "
                "warnings.filterwarnings('ignore', category=mirrored.LossScalingWarning)",
                LossScalingWarning,
                stacklevel=_caller_level(),
            )
        elif how not in ("scaled", "unscaled"):
            raise ValueError(
                f"loss.backward() on replica {replica.replica_id_in_sync_group} of "
                f"{replica.num_replicas_in_sync}: the loss is a mean over this replica's shard "
                f"({how}), and the strategy sums the replicas' gradients, so they would be "
                f"{replica.num_replicas_in_sync}x the single-device gradient. Compute per-example "
                "losses (reduction='none') and pass them to mirrored.compute_average_loss(); "
                "for token-level losses use mirrored.compute_weighted_average_loss(per_token, "
                "mask); for a model's own mean loss (a Hugging Face model's out.loss) use "
                "mirrored.scale_shard_mean(out.loss, count); for a weight penalty "
                "mirrored.scale_regularization_loss(penalty)"
            )
