"""examples/ray_train.py on a local Ray cluster: MultiWorkerMirroredStrategy in Ray Train's
TorchTrainer, 2 CPU workers, against the plain loop in float64.

Ray forms the workers' process group before the training function runs; the strategy joins it,
and its checkpoints go through ``ray.train.report``. The example runs as users run it (its own
process starts and stops the local Ray cluster), twice with the same run name: the second run
resumes from Ray's last checkpoint of the first.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from mirrored import checkpoint
from tests.exactness import assert_close_float64
from tests.multiprocess.spawn import (
    REPO,
    Worker,
    assert_all_succeeded,
    program_env,
    start_process,
    wait_workers,
)

pytest.importorskip("ray.train", reason="Ray Train is a test-only extra: pip install -e '.[ray]'")
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow, pytest.mark.usefixtures("float64")]

EXAMPLE = str(REPO / "examples" / "ray_train.py")
SEED = 0
CHECKPOINT_LINE = re.compile(r"^checkpoint: (.+)$", re.MULTILINE)


def _run_example(storage: Path, epochs: int) -> tuple[Worker, dict[str, Any]]:
    """``python examples/ray_train.py`` in float64, run ``test`` kept in ``storage``; its output
    and the checkpoint Ray kept last."""
    flags = ["--float64", "--epochs", str(epochs), "--seed", str(SEED)]
    flags += ["--storage-path", str(storage), "--name", "test"]
    # Ray's session files (logs, sockets) in a folder of their own, removed after; a short path,
    # as the sockets' must fit in 107 bytes. A variable spawn's fork server does not have also
    # starts a fresh interpreter: the server cannot fork where Ray is installed (pandas imports
    # pyarrow, whose allocator starts a thread).
    with tempfile.TemporaryDirectory(prefix="ray-") as session:
        env = {**program_env(), "RAY_TMPDIR": session}
        (driver,) = wait_workers([start_process([sys.executable, EXAMPLE, *flags], env)], 240)
    assert_all_succeeded([driver])
    paths = CHECKPOINT_LINE.findall(driver.output)
    assert len(paths) == 1, driver.output
    return driver, checkpoint.load(paths[0])["objects"]


def _plain_states(epochs: int) -> list[dict[str, Any]]:
    """The example's training in one process without a strategy: the model's and optimizer's
    states after each epoch (epoch e shuffles with seed + e, as the example does)."""
    from mirrored.examples.mnist_mlp import build_model
    from mirrored.examples.ray_train import datasets

    train_set, _ = datasets(None, SEED)
    torch.manual_seed(SEED)
    model = build_model(train_set.tensors[0].shape[1], 64, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    states = []
    for epoch in range(1, epochs + 1):
        generator = torch.Generator().manual_seed(SEED + epoch)
        for x, y in DataLoader(train_set, 200, shuffle=True, generator=generator):
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        states.append(
            {
                "model": {k: v.clone() for k, v in model.state_dict().items()},
                "momentum": [
                    optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()
                ],
            }
        )
    return states


def _assert_same_training(saved: dict[str, Any], plain: dict[str, Any]) -> None:
    assert saved["model"].keys() == plain["model"].keys()
    for name, value in plain["model"].items():
        assert saved["model"][name].dtype == torch.float64, name
        assert_close_float64(saved["model"][name], value, msg=name)
    momentum = [
        saved["optimizer"]["state"][i]["momentum_buffer"] for i in range(len(plain["momentum"]))
    ]
    for index, value in enumerate(plain["momentum"]):
        assert_close_float64(momentum[index], value, msg=f"momentum of parameter {index}")


def test_ray_train_workers_equal_the_plain_loop_and_resume_from_rays_checkpoint(
    tmp_path: Path,
) -> None:
    plain = _plain_states(3)
    first, saved = _run_example(tmp_path, epochs=2)
    assert "MultiWorkerMirroredStrategy(worker 0 of 2" in first.output, first.output
    assert "resumed" not in first.output
    assert int(saved["epoch"]) == 2
    _assert_same_training(saved, plain[1])
    # The same run again, one epoch longer: Ray hands the workers its last checkpoint.
    second, saved = _run_example(tmp_path, epochs=3)
    assert "resumed after epoch 2" in second.output, second.output
    assert int(saved["epoch"]) == 3
    _assert_same_training(saved, plain[2])


def test_ray_train_refuses_its_own_checkpoint_file(capsys: pytest.CaptureFixture[str]) -> None:
    from mirrored.examples import ray_train

    with pytest.raises(SystemExit) as exit_info:
        ray_train.parse_args(["--checkpoint", "model.pt"])
    assert exit_info.value.code == 2
    assert "--checkpoint model.pt: Ray keeps the checkpoints of a run" in capsys.readouterr().err
