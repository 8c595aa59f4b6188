"""Train an MLP classifier with a custom training loop on N logical CPU devices.

In the spirit of the users' data-parallel programs (MISSION.md), as TensorFlow's MirroredStrategy
would run them: one physical CPU split into N logical devices, one copy of the model on each,
every global batch split across them, gradients summed before each synchronous update. The data
are scikit-learn's bundled handwritten digits (1797 8x8 images, no download) or any .npz with
arrays x and y.

    python examples/custom_training_loop.py --logical-devices 4 --epochs 10
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from mirrored.examples.command_line import example_parser
from mirrored.examples.devices import add_device_arguments, positive_int, strategy_from_arguments
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import mirrored

Batch = tuple[Tensor, Tensor]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = example_parser(__doc__)
    add_device_arguments(parser)
    parser.add_argument(
        "--epochs", type=positive_int, default=10, help="passes over the training set"
    )
    parser.add_argument("--batch-size", type=positive_int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seeds the split, init and shuffling")
    parser.add_argument(
        "--data",
        type=Path,
        help=".npz with x (N, features) and y (N,) (default: scikit-learn's 8x8 digits)",
    )
    return parser.parse_args(argv)


def load_data(path: Path | None, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """A stratified 80/20 train/test split, standardised with the training set's statistics only,
    so that nothing about the test set leaks into training."""
    if path is None:
        x, y = load_digits(return_X_y=True)
    else:
        with np.load(path) as arrays:
            x, y = arrays["x"], arrays["y"]
        if x.ndim != 2 or y.shape != (len(x),):
            raise ValueError(f"{path}: expected x (N, features), y (N,); got {x.shape}, {y.shape}")
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, stratify=y, random_state=seed
    )
    scaler = StandardScaler().fit(x_train)

    def dataset(x: np.ndarray, y: np.ndarray) -> TensorDataset:
        features = torch.as_tensor(scaler.transform(x), dtype=torch.float32)
        return TensorDataset(features, torch.as_tensor(y, dtype=torch.long))

    return dataset(x_train, y_train), dataset(x_test, y_test)


def train_step(
    model: mirrored.MirroredModule, optimizer: mirrored.MirroredOptimizer, batch: Batch
) -> tuple[Tensor, Tensor]:
    """One replica's part of a step; ``optimizer.step()`` sums the gradients of all replicas.

    The loss is divided by the *global* batch size, so the summed gradients are those of the mean
    loss over the whole batch. Returns the shard's summed loss and correct count, for the metrics.
    """
    x, y = batch
    logits = model(x)
    per_example_loss = F.cross_entropy(logits, y, reduction="none")
    mirrored.compute_average_loss(per_example_loss).backward()
    optimizer.step()
    optimizer.zero_grad()
    return per_example_loss.detach().sum(), (logits.argmax(-1) == y).sum()


@torch.no_grad()
def eval_step(model: mirrored.MirroredModule, batch: Batch) -> tuple[Tensor, Tensor]:
    """Forward only: the shard's summed loss and correct count."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits, y, reduction="sum"), (logits.argmax(-1) == y).sum()


def run_epoch(
    strategy: mirrored.Strategy,
    step: Callable[[Batch], tuple[Tensor, Tensor]],
    loader: DataLoader[tuple[Tensor, ...]],
) -> tuple[float, int]:
    """Summed loss and correct count over the epoch. Sums, not means, are reduced across replicas
    so that dividing by the number of examples is exact even with a ragged last batch."""
    loss_sum, correct = 0.0, 0
    for batch in strategy.experimental_distribute_dataset(loader):
        loss, hits = strategy.reduce("sum", strategy.run(step, args=(batch,)), axis=None)
        loss_sum += loss.item()
        correct += int(hits.item())
    return loss_sum, correct


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    train_set, test_set = load_data(args.data, args.seed)
    num_features = train_set.tensors[0].shape[1]
    num_classes = int(max(train_set.tensors[1].max(), test_set.tensors[1].max())) + 1
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=args.batch_size)

    # One replica per device: N logical devices carved out of the CPU (or GPU), or N GPUs.
    with strategy_from_arguments(args) as strategy:
        with strategy.scope():
            model = nn.Sequential(
                nn.Linear(num_features, 128),
                nn.ReLU(),
                nn.Linear(128, 64),
                nn.ReLU(),
                nn.Linear(64, num_classes),
            )
            optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        mirrored_model, mirrored_optimizer = strategy.mirror(model, optimizer)
        train = functools.partial(train_step, mirrored_model, mirrored_optimizer)
        evaluate = functools.partial(eval_step, mirrored_model)
        print(strategy)
        print(f"{len(train_set)} train / {len(test_set)} test examples, batch {args.batch_size}")

        for epoch in range(1, args.epochs + 1):
            start = time.perf_counter()
            train_loss, train_correct = run_epoch(strategy, train, train_loader)
            test_loss, test_correct = run_epoch(strategy, evaluate, test_loader)
            print(
                f"epoch {epoch:2d}/{args.epochs}  "
                f"train loss {train_loss / len(train_set):.4f} "
                f"acc {train_correct / len(train_set):.4f}  "
                f"test loss {test_loss / len(test_set):.4f} "
                f"acc {test_correct / len(test_set):.4f}  "
                f"{time.perf_counter() - start:.2f} s"
            )
    results = {"loss": test_loss / len(test_set), "accuracy": test_correct / len(test_set)}
    print(" - ".join(f"test {name}: {value:.4f}" for name, value in results.items()))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
