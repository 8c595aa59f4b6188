"""What TensorFlow users write, accepted by Model: one metric for metrics=, Keras's loss and metric
functions, get_layer(...).trainable = False, uint8 images fed to a float model."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from tests.reference_loops import assert_replicas_identical, assert_same_parameters, make_mlp

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

NUM_EXAMPLES, BATCH, FEATURES, CLASSES = 70, 16, 12, 5


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_EXAMPLES, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (NUM_EXAMPLES,), generator=generator)
    return x, y, torch.rand(NUM_EXAMPLES, generator=generator)


def strategy_for(num_replicas: int) -> mirrored.MirroredStrategy:
    return mirrored.MirroredStrategy([f"cpu:{i}" for i in range(num_replicas)])


def test_one_metric_not_in_a_list_is_taken_as_a_list_of_one() -> None:
    x, y, weight = data()
    module = make_mlp(FEATURES, CLASSES)
    with torch.no_grad():
        correct = (module(x).argmax(-1) == y).double()
    with strategy_for(3) as strategy, strategy.scope():
        model = mirrored.Model(module)
        model.compile(
            loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=mirrored.metrics.SparseCategoricalAccuracy,
            weighted_metrics=mirrored.metrics.SparseCategoricalAccuracy(),
        )
        results = model.evaluate(
            x, y, sample_weight=weight, batch_size=BATCH, verbose=0, return_dict=True
        )
    weighted = (correct * weight.double()).sum() / weight.double().sum()
    assert results["sparse_categorical_accuracy"] == pytest.approx(correct.mean().item())
    assert results["weighted_sparse_categorical_accuracy"] == pytest.approx(weighted.item())


def test_a_metric_name_not_in_a_list_is_refused_with_our_spelling() -> None:
    model = mirrored.Model(make_mlp())
    with pytest.raises(TypeError, match=r"metrics=\['accuracy'\]"):
        model.compile(loss="mse", metrics="accuracy")


def test_keras_loss_and_metric_functions_compile_with_their_names_in_the_logs() -> None:
    x, y, _ = data()
    module = nn.Sequential(make_mlp(FEATURES, CLASSES), nn.Softmax(dim=-1))
    with torch.no_grad():
        probabilities = module(x)
    cross_entropy = F.nll_loss(probabilities.log(), y)
    accuracy = (probabilities.argmax(-1) == y).double().mean()
    with strategy_for(3) as strategy, strategy.scope():
        model = mirrored.Model(module)
        model.compile(
            loss=mirrored.losses.sparse_categorical_crossentropy,
            metrics=[
                mirrored.metrics.sparse_categorical_accuracy,
                mirrored.losses.sparse_categorical_crossentropy,
            ],
        )
        results = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    assert results == pytest.approx(
        {
            "loss": cross_entropy.item(),
            "sparse_categorical_accuracy": accuracy.item(),
            "sparse_categorical_crossentropy": cross_entropy.item(),
        },
        rel=1e-5,
    )


def test_a_partial_loss_function_fits_as_the_loss_object_and_keeps_its_name() -> None:
    x, y, _ = data()
    by_function, by_object = make_mlp(FEATURES, CLASSES), make_mlp(FEATURES, CLASSES)
    from_logits = functools.partial(
        mirrored.losses.sparse_categorical_crossentropy, from_logits=True
    )
    with strategy_for(2) as strategy:
        with strategy.scope():
            function_model = mirrored.Model(by_function)
            function_model.compile(optimizer="sgd", loss=from_logits, metrics=[from_logits])
            object_model = mirrored.Model(by_object)
            object_model.compile(
                optimizer="sgd",
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        history = function_model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        object_model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert_same_parameters(by_object, by_function)
    assert "sparse_categorical_crossentropy" in history.history


@pytest.mark.parametrize("when", ["before_compile", "after_compile"])
def test_get_layer_trainable_false_freezes_the_layer_on_every_replica(when: str) -> None:
    x, y, _ = data()
    reference = make_mlp(FEATURES, CLASSES)
    module = copy.deepcopy(reference)
    before = copy.deepcopy(reference[0].state_dict())
    reference[0].requires_grad_(False)  # the plain loop with the first layer frozen
    optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    for start in range(0, NUM_EXAMPLES, BATCH):
        F.cross_entropy(reference(x[start : start + BATCH]), y[start : start + BATCH]).backward()
        optimizer.step()
        optimizer.zero_grad()
    with strategy_for(3) as strategy:
        with strategy.scope():
            model = mirrored.Model(module)
            layer = model.get_layer(index=0)
            if when == "before_compile":
                layer.trainable = False
            model.compile(
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        if when == "after_compile":
            layer.trainable = False  # a handle taken before compile reaches the replicas
        assert not layer.trainable and not model.get_layer("0").trainable
        assert model.get_layer("2").trainable
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        for replica in model._replicas.replicas:
            for name, value in replica[0].state_dict().items():
                assert torch.equal(value, before[name]), f"replica's frozen {name} moved"
        assert_replicas_identical(model._replicas)
        layer.trainable = True
        assert all(p.requires_grad for r in model._replicas.replicas for p in r.parameters())
    assert_same_parameters(reference, model.module)


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU())
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def test_get_layer_finds_nested_layers_and_names_its_mistakes() -> None:
    model = mirrored.Model(_Encoder())
    assert model.get_layer("encoder.0").module is model.module.encoder[0]
    assert model.get_layer(index=-1).name == "head"
    assert model.get_layer("head").out_features == CLASSES  # reads the layer's attributes
    with pytest.raises(ValueError, match=r"no such layer.*\['encoder', 'head'\]"):
        model.get_layer("decoder")
    with pytest.raises(ValueError, match="not both"):
        model.get_layer("head", index=1)
    with pytest.raises(ValueError, match="not neither"):
        model.get_layer()
    with pytest.raises(ValueError, match=r"index=2.*2 top-level layers"):
        model.get_layer(index=2)
    with pytest.raises(TypeError, match="trainable=0"):
        model.get_layer("head").trainable = 0  # type: ignore[assignment]


class _Images(nn.Module):
    """Images and token ids: the uint8 images are cast, the int64 ids are not."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.embedding = nn.Embedding(10, CLASSES)
        self.linear = nn.Linear(16, CLASSES)

    def forward(self, image: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.linear(image.flatten(1)) + self.embedding(ids).mean(dim=1)


def test_uint8_images_are_cast_to_the_model_dtype_and_token_ids_are_not() -> None:
    generator = torch.Generator().manual_seed(5)
    images = torch.randint(0, 4, (NUM_EXAMPLES, 1, 4, 4), generator=generator, dtype=torch.uint8)
    ids = torch.randint(0, 10, (NUM_EXAMPLES, 3), generator=generator)
    y = torch.randint(0, CLASSES, (NUM_EXAMPLES,), generator=generator)
    as_uint8, as_float = _Images(), _Images()
    with strategy_for(2) as strategy:
        models = []
        for module, image_input in (
            (as_uint8, images),
            (as_float, images.to(torch.get_default_dtype())),
        ):
            with strategy.scope():
                model = mirrored.Model(module)
                model.compile(
                    optimizer="sgd",
                    loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
                )
            inputs = {"image": image_input, "ids": ids}
            model.fit(inputs, y, batch_size=BATCH, shuffle=False, verbose=0)
            model.evaluate(inputs, y, batch_size=BATCH, verbose=0)
            models.append(model.predict(inputs, batch_size=BATCH, verbose=0))
    assert_same_parameters(as_float, as_uint8, rtol=0, atol=0)
    torch.testing.assert_close(models[0], models[1], rtol=0, atol=0)
