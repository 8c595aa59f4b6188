"""``mirrored.losses``: Keras-named losses on PyTorch tensors, and the loss scaling helpers.

The scaling helpers (:mod:`mirrored.replication.global_batch_loss`) divide each replica's loss
by the *global* batch size, not its shard's, so that summing the replicas' gradients gives exactly
the gradient of the mean loss over the global batch, whatever the split.

The loss objects (:mod:`mirrored.losses.classes`: ``SparseCategoricalCrossentropy`` and friends)
compute what Keras's do, on PyTorch tensors. Their ``call`` gives one loss per element,
unreduced, which is what a replica needs: it weighs and sums its shard and the division is by
the global count. Called, they reduce as their ``reduction`` says (Keras 3's values;
``Reduction.NONE`` and friends for TensorFlow 2's spelling). Keras's function forms and ``get``
live in :mod:`mirrored.losses.functions`, the handling of ``y_true``, ``y_pred`` and
``sample_weight`` they share with the metrics in :mod:`mirrored.losses.shapes`; this module
gathers what users import.
"""

from __future__ import annotations

from mirrored.losses.classes import (
    BinaryCrossentropy,
    CategoricalCrossentropy,
    Loss,
    LossFunctionWrapper,
    MeanAbsoluteError,
    MeanSquaredError,
    Reduction,
    SparseCategoricalCrossentropy,
)
from mirrored.losses.classes import function_name as function_name
from mirrored.losses.functions import (
    binary_crossentropy,
    categorical_crossentropy,
    get,
    mae,
    mean_absolute_error,
    mean_squared_error,
    mse,
    sparse_categorical_crossentropy,
)
from mirrored.losses.shapes import broadcast_weight
from mirrored.replication.global_batch_loss import (
    compute_average_loss,
    compute_weighted_average_loss,
    scale_regularization_loss,
    scale_shard_mean,
)

__all__ = [
    "BinaryCrossentropy",
    "CategoricalCrossentropy",
    "Loss",
    "LossFunctionWrapper",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "Reduction",
    "SparseCategoricalCrossentropy",
    "binary_crossentropy",
    "broadcast_weight",
    "categorical_crossentropy",
    "compute_average_loss",
    "compute_weighted_average_loss",
    "get",
    "mae",
    "mean_absolute_error",
    "mean_squared_error",
    "mse",
    "scale_regularization_loss",
    "scale_shard_mean",
    "sparse_categorical_crossentropy",
]
