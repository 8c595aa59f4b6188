"""examples/mnist_mlp.py: the main job's program."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
from mirrored.examples import mnist_mlp


def test_default_run_beats_ninety_percent_on_the_held_out_digits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The main job's global batch of 32 (8 x 4 replicas) on 2 replicas: fit gives the same
    # parameters whatever the replica count.
    results = mnist_mlp.main(["--logical-devices", "2", "--batch-size-per-replica", "16"])
    assert results["accuracy"] > 0.9
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"test loss: {results['loss']:.4f} - test accuracy: {results['accuracy']:.4f}"


def _write_idx(path: Path, array: np.ndarray, compress: bool) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(n).to_bytes(4, "big") for n in array.shape
    )
    data = header + array.astype(np.uint8).tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


@pytest.mark.parametrize("compress", [False, True])
def test_reads_mnist_idx_files(tmp_path: Path, compress: bool) -> None:
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (40, 28, 28)), rng.integers(0, 10, 40)
    _write_idx(tmp_path / "train-images-idx3-ubyte", images, compress)
    _write_idx(tmp_path / "train-labels-idx1-ubyte", labels, compress)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", images[:10], compress)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", labels[:10], compress)
    (x, y), (x_test, y_test) = mnist_mlp.load_mnist(tmp_path)
    assert x.shape == (40, 784) and x.dtype == np.float32 and x.max() <= 1.0
    np.testing.assert_array_equal(y, labels)
    assert x_test.shape == (10, 784) and y_test.shape == (10,)
    results = mnist_mlp.main(
        ["--data", str(tmp_path), "--epochs", "1", "--logical-devices", "2", "--verbose", "0"]
    )
    assert set(results) == {"loss", "accuracy"}


def test_reads_keras_npz(tmp_path: Path) -> None:
    arrays = {
        "x_train": np.zeros((6, 28, 28), np.uint8),
        "y_train": np.arange(6),
        "x_test": np.zeros((2, 28, 28), np.uint8),
        "y_test": np.arange(2),
    }
    np.savez(tmp_path / "mnist.npz", **arrays)
    (x, y), _ = mnist_mlp.load_mnist(tmp_path / "mnist.npz")
    assert x.shape == (6, 784) and y.tolist() == list(range(6))


def test_bad_data_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="IDX"):
        mnist_mlp.load_mnist(tmp_path)
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"junk")
    with pytest.raises(ValueError, match="not an IDX file"):
        mnist_mlp._read_idx(tmp_path / "train-images-idx3-ubyte")


def test_help_exits_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        mnist_mlp.main(["--help"])
    assert exit_info.value.code == 0
    assert "--batch-size-per-replica" in capsys.readouterr().out
