"""pytorch/examples' DCGAN (dcgan/main.py) ported to MirroredStrategy: a generator and a
discriminator, each with its own Adam optimizer, trained on 1, 2 and 4 logical devices to the
plain program's parameters and printed losses, in float64.

Upstream's nets and training step, made tiny (nz=8, ngf=ndf=4, 16x16 images: two transposed
convolutions up from 1x1, two convolutions down) and run for 3 steps of 10 random images (shards
of 5/5 and 3/3/2/2). The port's changes are the ones the docs ask for: the step runs in
``strategy.run``, ``BCELoss(reduction="none")`` with ``mirrored.compute_average_loss``, and
``sync_batch_norm=True`` in ``strategy.mirror``: in training mode BatchNorm normalises over its
batch, and without it each replica would normalise over its own shard, which is not the plain
program. Both programs take their noise with the data (upstream draws it in the loop, where each
replica would draw its own). dcgan's ``netG(fixed_noise)`` sample between steps (upstream's,
every 100 iterations; here before every step) is a forward outside ``strategy.run`` in training
mode: it moves the generator's BatchNorm statistics on replica 0, which every replica takes
before the next run.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mirrored
from tests.exactness import assert_close_float64
from tests.reference_loops import assert_replicas_identical, assert_same_parameters

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

nz, ngf, ndf, nc = 8, 4, 4, 3
real_label, fake_label = 1.0, 0.0
BATCH_SIZE, STEPS = 10, 3


def weights_init(m):
    """upstream's custom weights initialization, called on netG and netD."""
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            # input is Z, going into a convolution
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            # state size. (ngf*2) x 4 x 4
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            # state size. (ngf) x 8 x 8
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),
            nn.Tanh(),
            # state size. (nc) x 16 x 16
        )

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            # input is (nc) x 16 x 16
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf) x 8 x 8
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf*2) x 4 x 4
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, input):
        output = self.main(input)
        return output.view(-1, 1).squeeze(1)


class GAN(nn.Module):
    """Both nets in one module, for the port that mirrors it with both optimizers."""

    def __init__(self, netG, netD):
        super().__init__()
        self.netG, self.netD = netG, netD


def _nets():
    torch.manual_seed(999)
    netG = Generator()
    netG.apply(weights_init)
    netD = Discriminator()
    netD.apply(weights_init)
    optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    return netG, netD, optimizerG, optimizerD


def _data():
    """Random "real" images in tanh's range, and each batch's noise."""
    generator = torch.Generator().manual_seed(0)
    return [
        (
            torch.rand(BATCH_SIZE, nc, 16, 16, generator=generator) * 2 - 1,
            torch.randn(BATCH_SIZE, nz, 1, 1, generator=generator),
        )
        for _ in range(STEPS)
    ]


def _fixed_noise() -> torch.Tensor:
    return torch.randn(4, nz, 1, 1, generator=torch.Generator().manual_seed(1))


def train_plain(data):
    """upstream's loop (the noise from the data)."""
    netG, netD, optimizerG, optimizerD = _nets()
    fixed_noise = _fixed_noise()
    criterion = nn.BCELoss()
    reported = []
    for real_cpu, noise in data:
        netG(fixed_noise)  # upstream's sample, to save as an image
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)
        output = netD(real_cpu)
        errD_real = criterion(output, label)
        errD_real.backward()
        D_x = output.mean().item()
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach())
        errD_fake = criterion(output, label)
        errD_fake.backward()
        D_G_z1 = output.mean().item()
        errD = errD_real + errD_fake
        optimizerD.step()
        # (2) Update G network: maximize log(D(G(z)))
        netG.zero_grad()
        label.fill_(real_label)  # fake labels are real for generator cost
        output = netD(fake)
        errG = criterion(output, label)
        errG.backward()
        D_G_z2 = output.mean().item()
        optimizerG.step()
        reported.append([errD.item(), errG.item(), D_x, D_G_z1, D_G_z2])
    return netG, netD, reported


def train_port(strategy, data, one_module):
    """The port: upstream's step in ``strategy.run``; the two nets mirrored one by one, or
    together in one module with both optimizers."""
    netG, netD, optimizerG, optimizerD = _nets()
    if one_module:
        gan, optimizerG, optimizerD = strategy.mirror(
            GAN(netG, netD), optimizerG, optimizerD, sync_batch_norm=True
        )
        netG, netD = gan.netG, gan.netD
    else:
        netG, optimizerG = strategy.mirror(netG, optimizerG, sync_batch_norm=True)
        netD, optimizerD = strategy.mirror(netD, optimizerD, sync_batch_norm=True)
    criterion = nn.BCELoss(reduction="none")

    def step(real_cpu, noise):
        netD.zero_grad()
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)
        output = netD(real_cpu)
        errD_real = mirrored.compute_average_loss(criterion(output, label))
        errD_real.backward()
        D_x = mirrored.compute_average_loss(output.detach())
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach())
        errD_fake = mirrored.compute_average_loss(criterion(output, label))
        errD_fake.backward()
        D_G_z1 = mirrored.compute_average_loss(output.detach())
        errD = errD_real + errD_fake
        optimizerD.step()
        netG.zero_grad()
        label.fill_(real_label)  # fake labels are real for generator cost
        output = netD(fake)
        errG = mirrored.compute_average_loss(criterion(output, label))
        errG.backward()
        D_G_z2 = mirrored.compute_average_loss(output.detach())
        optimizerG.step()
        return [errD.detach(), errG.detach(), D_x, D_G_z1, D_G_z2]

    reported, fixed_noise = [], _fixed_noise()
    for real_cpu, noise in strategy.experimental_distribute_dataset(data):
        netG(fixed_noise)  # outside strategy.run, in training mode: every replica's statistics
        values = strategy.reduce("sum", strategy.run(step, args=(real_cpu, noise)), axis=None)
        reported.append([value.item() for value in values])
    return netG, netD, reported


@pytest.fixture(scope="module")
def plain_run():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the module-scoped run, as the float64 fixture
    try:
        return train_plain(_data())
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("one_module", [False, True], ids=["two_mirrors", "one_module"])
@pytest.mark.parametrize("num_devices", [1, 2, 4])
def test_the_port_trains_as_the_plain_program(plain_run, num_devices, one_module):
    expected_g, expected_d, expected_reported = plain_run
    devices = [f"cpu:{i}" for i in range(num_devices)]
    with mirrored.MirroredStrategy(devices) as strategy:
        netG, netD, reported = train_port(strategy, _data(), one_module)
        assert_close_float64(torch.tensor(reported), torch.tensor(expected_reported))
        for expected, actual in ((expected_g, netG), (expected_d, netD)):
            assert_same_parameters(expected, actual)
            assert_replicas_identical(actual)
