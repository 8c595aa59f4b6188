"""examples/model_parallel.py: the article's split MLP learns, and its parameters are those of
the same training on one device, with the loop and with fit."""

from __future__ import annotations

from pathlib import Path
from types import MethodType

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mirrored.examples import model_parallel
from torch import nn

from mirrored import checkpoint, cli, config
from tests.exactness import assert_within_reordering, sharded_forward

EPOCHS, MAX_EXAMPLES, BATCH_SIZE = 4, 400, 32
SHORT_RUN = [
    *("--epochs", str(EPOCHS), "--max-examples", str(MAX_EXAMPLES)),
    *("--batch-size", str(BATCH_SIZE)),
]


def _train_on_one_device(num_shards: int = 1) -> dict[str, torch.Tensor]:
    """The plain loop on the example's model, data and batches (same seeds), on one device;
    with ``num_shards`` > 1 each batch's gradient is summed over that many micro-batches (the
    yardstick of the plain loop's own float32 rounding)."""
    torch.manual_seed(0)
    train_set, _ = model_parallel.load_data(None, seed=0, max_examples=MAX_EXAMPLES)
    loader = model_parallel.make_loader(train_set, BATCH_SIZE, num_replicas=4, seed=0)
    model = model_parallel.build_model()
    if num_shards > 1:
        model.forward = MethodType(sharded_forward(nn.Sequential.forward, num_shards), model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(EPOCHS):
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize(
    "flags", [["--schedule", "gpipe"], ["--schedule", "1f1b", "--recompute", "--fit"]]
)
def test_a_short_run_learns_and_equals_training_on_one_device(
    fresh_config: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    # No split yet, as in a new process: the example carves the CPU into three devices itself.
    results = model_parallel.main([*SHORT_RUN, *flags, "--save", str(tmp_path / "mlp.pt")])
    out = capsys.readouterr().out
    assert "stages=[['cpu:0', 'cpu:1', 'cpu:2']]" in out
    assert len(config.list_logical_devices("CPU")) == 3
    assert results["accuracy"] > 0.7  # ten classes: chance is 0.1
    assert out.strip().splitlines()[-1] == (
        f"test loss: {results['loss']:.4f} - test accuracy: {results['accuracy']:.4f}"
    )
    expected = _train_on_one_device()
    trained = checkpoint.load(tmp_path / "mlp.pt")
    assert list(trained) == list(expected)  # the plain model's keys
    assert_within_reordering(expected, trained, _train_on_one_device(num_shards=4))


def test_digits_are_made_mnist_shaped() -> None:
    scans = np.random.default_rng(0).random((5, 64), dtype=np.float32)
    images = model_parallel.digits_as_mnist(scans).reshape(5, 28, 28)
    assert images.dtype == np.float32 and images.min() >= 0.0 and images.max() <= 1.0
    assert not images[:, :4].any() and not images[:, 24:].any()  # MNIST's 4-pixel border
    assert not images[:, :, :4].any() and not images[:, :, 24:].any()
    assert images[:, 4:24, 4:24].all()


def test_a_ragged_last_batch_smaller_than_the_micro_batches_is_dropped() -> None:
    train_set, _ = model_parallel.load_data(None, seed=0, max_examples=66)
    dropped = model_parallel.make_loader(train_set, 32, num_replicas=4)
    kept = model_parallel.make_loader(train_set, 32, num_replicas=2)
    assert model_parallel.num_examples(dropped) == 64 == sum(len(x) for x, _ in dropped)
    assert model_parallel.num_examples(kept) == 66 == sum(len(x) for x, _ in kept)


def test_more_stages_than_the_models_three_layers_is_a_clear_error() -> None:
    # The session's four logical CPU devices, one stage each: one more than the article's layers.
    with pytest.raises(ValueError, match=r"3 layer\(s\), fewer than the 4 stages"):
        model_parallel.main(["--logical-devices", "4", *SHORT_RUN])


def test_more_micro_batches_than_examples_per_batch_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        model_parallel.main(["--batch-size", "6", "--microbatches", "4", "--pipelines", "2"])
    assert exit_info.value.code == 2
    assert (
        "--batch-size 6 is smaller than --microbatches 4 x --pipelines 2" in capsys.readouterr().err
    )


def test_runs_through_the_mirrored_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert "model_parallel" in cli.EXAMPLES
    assert cli.main(["train", "model_parallel", "--epochs", "1", "--max-examples", "64"]) == 0
    assert "test accuracy" in capsys.readouterr().out
