"""Train MobileNetV2 from scratch on an image folder with ``mirrored.Model.fit``.

The users' fourth program (MISSION.md): MobileNetV2 without pretrained weights, a 2-class head,
64 images per replica (global batch = 64 x replicas), Adam 1e-3, 5 epochs, under a
MirroredStrategy over all local GPUs, or over N logical CPU devices when there is none.

``--data DIR`` takes one sub-folder of jpg/png images per class (cats-vs-dogs' ``PetImages/``
with ``Cat/`` and ``Dog/``), split 80/10/10 into train/val/test per class, resized to 224x224.
Without it the task is to tell which of scikit-learn's two bundled photos (``china.jpg``,
``flower.jpg``) a random crop comes from: 2048 train crops from the left 60% of each photo,
512 validation crops from the next 20% and 512 test crops from the right 20%, so the test
regions were never seen in training; at 64x64 it trains in about a minute on 2 CPU cores.
The network is torchvision's ``mobilenet_v2`` when torchvision is installed, else the same
architecture defined below (torchvision's parameter names, so their state dicts interchange).

    python examples/mobilenet.py                          # the bundled photos, 2 CPU devices
    python examples/mobilenet.py --data PetImages --devices 4 --image-size 160
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from mirrored.examples.command_line import example_parser
from mirrored.examples.devices import add_device_arguments, strategy_from_arguments
from PIL import Image, ImageOps
from sklearn.datasets import load_sample_images
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import mirrored

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp"}
# The per-channel statistics of ImageNet that torchvision's models are normalised with.
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
# The bundled photos' regions (fractions of their width) that train, val and test crops come from.
PHOTO_REGIONS = {"train": (0.0, 0.6), "val": (0.6, 0.8), "test": (0.8, 1.0)}
PHOTO_CROP_SIDE = (0.2, 0.3)  # crop side as a fraction of the photo's height (427 px)
SPLIT_FRACTIONS = (0.8, 0.1, 0.1)  # train, val, test of a --data folder


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = example_parser(__doc__)
    parser.add_argument(
        "--data",
        type=Path,
        help="folder with one sub-folder of images per class (default: crops of "
        "scikit-learn's two sample photos)",
    )
    parser.add_argument(
        "--image-size", type=int, help="image side in pixels (default: 224 with --data, else 64)"
    )
    add_device_arguments(parser, default_logical=2, all_gpus_by_default=True)
    parser.add_argument("--batch-size-per-replica", type=int, default=64, help="per replica")
    parser.add_argument("--epochs", type=int, default=5, help="passes over the training set")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument(
        "--width-multiplier", type=float, default=1.0, help="MobileNetV2's channel multiplier"
    )
    parser.add_argument(
        "--bn-momentum",
        type=float,
        default=0.5,
        help="BatchNorm's running-statistics momentum (torchvision's: 0.1; see build_model)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the data, split and init")
    parser.add_argument(
        "--max-images",
        type=int,
        help="at most this many images in all (default: the whole folder, or 3072 crops)",
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="processes decoding --data images (0: inline)"
    )
    parser.add_argument(
        "--verbose",
        type=int,
        choices=(0, 1, 2),
        help="fit's Keras verbosity: 1 a progress bar, 2 a line per epoch (default: 1 on a tty)",
    )
    parser.add_argument(
        "--sync-batch-norm",
        action="store_true",
        help="normalise with the whole global batch's statistics instead of each replica's",
    )
    args = parser.parse_args(argv)
    positive = ("image_size", "batch_size_per_replica", "epochs", "max_images")
    for name in positive:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} {value}: expected a positive integer")
    if args.width_multiplier <= 0:
        parser.error(f"--width-multiplier {args.width_multiplier}: expected a positive number")
    if not 0 < args.bn_momentum <= 1:
        parser.error(f"--bn-momentum {args.bn_momentum}: expected a number in (0, 1]")
    if args.workers < 0:
        parser.error(f"--workers {args.workers}: expected 0 or more")
    if args.image_size is None:
        args.image_size = 224 if args.data is not None else 64
    return args


# -- the network -----------------------------------------------------------------------------------
def make_divisible(value: float, divisor: int = 8) -> int:
    """Round a channel count to a multiple of ``divisor``, losing at most 10% (torchvision's)."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def conv_bn_relu6(
    in_channels: int, out_channels: int, kernel_size: int = 3, stride: int = 1, groups: int = 1
) -> nn.Sequential:
    padding = (kernel_size - 1) // 2
    return nn.Sequential(
        nn.Conv2d(
            in_channels, out_channels, kernel_size, stride, padding, groups=groups, bias=False
        ),
        nn.BatchNorm2d(out_channels),
        nn.ReLU6(inplace=True),
    )


class InvertedResidual(nn.Module):
    """Expand (1x1), filter (3x3 depthwise), project (1x1, linear); a skip when shapes allow."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = round(in_channels * expansion)
        self.use_skip = stride == 1 and in_channels == out_channels
        expand = [conv_bn_relu6(in_channels, hidden, 1)] if expansion != 1 else []
        self.conv = nn.Sequential(
            *expand,
            conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),
            nn.Conv2d(hidden, out_channels, 1, bias=False),
            nn.BatchNorm2d(out_channels),
        )

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv(x) if self.use_skip else self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 (Sandler et al. 2018, arXiv:1801.04381) as torchvision builds it: the same
    layers, parameter names, initialisation and channel rounding."""

    # expansion t, output channels c, repeats n, first stride s (the paper's Table 2)
    SETTINGS = (
        (1, 16, 1, 1),
        (6, 24, 2, 2),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    )

    def __init__(
        self, num_classes: int = 1000, width_mult: float = 1.0, dropout: float = 0.2
    ) -> None:
        super().__init__()
        channels = make_divisible(32 * width_mult)
        last_channels = make_divisible(1280 * max(1.0, width_mult))
        layers: list[nn.Module] = [conv_bn_relu6(3, channels, stride=2)]
        for expansion, c, repeats, stride in self.SETTINGS:
            out_channels = make_divisible(c * width_mult)
            for i in range(repeats):
                layers.append(
                    InvertedResidual(channels, out_channels, stride if i == 0 else 1, expansion)
                )
                channels = out_channels
        layers.append(conv_bn_relu6(channels, last_channels, 1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(last_channels, num_classes))
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0, 0.01)
                nn.init.zeros_(module.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = F.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


def build_model(num_classes: int, width_multiplier: float, bn_momentum: float) -> nn.Module:
    """torchvision's MobileNetV2 when it is installed, else ours; randomly initialised.

    ``bn_momentum`` replaces BatchNorm's 0.1: its running statistics, which evaluation uses,
    average the last ~1/momentum steps, and Adam keeps moving the weights under them. With the
    bundled photos' 16 steps per epoch, 0.1 left validation accuracy at 0.50 (a constant output)
    for 4 epochs while training accuracy was 0.99; 0.5 gave 0.99 after the first epoch.
    """
    if importlib.util.find_spec("torchvision") is not None:
        from torchvision.models import mobilenet_v2

        net = mobilenet_v2(weights=None, num_classes=num_classes, width_mult=width_multiplier)
    else:
        net = MobileNetV2(num_classes, width_multiplier)
    for module in net.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.momentum = bn_momentum
    return net


# -- the data --------------------------------------------------------------------------------------
def normalize(images: Tensor) -> Tensor:
    """uint8 images (..., 3, H, W) -> float, standardised per channel."""
    return (images.float() / 255 - MEAN) / STD


def random_box(
    width: int, height: int, region: tuple[float, float], generator: np.random.Generator
) -> tuple[int, int, int, int]:
    """A random square (left, top, right, bottom) inside the columns ``region`` (fractions of
    ``width``) of a ``width`` x ``height`` photo, its side 20-30% of the height."""
    left, right = round(region[0] * width), round(region[1] * width)
    side = min(int(generator.uniform(*PHOTO_CROP_SIDE) * height), right - left)
    x = int(generator.integers(left, right - side + 1))
    y = int(generator.integers(0, height - side + 1))
    return x, y, x + side, y + side


def photo_crops(
    num_images: int, image_size: int, seed: int
) -> tuple[list[str], tuple[TensorDataset, TensorDataset, TensorDataset]]:
    """The class names and train/val/test crops (4:1:1) of scikit-learn's two sample photos.

    Each split's crops come from its own columns of the photos (PHOTO_REGIONS), are flipped half
    the time and resized to ``image_size``. The classes alternate, so they are balanced.
    """
    sample = load_sample_images()
    classes = [Path(name).stem for name in sample.filenames]  # china, flower
    photos = [Image.fromarray(image) for image in sample.images]
    generator = np.random.default_rng(seed)
    counts = {"train": num_images * 4 // 6, "val": num_images // 6}
    counts["test"] = num_images - counts["train"] - counts["val"]
    splits = []
    for split, region in PHOTO_REGIONS.items():
        labels = [i % len(photos) for i in range(counts[split])]
        crops = []
        for label in labels:
            photo = photos[label]
            box = random_box(photo.width, photo.height, region, generator)
            crop = photo.resize((image_size, image_size), box=box)
            if generator.random() < 0.5:
                crop = ImageOps.mirror(crop)
            crops.append(np.asarray(crop))
        images = torch.from_numpy(np.stack(crops)).permute(0, 3, 1, 2)
        splits.append(TensorDataset(normalize(images), torch.tensor(labels)))
    train, val, test = splits
    return classes, (train, val, test)


def stratified_split(
    labels: Sequence[int], seed: int, max_images: int | None = None
) -> tuple[list[int], list[int], list[int]]:
    """Indices of an 80/10/10 train/val/test split made per class (at least one val and one
    test image per class; every class needs 3 or more), of at most about ``max_images`` images
    drawn in the classes' proportions."""
    generator = np.random.default_rng(seed)
    label_array = np.asarray(labels)
    fraction = 1.0 if max_images is None else min(1.0, max_images / len(label_array))
    train: list[int] = []
    val: list[int] = []
    test: list[int] = []
    for label in np.unique(label_array):
        members = generator.permutation(np.flatnonzero(label_array == label))
        members = members[: max(3, math.floor(len(members) * fraction))]
        num_val = max(1, round(len(members) * SPLIT_FRACTIONS[1]))
        num_test = max(1, round(len(members) * SPLIT_FRACTIONS[2]))
        val += members[:num_val].tolist()
        test += members[num_val : num_val + num_test].tolist()
        train += members[num_val + num_test :].tolist()
    return train, val, test


class ImageFolder(Dataset[tuple[Tensor, int]]):
    """Images read from disk as they are needed (a folder may not fit in memory), resized and
    center-cropped to a square, flipped at random when ``flip``."""

    def __init__(
        self, paths: Sequence[Path], labels: Sequence[int], image_size: int, flip: bool = False
    ) -> None:
        self.paths, self.labels = list(paths), list(labels)
        self.image_size, self.flip = image_size, flip

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        with Image.open(self.paths[index]) as image:
            square = ImageOps.fit(image.convert("RGB"), (self.image_size, self.image_size))
        pixels = normalize(torch.from_numpy(np.array(square)).permute(2, 0, 1))
        if self.flip and torch.rand(()) < 0.5:
            pixels = pixels.flip(-1)
        return pixels, self.labels[index]


def scan_folder(root: Path) -> tuple[list[str], list[Path], list[int]]:
    """Class names (sorted sub-folders), image paths and labels; files PIL cannot open (the
    zero-byte and non-image files of cats-vs-dogs' PetImages) are skipped with a note."""
    if not root.is_dir():
        raise ValueError(f"--data {root}: not a folder; pass one with a sub-folder per class")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if len(classes) < 2:
        raise ValueError(
            f"--data {root}: found {len(classes)} class sub-folders {classes}; expected one "
            "sub-folder of images per class, two or more"
        )
    paths: list[Path] = []
    labels: list[int] = []
    skipped = 0
    for label, name in enumerate(classes):
        for path in sorted((root / name).rglob("*")):
            if path.suffix.lower() not in IMAGE_SUFFIXES:
                continue
            try:
                with Image.open(path):
                    pass
            except OSError:
                skipped += 1
                continue
            paths.append(path)
            labels.append(label)
    if skipped:
        print(f"skipped {skipped} files of {root} that are not readable images")
    return classes, paths, labels


def folder_datasets(
    root: Path, image_size: int, seed: int, max_images: int | None
) -> tuple[list[str], tuple[ImageFolder, ImageFolder, ImageFolder]]:
    """The class names and the train (randomly flipped), val and test images of ``root``."""
    classes, paths, labels = scan_folder(root)
    for label, name in enumerate(classes):
        if labels.count(label) < 3:
            raise ValueError(
                f"--data {root}: class folder {name!r} has {labels.count(label)} readable "
                f"images ({', '.join(sorted(IMAGE_SUFFIXES))}); a train/val/test split needs 3 "
                "or more per class"
            )
    train, val, test = stratified_split(labels, seed, max_images)

    def images(indices: list[int], flip: bool = False) -> ImageFolder:
        subset = [paths[i] for i in indices], [labels[i] for i in indices]
        return ImageFolder(*subset, image_size, flip)

    return classes, (images(train, flip=True), images(val), images(test))


# -- devices and training --------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Train, then evaluate on the test split; prints and returns its ``loss`` and ``accuracy``."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    datasets: tuple[TensorDataset, ...] | tuple[ImageFolder, ...]
    if args.data is None:
        classes, datasets = photo_crops(args.max_images or 3072, args.image_size, args.seed)
        workers = 0  # already in memory
    else:
        classes, datasets = folder_datasets(args.data, args.image_size, args.seed, args.max_images)
        workers = args.workers
    train_set, val_set, test_set = datasets

    with strategy_from_arguments(args) as strategy:
        global_batch_size = args.batch_size_per_replica * strategy.num_replicas_in_sync
        loaders = [
            DataLoader(
                dataset,
                batch_size=global_batch_size,
                shuffle=dataset is train_set,
                num_workers=workers,
                persistent_workers=workers > 0,
                generator=torch.Generator().manual_seed(args.seed),
            )
            for dataset in datasets
        ]
        with strategy.scope():
            net = build_model(len(classes), args.width_multiplier, args.bn_momentum)
            model = mirrored.Model(net)
            model.compile(
                optimizer=mirrored.optimizers.Adam(learning_rate=args.lr),
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
                sync_batch_norm=args.sync_batch_norm,
            )
        source = "torchvision" if type(net).__module__.startswith("torchvision") else "ours"
        print(strategy)
        print(
            f"MobileNetV2 ({source}, width {args.width_multiplier}): "
            f"{sum(p.numel() for p in net.parameters()):,} parameters; classes {classes}"
        )
        print(
            f"{len(train_set)} train / {len(val_set)} val / {len(test_set)} test images of "
            f"{args.image_size}x{args.image_size}; global batch {global_batch_size} = "
            f"{args.batch_size_per_replica} x {strategy.num_replicas_in_sync} replicas"
        )
        verbose = "auto" if args.verbose is None else args.verbose
        start = time.perf_counter()
        model.fit(loaders[0], epochs=args.epochs, validation_data=loaders[1], verbose=verbose)
        print(f"trained in {time.perf_counter() - start:.1f} s")
        results = model.evaluate(loaders[2], verbose=0, return_dict=True)
    print(" - ".join(f"test {name}: {value:.4f}" for name, value in results.items()))
    return results


if __name__ == "__main__":
    main()
