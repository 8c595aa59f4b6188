"""mirrored.Model: fit on N replicas == fit on one device == plain torch; metrics exact; errors."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mirrored
from mirrored import checkpoint
from mirrored.training.float16_loss_scale import LossScale
from tests.reference_loops import assert_replicas_identical, assert_same_parameters, make_mlp

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

NUM_EXAMPLES, BATCH, FEATURES, CLASSES = 203, 16, 12, 5  # 203 = 12 * 16 + 11: a ragged last batch


def data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(NUM_EXAMPLES, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (NUM_EXAMPLES,), generator=generator)
    weight = torch.rand(NUM_EXAMPLES, generator=generator)
    return x, y, weight


def strategy_for(num_replicas: int) -> mirrored.MirroredStrategy:
    return mirrored.MirroredStrategy([f"cpu:{i}" for i in range(num_replicas)])


def plain_fit(
    module: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    shuffle: bool,
    weight: torch.Tensor | None = None,
    lr: float = 1e-2,
) -> list[float]:
    """The single-device loop fit() must reproduce: Keras's sum_over_batch_size loss; returns
    each epoch's mean loss over examples."""
    optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    epoch_losses = []
    for _ in range(epochs):
        order = torch.randperm(len(x)) if shuffle else torch.arange(len(x))
        total = 0.0
        for start in range(0, len(x), BATCH):
            index = order[start : start + BATCH]
            per_example = F.cross_entropy(module(x[index]), y[index], reduction="none")
            if weight is not None:
                per_example = per_example * weight[index]
            loss = per_example.mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total += per_example.sum().item()
        epoch_losses.append(total / len(x))
    return epoch_losses


def compiled(
    strategy: mirrored.Strategy, module: nn.Module, lr: float = 1e-2, **kwargs: object
) -> mirrored.Model:
    with strategy.scope():
        model = mirrored.Model(module)
        model.compile(
            optimizer=torch.optim.Adam(model.parameters(), lr=lr),
            loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
            **kwargs,  # type: ignore[arg-type]
        )
    return model


@pytest.mark.parametrize("num_replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "sample_weight"])
def test_fit_on_n_replicas_gives_the_single_device_parameters(
    num_replicas: int, weighted: bool
) -> None:
    x, y, weight = data()
    reference = make_mlp(FEATURES, CLASSES)
    module = copy.deepcopy(reference)
    torch.manual_seed(5)
    expected_losses = plain_fit(reference, x, y, 2, True, weight if weighted else None)
    torch.manual_seed(5)
    with strategy_for(num_replicas) as strategy:
        model = compiled(strategy, module)
        history = model.fit(
            x,
            y,
            sample_weight=weight if weighted else None,
            batch_size=BATCH,
            epochs=2,
            verbose=0,
        )
        assert_same_parameters(reference, model.module)
        if num_replicas > 1:
            assert_replicas_identical(model._replicas)
    # The reported loss is the mean over examples, not the mean of batch means.
    assert history.history["loss"] == pytest.approx(expected_losses, rel=1e-5)


def test_fit_equals_the_custom_training_loop() -> None:
    x, y, _ = data()
    batches = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, NUM_EXAMPLES, BATCH)]
    reference = make_mlp(FEATURES, CLASSES)
    module = copy.deepcopy(reference)
    with strategy_for(3) as strategy:
        with strategy.scope():
            optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
        loop_model, loop_optimizer = strategy.mirror(reference, optimizer)

        def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
            features, labels = batch
            per_example = F.cross_entropy(loop_model(features), labels, reduction="none")
            mirrored.compute_average_loss(per_example).backward()
            loop_optimizer.step()
            loop_optimizer.zero_grad()

        for batch in strategy.experimental_distribute_dataset(batches):
            strategy.run(step, args=(batch,))
        model = compiled(strategy, module)
        model.fit(DataLoader(TensorDataset(x, y), batch_size=BATCH), epochs=1, verbose=0)
        assert_same_parameters(loop_model.module, model.module)


def test_steps_per_execution_gives_the_same_parameters() -> None:
    x, y, _ = data()
    first, second = make_mlp(FEATURES, CLASSES), make_mlp(FEATURES, CLASSES)
    with strategy_for(2) as strategy:
        one = compiled(strategy, first)
        one.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        three = compiled(strategy, second, steps_per_execution=3)
        seen: list[int] = []
        callback = mirrored.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: seen.append(batch)
        )
        three.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[callback])
    assert_same_parameters(first, second)
    # 13 batches per epoch in executions of 3: batch hooks after batches 2, 5, 8, 11 and 12.
    assert seen == [2, 5, 8, 11, 12] * 2


def test_evaluate_metrics_are_exact_with_ragged_batches_and_sample_weights() -> None:
    x, y, weight = data()
    module = make_mlp(FEATURES, CLASSES)
    with torch.no_grad():
        logits = module(x)
    per_example = F.cross_entropy(logits, y, reduction="none")
    correct = (logits.argmax(-1) == y).double()
    with strategy_for(3) as strategy:
        model = compiled(
            strategy,
            module,
            metrics=["accuracy"],
            weighted_metrics=["sparse_categorical_accuracy"],
        )
        results = model.evaluate(
            x, y, sample_weight=weight, batch_size=BATCH, verbose=0, return_dict=True
        )
    assert set(results) == {"loss", "accuracy", "sparse_categorical_accuracy"}
    assert results["loss"] == pytest.approx((per_example * weight).mean().item(), rel=1e-6)
    assert results["accuracy"] == pytest.approx(correct.mean().item(), rel=1e-12)
    weighted = (correct * weight.double()).sum() / weight.double().sum()
    assert results["sparse_categorical_accuracy"] == pytest.approx(weighted.item(), rel=1e-6)


def test_evaluate_returns_keras_shapes() -> None:
    x, y, _ = data()
    with strategy_for(2) as strategy:
        model = compiled(strategy, make_mlp(FEATURES, CLASSES))
        loss_only = model.evaluate(x, y, verbose=0)
        model = compiled(strategy, make_mlp(FEATURES, CLASSES), metrics=["accuracy"])
        both = model.evaluate(x, y, verbose=0)
    assert isinstance(loss_only, float)
    assert isinstance(both, list) and len(both) == 2


@pytest.mark.parametrize("num_replicas", [1, 3])
def test_predict_returns_every_output_in_order(num_replicas: int) -> None:
    x, _, _ = data()
    module = make_mlp(FEATURES, CLASSES)
    with torch.no_grad():
        expected = module(x)
    with strategy_for(num_replicas) as strategy:
        with strategy.scope():
            model = mirrored.Model(module)  # never compiled: predict still works
        outputs = model.predict(x, batch_size=BATCH, verbose=0)
    torch.testing.assert_close(outputs, expected)


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(FEATURES, CLASSES)
        self.b = nn.Linear(3, CLASSES)

    def forward(self, features: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return self.a(features) + self.b(extra)


@pytest.mark.parametrize("as_dict", [False, True], ids=["tuple", "dict"])
def test_structured_inputs_reach_forward(as_dict: bool) -> None:
    x, y, _ = data()
    extra = torch.randn(NUM_EXAMPLES, 3)
    inputs = {"features": x, "extra": extra} if as_dict else (x, extra)
    torch.manual_seed(0)
    module = _TwoInputs()
    with torch.no_grad():
        expected = module(x, extra)
    with strategy_for(2) as strategy:
        model = compiled(strategy, module)
        torch.testing.assert_close(model.predict(inputs, batch_size=BATCH, verbose=0), expected)
        history = model.fit(inputs, y, batch_size=BATCH, verbose=0)
    assert math.isfinite(history.history["loss"][0])


def test_numpy_arrays_and_validation() -> None:
    x, y, _ = data()
    with strategy_for(2) as strategy:
        model = compiled(strategy, make_mlp(FEATURES, CLASSES), metrics=["accuracy"])
        history = model.fit(
            x.double().numpy(),  # float64 arrays become the default dtype, as Keras's floatx
            y.numpy(),
            batch_size=BATCH,
            epochs=3,
            validation_data=(x[:50].numpy(), y[:50].numpy()),
            validation_freq=2,
            verbose=0,
        )
    assert history.epoch == [0, 1, 2]
    assert len(history.history["loss"]) == 3
    assert len(history.history["val_loss"]) == 1  # validated after epoch 2 only
    assert set(history.history) >= {"loss", "accuracy", "learning_rate"}


def test_schedules_advance_per_optimizer_step() -> None:
    x, y, _ = data()
    schedule = mirrored.optimizers.schedules.PolynomialDecay(0.1, 10, end_learning_rate=0.0)
    seen: list[float] = []
    with strategy_for(2) as strategy:
        with strategy.scope():
            model = mirrored.Model(make_mlp(FEATURES, CLASSES))
            model.compile(
                optimizer=mirrored.optimizers.SGD(learning_rate=schedule),
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        callback = mirrored.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: seen.append(model.learning_rate)
        )
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[callback])
        # Every replica used the scheduled rate: they are still identical.
        assert_replicas_identical(model._replicas)
    # After update n, the rate of update n + 1 (Keras's optimizer.learning_rate).
    assert seen == pytest.approx([schedule(step) for step in range(1, 14)])


def test_a_torch_lr_scheduler_steps_after_every_update() -> None:
    x, y, _ = data()
    with strategy_for(2) as strategy:
        with strategy.scope():
            model = mirrored.Model(make_mlp(FEATURES, CLASSES))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            model.compile(
                optimizer=optimizer,
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
                lr_scheduler=scheduler,
            )
        model.fit(x[:96], y[:96], batch_size=BATCH, verbose=0)  # 6 updates
    assert model.learning_rate == pytest.approx(0.1 * 0.5**3)


@pytest.mark.parametrize("driver", ["schedule", "lr_scheduler"])
def test_epoch_logs_hold_the_learning_rate_of_the_next_update(driver: str) -> None:
    """Keras logs the optimizer's learning rate as it stands for the next step: after epochs of
    13 updates, the rates of updates 13 and 26."""
    x, y, _ = data()
    loss = mirrored.losses.SparseCategoricalCrossentropy(from_logits=True)
    with strategy_for(2) as strategy:
        with strategy.scope():
            model = mirrored.Model(make_mlp(FEATURES, CLASSES))
            if driver == "schedule":
                rates = mirrored.optimizers.schedules.PiecewiseConstantDecay(
                    [12, 25], [0.1, 0.01, 0.001]
                )
                model.compile(optimizer=mirrored.optimizers.SGD(learning_rate=rates), loss=loss)
            else:
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=13, gamma=0.1)
                model.compile(optimizer=optimizer, loss=loss, lr_scheduler=scheduler)
        history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    assert history.history["learning_rate"] == pytest.approx([0.01, 0.001])
    assert model.learning_rate == pytest.approx(0.001)


@pytest.mark.float32
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_trains_with_float32_master_weights(precision: str) -> None:
    x, y, _ = data()
    reference = make_mlp(FEATURES, CLASSES)
    module = copy.deepcopy(reference)
    torch.manual_seed(3)
    plain_fit(reference, x, y, 2, True)
    torch.manual_seed(3)
    with strategy_for(2) as strategy:
        model = compiled(strategy, module, precision=precision)
        history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert history.history["loss"][1] < history.history["loss"][0]
    # Low-precision compute, same training: close to the float32 run.
    assert_same_parameters(reference, model.module, rtol=0.1, atol=0.05)


@pytest.mark.float32
def test_float16_overflow_skips_the_update_on_every_replica() -> None:
    x, y, _ = data()
    with strategy_for(2) as strategy:
        model = compiled(strategy, make_mlp(FEATURES, CLASSES), precision="16-mixed")
        model._progress.loss_scale = LossScale(scale=1e38)  # overflows
        before = copy.deepcopy(model.state_dict())
        model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0)
        for name, value in model.state_dict().items():
            assert torch.equal(value, before[name]), f"{name} changed in a skipped step"
        assert_replicas_identical(model._replicas)
    assert model._progress.loss_scale.scale == 1e38 / 2


def test_save_and_load_weights(tmp_path: Path) -> None:
    x, y, _ = data()
    with strategy_for(2) as strategy:
        model = compiled(strategy, make_mlp(FEATURES, CLASSES))
        model.fit(x, y, batch_size=BATCH, verbose=0)
        model.save_weights(tmp_path / "weights.pt")
        model.save(tmp_path / "full.pt")
        other = compiled(strategy, make_mlp(FEATURES, CLASSES, seed=7))
        other.load_weights(tmp_path / "weights.pt")
        assert_same_parameters(model.module, other.module, rtol=0, atol=0)
        assert_replicas_identical(other._replicas)
        restored = compiled(strategy, make_mlp(FEATURES, CLASSES, seed=8))
        restored.load(tmp_path / "full.pt")
        assert restored._progress.iterations == model._progress.iterations
        assert_same_parameters(model.module, restored.module, rtol=0, atol=0)
    saved = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert set(saved) == set(model.state_dict())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary files left"


def test_load_weights_that_do_not_fit_loads_nothing(tmp_path: Path) -> None:
    torch.save(make_mlp(FEATURES, CLASSES + 1).state_dict(), tmp_path / "other.pt")
    with strategy_for(2) as strategy:
        model = compiled(strategy, make_mlp(FEATURES, CLASSES))
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(ValueError, match=r"different shapes.*nothing was loaded"):
            model.load_weights(tmp_path / "other.pt")
        with pytest.raises(FileNotFoundError, match=r"missing\.pt"):
            model.load_weights(tmp_path / "missing.pt")
        (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
        with pytest.raises(ValueError, match="not a readable checkpoint"):
            model.load_weights(tmp_path / "junk.pt")
        with pytest.raises(ValueError, match=r"not written by Model\.save"):
            model.load(tmp_path / "other.pt")
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])


def test_load_of_another_optimizer_s_training_state_changes_nothing(tmp_path: Path) -> None:
    x, y, _ = data()
    with strategy_for(2) as strategy:
        with strategy.scope():
            sgd = mirrored.Model(make_mlp(FEATURES, CLASSES))
            sgd.compile(
                optimizer=torch.optim.SGD(sgd.parameters(), lr=0.1, momentum=0.9),
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        sgd.fit(x, y, batch_size=BATCH, verbose=0)
        sgd.save(tmp_path / "sgd.pt")
        model = compiled(strategy, make_mlp(FEATURES, CLASSES, seed=7))
        model.fit(x[:32], y[:32], batch_size=BATCH, verbose=0)
        weights = copy.deepcopy(model.state_dict())
        optimizer = copy.deepcopy(model.optimizer.state_dict())
        # torch took SGD's hyperparameters, then failed on KeyError: 'step' (the next fit on
        # KeyError: 'betas')
        with pytest.raises(
            ValueError, match=r"group 0 has no \['betas', 'eps'\] \(.*saved by SGD\?\)"
        ):
            model.load(tmp_path / "sgd.pt")
        saved = checkpoint.load(tmp_path / "sgd.pt")
        saved["optimizer"]["param_groups"] = optimizer["param_groups"]
        checkpoint.save(saved, tmp_path / "mixed.pt")
        with pytest.raises(ValueError, match=r"parameter \d+ has no 'step' .*saved by .*SGD\?"):
            model.load(tmp_path / "mixed.pt")
        state = {"format": "mirrored.model/1", **model.training_state()}
        state["model"] = {k: v + 1 for k, v in state["model"].items()}
        state["loss_scale"] = {"scale": float("nan"), "good_steps": 0}
        checkpoint.save(state, tmp_path / "scaled.pt")
        with pytest.raises(ValueError, match=r"the loss scale is nan, expected a finite number"):
            model.load(tmp_path / "scaled.pt")
        for name, value in model.state_dict().items():
            assert torch.equal(value, weights[name]), name
        assert model.optimizer.state_dict()["param_groups"] == optimizer["param_groups"]
        assert_replicas_identical(model._replicas)
        model.fit(x, y, batch_size=BATCH, verbose=0)  # still trains


def test_load_weights_with_an_entry_that_is_not_a_tensor_loads_nothing(tmp_path: Path) -> None:
    with strategy_for(2) as strategy:
        model = compiled(strategy, make_mlp(FEATURES, CLASSES))
        before = copy.deepcopy(model.state_dict())
        saved = {k: v + 1 for k, v in before.items()}
        saved[list(saved)[-1]] = [0.0] * CLASSES  # torch copied the others, then failed
        checkpoint.save(saved, tmp_path / "listed.pt")
        with pytest.raises(ValueError, match=r"checkpoint list, model a tensor.*nothing was"):
            model.load_weights(tmp_path / "listed.pt")
        for name, value in model.state_dict().items():
            assert torch.equal(value, before[name]), name
        assert_replicas_identical(model._replicas)


def test_weights_that_are_not_finite_are_not_saved_unless_allowed(tmp_path: Path) -> None:
    with strategy_for(2) as strategy:
        model = compiled(strategy, make_mlp(FEATURES, CLASSES))
        model.save_weights(tmp_path / "weights.pt")
        good = (tmp_path / "weights.pt").read_bytes()
        name = list(model.state_dict())[1]
        with torch.no_grad():
            model.module.get_parameter(name)[0] = float("nan")
        for save in (model.save_weights, model.save):
            with pytest.raises(ValueError, match=rf"not finite \('{name}' holds a NaN.*stays"):
                save(tmp_path / "weights.pt")
        assert (tmp_path / "weights.pt").read_bytes() == good
        assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.pt"]
        model.save_weights(tmp_path / "weights.pt", allow_non_finite=True)
        model.save(tmp_path / "full.pt", allow_non_finite=True)
        assert checkpoint.load(tmp_path / "weights.pt")[name][0].isnan().all()


def test_summary_counts_parameters() -> None:
    model = mirrored.Model(make_mlp(FEATURES, CLASSES))  # the default strategy
    lines: list[str] = []
    text = model.summary(print_fn=lines.append)
    total = sum(p.numel() for p in model.parameters())
    assert f"Total params: {total:,}" in text
    assert "0 (Linear)" in text
    assert lines == [text]


def test_default_strategy_outside_any_scope() -> None:
    x, y, _ = data()
    reference = make_mlp(FEATURES, CLASSES)
    module = copy.deepcopy(reference)
    plain_fit(reference, x, y, 1, False)
    model = mirrored.Model(module)
    model.compile(
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
        loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert_same_parameters(reference, module)


@pytest.mark.float32  # float32 arrays, as a Keras program has them
def test_names_resolve_to_keras_objects() -> None:
    x = np.random.default_rng(0).normal(size=(40, FEATURES)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.float32).reshape(-1, 1)
    model = mirrored.Model(nn.Sequential(nn.Linear(FEATURES, 1), nn.Sigmoid()))
    model.compile(optimizer="sgd", loss="binary_crossentropy", metrics=["accuracy"])
    results = model.evaluate(x, y, verbose=0, return_dict=True)
    assert set(results) == {"loss", "accuracy"}
    assert isinstance(model.optimizer, torch.optim.SGD)


class TestBadInput:
    def model(self) -> mirrored.Model:
        return compiled(mirrored.get_strategy(), make_mlp(FEATURES, CLASSES))

    def test_fit_before_compile(self) -> None:
        x, y, _ = data()
        with pytest.raises(RuntimeError, match="compile"):
            mirrored.Model(make_mlp()).fit(x, y, verbose=0)

    def test_unknown_names(self) -> None:
        model = mirrored.Model(make_mlp())
        with pytest.raises(ValueError, match="adamm"):
            model.compile(optimizer="adamm", loss="mse")
        with pytest.raises(ValueError, match="msee"):
            model.compile(optimizer="adam", loss="msee")
        with pytest.raises(ValueError, match="acuracy"):
            model.compile(optimizer="adam", loss="mse", metrics=["acuracy"])
        with pytest.raises(ValueError, match="precision"):
            model.compile(optimizer="adam", loss="mse", precision="fp8")
        with pytest.raises(TypeError, match="list"):
            model.compile(optimizer="adam", loss="mse", metrics="accuracy")

    def test_y_given_twice(self) -> None:
        x, y, _ = data()
        loader = DataLoader(TensorDataset(x, y), batch_size=BATCH)
        with pytest.raises(ValueError, match="y was given twice"):
            self.model().fit(loader, y, verbose=0)
        with pytest.raises(ValueError, match="batch_size"):
            self.model().fit(loader, batch_size=8, verbose=0)

    def test_empty_data(self) -> None:
        with pytest.raises(ValueError, match="no batches"):
            self.model().fit([], verbose=0)
        with pytest.raises(ValueError, match="0 examples"):
            self.model().fit(torch.zeros(0, FEATURES), torch.zeros(0), verbose=0)
        with pytest.raises(ValueError, match="no batches"):
            self.model().evaluate([], verbose=0)

    def test_lengths_that_differ(self) -> None:
        x, y, _ = data()
        with pytest.raises(ValueError, match="same number of examples"):
            self.model().fit(x, y[:-1], verbose=0)

    def test_wrong_shapes_reach_a_clear_error(self) -> None:
        x, _, _ = data()
        with pytest.raises(ValueError, match="shape"):
            self.model().fit(x, torch.zeros(NUM_EXAMPLES, 2, 3).long(), verbose=0)

    def test_bad_arguments(self) -> None:
        x, y, _ = data()
        model = self.model()
        with pytest.raises(ValueError, match="epochs"):
            model.fit(x, y, epochs=0, verbose=0)
        with pytest.raises(ValueError, match="verbose"):
            model.fit(x, y, verbose=3)
        with pytest.raises(ValueError, match="batch_size"):
            model.fit(x, y, batch_size=0, verbose=0)
        with pytest.raises(ValueError, match="validation_freq"):
            model.fit(x, y, validation_data=(x, y), validation_freq=0, verbose=0)
        with pytest.raises(ValueError, match="validation_data"):
            model.fit(x, y, validation_data=(x, y, y, y), verbose=0)
        with pytest.raises(TypeError, match="callbacks"):
            model.fit(x, y, callbacks=[print], verbose=0)  # type: ignore[list-item]
        with pytest.raises(TypeError, match="Module"):
            mirrored.Model("not a module")  # type: ignore[arg-type]

    def test_model_and_compile_in_different_scopes(self) -> None:
        with strategy_for(2) as first, strategy_for(2) as second:
            with first.scope():
                model = mirrored.Model(make_mlp())
            with second.scope(), pytest.raises(ValueError, match="same scope"):
                model.compile(optimizer="adam", loss="mse")

    def test_lr_scheduler_mistakes(self) -> None:
        model = mirrored.Model(make_mlp())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        other = torch.optim.SGD(make_mlp().parameters(), lr=0.1)
        with pytest.raises(ValueError, match="another optimizer"):
            model.compile(
                optimizer=optimizer,
                loss="mse",
                lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1),
            )
        with pytest.raises(TypeError, match="ReduceLROnPlateau"):
            model.compile(
                optimizer=optimizer,
                loss="mse",
                lr_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer),
            )

    def test_learning_rate_set_while_a_schedule_drives_it(self) -> None:
        model = mirrored.Model(make_mlp())
        schedule = mirrored.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
        model.compile(optimizer=mirrored.optimizers.SGD(schedule), loss="mse")
        with pytest.raises(ValueError, match="schedule"):
            model.learning_rate = 0.5


def test_a_compile_that_fails_changes_nothing() -> None:
    """A re-compile refused for its optimizer, or for one of its arguments, leaves the model
    compiled, mirrored and training as before."""
    x, y, _ = data()
    reference = make_mlp()
    plain_fit(reference, x, y, epochs=2, shuffle=False)
    with strategy_for(2) as strategy:
        model = compiled(strategy, make_mlp())
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        foreign = torch.optim.SGD(make_mlp().parameters(), lr=0.1)
        loss = mirrored.losses.SparseCategoricalCrossentropy(from_logits=True)
        with strategy.scope():
            with pytest.raises(ValueError, match="not in the module"):
                model.compile(optimizer=foreign, loss=loss, steps_per_execution=2)
            with pytest.raises(ValueError, match="precision"):
                model.compile(optimizer="sgd", loss=loss, steps_per_execution=2, precision="8")
        assert model._steps_per_execution == 1
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        assert_replicas_identical(model._replicas)
    assert_same_parameters(reference, model.module)


def test_predict_from_a_callback_keeps_training_mode_and_fit_state() -> None:
    x, y, _ = data()
    modes: list[bool] = []
    with strategy_for(2) as strategy:
        model = compiled(strategy, nn.Sequential(make_mlp(FEATURES, CLASSES), nn.Dropout(0.1)))

        def peek(batch: int, logs: object) -> None:
            model.predict(x[:4], verbose=0)
            modes.append(bool(model.module.training))
            with pytest.raises(RuntimeError, match="during fit"):
                model.evaluate(x, y, verbose=0)

        callback = mirrored.callbacks.LambdaCallback(on_train_batch_end=peek)
        history = model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[callback])
    assert modes and all(modes)
    assert model.history is history and len(history.history["loss"]) == 1


def test_a_one_shot_iterator_that_runs_out_ends_fit_without_a_phantom_epoch() -> None:
    x, y, _ = data()
    batches = iter([(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, 3 * BATCH, BATCH)])
    model = compiled(mirrored.get_strategy(), make_mlp(FEATURES, CLASSES))
    with pytest.warns(UserWarning, match="ran out of data"):
        history = model.fit(batches, epochs=3, verbose=0)
    assert history.epoch == [0] and len(history.history["loss"]) == 1


def test_ignore_class_is_refused_by_compile() -> None:
    model = mirrored.Model(make_mlp())
    with pytest.raises(ValueError, match="ignore_class"):
        model.compile(
            optimizer="adam",
            loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0),
        )
