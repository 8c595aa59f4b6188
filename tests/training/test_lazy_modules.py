"""Lazy modules (nn.LazyLinear, a Keras Dense without an input shape): Model builds them on the
first batch, then mirrors them; fit on N replicas == fit on one device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mirrored
from tests.reference_loops import assert_replicas_identical, assert_same_parameters

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

NUM_EXAMPLES, BATCH, FEATURES, CLASSES = 70, 16, 12, 5


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_EXAMPLES, FEATURES, generator=generator)
    return x, torch.randint(0, CLASSES, (NUM_EXAMPLES,), generator=generator)


def lazy_mlp() -> nn.Module:
    return nn.Sequential(nn.LazyLinear(32), nn.ReLU(), nn.LazyLinear(CLASSES))


def fit_lazy(num_replicas: int, optimizer: str) -> tuple[nn.Module, mirrored.Model]:
    x, y = data()
    with mirrored.MirroredStrategy([f"cpu:{i}" for i in range(num_replicas)]) as strategy:
        with strategy.scope():
            model = mirrored.Model(lazy_mlp())
            lazy_parameters = list(model.parameters())
            torch_optimizer = torch.optim.Adam(lazy_parameters, lr=1e-2)
            model.compile(
                optimizer=torch_optimizer if optimizer == "torch" else "adam",
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        assert model._replicas is None  # mirrored once built, on the first batch
        torch.manual_seed(4)  # the parameters are initialised from it when they are built
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
        if num_replicas > 1:
            assert_replicas_identical(model._replicas)
    # torch materialised the parameter objects in place: the optimizer built on them before
    # holds the trained parameters, and has a state for each.
    assert all(a is b for a, b in zip(lazy_parameters, model.parameters(), strict=True))
    trained = model.optimizer
    assert trained is not None and len(trained.state) == len(lazy_parameters)
    assert all(type(p) is nn.Parameter for p in model.parameters())
    return model.module, model


@pytest.mark.parametrize("optimizer", ["torch", "adam"], ids=["torch_optimizer", "name"])
def test_a_lazy_model_fit_on_two_replicas_equals_one_device(optimizer: str) -> None:
    one_device, _ = fit_lazy(1, optimizer)
    two_replicas, model = fit_lazy(2, optimizer)
    assert_same_parameters(one_device, two_replicas)
    assert model.module[0].weight.shape == (32, FEATURES)


@pytest.mark.parametrize("num_replicas", [1, 3])
def test_predict_and_evaluate_build_a_lazy_model(num_replicas: int) -> None:
    x, y = data()
    with mirrored.MirroredStrategy([f"cpu:{i}" for i in range(num_replicas)]) as strategy:
        with strategy.scope():
            model = mirrored.Model(lazy_mlp())
        model.module.train()
        outputs = model.predict(x, batch_size=BATCH, verbose=0)  # never compiled
        assert model.module.training  # the mode it had, back after predict
        model.module.eval()
        with torch.no_grad():
            expected = model.module(x)
        with strategy.scope():
            evaluated = mirrored.Model(lazy_mlp())
            evaluated.compile(loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True))
        loss = evaluated.evaluate(x, y, batch_size=BATCH, verbose=0)
    torch.testing.assert_close(outputs, expected)
    assert loss > 0


class _UnreachedLazyLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.LazyLinear(CLASSES)
        self.unused = nn.LazyLinear(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_a_lazy_layer_the_forward_does_not_reach_is_named() -> None:
    x, y = data()
    model = mirrored.Model(_UnreachedLazyLayer())
    model.compile(loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match=r"_UnreachedLazyLayer.*still has lazy parameters"):
        model.fit(x, y, batch_size=BATCH, verbose=0)


def test_loading_into_a_lazy_model_before_it_is_built_is_refused() -> None:
    model = mirrored.Model(lazy_mlp())
    with pytest.raises(ValueError, match="lazy parameters that are not built yet"):
        model.load_state_dict({})
