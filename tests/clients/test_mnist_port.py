"""pytorch/examples' MNIST program ported to MirroredStrategy: the port trains and reports what
the plain program does, and docs/migrating/from-pytorch.md's "Porting a PyTorch loop" shows the
port as it runs.

The data are scikit-learn's handwritten digits scaled up to MNIST's 28x28 and normalised with
MNIST's statistics (no torchvision, no download), 90 training examples in batches of 64 and a
ragged 26 (22/21/21 and 9/9/8 over three replicas), trained for two epochs.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import inspect
import io
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import mirrored
from tests.clients import mnist_port, mnist_upstream
from tests.exactness import REORDERING_FACTOR, assert_within_reordering, sharded_forward

PORTING_PAGE = Path(__file__).parents[2] / "docs" / "migrating" / "from-pytorch.md"
TRAIN_LINE = re.compile(r"Train Epoch: (\d+) \[(\d+)/(\d+) \((\d+)%\)\]\tLoss: (\d+\.\d+)")


def _digits(first: int, last: int) -> TensorDataset:
    x, y = load_digits(return_X_y=True)
    images = torch.tensor(x[first:last], dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    return TensorDataset((images - 0.1307) / 0.3081, torch.tensor(y[first:last]))


def _args(**devices: object) -> argparse.Namespace:
    """upstream's command-line defaults, but two epochs and a line for every batch."""
    return argparse.Namespace(
        batch_size=64,
        test_batch_size=1000,
        epochs=2,
        lr=1.0,
        gamma=0.7,
        no_cuda=True,
        no_mps=True,
        dry_run=False,
        seed=1,
        log_interval=1,
        save_model=False,
        **devices,
    )


@pytest.fixture(scope="module")
def without_dropout() -> Iterator[None]:
    """Net's two Dropout layers at p=0: replicas draw their own dropout masks, so only without
    dropout can the mirrored run be compared number for number with one device."""
    build = mnist_upstream.Net.__init__

    def build_without_dropout(net: mnist_upstream.Net) -> None:
        build(net)
        net.dropout1.p = net.dropout2.p = 0.0

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mnist_upstream.Net, "__init__", build_without_dropout)
        yield


@pytest.fixture(scope="module")
def datasets() -> tuple[TensorDataset, TensorDataset]:
    """90 training examples (batches of 64 and a ragged 26) and 100 test examples."""
    return _digits(200, 290), _digits(1000, 1100)


def _run_upstream(datasets, num_shards: int = 1) -> tuple[nn.Module, list[str]]:
    """upstream's program: its trained model and the lines it printed; with ``num_shards`` > 1
    its Net sums each batch's gradient over the shards the replicas would get (the yardstick of
    the plain program's own float32 rounding)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.MonkeyPatch.context() as patch:
        if num_shards > 1:
            forward = sharded_forward(mnist_upstream.Net.forward, num_shards)
            patch.setattr(mnist_upstream.Net, "forward", forward)
        model = mnist_upstream.main(_args(), *datasets)
    return model, printed.getvalue().splitlines()


@pytest.fixture(scope="module")
def plain_run(without_dropout, datasets) -> tuple[nn.Module, list[str]]:
    return _run_upstream(datasets)


def _losses(lines: list[str]) -> list[float]:
    return [float(match[5]) for line in lines if (match := TRAIN_LINE.fullmatch(line))]


@pytest.mark.parametrize("num_devices", [2, 3, 4])
def test_port_trains_and_prints_what_the_plain_program_does(
    without_dropout, datasets, plain_run, num_devices, capsys
):
    """The port's parameters are as close to the plain program's as the plain program run with
    its batches summed in the same shards (its own float32 rounding on this CPU), and it prints
    the same lines; its losses are as close as the sharded run's, or equal when printed."""
    expected, plain_lines = plain_run
    reordered, reordered_lines = _run_upstream(datasets, num_devices)
    devices = [f"cpu:{i}" for i in range(num_devices)]
    model = mnist_port.main(_args(devices=devices), *datasets)
    port_lines = capsys.readouterr().out.splitlines()

    assert_within_reordering(expected, model, reordered)
    printed = 1e-6  # six decimals
    loss_noise = max(
        abs(a - b) for a, b in zip(_losses(reordered_lines), _losses(plain_lines), strict=True)
    )
    train_lines = 0
    for plain, port in zip(plain_lines, port_lines, strict=True):
        plain_match, port_match = TRAIN_LINE.fullmatch(plain), TRAIN_LINE.fullmatch(port)
        if plain_match is None:  # test()'s report, unchanged on the mirrored model
            assert port == plain
            continue
        train_lines += 1
        assert port_match is not None, port
        assert port_match.groups()[:4] == plain_match.groups()[:4]
        loss_bound = REORDERING_FACTOR * max(loss_noise, printed)
        assert float(port_match[5]) == pytest.approx(float(plain_match[5]), abs=loss_bound)
    assert train_lines == 2 * 2  # every batch of both epochs
    assert sum(line.startswith("Test set: ") for line in port_lines) == 2


def _changed_functions(module: object) -> list[str]:
    return [
        line
        for function in (module.train, module.main)  # type: ignore[attr-defined]
        for line in [*inspect.getsource(function).splitlines(keepends=True), "\n"]
    ][:-1]


def port_diff() -> str:
    """The unified diff of the functions the port changes, as the documentation quotes it."""
    return "".join(
        difflib.unified_diff(
            _changed_functions(mnist_upstream),
            _changed_functions(mnist_port),
            "main.py",
            "main.py",
        )
    )


def changed_lines_ignoring_whitespace() -> tuple[int, int]:
    """Lines removed and added, whitespace ignored (``diff -w``)."""

    def squeezed(module: object) -> list[str]:
        return ["".join(line.split()) for line in _changed_functions(module)]

    diff = list(difflib.ndiff(squeezed(mnist_upstream), squeezed(mnist_port)))
    return sum(d.startswith("- ") for d in diff), sum(d.startswith("+ ") for d in diff)


def _porting_section() -> str:
    text = PORTING_PAGE.read_text()
    start = text.index("## Porting a PyTorch loop")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_docs_quote_the_diff_the_test_runs() -> None:
    section = _porting_section()
    quoted = re.search(r"```diff\n(.*?)```", section, re.DOTALL)
    assert quoted is not None, "the porting section has no diff block"
    assert quoted[1] == port_diff()
    removed, added = changed_lines_ignoring_whitespace()
    assert f"{removed} lines removed and {added} added" in section


def test_the_unported_loss_is_refused_at_backward(datasets):
    """``F.nll_loss(output, target)`` left as it is averages over the replica's shard."""
    model = mnist_upstream.Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    loader = torch.utils.data.DataLoader(datasets[0], batch_size=64)
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        model, optimizer = strategy.mirror(model, optimizer)

        def step(data, target):
            F.nll_loss(model(data), target).backward()

        batch = next(iter(strategy.experimental_distribute_dataset(loader)))
        with pytest.raises(ValueError, match=r"mean over this replica's shard"):
            strategy.run(step, args=batch)
