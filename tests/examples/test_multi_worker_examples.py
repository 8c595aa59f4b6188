"""examples/multi_worker_mobilenet.py and examples/distributed_loop.py in real worker processes.

Each example runs as users run it: two processes on 127.0.0.1, told who they are by the
example's own flags (which build a TF_CONFIG), by TF_CONFIG or by torchrun's variables
(tests/multiprocess/spawn.py's environment), or by ``mirrored launch``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from mirrored.examples import distributed_loop, multi_worker_mobilenet

from tests.multiprocess.spawn import (
    REPO,
    Worker,
    assert_all_succeeded,
    free_port,
    start_process,
    wait_workers,
    worker_env,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

FINAL_LINE = re.compile(r"^test loss: (\d+\.\d+) - test accuracy: (\d+\.\d+)$", re.MULTILINE)
# About 10 s for two workers on 2 cores; 0.89 test accuracy (seeds 1 and 2: 0.81, 0.88).
TINY_MOBILENET = ["--image-size", "48", "--width-multiplier", "0.25", "--max-images", "384"]
TINY_MOBILENET += ["--epochs", "4", "--batch-size-per-replica", "16", "--verbose", "2"]
MOBILENET = ["-m", "mirrored.examples.multi_worker_mobilenet"]
DISTRIBUTED_LOOP = [str(REPO / "examples" / "distributed_loop.py")]


def _run(
    program: Sequence[str], args: Sequence[Sequence[str]], envs: Sequence[dict[str, str]]
) -> list[Worker]:
    """``python PROGRAM ARGS[i]`` in process i with ``envs[i]``; all killed after 150 s."""
    workers = [
        start_process([sys.executable, *program, *worker_args], env, rank)
        for rank, (worker_args, env) in enumerate(zip(args, envs, strict=True))
    ]
    return wait_workers(workers, timeout=150)


def _accuracy(chief: Worker) -> float:
    lines = FINAL_LINE.findall(chief.output)
    assert len(lines) == 1, chief.output
    return float(lines[0][1])


def _assert_same_weights(paths: Sequence[Path], key: str | None = None) -> None:
    first, *others = [torch.load(p, weights_only=True) for p in paths]
    first = first if key is None else first[key]
    for other in others:
        other = other if key is None else other[key]
        assert other.keys() == first.keys()
        for name, value in first.items():
            assert torch.equal(other[name], value), name


def test_mobilenet_workers_from_the_worker_index_flag(tmp_path: Path) -> None:
    port = free_port()
    env = worker_env(0, 2, port, 1, "tf_config")
    del env["TF_CONFIG"]  # the flags build it
    flags = [*TINY_MOBILENET, "--num-workers", "2", "--port", str(port)]
    flags += ["--save", str(tmp_path / "weights{rank}.pt"), "--backup-dir", str(tmp_path / "bk")]
    workers = _run(MOBILENET, [[*flags, "--worker-index", str(i)] for i in range(2)], [env] * 2)
    assert_all_succeeded(workers)
    chief, other = workers
    assert "MultiWorkerMirroredStrategy(worker 0 of 2" in chief.output
    assert "global batch 32 = 16 x 2 replicas" in chief.output
    assert chief.output.count("val_accuracy") == 4, chief.output  # a line per epoch
    assert _accuracy(chief) > 0.7, chief.output
    assert other.output.strip() == "", "only the chief prints"
    _assert_same_weights([tmp_path / "weights0.pt", tmp_path / "weights1.pt"])
    # BackupAndRestore wrote its backup there every epoch and deleted it when training ended.
    assert (tmp_path / "bk").is_dir() and not any((tmp_path / "bk").iterdir())


def test_mobilenet_workers_from_tf_config(tmp_path: Path) -> None:
    port = free_port()
    envs = [worker_env(rank, 2, port, 1, "tf_config") for rank in range(2)]
    save = ["--save", str(tmp_path / "weights.pt")]  # no {rank}: the chief alone writes it
    workers = _run(MOBILENET, [TINY_MOBILENET + save] * 2, envs)
    assert_all_succeeded(workers)
    assert _accuracy(workers[0]) > 0.7, workers[0].output
    assert "test loss" not in workers[1].output
    assert [p.name for p in tmp_path.iterdir()] == ["weights.pt"]


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--worker-index", "2"], {}, "--worker-index 2: expected 0..1 (--num-workers 2)"),
        ([], {}, "--num-workers 2 needs --worker-index 0..1 in each worker"),
        (["--worker-index", "0"], {"TF_CONFIG": "{}"}, "but TF_CONFIG is set"),
        (["--port", "65535"], {"TF_CONFIG": "{}"}, "--port 65535: expected 1..65534"),
    ],
)
def test_mobilenet_rejects_a_bad_cluster(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    env: dict[str, str],
    message: str,
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        multi_worker_mobilenet.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_mobilenet_worker_index_out_of_range_exits_with_the_fix() -> None:
    env = worker_env(0, 2, free_port(), 1, "tf_config")
    del env["TF_CONFIG"]
    (worker,) = _run(MOBILENET, [["--worker-index", "5"]], [env])
    assert worker.returncode == 2
    assert "--worker-index 5: expected 0..1 (--num-workers 2)" in worker.output


def test_distributed_loop_under_torchrun_variables(tmp_path: Path) -> None:
    port = free_port()
    envs = [worker_env(rank, 2, port, 1, "torchrun") for rank in range(2)]
    flags = ["--checkpoint", str(tmp_path / "model{rank}.pt")]
    workers = _run(DISTRIBUTED_LOOP, [flags] * 2, envs)
    assert_all_succeeded(workers)
    chief, other = workers
    assert "global batch 200 = 100 x 2 replicas" in chief.output
    assert len(re.findall(r"^epoch +\d+/10 ", chief.output, re.MULTILINE)) == 10
    assert _accuracy(chief) > 0.85, chief.output
    assert other.output.strip() == "", "only the chief prints"
    paths = [tmp_path / "model0.pt", tmp_path / "model1.pt"]
    assert [torch.load(p, weights_only=True)["epoch"] for p in paths] == [10, 10]
    _assert_same_weights(paths, key="model")


def test_distributed_loop_under_mirrored_launch(tmp_path: Path) -> None:
    env = worker_env(0, 1, 0, 1, "tf_config")
    del env["TF_CONFIG"]
    launch = ["-m", "mirrored.cli", "launch", "--nproc-per-node", "2", *DISTRIBUTED_LOOP]
    (launcher,) = _run(launch, [["--checkpoint", str(tmp_path / "model.pt")]], [env])
    assert_all_succeeded([launcher])
    assert "worker 0 of 2" in launcher.output
    assert _accuracy(launcher) > 0.85, launcher.output  # one final line: the chief's
    assert torch.load(tmp_path / "model.pt", weights_only=True)["epoch"] == 10


def test_distributed_loop_as_one_worker(capsys: pytest.CaptureFixture[str]) -> None:
    # In this process: tests/conftest.py's four logical CPU devices are the worker's replicas.
    results = distributed_loop.main(["--epochs", "3", "--batch-size-per-replica", "25"])
    out = capsys.readouterr().out
    assert "worker 0 of 1" in out and "global batch 100 = 25 x 4 replicas" in out
    assert out.strip().splitlines()[-1] == (
        f"test loss: {results['loss']:.4f} - test accuracy: {results['accuracy']:.4f}"
    )
    assert results["accuracy"] > 0.5


def test_distributed_loop_without_master_port_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="MASTER_PORT is not set but WORLD_SIZE=2"):
        distributed_loop.main(["--epochs", "1"])


def test_distributed_loop_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        distributed_loop.main(["--epochs", "0"])
    assert exit_info.value.code == 2
    assert "--epochs: 0: expected a positive integer" in capsys.readouterr().err
