"""Loss scaling: the helpers are exact on any split, and a replica's loss averaged over its shard
is refused at backward before any gradient changes."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from mirrored.replication import global_batch_loss
from tests.reference_loops import (
    assert_replicas_identical,
    assert_same_parameters,
    make_batches,
    make_mlp,
)

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

VOCAB, LENGTH, IGNORE = 11, 6, -100


@pytest.fixture(autouse=True)
def warn_again(monkeypatch):
    """The unscaled-loss warning comes once a process: let every test see its own."""
    monkeypatch.setattr(global_batch_loss, "_warned", False)


class TinyMaskedLM(nn.Module):
    """Embedding, one mixing layer and a vocabulary head: a masked language model's shape."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Embedding(VOCAB, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def masked_lm_batches(num_batches: int = 5, batch_size: int = 7) -> list[tuple]:
    """Token batches whose labels are -100 except at a few random positions, so that the number
    of predicted tokens differs from shard to shard (one batch predicts nothing at all)."""
    generator = torch.Generator().manual_seed(5)
    batches = []
    for index in range(num_batches):
        tokens = torch.randint(0, VOCAB, (batch_size, LENGTH), generator=generator)
        chosen = torch.rand(batch_size, LENGTH, generator=generator) < 0.3
        if index == 2:
            chosen[:] = False
        labels = torch.where(chosen, tokens, torch.full_like(tokens, IGNORE))
        batches.append((tokens, labels))
    return batches


def per_token_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")


def plain_masked_lm(batches: list[tuple]) -> nn.Module:
    """The plain loop: the mean over the batch's predicted tokens (an empty batch: no step)."""
    model = TinyMaskedLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for tokens, labels in batches:
        valid = labels.flatten() != IGNORE
        if valid.any():
            loss = per_token_loss(model, tokens, labels).sum() / valid.sum()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def mirrored_masked_lm(strategy: mirrored.Strategy, batches: list[tuple], own_loss: bool):
    module = TinyMaskedLM()
    model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.5))

    def step(batch):
        tokens, labels = batch
        per_token = per_token_loss(model, tokens, labels)
        valid = labels.flatten() != IGNORE
        if own_loss:  # a model's own mean over its shard's valid tokens, as Hugging Face's
            mean = per_token.sum() / valid.sum()
            loss = mirrored.scale_shard_mean(mean, valid.sum())
        else:
            loss = mirrored.compute_weighted_average_loss(per_token, valid)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    losses = []
    for batch in strategy.experimental_distribute_dataset(batches):
        losses.append(float(strategy.reduce("sum", strategy.run(step, (batch,)), axis=None)))
    return model, losses


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("own_loss", [False, True], ids=["weighted", "shard_mean"])
def test_token_level_losses_equal_the_plain_loop(devices, own_loss):
    batches = masked_lm_batches()
    expected = plain_masked_lm(batches)
    with mirrored.MirroredStrategy([f"cpu:{i}" for i in range(devices)]) as strategy:
        model, losses = mirrored_masked_lm(strategy, batches, own_loss)
    assert_same_parameters(expected, model.module)
    assert_replicas_identical(model)
    assert losses[2] == 0.0  # nothing predicted anywhere: a loss of 0, not NaN
    assert all(loss > 0 for i, loss in enumerate(losses) if i != 2)


def test_weighted_average_outside_replicas_is_the_masked_mean():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[True, False], [True, True]])
    assert mirrored.compute_weighted_average_loss(values, mask).item() == pytest.approx(8 / 3)
    assert mirrored.compute_weighted_average_loss(values).item() == pytest.approx(2.5)
    weights = torch.tensor([[0.5], [1.0]])  # broadcast along the row
    expected = (0.5 * 3 + 7) / 3
    assert mirrored.compute_weighted_average_loss(values, weights).item() == pytest.approx(expected)


def test_helpers_say_what_was_wrong():
    with pytest.raises(ValueError, match=r"weights of shape \[3\] do not broadcast"):
        mirrored.compute_weighted_average_loss(torch.ones(2, 2), torch.ones(3))
    with pytest.raises(TypeError, match="reduction='none'"):
        mirrored.compute_weighted_average_loss([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one-element loss"):
        mirrored.scale_shard_mean(torch.ones(3), 3)


def test_regularization_loss_counts_once_over_the_replicas():
    batches = make_batches()[:4]
    penalty = 0.1

    def loss_of(model, x, y, scale):
        weight_penalty = penalty * sum(p.square().sum() for p in model.parameters())
        data = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        return data + scale(weight_penalty)

    expected = make_mlp()
    optimizer = torch.optim.SGD(expected.parameters(), lr=0.1)
    for x, y in batches:
        loss_of(expected, x, y, lambda v: v).backward()
        optimizer.step()
        optimizer.zero_grad()
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]) as strategy:
        module = make_mlp()
        model, mirrored_optimizer = strategy.mirror(
            module, torch.optim.SGD(module.parameters(), lr=0.1)
        )

        def step(batch):
            x, y = batch
            loss_of(model, x, y, mirrored.scale_regularization_loss).backward()
            mirrored_optimizer.step()
            mirrored_optimizer.zero_grad()

        for batch in strategy.experimental_distribute_dataset(batches):
            strategy.run(step, (batch,))
    assert_same_parameters(expected, model.module)


def _loss_averaged_per_shard(model, x, y):
    return F.cross_entropy(model(x), y)


def _label_smoothed_mean(model, x, y):
    return F.cross_entropy(model(x), y, label_smoothing=0.1) * 0.5


def _output_mean(model, x, y):
    return model(x).square().mean()


def _mse_mean(model, x, y):
    return F.mse_loss(model(x), F.one_hot(y, 5).float())


def _shard_mean_beside_a_scaled_term(model, x, y):
    penalty = 1e-3 * sum(p.square().sum() for p in model.parameters())
    return F.cross_entropy(model(x), y) + mirrored.scale_regularization_loss(penalty)


def _mean_of_weights_picked_by_labels(model, x, y):
    """A mean over rows of a weight chosen by the shard's labels: it depends on the batch."""
    data = F.cross_entropy(model(x), y, reduction="sum") / 16
    return data + model[0].weight[y].square().mean()


def _mean_of_weights_minus_an_input(model, x, y):
    data = F.cross_entropy(model(x), y, reduction="sum") / 16
    return data + (model[0].weight - x.mean(dim=0)).square().mean()


def _shard_mean_beside_a_summed_term(model, x, y):
    return F.cross_entropy(model(x), y, reduction="sum") - 2.0 * F.cross_entropy(model(x), y)


@pytest.mark.parametrize(
    "loss_fn",
    [
        _loss_averaged_per_shard,
        _label_smoothed_mean,
        _output_mean,
        _mse_mean,
        _shard_mean_beside_a_scaled_term,
        _mean_of_weights_picked_by_labels,
        _mean_of_weights_minus_an_input,
        _shard_mean_beside_a_summed_term,
    ],
    ids=[
        "cross_entropy",
        "label_smoothing",
        "tensor_mean",
        "mse",
        "beside_a_scaled_term",
        "weights_picked_by_labels",
        "weights_minus_an_input",
        "beside_a_summed_term",
    ],
)
def test_a_loss_averaged_over_the_shard_is_refused_before_any_change(loss_fn):
    x, y = make_batches()[0]
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        module = make_mlp()
        before = {k: v.clone() for k, v in module.state_dict().items()}
        model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))

        def step(batch):
            loss_fn(model, *batch).backward()
            optimizer.step()

        batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
        with pytest.raises(ValueError, match="mean over this replica's shard") as raised:
            strategy.run(step, (batch,))
        assert "2x the single-device gradient" in str(raised.value)
        assert "compute_average_loss" in str(raised.value)
        for replica in model.replicas:
            assert all(p.grad is None for p in replica.parameters())
            for name, value in replica.state_dict().items():
                assert torch.equal(value, before[name]), name


def test_an_unrecognised_loss_warns_once_and_trains():
    x, y = make_batches()[0]
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        module = make_mlp()
        model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))

        def step(batch):  # TensorFlow's hand-written form: a sum over the global batch size
            inputs, labels = batch
            (F.cross_entropy(model(inputs), labels, reduction="sum") / len(x)).backward()
            optimizer.step()
            optimizer.zero_grad()

        batches = list(strategy.experimental_distribute_dataset([(x, y)] * 3))
        with pytest.warns(mirrored.LossScalingWarning, match="did not come through"):
            strategy.run(step, (batches[0],))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for batch in batches[1:]:
                strategy.run(step, (batch,))


def test_a_mean_over_parameters_alone_is_a_penalty_not_a_shard_mean():
    """A weight penalty written as a mean of squared weights, scaled by hand as the data loss
    is: it reads no input, so it trains (with the one warning about losses scaled by hand)."""
    batches = make_batches()[:4]
    penalty = 0.01

    def loss_of(model, x, y, global_batch_size, num_replicas):
        data = F.cross_entropy(model(x), y, reduction="sum") / global_batch_size
        weights = sum(p.pow(2).mean() for p in model.parameters())
        return data + penalty * weights / num_replicas

    expected = make_mlp()
    optimizer = torch.optim.SGD(expected.parameters(), lr=0.1)
    for x, y in batches:
        loss_of(expected, x, y, len(x), 1).backward()
        optimizer.step()
        optimizer.zero_grad()
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        module = make_mlp()
        model, mirrored_optimizer = strategy.mirror(
            module, torch.optim.SGD(module.parameters(), lr=0.1)
        )

        def step(batch):
            loss_of(model, *batch, len(batches[0][0]), 2).backward()
            mirrored_optimizer.step()
            mirrored_optimizer.zero_grad()

        with pytest.warns(mirrored.LossScalingWarning, match="did not come through"):
            for batch in strategy.experimental_distribute_dataset(batches):
                strategy.run(step, (batch,))
    assert_same_parameters(expected, model.module)


def test_scaled_losses_pass_silently_in_sums_and_scales():
    x, y = make_batches()[0]
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        module = make_mlp()
        model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))

        def step(batch):
            inputs, labels = batch
            logits = model(inputs)
            main = mirrored.compute_average_loss(F.cross_entropy(logits, labels, reduction="none"))
            penalty = mirrored.scale_regularization_loss(logits.new_ones(()) * 0 + 1e-3)
            (2.0 * (main + penalty)).backward()  # a loss scale on a sum of scaled terms
            optimizer.step()
            optimizer.zero_grad()

        batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            strategy.run(step, (batch,))


class TinyVAE(nn.Module):
    """pytorch/examples' VAE, shrunk (its sampling left out: z is the mean)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.encode = nn.Linear(12, 6)
        self.decode = nn.Linear(3, 12)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mu, logvar = self.encode(x).chunk(2, dim=1)
        return torch.sigmoid(self.decode(torch.tanh(mu))), mu, logvar


def _vae_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The examples' loss as written there: sums over the batch (``reduction="sum"``)."""
    recon, mu, logvar = model(x)
    bce = F.binary_cross_entropy(recon, x, reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld


def test_a_loss_summed_over_the_shard_trains_exactly_without_a_warning():
    """A sum over the shard is exact under the strategy's sum of gradients: nothing to say."""
    batches = [torch.sigmoid(x) for x, _ in make_batches(num_examples=45)]
    expected = TinyVAE()
    optimizer = torch.optim.SGD(expected.parameters(), lr=0.01)
    for x in batches:
        _vae_loss(expected, x).backward()
        optimizer.step()
        optimizer.zero_grad()
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        module = TinyVAE()
        model, mirrored_optimizer = strategy.mirror(
            module, torch.optim.SGD(module.parameters(), lr=0.01)
        )

        def step(x):
            _vae_loss(model, x).backward()
            mirrored_optimizer.step()
            mirrored_optimizer.zero_grad()

        with warnings.catch_warnings():
            warnings.simplefilter("error", mirrored.LossScalingWarning)
            for x in strategy.experimental_distribute_dataset(batches):
                strategy.run(step, (x,))
    assert_same_parameters(expected, model.module)
    assert_replicas_identical(model)


def _sum_divided_by_the_shard(model, x, y):
    return F.cross_entropy(model(x), y, reduction="sum") / len(x)


def _sum_times_one_over_the_shard(model, x, y):
    return F.cross_entropy(model(x), y, reduction="sum") * (1 / len(x))


def _sum_plus_a_summed_weight_penalty(model, x, y):
    penalty = sum(p.square().sum() for p in model.parameters())
    return F.cross_entropy(model(x), y, reduction="sum") + penalty


@pytest.mark.parametrize(
    "loss_fn",
    [_sum_divided_by_the_shard, _sum_times_one_over_the_shard, _sum_plus_a_summed_weight_penalty],
    ids=["divided", "times_a_fraction", "summed_penalty"],
)
def test_a_sum_that_may_be_a_hand_made_mean_or_reads_no_input_still_warns(loss_fn):
    """A sum divided (or scaled down) after it may be a mean over the shard written by hand; a
    sum of parameters alone is counted once per replica: both keep the warning."""
    x, y = make_batches()[0]
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        module = make_mlp()
        model, _ = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))
        batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
        with pytest.warns(mirrored.LossScalingWarning, match="did not come through"):
            strategy.run(lambda b: loss_fn(model, *b).backward(), (batch,))


def test_one_replica_takes_any_loss():
    x, y = make_batches()[0]
    with mirrored.MirroredStrategy(["cpu:0"]) as strategy:
        module = make_mlp()
        model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))

        def step(batch):
            F.cross_entropy(model(batch[0]), batch[1]).backward()
            optimizer.step()

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            strategy.run(step, (next(iter(strategy.experimental_distribute_dataset([(x, y)]))),))
