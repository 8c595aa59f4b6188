"""Checkpoint, CheckpointManager and latest_checkpoint: TensorFlow's names, files numbered and
found by number, restores that are exact and all or nothing, written by the chief alone.

Run as a program (``python -m tests.test_checkpoint_manager OUT``), it is one worker of the
multi-worker test at the end."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import mirrored
from tests import seeded_inputs as seeded


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _data(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(seeded.logits(12, 6), seeded.ids(12, classes=3)) for _ in range(steps)]


class Run:
    """A custom loop on ``devices`` logical CPU devices (none: no strategy), TensorFlow's
    tutorial pattern: per-example losses, compute_average_loss, Adam, a step counter."""

    def __init__(self, devices: int | None) -> None:
        self.module = _module()
        optimizer = torch.optim.Adam(self.module.parameters(), lr=0.01)
        self.scheduler_optimizer = optimizer
        self.step_count = torch.zeros((), dtype=torch.int64)
        if devices is None:
            self.strategy = None
            self.model, self.optimizer = self.module, optimizer
        else:
            self.strategy = mirrored.MirroredStrategy([f"cpu:{i}" for i in range(devices)])
            self.model, self.optimizer = self.strategy.mirror(self.module, optimizer)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)
        self.checkpoint = mirrored.Checkpoint(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            step=self.step_count,
        )
        self.loss = mirrored.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        per_example = self.loss(y, self.model(x))
        mirrored.compute_average_loss(per_example, global_batch_size=12).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def train(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for batch in batches:
            if self.strategy is None:
                self._step(*batch)
            else:
                (shards,) = list(self.strategy.experimental_distribute_dataset([batch]))
                self.strategy.run(self._step, args=shards)
            self.scheduler.step()
            self.step_count += 1

    def state(self) -> dict[str, object]:
        return {
            "model": {k: v.clone() for k, v in self.module.state_dict().items()},
            "optimizer": _clone(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step_count.item(),
        }

    def close(self) -> None:
        if self.strategy is not None:
            self.strategy.close()


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


@pytest.fixture
def run():
    runs: list[Run] = []

    def make(devices: int | None = 2) -> Run:
        runs.append(Run(devices))
        return runs[-1]

    yield make
    for made in runs:
        made.close()


def test_saves_are_numbered_and_the_oldest_beyond_max_to_keep_deleted(run, tmp_path):
    training = run(2)
    manager = mirrored.CheckpointManager(training.checkpoint, tmp_path, max_to_keep=2)
    assert manager.latest_checkpoint is None and manager.checkpoints == []
    assert mirrored.latest_checkpoint(tmp_path) is None
    paths = []
    for batch in _data(3):
        training.train([batch])
        paths.append(manager.save())
    assert paths == [str(tmp_path / f"ckpt-{n}.pt") for n in (1, 2, 3)]
    assert manager.checkpoints == paths[1:]  # ckpt-1 deleted, oldest first
    assert sorted(os.listdir(tmp_path)) == ["ckpt-2.pt", "ckpt-3.pt"]
    assert manager.latest_checkpoint == mirrored.latest_checkpoint(tmp_path) == paths[2]
    assert training.checkpoint.save_counter == 3
    keep_all = mirrored.CheckpointManager(training.checkpoint, tmp_path / "all", max_to_keep=None)
    for _ in range(6):
        keep_all.save()
    assert len(keep_all.checkpoints) == 6
    five = mirrored.CheckpointManager(training.checkpoint, tmp_path / "five")  # max_to_keep=5
    for _ in range(4):
        five.save()
    assert len(five.checkpoints) == len(os.listdir(tmp_path / "five")) == 4
    five.save(), five.save()
    assert [Path(p).name for p in five.checkpoints] == [f"ckpt-{n}.pt" for n in range(11, 16)]


def test_a_restart_finds_the_files_by_number_not_modification_time(run, tmp_path):
    first = run(2)
    manager = mirrored.CheckpointManager(first.checkpoint, tmp_path, max_to_keep=3)
    for number in (8, 9, 10):
        manager.save(checkpoint_number=number)
    saved_at_10 = first.state()
    # ckpt-8 touched last: the newest by mtime, the oldest by number; "ckpt-10" < "ckpt-8" as text.
    later = time.time() + 100
    os.utime(tmp_path / "ckpt-8.pt", (later, later))
    first.train(_data(1))

    restarted = run(4)  # a new process's objects, another replica count
    again = mirrored.CheckpointManager(restarted.checkpoint, tmp_path, max_to_keep=3)
    assert again.checkpoints == [str(tmp_path / f"ckpt-{n}.pt") for n in (8, 9, 10)]
    assert again.latest_checkpoint == str(tmp_path / "ckpt-10.pt")
    restarted.checkpoint.restore(again.latest_checkpoint).assert_consumed()
    _assert_same_state(restarted.state(), saved_at_10)
    assert restarted.checkpoint.save_counter == 3  # the saves counted, saved in the file
    assert again.save() == str(tmp_path / "ckpt-11.pt")  # never overwrites ckpt-10
    assert again.checkpoints[0] == str(tmp_path / "ckpt-9.pt")


def _assert_same_state(state, expected) -> None:
    assert_close(state, expected, rtol=0, atol=0)


@pytest.mark.parametrize("restore_on", [None, 1, 2, 4], ids=lambda d: f"restore-on-{d}")
def test_restore_gives_exactly_the_saved_state_on_any_replica_count(run, tmp_path, restore_on):
    """Saved with 2 replicas, restored with ``restore_on``: the weights, Adam's moments and step,
    the schedule and the step counter are the saved ones, and training goes on exactly as the
    saving run does."""
    batches = _data(4)
    saver = run(2)
    saver.train(batches[:2])
    path = saver.checkpoint.save(tmp_path / "run")
    assert path == str(tmp_path / "run-1.pt")
    saved = saver.state()
    saver.train(batches[2:])

    restorer = run(restore_on)
    restorer.checkpoint.restore(path)
    _assert_same_state(restorer.state(), saved)
    assert restorer.scheduler_optimizer.param_groups[0]["lr"] == 0.01 * 0.5**2
    restorer.train(batches[2:])
    assert_close(restorer.state(), saver.state(), rtol=0, atol=1e-6)


def test_a_file_that_does_not_fit_is_refused_and_changes_nothing(run, tmp_path):
    training = run(2)
    training.train(_data(1))
    path = training.checkpoint.save(tmp_path / "adam")
    sgd_module = _module()
    other = mirrored.Checkpoint(
        model=sgd_module,
        optimizer=torch.optim.SGD(sgd_module.parameters(), lr=0.1, momentum=0.9),
        scheduler=training.scheduler,
        step=torch.zeros((), dtype=torch.int64),
    )
    with torch.no_grad():
        sgd_module[0].weight.add_(1.0)
    before = {k: v.clone() for k, v in sgd_module.state_dict().items()}
    # The model entry fits and comes first; the optimizer's does not: nothing is loaded.
    with pytest.raises(ValueError, match=r"adam-1\.pt', entry 'optimizer'.*momentum"):
        other.restore(path)
    assert_close(sgd_module.state_dict(), before, rtol=0, atol=0)
    assert other.save_counter == 0
    wider = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.ReLU(), torch.nn.Linear(9, 3))
    with pytest.raises(ValueError, match=r"entry 'model'.*0\.weight: checkpoint \(8, 6\)"):
        mirrored.Checkpoint(model=wider).restore(path)
    with pytest.raises(ValueError, match=r"entry 'step': \(\), expected a tensor of shape \(2,\)"):
        mirrored.Checkpoint(step=torch.zeros(2)).restore(path)
    with pytest.raises(ValueError, match=r"no entry for \['ema'\].*\['model', 'optimizer'"):
        mirrored.Checkpoint(ema=_module()).restore(path)


def test_restore_of_none_or_of_a_subset(run, tmp_path):
    training = run(None)
    status = training.checkpoint.restore(None)  # a first run: latest_checkpoint() is None
    assert status.path is None and training.checkpoint.save_counter == 0
    path = training.checkpoint.save(tmp_path / "ckpt")
    module = _module()
    with torch.no_grad():
        module[2].bias.fill_(5.0)
    partial = mirrored.Checkpoint(model=module).restore(path)
    assert_close(module.state_dict(), training.module.state_dict())
    assert partial.unused == ("optimizer", "scheduler", "step")
    with pytest.raises(AssertionError, match=r"\['optimizer', 'scheduler', 'step'\]"):
        partial.assert_consumed()
    assert partial.expect_partial() is partial


def test_a_model_is_checkpointed_by_its_weights(tmp_path):
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        model = mirrored.Model(_module())
        model.compile(optimizer="adam", loss=mirrored.losses.SparseCategoricalCrossentropy(True))
        x, y = _data(1)[0]
        model.fit(x, y, batch_size=6, verbose=0)
        path = mirrored.Checkpoint(model=model).save(tmp_path / "model")
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        model.fit(x, y, batch_size=6, verbose=0)
        mirrored.Checkpoint(model=model).restore(path)
        assert_close(model.state_dict(), saved, rtol=0, atol=0)
        model.strategy.close()


def test_latest_checkpoint_of_a_folder():
    assert mirrored.latest_checkpoint("/nonexistent/folder") is None


def test_latest_checkpoint_with_several_names_asks_which(tmp_path):
    checkpoint = mirrored.Checkpoint(model=_module())
    checkpoint.save(tmp_path / "a")
    checkpoint.save(tmp_path / "b")
    (tmp_path / "b-7.pt.tmp").write_text("")
    (tmp_path / "notes-x.pt").write_text("")
    with pytest.raises(ValueError, match=r"several names \(\['a', 'b'\]\).*checkpoint_name="):
        mirrored.latest_checkpoint(tmp_path)
    assert mirrored.latest_checkpoint(tmp_path, "a") == str(tmp_path / "a-1.pt")
    assert mirrored.latest_checkpoint(tmp_path, checkpoint_name="b") == str(tmp_path / "b-2.pt")


def test_bad_arguments(tmp_path):
    module = _module()
    with pytest.raises(TypeError, match=r"Checkpoint\(model=int\).*state_dict\(\)"):
        mirrored.Checkpoint(model=3)
    with pytest.raises(ValueError, match=r"Checkpoint\(save_counter=\.\.\.\).*reserved"):
        mirrored.Checkpoint(save_counter=torch.zeros(()))
    checkpoint = mirrored.Checkpoint(model=module)
    assert checkpoint.model is module
    with pytest.raises(AttributeError, match=r"no object 'optimizer'; it has \['model'\]"):
        _ = checkpoint.optimizer
    with pytest.raises(TypeError, match=r"checkpoint=.*mirrored\.Checkpoint"):
        mirrored.CheckpointManager(module, tmp_path)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=rf"max_to_keep={bad!r}: expected an int >= 1"):
            mirrored.CheckpointManager(checkpoint, tmp_path, max_to_keep=bad)
    with pytest.raises(ValueError, match=r"checkpoint_name='a/b'"):
        mirrored.CheckpointManager(checkpoint, tmp_path, checkpoint_name="a/b")
    manager = mirrored.CheckpointManager(checkpoint, tmp_path)
    with pytest.raises(ValueError, match=r"checkpoint_number=-1: expected an int >= 0"):
        manager.save(checkpoint_number=-1)
    torch.save(module.state_dict(), tmp_path / "weights.pt")
    with pytest.raises(ValueError, match=r"weights\.pt' is not a mirrored\.Checkpoint file"):
        checkpoint.restore(tmp_path / "weights.pt")
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        checkpoint.restore(tmp_path / "missing.pt")


def test_a_tensor_of_another_dtype_is_refused_before_anything_is_loaded(tmp_path):
    module = _module()
    path = mirrored.Checkpoint(model=module, step=torch.full((), 2.5)).save(tmp_path / "f")
    other = _module()
    with torch.no_grad():
        other[0].weight.add_(1.0)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    step = torch.zeros((), dtype=torch.int64)
    # 'model' fits and comes first; copy_ would cast 2.5 into the int64 counter as 2.
    with pytest.raises(ValueError, match=r"entry 'step': a torch\.float32 tensor, expected "):
        mirrored.Checkpoint(model=other, step=step).restore(path)
    assert step.item() == 0
    assert_close(other.state_dict(), before, rtol=0, atol=0)


def test_a_schedule_of_another_kind_is_refused_before_anything_is_loaded(tmp_path):
    module = _module()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    path = mirrored.Checkpoint(model=module, schedule=schedule).save(tmp_path / "f")
    other = _module()
    before = {k: v.clone() for k, v in other.state_dict().items()}
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(
        torch.optim.SGD(other.parameters(), lr=0.1), T_max=4
    )
    with pytest.raises(ValueError, match=r"'schedule'.*CosineAnnealingLR keeps \['T_max'"):
        mirrored.Checkpoint(model=other, schedule=cosine).restore(path)
    assert_close(other.state_dict(), before, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["save", "restore", "write", "save_counter", "_objects"])
def test_a_name_that_the_checkpoint_uses_itself_is_refused(name):
    with pytest.raises(ValueError, match=rf"Checkpoint\({name}=\.\.\.\).*pick another name"):
        mirrored.Checkpoint(**{name: _module()})
    assert mirrored.Checkpoint(read=_module()).read is not None  # not an attribute of Checkpoint


def test_a_checkpoint_number_at_or_below_the_newest_is_refused(tmp_path):
    manager = mirrored.CheckpointManager(
        mirrored.Checkpoint(model=_module()), tmp_path, max_to_keep=3
    )
    for number in (5, 6, 7):
        manager.save(checkpoint_number=number)
    for number in (3, 7):
        with pytest.raises(ValueError, match=rf"checkpoint_number={number}: .*\[5, 6, 7\]"):
            manager.save(checkpoint_number=number)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-5.pt", "ckpt-6.pt", "ckpt-7.pt"]
    assert manager.latest_checkpoint == str(tmp_path / "ckpt-7.pt")
    assert manager.save(checkpoint_number=8) == manager.latest_checkpoint


def _failing(error: OSError):
    def fail(*args: object) -> None:
        raise error

    return fail


def test_a_failed_write_deletes_nothing_and_counts_nothing(tmp_path, monkeypatch):
    checkpoint = mirrored.Checkpoint(model=_module())
    manager = mirrored.CheckpointManager(checkpoint, tmp_path, max_to_keep=2)
    manager.save(), manager.save()
    kept = manager.checkpoints
    monkeypatch.setattr(mirrored.checkpoint, "save", _failing(OSError(28, "No space left")))
    with pytest.raises(OSError, match="No space left"):
        manager.save()
    assert checkpoint.save_counter == 2 and manager.checkpoints == kept
    assert sorted(os.listdir(tmp_path)) == ["ckpt-1.pt", "ckpt-2.pt"]
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(tmp_path / "other")
    assert checkpoint.save_counter == 2
    monkeypatch.undo()
    assert manager.save() == str(tmp_path / "ckpt-3.pt")  # the number the failed save had


def test_a_failed_deletion_keeps_the_new_checkpoint_and_the_old_one_tracked(tmp_path, monkeypatch):
    checkpoint = mirrored.Checkpoint(model=_module())
    manager = mirrored.CheckpointManager(checkpoint, tmp_path, max_to_keep=2)
    manager.save(), manager.save()
    remove = os.remove
    monkeypatch.setattr(os, "remove", _failing(PermissionError(13, "Permission denied")))
    with pytest.raises(OSError, match=r"wrote .*ckpt-3\.pt.*could not delete .*ckpt-1\.pt"):
        manager.save()
    assert checkpoint.save_counter == 3
    assert manager.checkpoints == [str(tmp_path / f"ckpt-{n}.pt") for n in (1, 2, 3)]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-1.pt", "ckpt-2.pt", "ckpt-3.pt"]
    monkeypatch.setattr(os, "remove", remove)
    manager.save()  # deletes what the failed one left, too
    assert sorted(os.listdir(tmp_path)) == ["ckpt-3.pt", "ckpt-4.pt"]
    assert manager.checkpoints == [str(tmp_path / f"ckpt-{n}.pt") for n in (3, 4)]


# -- several workers ----------------------------------------------------------------------------


def _run_workers(out: Path, mode: str) -> list[dict[str, object]]:
    """Run this file as two workers of 2 logical devices each, and read what each wrote."""
    from tests.multiprocess.spawn import (
        assert_all_succeeded,
        free_port,
        start_process,
        wait_workers,
        worker_env,
    )

    port = free_port()
    command = [sys.executable, "-m", "tests.test_checkpoint_manager", str(out), mode]
    workers = [
        start_process(command, worker_env(rank, 2, port, 2, "torchrun"), rank) for rank in (0, 1)
    ]
    assert_all_succeeded(wait_workers(workers, timeout=120))
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)]


def test_on_multi_worker_only_the_chief_writes_and_every_worker_restores(tmp_path):
    chief, other = _run_workers(tmp_path, "train")
    assert sorted(os.listdir(tmp_path)) == ["ckpt-2.pt", "ckpt-3.pt", "rank0.pt", "rank1.pt"]
    assert chief["paths"] == other["paths"] == [str(tmp_path / f"ckpt-{n}.pt") for n in (1, 2, 3)]
    assert_close(chief["restored"], other["restored"], rtol=0, atol=0)
    assert_close(chief["restored"], chief["saved"], rtol=0, atol=0)


def test_on_multi_worker_the_workers_see_the_same_files_or_fail(tmp_path):
    """Separate disks: worker 1's folder holds other checkpoints than the chief's. Every worker
    refuses a manager there and a restore of its own file, instead of training apart."""
    for rank, shift in ((0, 0.0), (1, 1.0)):
        module = _module()
        with torch.no_grad():
            module[0].weight.add_(shift)
        checkpoint = mirrored.Checkpoint(model=module)
        for _ in range(2 - rank):  # the chief's disk: ckpt-1 and ckpt-2; worker 1's: ckpt-1
            checkpoint.save(tmp_path / f"disk{rank}" / "ckpt")
    chief, other = _run_workers(tmp_path, "diverge")
    # Worker 1 builds its manager late: the chief saved nothing before both had looked.
    assert chief["raced"] == other["raced"] == str(tmp_path / "shared" / "ckpt-1.pt")
    for errors in (chief, other):
        assert "ValueError: worker(s) [1] hold other values than worker 0" in errors["manager"]
        assert "ValueError: worker(s) [1] hold other values than worker 0" in errors["restore"]
        assert "ckpt-1.pt" in errors["restore"]
    assert chief["missing"].startswith("ValueError: worker(s) [1] hold other values")
    assert other["missing"].startswith("FileNotFoundError: no checkpoint at")
    assert chief["none"] == other["none"] == "restored nothing"


def _worker(out: Path) -> None:
    """One of two workers with 2 logical devices each: three saves through a manager keeping 2,
    one more step, then a restore of the latest. A non-chief that wrote would raise."""
    config = mirrored.config
    config.set_logical_device_configuration(
        config.list_physical_devices("CPU")[0], [config.LogicalDeviceConfiguration()] * 2
    )
    with mirrored.MultiWorkerMirroredStrategy() as strategy:
        rank = strategy.worker_group.rank
        if rank != 0:

            def forbidden(obj: object, path: object) -> None:
                raise AssertionError(f"worker {rank} wrote {path}")

            mirrored.checkpoint.save = forbidden  # type: ignore[assignment]
        module = _module()
        model, optimizer = strategy.mirror(module, torch.optim.Adam(module.parameters(), lr=0.01))
        manager = mirrored.CheckpointManager(
            mirrored.Checkpoint(model=model, optimizer=optimizer), out, max_to_keep=2
        )

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            per_example = F.cross_entropy(model(x), y, reduction="none")
            mirrored.compute_average_loss(per_example).backward()
            optimizer.step()
            optimizer.zero_grad()

        paths = []
        data = _data(4)
        for batch in strategy.experimental_distribute_dataset(data[:3]):
            strategy.run(step, args=batch)
            paths.append(manager.save())
        saved = {k: v.clone() for k, v in module.state_dict().items()}
        for batch in strategy.experimental_distribute_dataset(data[3:]):
            strategy.run(step, args=batch)
        manager.checkpoint.restore(mirrored.latest_checkpoint(out))
        restored = {k: v.clone() for k, v in module.state_dict().items()}
        torch.save({"paths": paths, "saved": saved, "restored": restored}, out / f"rank{rank}.pt")


def _diverging_worker(out: Path) -> None:
    """What ``test_on_multi_worker_the_workers_see_the_same_files_or_fail`` checks: the error
    (or result) of each step, per worker."""
    config = mirrored.config
    config.set_logical_device_configuration(
        config.list_physical_devices("CPU")[0], [config.LogicalDeviceConfiguration()] * 2
    )
    with mirrored.MultiWorkerMirroredStrategy() as strategy:
        rank = strategy.worker_group.rank
        checkpoint = mirrored.Checkpoint(model=strategy.mirror(_module()))
        if rank == 1:
            time.sleep(1.0)  # the chief makes its manager and saves first
        report: dict[str, object] = {
            "raced": mirrored.CheckpointManager(checkpoint, out / "shared").save()
        }
        mine = out / f"disk{rank}"
        steps = {
            "manager": lambda: mirrored.CheckpointManager(checkpoint, mine),
            "restore": lambda: checkpoint.restore(mine / "ckpt-1.pt"),
            "missing": lambda: checkpoint.restore(mine / "ckpt-2.pt"),
            "none": lambda: checkpoint.restore(None),
        }
        for name, step in steps.items():
            try:
                step()
                report[name] = "restored nothing"
            except (ValueError, OSError) as error:
                report[name] = f"{type(error).__name__}: {error}"
        torch.save(report, out / f"rank{rank}.pt")


if __name__ == "__main__":
    (_worker if sys.argv[2] == "train" else _diverging_worker)(Path(sys.argv[1]))
