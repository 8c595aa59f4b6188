"""The second article's model parallelism: its 784-512-256-10 MLP, one layer per device.

Written by hand, each layer is moved to its own device and ``forward`` carries the activations
from one to the next. Here the model is a plain ``nn.Sequential`` of the three stages, and a
``PipelineStrategy`` places them and passes activations and gradients between them:

    by hand                                        mirrored
    fc1 = nn.Linear(784, 512).to("cuda:0")         model = build_model()  # the three stages
    fc2 = nn.Linear(512, 256).to("cuda:1")         strategy = PipelineStrategy(three devices)
    fc3 = nn.Linear(256, 10).to("cuda:2")          model, opt = strategy.mirror(model, opt)
    h = relu(fc1(x.to("cuda:0")))                  for batch in distribute_dataset(loader):
    h = relu(fc2(h.to("cuda:1")))                      strategy.run(train_step, args=(batch,))
    loss = criterion(fc3(h.to("cuda:2")), y)       # train_step: custom_training_loop.py's

By hand, a batch visits the devices one after another, so two of the three wait at any moment.
Here every batch is cut into ``--microbatches`` micro-batches that follow each other through the
stages (GPipe, arXiv:1811.06965; ``--schedule 1f1b``: PipeDream-Flush, arXiv:2006.09503), so
the devices work at the same time; the micro-batches' gradients are summed before the one update,
so the parameters are those of the same training on one device. ``--fit`` trains the same model
with ``mirrored.Model.fit`` instead of the loop.

Data: ``--data`` reads MNIST as examples/mnist_mlp.py does. By default, scikit-learn's bundled
digits (1,797 real 8x8 scans, no download) made MNIST-shaped, so that the article's 784 inputs
see an image: MNIST's digits are size-normalised into a 20x20 box centred in a 28x28 field, so
each scan is upscaled (bilinear) to 20x20 and given a 4-pixel blank border. Zero-padding 64
pixels to 784 would run too, but 720 of the first layer's inputs would then be constant zeros.

    python examples/model_parallel.py                    # three logical CPU devices, GPipe
    python examples/model_parallel.py --schedule 1f1b --microbatches 8 --fit
    mirrored train model_parallel --devices 3 --data ~/data/mnist     # three GPUs
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from mirrored.examples.command_line import example_parser
from mirrored.examples.custom_training_loop import eval_step, run_epoch, train_step
from mirrored.examples.devices import add_device_arguments, devices_from_arguments, positive_int
from mirrored.examples.mnist_mlp import load_digits_split, load_mnist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mirrored
from mirrored import checkpoint

NUM_FEATURES = 28 * 28


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = example_parser(
        __doc__,
        epilog="The device flags give num_pipelines x stages devices, pipeline by pipeline.",
    )
    add_device_arguments(parser, default_logical=3)
    parser.add_argument(
        "--pipelines", type=positive_int, default=1, help="data-parallel copies of the pipeline"
    )
    parser.add_argument(
        "--microbatches", type=positive_int, default=4, help="micro-batches per pipeline and step"
    )
    parser.add_argument(
        "--schedule",
        choices=["gpipe", "1f1b"],
        default="gpipe",
        help="every forward then every backward (gpipe), or one forward one backward (1f1b)",
    )
    parser.add_argument(
        "--recompute", action="store_true", help="recompute activations at the backward"
    )
    parser.add_argument("--fit", action="store_true", help="train with mirrored.Model.fit")
    parser.add_argument(
        "--data",
        type=Path,
        help="MNIST folder (IDX files) or mnist.npz (default: scikit-learn's 8x8 digits, "
        "scaled to 28x28)",
    )
    parser.add_argument(
        "--epochs", type=positive_int, default=10, help="passes over the training set"
    )
    parser.add_argument("--batch-size", type=positive_int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument(
        "--max-examples", type=positive_int, help="use this many training examples (default: all)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the split, init and shuffling")
    parser.add_argument(
        "--save", type=Path, help="write the trained model's state_dict here (default: not saved)"
    )
    args = parser.parse_args(argv)
    num_replicas = args.microbatches * args.pipelines
    if args.batch_size < num_replicas:
        parser.error(
            f"--batch-size {args.batch_size} is smaller than --microbatches {args.microbatches} "
            f"x --pipelines {args.pipelines}: every micro-batch needs an example; pass "
            f"--batch-size {num_replicas} or more, or fewer micro-batches"
        )
    return args


def digits_as_mnist(x: np.ndarray) -> np.ndarray:
    """(N, 64) 8x8 scans in [0, 1] -> (N, 784): upscaled to 20x20 and centred in 28x28."""
    scans = torch.from_numpy(x).reshape(-1, 1, 8, 8)
    digits = F.interpolate(scans, size=(20, 20), mode="bilinear", align_corners=False)
    return F.pad(digits, (4, 4, 4, 4)).reshape(len(x), NUM_FEATURES).numpy()


def load_data(
    data: Path | None, seed: int, max_examples: int | None = None
) -> tuple[TensorDataset, TensorDataset]:
    """(train, test): MNIST from ``data``, else the MNIST-shaped digits."""
    if data is not None:
        (x, y), (x_test, y_test) = load_mnist(data)
    else:
        (x, y), (x_test, y_test) = load_digits_split(seed)
        x, x_test = digits_as_mnist(x), digits_as_mnist(x_test)
    if x.shape[1] != NUM_FEATURES:
        raise ValueError(
            f"--data {data}: images of {x.shape[1]} pixels; the article's model takes 28x28 = "
            f"{NUM_FEATURES}"
        )
    x, y = x[:max_examples], y[:max_examples]

    def dataset(x: np.ndarray, y: np.ndarray) -> TensorDataset:
        return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))

    return dataset(x, y), dataset(x_test, y_test)


def make_loader(
    dataset: TensorDataset, batch_size: int, num_replicas: int, seed: int | None = None
) -> DataLoader[tuple[torch.Tensor, ...]]:
    """Global batches, reshuffled every epoch from ``seed`` when given. A ragged last batch with
    fewer examples than the strategy's micro-batches is dropped, as the strategy refuses it."""
    drop_last = 0 < len(dataset) % batch_size < num_replicas
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset, batch_size, shuffle=seed is not None, drop_last=drop_last, generator=generator
    )


def num_examples(loader: DataLoader[tuple[torch.Tensor, ...]]) -> int:
    """How many examples one pass over ``loader`` yields."""
    assert loader.batch_size is not None
    if loader.drop_last:
        return len(loader) * loader.batch_size
    return len(loader.dataset)  # type: ignore[arg-type]


def build_model(num_classes: int = 10) -> nn.Sequential:
    """The article's MLP, one item per stage: on three devices a stage each; on fewer, the
    strategy groups neighbouring stages by parameter count."""
    return nn.Sequential(
        nn.Sequential(nn.Linear(NUM_FEATURES, 512), nn.ReLU()),
        nn.Sequential(nn.Linear(512, 256), nn.ReLU()),
        nn.Linear(256, num_classes),
    )


def train_with_loop(
    strategy: mirrored.PipelineStrategy,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_loader: DataLoader[tuple[torch.Tensor, ...]],
    test_loader: DataLoader[tuple[torch.Tensor, ...]],
    epochs: int,
) -> dict[str, float]:
    """The loop on ``strategy.run``: custom_training_loop.py's step, unchanged."""
    pipelined_model, pipelined_optimizer = strategy.mirror(model, optimizer)
    train = functools.partial(train_step, pipelined_model, pipelined_optimizer)
    seen = num_examples(train_loader)
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        loss, correct = run_epoch(strategy, train, train_loader)
        print(
            f"epoch {epoch:2d}/{epochs}  loss {loss / seen:.4f}  accuracy {correct / seen:.4f}  "
            f"{time.perf_counter() - start:.2f} s"
        )
    loss, correct = run_epoch(strategy, functools.partial(eval_step, pipelined_model), test_loader)
    return {
        "loss": loss / num_examples(test_loader),
        "accuracy": correct / num_examples(test_loader),
    }


def train_with_fit(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_loader: DataLoader[tuple[torch.Tensor, ...]],
    test_loader: DataLoader[tuple[torch.Tensor, ...]],
    epochs: int,
) -> dict[str, float]:
    """The same training with ``mirrored.Model`` (compiled inside the strategy's scope)."""
    keras_model = mirrored.Model(model)
    keras_model.compile(
        optimizer=optimizer,
        loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    keras_model.fit(train_loader, epochs=epochs, verbose=2)
    return keras_model.evaluate(test_loader, verbose=0, return_dict=True)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    train_set, test_set = load_data(args.data, args.seed, args.max_examples)
    num_replicas = args.microbatches * args.pipelines
    train_loader = make_loader(train_set, args.batch_size, num_replicas, args.seed)
    test_loader = make_loader(test_set, args.batch_size, num_replicas)

    strategy = mirrored.PipelineStrategy(
        devices_from_arguments(args),
        args.microbatches,
        args.schedule,
        num_pipelines=args.pipelines,
        recompute=args.recompute,
    )
    with strategy, strategy.scope():
        model = build_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
        print(strategy)
        print(
            f"{len(train_set)} train / {len(test_set)} test examples; global batch "
            f"{args.batch_size} = {num_replicas} micro-batches of about "
            f"{args.batch_size // num_replicas}"
        )
        if args.fit:
            results = train_with_fit(model, optimizer, train_loader, test_loader, args.epochs)
        else:
            results = train_with_loop(
                strategy, model, optimizer, train_loader, test_loader, args.epochs
            )
    if args.save is not None:
        checkpoint.save(model.state_dict(), args.save)  # the plain model's keys
    print(" - ".join(f"test {name}: {value:.4f}" for name, value in results.items()))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
