"""Ray Train on a local Ray cluster of 2 CPUs: MultiWorkerMirroredStrategy in ``TorchTrainer``'s
2 workers, against one process in float64.

Two programs run as their users run them, each its own Ray driver joining the module's cluster:
tests/cluster/cluster_program.py, the program the SLURM tests run, with Ray forming the workers'
process group over TCP (``TorchConfig(init_method="tcp")``, no MASTER_PORT: the strategy reads the
group itself), to the plain run's weights; and examples/ray_train.py (Ray's default ``env://``
group), whose checkpoints go through ``ray.train.report``, twice with the same run name: the
second run resumes from Ray's last checkpoint of the first.
"""

from __future__ import annotations

import re
import secrets
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from mirrored import checkpoint
from tests.cluster.cluster_program import COMMAND, assert_trained_as_one_process, plain_env
from tests.exactness import assert_close_float64
from tests.multiprocess.spawn import (
    REPO,
    Worker,
    assert_all_succeeded,
    free_port,
    kill_workers,
    start_process,
    wait_workers,
)

pytest.importorskip("ray.train", reason="Ray Train is a test-only extra: pip install -e '.[ray]'")
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow, pytest.mark.usefixtures("float64")]

EXAMPLE = str(REPO / "examples" / "ray_train.py")
SEED = 0
CHECKPOINT_LINE = re.compile(r"^checkpoint: (.+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[tuple[str, dict[str, str]]]:
    """One local Ray cluster for the module's runs (starting one is most of a run's time): its
    address, and the environment of the drivers that join it.

    ``ray start --head --block`` in a session of its own: on SIGTERM it stops the processes it
    started. Ray's session files (logs, sockets) go to a folder of their own, removed after, with
    a short path, as the sockets' must fit in 107 bytes; the cluster's token is in the
    environment, not written to ~/.ray. With these variables, which the fork server lacks, the
    head and every driver start as fresh interpreters."""
    with tempfile.TemporaryDirectory(prefix="ray-") as session:
        env = {**plain_env(), "RAY_TMPDIR": session}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
        env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"  # no 30 s drain at SIGTERM
        port = free_port()
        options = ["--head", "--block", f"--port={port}", "--num-cpus=2", f"--temp-dir={session}"]
        options += ["--include-dashboard=false", "--disable-usage-stats"]
        head = start_process([sys.executable, "-m", "ray.scripts.scripts", "start", *options], env)
        try:
            _wait_for_start(head)
            yield f"127.0.0.1:{port}", env
        finally:
            head.process.send_signal(signal.SIGTERM)
            wait_workers([head], 60)


def _wait_for_start(head: Worker) -> None:
    """Until ``ray start`` says the cluster is up; what it printed if it ended instead."""
    stdout = head.process.stdout
    assert stdout is not None
    printed = []
    while "Ray runtime started" not in (line := stdout.readline()):
        if not line:
            kill_workers([head])
            raise AssertionError("ray start --head failed:\n" + "".join(printed))
        printed.append(line)


def _run_driver(command: list[str], env: dict[str, str]) -> Worker:
    """A Ray driver program, run to its successful end."""
    (driver,) = wait_workers([start_process(command, env)], 240)
    assert_all_succeeded([driver])
    return driver


def test_the_cluster_program_in_ray_workers_equals_the_plain_run(
    tmp_path: Path, ray_cluster: tuple[str, dict[str, str]], plain_run: dict[str, Any]
) -> None:
    address, env = ray_cluster
    _run_driver([*COMMAND, str(tmp_path), "--ray", address], env)
    assert_trained_as_one_process(tmp_path, plain_run, "ProcessGroupClusterResolver")


def _run_example(
    storage: Path, epochs: int, ray_cluster: tuple[str, dict[str, str]]
) -> tuple[Worker, dict[str, Any]]:
    """``python examples/ray_train.py --address ADDRESS`` in float64, run ``test`` kept in
    ``storage``; its output and the checkpoint Ray kept last."""
    address, env = ray_cluster
    flags = ["--float64", "--epochs", str(epochs), "--seed", str(SEED), "--address", address]
    flags += ["--storage-path", str(storage), "--name", "test"]
    driver = _run_driver([sys.executable, EXAMPLE, *flags], env)
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
    tmp_path: Path, ray_cluster: tuple[str, dict[str, str]]
) -> None:
    plain = _plain_states(3)
    first, saved = _run_example(tmp_path, 2, ray_cluster)
    assert "MultiWorkerMirroredStrategy(worker 0 of 2" in first.output, first.output
    assert "resumed" not in first.output
    assert int(saved["epoch"]) == 2
    _assert_same_training(saved, plain[1])
    # The same run again, one epoch longer: Ray hands the workers its last checkpoint.
    second, saved = _run_example(tmp_path, 3, ray_cluster)
    assert "resumed after epoch 2" in second.output, second.output
    assert int(saved["epoch"]) == 3
    _assert_same_training(saved, plain[2])


def test_ray_train_refuses_its_own_checkpoint_file(capsys: pytest.CaptureFixture[str]) -> None:
    from mirrored.examples import ray_train

    with pytest.raises(SystemExit) as exit_info:
        ray_train.parse_args(["--checkpoint", "model.pt"])
    assert exit_info.value.code == 2
    assert "--checkpoint model.pt: Ray keeps the checkpoints of a run" in capsys.readouterr().err
