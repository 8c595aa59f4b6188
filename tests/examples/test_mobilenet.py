"""examples/mobilenet.py: its network, its data, and a tiny run of it in this process."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from mirrored.examples import mobilenet
from mirrored.examples.devices import strategy_from_arguments
from PIL import Image

TINY = ["--image-size", "32", "--width-multiplier", "0.25", "--epochs", "1", "--devices", "2"]
TINY += ["--batch-size-per-replica", "8", "--verbose", "0"]


def test_our_mobilenet_v2_has_torchvisions_parameter_count():
    # torchvision's published figure for mobilenet_v2 (width 1.0, 1000 classes): 3,504,872.
    net = mobilenet.MobileNetV2()
    assert sum(p.numel() for p in net.parameters()) == 3_504_872
    assert len(net.features) == 19  # stem, 17 inverted residual blocks, last 1x1 conv


def test_our_mobilenet_v2_matches_torchvisions_state_dict():
    models = pytest.importorskip("torchvision.models")
    for width in (1.0, 0.35):
        ours = mobilenet.MobileNetV2(num_classes=2, width_mult=width).state_dict()
        theirs = models.mobilenet_v2(weights=None, num_classes=2, width_mult=width).state_dict()
        assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}


def test_width_multiplier_shrinks_the_network_and_keeps_the_output_shape():
    small = mobilenet.MobileNetV2(num_classes=2, width_mult=0.25)
    assert sum(p.numel() for p in small.parameters()) < 500_000
    assert small.eval()(torch.zeros(3, 3, 32, 32)).shape == (3, 2)


def test_photo_crops_are_balanced_and_come_from_disjoint_regions():
    classes, (train, val, test) = mobilenet.photo_crops(60, 16, seed=0)
    assert classes == ["china", "flower"]
    assert [len(s) for s in (train, val, test)] == [40, 10, 10]
    for split in (train, val, test):
        images, labels = split.tensors
        assert images.shape[1:] == (3, 16, 16) and images.dtype == torch.float32
        assert torch.bincount(labels).tolist() == [len(split) // 2] * 2
    again = mobilenet.photo_crops(60, 16, seed=0)[1][2].tensors[0]
    assert torch.equal(again, test.tensors[0]), "the crops must be deterministic by seed"
    assert not torch.equal(mobilenet.photo_crops(60, 16, seed=1)[1][2].tensors[0], again)

    regions = list(mobilenet.PHOTO_REGIONS.values())
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(regions))  # ordered, not overlapping
    generator = np.random.default_rng(0)
    for start, stop in regions:
        for _ in range(200):
            left, top, right, bottom = mobilenet.random_box(640, 427, (start, stop), generator)
            assert start * 640 <= left < right <= stop * 640 and 0 <= top < bottom <= 427
            assert right - left == bottom - top >= 0.2 * 427 - 1


def test_stratified_split_is_disjoint_balanced_and_deterministic():
    labels = [0] * 50 + [1] * 30 + [2] * 3
    train, val, test = mobilenet.stratified_split(labels, seed=0)
    assert sorted(train + val + test) == list(range(len(labels)))
    counts = [np.bincount(np.take(labels, s), minlength=3).tolist() for s in (train, val, test)]
    assert counts == [[40, 24, 1], [5, 3, 1], [5, 3, 1]]
    assert mobilenet.stratified_split(labels, seed=0) == (train, val, test)
    assert mobilenet.stratified_split(labels, seed=1) != (train, val, test)

    train, val, test = mobilenet.stratified_split(labels, seed=0, max_images=40)
    assert len(set(train) | set(val) | set(test)) == len(train + val + test) <= 43
    assert np.bincount(np.take(labels, train + val + test)).tolist() == [24, 14, 3]


def test_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as exit_info:
        mobilenet.main(["--help"])
    assert exit_info.value.code == 0
    assert "--width-multiplier" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--epochs", "0"], "--epochs 0: expected a positive integer"),
        (["--width-multiplier", "-1"], "--width-multiplier -1.0: expected a positive number"),
    ],
)
def test_bad_flags_are_rejected(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        mobilenet.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="picks GPUs when there are any")
def test_devices_reuse_the_sessions_logical_cpus():
    # tests/conftest.py split the CPU into four logical devices; the example uses the first N.
    def devices(*flags: str) -> list[str]:
        args = mobilenet.parse_args(list(flags))
        with strategy_from_arguments(args) as strategy:
            return [d.short_name for d in strategy.devices]

    assert devices() == ["cpu:0", "cpu:1"]
    assert devices("--devices", "3") == ["cpu:0", "cpu:1", "cpu:2"]
    with pytest.raises(ValueError, match=r"--logical-devices 8: .* already split into 4"):
        devices("--logical-devices", "8")


def test_a_tiny_run_on_the_bundled_photos(capsys):
    results = mobilenet.main([*TINY, "--max-images", "48"])
    assert set(results) == {"loss", "accuracy"}
    assert math.isfinite(results["loss"]) and 0 <= results["accuracy"] <= 1
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert (
        last_line == f"test loss: {results['loss']:.4f} - test accuracy: {results['accuracy']:.4f}"
    )


def _write_images(folder: Path, color: tuple[int, int, int], count: int) -> None:
    folder.mkdir(parents=True)
    generator = np.random.default_rng(sum(color))
    for i in range(count):
        noise = generator.integers(-30, 30, size=(20, 24, 3))
        pixels = np.clip(np.array(color) + noise, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.png")


def test_a_tiny_run_on_an_image_folder(tmp_path, capsys):
    _write_images(tmp_path / "cat", (200, 120, 60), 10)
    _write_images(tmp_path / "dog", (60, 90, 200), 10)
    (tmp_path / "dog" / "broken.jpg").write_bytes(b"")  # PetImages has such files
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    classes, (train, val, test) = mobilenet.folder_datasets(tmp_path, 32, seed=0, max_images=None)
    assert classes == ["cat", "dog"] and [len(s) for s in (train, val, test)] == [16, 2, 2]
    assert set(train.paths).isdisjoint(val.paths + test.paths)
    assert train[0][0].shape == (3, 32, 32)

    results = mobilenet.main([*TINY, "--data", str(tmp_path), "--workers", "0"])
    assert math.isfinite(results["loss"]) and 0 <= results["accuracy"] <= 1
    assert "skipped 1 files" in capsys.readouterr().out


def test_unusable_folders_are_rejected_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        mobilenet.folder_datasets(tmp_path / "missing", 32, seed=0, max_images=None)
    _write_images(tmp_path / "cat", (200, 120, 60), 5)
    with pytest.raises(ValueError, match="found 1 class sub-folders"):
        mobilenet.folder_datasets(tmp_path, 32, seed=0, max_images=None)
    _write_images(tmp_path / "dog", (60, 90, 200), 2)
    with pytest.raises(ValueError, match="'dog' has 2 readable images"):
        mobilenet.folder_datasets(tmp_path, 32, seed=0, max_images=None)
