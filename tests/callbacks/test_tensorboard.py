"""TensorBoard: Keras's runs and tags, written with torch's SummaryWriter and read back with
TensorBoard's own event reader."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mirrored.callbacks import TensorBoard
from tests.callbacks.fakes import FakeModel, attach, fit_linear


def read(run: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(run), size_guidance={"scalars": 0, "histograms": 0})
    accumulator.Reload()
    return accumulator


def steps(accumulator: EventAccumulator, tag: str) -> list[int]:
    return [event.step for event in accumulator.Scalars(tag)]


def values(accumulator: EventAccumulator, tag: str) -> list[float]:
    return [event.value for event in accumulator.Scalars(tag)]


def run_fake(callback: TensorBoard, model: FakeModel, epochs: int = 2, steps: int = 4) -> None:
    """``steps`` batches of 8 examples an epoch, loss falling by 0.1 a batch."""
    attach(callback, model, epochs=epochs, steps=steps)
    callback.on_train_begin()
    for epoch in range(epochs):
        callback.on_epoch_begin(epoch)
        for batch in range(steps):
            callback.on_train_batch_begin(batch)
            loss = 1.0 - 0.1 * (epoch * steps + batch)
            callback.on_train_batch_end(batch, {"loss": loss, "mae": 2.0, "num_examples": 8})
        callback.on_test_begin()
        callback.on_test_end({"loss": 0.5 - epoch / 10, "mae": 0.25})
        logs = {
            "loss": 0.75 - epoch / 10,
            "mae": 0.5,
            "val_loss": 0.5 - epoch / 10,
            "val_mae": 0.25,
            "learning_rate": 0.01 * (epoch + 1),
        }
        callback.on_epoch_end(epoch, logs)
    callback.on_train_end()


def test_epoch_scalars_go_to_train_and_validation_runs_as_keras(tmp_path: Path) -> None:
    callback = TensorBoard(tmp_path, write_steps_per_second=False)
    run_fake(callback, FakeModel())
    train, validation = read(tmp_path / "train"), read(tmp_path / "validation")
    assert set(train.Tags()["scalars"]) == {"epoch_loss", "epoch_mae", "epoch_learning_rate"}
    assert steps(train, "epoch_loss") == [0, 1]
    assert values(train, "epoch_loss") == pytest.approx([0.75, 0.65])
    assert values(train, "epoch_learning_rate") == pytest.approx([0.01, 0.02])
    assert set(validation.Tags()["scalars"]) == {
        "epoch_loss",
        "epoch_mae",
        "evaluation_loss_vs_iterations",
        "evaluation_mae_vs_iterations",
    }
    assert steps(validation, "epoch_loss") == [0, 1]
    assert values(validation, "epoch_loss") == pytest.approx([0.5, 0.4])
    # against the global step, as Keras's evaluation_<name>_vs_iterations
    assert steps(validation, "evaluation_loss_vs_iterations") == [4, 8]
    assert values(validation, "evaluation_loss_vs_iterations") == pytest.approx([0.5, 0.4])
    assert callback._writers == {}  # closed at train end


def test_learning_rate_comes_from_the_model_when_not_in_the_logs(tmp_path: Path) -> None:
    callback = TensorBoard(tmp_path)
    attach(callback, FakeModel(learning_rate=0.125))
    callback.on_train_begin()
    callback.on_epoch_begin(0)
    callback.on_epoch_end(0, {"loss": 1.0})
    callback.on_train_end()
    train = read(tmp_path / "train")
    assert steps(train, "epoch_learning_rate") == [0]
    assert values(train, "epoch_learning_rate") == [0.125]
    assert not (tmp_path / "validation").exists()


def test_update_freq_writes_batch_scalars_every_n_steps(tmp_path: Path) -> None:
    callback = TensorBoard(tmp_path, update_freq=3, write_steps_per_second=True)
    run_fake(callback, FakeModel())
    train = read(tmp_path / "train")
    # global steps 3 and 6 of 8; the loss is 1.0 - 0.1 * (step - 1)
    assert steps(train, "batch_loss") == [3, 6]
    assert values(train, "batch_loss") == pytest.approx([0.8, 0.5])
    assert steps(train, "batch_mae") == [3, 6]
    assert steps(train, "batch_steps_per_second") == [3, 6]
    assert "batch_num_examples" not in train.Tags()["scalars"]


def test_update_freq_batch_is_every_batch_and_counts_executions_of_several_steps(
    tmp_path: Path,
) -> None:
    callback = TensorBoard(tmp_path, update_freq="batch")
    attach(callback, FakeModel())
    callback.on_train_begin()
    callback.on_epoch_begin(0)
    for first in (0, 2, 4):  # steps_per_execution=2
        callback.on_train_batch_begin(first)
        callback.on_train_batch_end(first + 1, {"loss": float(first)})
    callback.on_epoch_end(0, {"loss": 1.0})
    callback.on_train_end()
    train = read(tmp_path / "train")
    assert steps(train, "batch_loss") == [2, 4, 6]
    assert values(train, "batch_loss") == [0.0, 2.0, 4.0]


def test_throughput_in_steps_and_examples_per_second(tmp_path: Path) -> None:
    callback = TensorBoard(tmp_path, write_steps_per_second=True)
    run_fake(callback, FakeModel())
    train = read(tmp_path / "train")
    assert steps(train, "epoch_steps_per_second") == [0, 1]
    assert steps(train, "epoch_examples_per_second") == [0, 1]
    per_step = values(train, "epoch_steps_per_second")
    assert all(rate > 0 for rate in per_step)
    # 8 examples a batch
    expected = [8 * rate for rate in per_step]
    assert values(train, "epoch_examples_per_second") == pytest.approx(expected, rel=1e-5)


def test_histograms_of_the_weights(tmp_path: Path) -> None:
    run_fake(TensorBoard(tmp_path, histogram_freq=2), FakeModel(), epochs=3)
    train = read(tmp_path / "train")
    assert set(train.Tags()["histograms"]) == {"weight", "bias"}
    assert [event.step for event in train.Histograms("weight")] == [0, 2]
    assert train.Histograms("weight")[0].histogram_value.num == 3  # nn.Linear(3, 1)


def test_a_process_that_does_not_write_checkpoints_writes_nothing(tmp_path: Path) -> None:
    run_fake(TensorBoard(tmp_path / "logs", update_freq=1), FakeModel(should_checkpoint=False))
    assert not (tmp_path / "logs").exists()


def test_the_global_step_survives_a_restart(tmp_path: Path) -> None:
    first = TensorBoard(tmp_path)
    run_fake(first, FakeModel())
    second = TensorBoard(tmp_path)
    attach(second, FakeModel())
    second.on_train_begin()
    second.load_state_dict(first.state_dict())
    assert second.state_dict() == {"global_step": 8}
    second.on_train_end()


def test_without_the_tensorboard_package_the_error_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install 'mirrored\[tensorboard\]'"):
        TensorBoard("logs")


def test_bad_arguments_are_named() -> None:
    cases: list[tuple[dict[str, object], str]] = [
        ({"update_freq": 0}, r"update_freq=0"),
        ({"update_freq": "step"}, r"update_freq='step'"),
        ({"histogram_freq": -1}, r"histogram_freq=-1"),
    ]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=message):
            TensorBoard("logs", **arguments)  # type: ignore[arg-type]


# -- in a real fit ---------------------------------------------------------------------------------
@pytest.mark.parametrize("num_replicas", [1, 2])
def test_fit_logs_what_history_has(tmp_path: Path, num_replicas: int) -> None:
    callback = TensorBoard(tmp_path, update_freq=2, write_steps_per_second=True)
    _, history = fit_linear([callback], epochs=2, num_replicas=num_replicas)
    train, validation = read(tmp_path / "train"), read(tmp_path / "validation")
    for name in ("loss", "mae", "learning_rate"):
        assert steps(train, f"epoch_{name}") == [0, 1]
        assert values(train, f"epoch_{name}") == pytest.approx(history.history[name])
    for name in ("loss", "mae"):
        assert steps(validation, f"epoch_{name}") == [0, 1]
        assert values(validation, f"epoch_{name}") == pytest.approx(history.history[f"val_{name}"])
    assert steps(train, "batch_loss") == [2, 4, 6, 8]  # 4 batches an epoch
    # batches of 16 examples
    expected = [16 * rate for rate in values(train, "epoch_steps_per_second")]
    assert values(train, "epoch_examples_per_second") == pytest.approx(expected, rel=1e-5)
