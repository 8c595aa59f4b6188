"""BatchNorm across replicas.

By default each replica normalises with its own shard's statistics (as TensorFlow does) and the
running statistics are averaged at each ``optimizer.step`` so that replicas stay identical.
With ``strategy.mirror(..., sync_batch_norm=True)`` every BatchNorm layer normalises with the
statistics of the whole global batch, which equals single-device BatchNorm on that batch:
the forward all-reduces the per-channel sums (two passes, for accuracy), and the backward
all-reduces the two per-channel sums the input gradient needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mirrored._torch_internals import BatchNormBase
from mirrored.core.context import ReplicaContext, current_replica_context
from mirrored.core.values import ReduceOp

if TYPE_CHECKING:
    from mirrored.core.replica_set import ReplicaSet

__all__ = ["MirroredSyncBatchNorm", "convert_sync_batch_norm", "running_stat_buffers"]


def _all_reduce_sum(replica: ReplicaContext, tensor: torch.Tensor) -> torch.Tensor:
    return replica.strategy.all_reduce_tensors(replica, ReduceOp.SUM, [tensor])[0]


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        factor: float,
        eps: float,
        replica: ReplicaContext,
    ) -> torch.Tensor:
        channels = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        shape = [1, channels] + [1] * (x.dim() - 2)
        local_count = x.numel() // channels
        totals = _all_reduce_sum(
            replica, torch.cat([x.sum(dims), x.new_tensor([float(local_count)])])
        )
        count = totals[-1]
        mean = totals[:-1] / count
        centered = x - mean.view(shape)
        var = _all_reduce_sum(replica, centered.square().sum(dims)) / count
        invstd = torch.rsqrt(var + eps)
        xhat = centered * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.view(shape)
        if bias is not None:
            y = y + bias.view(shape)
        if running_mean is not None and running_var is not None:
            n = float(count)
            unbiased = var * (n / max(n - 1.0, 1.0))
            running_mean.mul_(1 - factor).add_(mean, alpha=factor)
            running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
        ctx.save_for_backward(xhat, weight, invstd, count)
        ctx.replica = replica
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        xhat, weight, invstd, count = ctx.saved_tensors
        channels = xhat.shape[1]
        dims = [d for d in range(xhat.dim()) if d != 1]
        shape = [1, channels] + [1] * (xhat.dim() - 2)
        local_dy = dy.sum(dims)
        local_dy_xhat = (dy * xhat).sum(dims)
        sums = _all_reduce_sum(ctx.replica, torch.cat([local_dy, local_dy_xhat]))
        sum_dy, sum_dy_xhat = sums[:channels], sums[channels:]
        scale = invstd if weight is None else invstd * weight
        dx = dy - (sum_dy / count).view(shape) - xhat * (sum_dy_xhat / count).view(shape)
        dx = dx * scale.view(shape)
        # Parameter gradients are this replica's share; optimizer.step sums them across replicas.
        dweight = local_dy_xhat if weight is not None else None
        dbias = local_dy if ctx.has_bias else None
        return dx, dweight, dbias, None, None, None, None, None


class MirroredSyncBatchNorm(BatchNormBase):
    """BatchNorm over the whole global batch of a mirrored step; plain BatchNorm elsewhere."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, ...), got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        replica = current_replica_context()
        if not self.training or replica is None or replica.num_replicas_in_sync == 1:
            return super().forward(input)
        self._check_input_dim(input)
        factor = 0.0
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = (
                1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            )
        result: torch.Tensor = _SyncBatchNormFunction.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean,
            self.running_var,
            factor,
            self.eps,
            replica,
        )
        return result


def convert_sync_batch_norm(module: nn.Module, strategy: ReplicaSet) -> nn.Module:
    """Replace every BatchNorm layer of ``module`` by a MirroredSyncBatchNorm sharing its
    parameters and buffers (the root may be replaced, so use the return value)."""
    physical = [d.physical for d in strategy.devices]
    if any(d.device_type == "GPU" for d in strategy.devices) and len(set(physical)) < len(physical):
        raise ValueError(
            "sync_batch_norm=True needs CPU devices or one replica per physical GPU: the "
            "backward of logical devices of one GPU runs on one autograd thread, where a "
            "cross-replica reduction would deadlock"
        )
    if isinstance(module, BatchNormBase) and not isinstance(module, MirroredSyncBatchNorm):
        converted = MirroredSyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
        )
        converted.weight, converted.bias = module.weight, module.bias
        converted.running_mean, converted.running_var = module.running_mean, module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        return converted
    for name, child in module.named_children():
        replacement = convert_sync_batch_norm(child, strategy)
        if replacement is not child:
            setattr(module, name, replacement)
    return module


def running_stat_buffers(module: nn.Module) -> list[torch.Tensor]:
    """The running statistics that per-replica BatchNorm updates differently on each replica."""
    buffers: list[torch.Tensor] = []
    for layer in module.modules():
        if isinstance(layer, MirroredSyncBatchNorm) or not isinstance(layer, BatchNormBase):
            continue
        if layer.running_mean is not None and layer.running_var is not None:
            buffers += [layer.running_mean, layer.running_var]
    return buffers
