"""Model.load into a model whose lazy layers are not built yet: the clear error load_weights
gives (not an AttributeError from deep inside), a ValueError that says how to build them, and a
load once they are built; a file with any part that does not fit loads nothing."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import mirrored


def _lazy_model() -> mirrored.Model:
    torch.manual_seed(0)
    model = mirrored.Model(nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.LazyLinear(3)))
    model.compile(optimizer="adam", loss=mirrored.losses.SparseCategoricalCrossentropy(True))
    return model


def test_load_into_an_unbuilt_lazy_model_says_so_as_load_weights_does(tmp_path):
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy, strategy.scope():
        built = _lazy_model()
        built.fit(x, y, batch_size=8, verbose=0)
        built.save(tmp_path / "model.pt")
        built.save_weights(tmp_path / "weights.pt")
        saved = {k: v.clone() for k, v in built.state_dict().items()}

        unbuilt = _lazy_model()
        errors = []
        for load in (
            lambda: unbuilt.load(tmp_path / "model.pt"),
            lambda: unbuilt.load_weights(tmp_path / "weights.pt"),
            lambda: unbuilt.load_training_state(built.training_state()),
        ):
            with pytest.raises(ValueError, match=r"lazy parameters that are not built yet") as e:
                load()
            errors.append(str(e.value))
        assert len(set(errors)) == 1 and "Sequential" in errors[0]
        assert "before loading: model.predict(x[:1])" in errors[0]

        unbuilt.predict(x[:1], verbose=0)  # what the error says: one batch builds it
        unbuilt.load(tmp_path / "model.pt")
        assert_close(unbuilt.state_dict(), saved, rtol=0, atol=0)
        unbuilt.evaluate(x, y, verbose=0)  # and it trains and evaluates as the saved one


def _damage(saved: dict, part: str) -> None:
    """One part of a ``Model.save`` file made not to fit the model."""
    if part == "weights":
        saved["model"]["2.weight"] = torch.zeros(4, 8)
    elif part == "optimizer":
        saved["optimizer"]["param_groups"][0]["nesterov"] = True
    elif part == "optimizer-state":
        first = next(iter(saved["optimizer"]["state"].values()))
        first["exp_avg"] = torch.zeros(3)
    elif part == "iterations":
        saved["iterations"] = "many"


@pytest.mark.parametrize(
    ("part", "named"),
    [
        ("weights", "2.weight"),
        ("optimizer", "nesterov"),
        ("optimizer-state", "exp_avg"),
        ("iterations", "iterations"),
    ],
)
def test_each_damaged_part_of_a_saved_model_loads_nothing(tmp_path, part, named):
    """``Model.load`` checks every part before it changes any: the weights, the optimizer's
    state and the step count stay as they were, on every replica."""
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy, strategy.scope():
        trained = _lazy_model()
        trained.fit(x, y, batch_size=8, epochs=2, verbose=0)
        trained.save(tmp_path / "model.pt")
        saved = mirrored.checkpoint.load(tmp_path / "model.pt")
        _damage(saved, part)
        mirrored.checkpoint.save(saved, tmp_path / "model.pt")

        model = _lazy_model()
        model.fit(x, y, batch_size=8, verbose=0)
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer = copy.deepcopy(model.optimizer.state_dict())
        iterations = model.training_state()["iterations"]
        with pytest.raises(ValueError, match=named):
            model.load(tmp_path / "model.pt")
        assert_close(model.state_dict(), weights, rtol=0, atol=0)
        after = model.optimizer.state_dict()
        assert after["param_groups"] == optimizer["param_groups"]
        assert_close(after["state"], optimizer["state"], rtol=0, atol=0)
        assert model.training_state()["iterations"] == iterations
        for replica in model._mirrored_module().replicas[1:]:
            assert_close(replica.state_dict(), weights, rtol=0, atol=0)
