"""Several optimizers: one module trained by two (an encoder and a decoder at different learning
rates), two modules each with its own (a GAN), and every wrong way to ask for them refused with
the call to make instead."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from tests.reference_loops import (
    CROSS_DEVICE_OPS,
    assert_replicas_identical,
    assert_same_parameters,
)

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

DEVICES = ["cpu:0", "cpu:1", "cpu:2"]


class AutoEncoder(nn.Module):
    """An encoder and a decoder, and a middle layer no optimizer holds (it keeps its values)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.encoder = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))
        self.middle = nn.Linear(4, 4)
        self.decoder = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.middle(self.encoder(x)))


def _optimizers(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """Different classes and learning rates, as an encoder/decoder pair often has (SGD second:
    a gradient the first one's step summed again would be N times too large, which Adam would
    all but hide)."""
    return (
        torch.optim.Adam(model.encoder.parameters(), lr=1e-2),
        torch.optim.SGD(model.decoder.parameters(), lr=0.1, momentum=0.9),
    )


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return list(torch.randn(4 * 15, 12, generator=generator).split(15))  # 5/5/5 on 3 replicas


def _train_plain(batches: list[torch.Tensor]) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    model = AutoEncoder()
    optimizers = _optimizers(model)
    for x in batches:
        F.mse_loss(model(x), x).backward()
        for optimizer in optimizers:
            optimizer.step()
        model.zero_grad()
    return model, list(optimizers)


@pytest.mark.parametrize(
    ("ops", "zero_stage"), [("default", 0), ("one_device", 0), ("default", 1), ("default", 2)]
)
def test_two_optimizers_over_one_module_train_as_the_plain_loop(ops, zero_stage):
    batches = _batches()
    expected, plain_optimizers = _train_plain(batches)
    ops = CROSS_DEVICE_OPS[ops]()
    with mirrored.MirroredStrategy(
        DEVICES, cross_device_ops=ops, zero_stage=zero_stage
    ) as strategy:
        module = AutoEncoder()
        model, encoder_optimizer, decoder_optimizer = strategy.mirror(module, *_optimizers(module))

        def step(x):
            per_example = F.mse_loss(model(x), x, reduction="none").mean(dim=1)
            mirrored.compute_average_loss(per_example).backward()
            encoder_optimizer.step()
            decoder_optimizer.step()
            model.zero_grad()

        for x in strategy.experimental_distribute_dataset(batches):
            strategy.run(step, args=(x,))
        assert_same_parameters(expected, model)
        assert_replicas_identical(model)
        # The middle layer no optimizer holds is left as it was, as in the plain loop.
        assert torch.equal(model.middle.weight, AutoEncoder().middle.weight)
        assert decoder_optimizer.param_groups[0]["lr"] == 0.1
        assert type(encoder_optimizer.optimizer) is torch.optim.Adam
        for plain, mirrored_optimizer in zip(
            plain_optimizers, (encoder_optimizer, decoder_optimizer), strict=True
        ):
            state = mirrored_optimizer.state_dict()["state"]
            for index, values in plain.state_dict()["state"].items():
                for key, value in values.items():
                    torch.testing.assert_close(state[index][key], value, rtol=1e-9, atol=1e-12)


def test_two_modules_each_with_its_own_optimizer():
    """A GAN's shape: strategy.mirror(netG, optG), then strategy.mirror(netD, optD)."""

    def nets():
        torch.manual_seed(7)
        return nn.Linear(3, 6), nn.Sequential(nn.Linear(6, 1), nn.Sigmoid())

    def optimizers(generator, discriminator):
        return (
            torch.optim.Adam(generator.parameters(), lr=1e-2),
            torch.optim.SGD(discriminator.parameters(), lr=0.05),
        )

    noise = list(torch.randn(3 * 6, 3, generator=torch.Generator().manual_seed(1)).split(6))
    generator, discriminator = nets()
    plain = optimizers(generator, discriminator)
    for z in noise:
        discriminator(generator(z).detach()).mean().backward()
        plain[1].step()
        generator.zero_grad()
        (-discriminator(generator(z)).mean()).backward()
        plain[0].step()
        discriminator.zero_grad()
    with mirrored.MirroredStrategy(DEVICES) as strategy:
        net_g, net_d = nets()
        opt_g, opt_d = optimizers(net_g, net_d)
        net_g, opt_g = strategy.mirror(net_g, opt_g)
        net_d, opt_d = strategy.mirror(net_d, opt_d)

        def step(z):
            mirrored.compute_average_loss(net_d(net_g(z).detach()).squeeze(1)).backward()
            opt_d.step()
            net_g.zero_grad()
            mirrored.compute_average_loss(-net_d(net_g(z)).squeeze(1)).backward()
            opt_g.step()
            net_d.zero_grad()

        for z in strategy.experimental_distribute_dataset(noise):
            strategy.run(step, args=(z,))
        assert_same_parameters(generator, net_g)
        assert_same_parameters(discriminator, net_d)


@pytest.fixture
def strategy():
    with mirrored.MirroredStrategy(DEVICES) as strategy:
        yield strategy


def test_a_list_of_optimizers_is_refused_with_the_call_to_make(strategy):
    module = AutoEncoder()
    for given in (list(_optimizers(module)), tuple(_optimizers(module))):
        with pytest.raises(TypeError, match=r"strategy\.mirror\(model, opt_a, opt_b\)"):
            strategy.mirror(module, given)


def test_optimizers_given_by_keyword_are_refused_with_the_call_to_make(strategy):
    module = AutoEncoder()
    first, second = _optimizers(module)
    with pytest.raises(
        TypeError, match=r"optimizer_d=Adam.*strategy\.mirror\(model, opt_a, opt_b\)"
    ):
        strategy.mirror(module, second, optimizer_d=first)
    with pytest.raises(TypeError, match=r"optimizer=.*strategy\.mirror\(model, opt_a, opt_b\)"):
        strategy.mirror(module, first, optimizer=second)
    # One optimizer by its keyword, as before.
    _, optimizer = strategy.mirror(module, optimizer=first)
    assert optimizer.optimizer is first


def test_a_module_mirrored_again_for_another_optimizer_is_refused(strategy):
    module = AutoEncoder()
    first, second = _optimizers(module)
    model, _ = strategy.mirror(module, first)
    with pytest.raises(
        ValueError, match=r"already mirrored.*strategy\.mirror\(model, opt_a, opt_b\)"
    ):
        strategy.mirror(module, second)
    with pytest.raises(
        TypeError, match=r"already mirrored.*strategy\.mirror\(model, opt_a, opt_b\)"
    ):
        strategy.mirror(model, second)


def test_an_optimizer_over_another_module_s_parameters_is_refused(strategy):
    module, other = AutoEncoder(), nn.Linear(2, 2)
    encoder, _ = _optimizers(module)
    foreign = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer 1 .*not in the module.*strategy\.mirror\("):
        strategy.mirror(module, encoder, foreign)
    with pytest.raises(TypeError, match=r"optimizer 1=str: expected a torch\.optim\.Optimizer"):
        strategy.mirror(module, encoder, "adam")


def test_optimizers_sharing_a_parameter_are_refused(strategy):
    module = AutoEncoder()
    encoder, decoder = _optimizers(module)
    both = torch.optim.SGD([module.encoder[0].weight, module.middle.bias], lr=0.1)
    with pytest.raises(ValueError, match=r"'encoder\.0\.weight'.*optimizers 0 and 2"):
        strategy.mirror(module, encoder, decoder, both)
    with pytest.raises(ValueError, match="the same optimizer twice"):
        strategy.mirror(module, encoder, encoder)
    _, *optimizers = strategy.mirror(module, encoder, decoder)  # nothing was mirrored yet
    assert len(optimizers) == 2
