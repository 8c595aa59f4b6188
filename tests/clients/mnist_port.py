# fmt: off
# ruff: noqa: E501, UP032
"""``mnist_upstream.py`` ported to ``MirroredStrategy`` with as few changed lines as we could:
the functions that change (``train`` and ``main``); ``Net`` and ``test`` are upstream's, unchanged.

docs/migrating/from-pytorch.md's "Porting a PyTorch loop" quotes the diff of these two functions
against upstream's (``tests/clients/test_mnist_port.py`` checks that it does).
"""
import torch
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR

import mirrored
from tests.clients.mnist_upstream import Net, test


def train(args, model, device, train_loader, optimizer, epoch, strategy):
    model.train()
    for batch_idx, (data, target) in enumerate(strategy.experimental_distribute_dataset(train_loader)):
        def step(data, target):
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            output = model(data)
            loss = mirrored.compute_average_loss(F.nll_loss(output, target, reduction='none'))
            loss.backward()
            optimizer.step()
            return loss
        loss = strategy.reduce("sum", strategy.run(step, args=(data, target)), axis=None)
        if batch_idx % args.log_interval == 0:
            print('Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}'.format(
                epoch, batch_idx * len(data), len(train_loader.dataset),
                100. * batch_idx / len(train_loader), loss.item()))
            if args.dry_run:
                break


def main(args, dataset1, dataset2):
    use_cuda = not args.no_cuda and torch.cuda.is_available()
    use_mps = not args.no_mps and torch.backends.mps.is_available()

    torch.manual_seed(args.seed)

    if use_cuda:
        device = torch.device("cuda")
    elif use_mps:
        device = torch.device("mps")
    else:
        device = torch.device("cpu")

    train_kwargs = {'batch_size': args.batch_size}
    test_kwargs = {'batch_size': args.test_batch_size}
    if use_cuda:
        cuda_kwargs = {'num_workers': 1,
                       'pin_memory': True,
                       'shuffle': True}
        train_kwargs.update(cuda_kwargs)
        test_kwargs.update(cuda_kwargs)

    train_loader = torch.utils.data.DataLoader(dataset1,**train_kwargs)
    test_loader = torch.utils.data.DataLoader(dataset2, **test_kwargs)

    strategy = mirrored.MirroredStrategy(args.devices)
    model = Net().to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    model, optimizer = strategy.mirror(model, optimizer)

    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train(args, model, device, train_loader, optimizer, epoch, strategy)
        test(model, device, test_loader)
        scheduler.step()

    if args.save_model:
        torch.save(model.state_dict(), "mnist_cnn.pt")
    strategy.close()
    return model
