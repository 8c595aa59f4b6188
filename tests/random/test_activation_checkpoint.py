"""Activation checkpointing, inside replicas and out: every recomputation draws the random numbers
of its forward, with torch's and Hugging Face's default arguments or with
``activation_checkpoint_contexts``, so checkpointed training equals training without."""

from __future__ import annotations

import functools
import gc
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import mirrored
from mirrored.random import routing
from tests.exactness import assert_close_float64
from tests.reference_loops import make_batches, train_mirrored

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py


def _policy(ctx, op, *args, **kwargs):  # type: ignore[no-untyped-def]
    """Selective checkpointing that saves the matrix products and recomputes the rest (the
    dropout masks included)."""
    saved = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


CHECKPOINTS = {
    "reentrant": {"use_reentrant": True},  # torch's default until it made the argument required
    "non_reentrant": {"use_reentrant": False},
    "context_fn": {"use_reentrant": False, "context_fn": mirrored.activation_checkpoint_contexts},
    "selective": {
        "use_reentrant": False,
        "context_fn": functools.partial(create_selective_checkpoint_contexts, _policy),
    },
}


# The dropout mask of every call of a block (forward and recomputation), by replica.
_masks: dict[int, list[torch.Tensor]] = {}


class _Block(nn.Module):
    """A residual block with dropout."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.linear(x)) + 1  # never 0: a 0 after dropout is a dropped unit
        dropped = F.dropout(hidden, 0.3, self.training)
        replica = mirrored.get_replica_context().replica_id_in_sync_group
        _masks.setdefault(replica, []).append(dropped == 0)
        return x + dropped


class _Net(nn.Module):
    def __init__(self, options: dict | None) -> None:
        super().__init__()
        self.options = options
        self.embed = nn.Linear(12, 16)  # the blocks' input requires grad (reentrant needs it)
        self.blocks = nn.ModuleList([_Block(16) for _ in range(3)])
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x) if self.options is None else checkpoint(block, x, **self.options)
        return self.head(x)


def _train(devices: list[str], options: dict | None):
    """Parameters after four steps, and each replica's masks (forward and recomputation)."""
    _masks.clear()
    torch.manual_seed(0)
    module = _Net(options)
    device = torch.device(devices[0]).type
    batches = [(x.to(device), y.to(device)) for x, y in make_batches(96, batch_size=24)]
    with mirrored.MirroredStrategy(devices) as strategy:
        optimizer = torch.optim.SGD(module.parameters(), 0.1)
        model, _, _ = train_mirrored(strategy, module, optimizer, batches)
        return {k: v.clone() for k, v in model.state_dict().items()}, dict(_masks)


@pytest.mark.parametrize("num_replicas", [1, 2, 3])  # one: torch's own, unchanged
@pytest.mark.parametrize("options", CHECKPOINTS.values(), ids=CHECKPOINTS.keys())
def test_checkpointed_training_equals_training_without_checkpoints(num_replicas, options):
    devices = [f"cpu:{i}" for i in range(num_replicas)]
    plain, plain_masks = _train(devices, None)
    checkpointed, masks = _train(devices, options)
    for name, value in plain.items():
        assert torch.equal(checkpointed[name], value), name
    # Each replica drew masks of its own, the masks of the run without checkpoints.
    firsts = [masks[replica][0] for replica in range(num_replicas)]
    assert all(torch.equal(m, plain_masks[r][0]) for r, m in enumerate(firsts))
    assert all(not torch.equal(firsts[0], other) for other in firsts[1:])


@pytest.mark.timeout(60, method="thread")  # a deadlock ends the run with every thread's stack
@pytest.mark.parametrize("kind", ["reentrant", "non_reentrant"])
def test_a_recomputation_through_torch_s_kernels_does_not_deadlock(kind, monkeypatch):
    """On a GPU dropout is torch's kernel run with the replica's state in the global generator;
    a recomputation inside backward reaches it with the replica's routing active twice, and the
    inner swap waited for the lock the outer one held: a hang. Forced here on the CPU."""
    monkeypatch.setattr(routing, "is_plain", lambda tensor: False)  # torch's kernel, as on CUDA
    plain, plain_masks = _train(["cpu:0", "cpu:1"], None)
    checkpointed, masks = _train(["cpu:0", "cpu:1"], CHECKPOINTS[kind])
    for name, value in plain.items():
        assert torch.equal(checkpointed[name], value), name
    assert all(torch.equal(masks[r][0], plain_masks[r][0]) for r in range(2))
    assert not torch.equal(masks[0][0], masks[1][0])


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["reentrant", "non_reentrant"])
def test_checkpointed_training_on_logical_gpus_equals_training_without(fresh_config, kind):
    """On a GPU, backward (and so the recomputation) runs on autograd's device thread."""
    gpu = mirrored.config.list_physical_devices("GPU")[0]
    mirrored.config.set_logical_device_configuration(
        gpu, [mirrored.config.LogicalDeviceConfiguration()] * 2
    )
    plain, _ = _train(["cuda:0", "cuda:1"], None)
    checkpointed, _ = _train(["cuda:0", "cuda:1"], CHECKPOINTS[kind])
    for name, value in plain.items():  # other masks would be 0.05 off
        assert_close_float64(checkpointed[name], value)


def _bert_config():
    transformers = pytest.importorskip("transformers")
    return transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.2,
        attention_probs_dropout_prob=0.2,
    )


def _train_bert(gradient_checkpointing: dict | None) -> dict[str, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    module = transformers.BertForMaskedLM(_bert_config())
    module.train()
    if gradient_checkpointing is not None:
        module.gradient_checkpointing_enable(**gradient_checkpointing)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, 64, (6, 8, 12), generator=generator)
    labels = torch.where(torch.rand(6, 8, 12, generator=generator) < 0.3, inputs, -100)
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        model, optimizer = strategy.mirror(module, torch.optim.AdamW(module.parameters(), 1e-3))

        def step(batch):
            input_ids, target = batch
            logits = model(input_ids=input_ids).logits
            per_token = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
            loss = mirrored.compute_weighted_average_loss(per_token, target.flatten() != -100)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        batches = list(zip(inputs, labels, strict=True))
        for batch in strategy.experimental_distribute_dataset(batches):
            strategy.run(step, args=(batch,))
        return {k: v.clone() for k, v in model.state_dict().items()}


HF_CHECKPOINTS = {
    "default": {},
    "reentrant": {"gradient_checkpointing_kwargs": {"use_reentrant": True}},
    "non_reentrant": {"gradient_checkpointing_kwargs": {"use_reentrant": False}},
}


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
@pytest.mark.parametrize("options", HF_CHECKPOINTS.values(), ids=HF_CHECKPOINTS.keys())
def test_a_hugging_face_model_s_gradient_checkpointing_equals_training_without(options):
    plain = _train_bert(None)
    checkpointed = _train_bert(options)
    for name, value in plain.items():
        assert torch.equal(checkpointed[name], value), name


def test_a_reentrant_checkpoint_s_inner_backward_is_not_another_pass():
    def step():
        x = torch.ones(8, requires_grad=True)
        y = checkpoint(lambda t: F.dropout(t, 0.5, True) * t, x, use_reentrant=True)
        mirrored.compute_average_loss(y).backward()
        return torch.tensor(mirrored.get_replica_context().backward_passes)

    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        passes = strategy.experimental_local_results(strategy.run(step))
    assert [int(p) for p in passes] == [1, 1]


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_on_an_unknown_torch_a_checkpoint_preserving_rng_state_is_refused_in_replicas(
    monkeypatch, use_reentrant
):
    module = torch.utils.checkpoint

    def step():
        return checkpoint(F.relu, torch.ones(8, requires_grad=True), use_reentrant=use_reentrant)

    gc.collect()  # earlier tests' replica streams: the patch is installed afresh below
    assert module.CheckpointFunction.__module__ == module.__name__, "a replica stream is alive"
    # torch's own implementations, one of them in a form the wrappers do not know
    generator = inspect.unwrap(module._checkpoint_without_reentrant_generator)
    monkeypatch.setattr(
        module, "_checkpoint_without_reentrant_generator", functools.partial(generator)
    )
    get_rng_state = torch.get_rng_state
    monkeypatch.setattr(torch, "get_rng_state", get_rng_state)
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        assert torch.get_rng_state is not get_rng_state  # the refusing one
        assert torch.equal(step(), torch.ones(8))  # outside replicas: torch's checkpoint
        with pytest.raises(ValueError, match=r"not the torch mirrored knows.*preserve_rng_state"):
            strategy.run(step)
    del strategy
    gc.collect()
    assert torch.get_rng_state is get_rng_state  # torch's own again, with the last stream


CHECKPOINT_OPTIONS = {
    "use_reentrant": False,
    "preserve_rng_state": False,
    "context_fn": mirrored.activation_checkpoint_contexts,
}


def _train_checkpointed(checkpointed: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 5))
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), 0.1))

        def step(batch):
            x, y = batch
            logits = checkpoint(model, x, **CHECKPOINT_OPTIONS) if checkpointed else model(x)
            loss = F.cross_entropy(logits, y, reduction="none")
            mirrored.compute_average_loss(loss).backward()
            optimizer.step()
            optimizer.zero_grad()

        for batch in strategy.experimental_distribute_dataset(make_batches()):
            strategy.run(step, args=(batch,))
        return {k: v.clone() for k, v in model.state_dict().items()}


def test_activation_checkpointing_recomputes_with_the_forward_s_dropout_masks():
    plain, checkpointed = _train_checkpointed(False), _train_checkpointed(True)
    for name, value in plain.items():
        assert_close_float64(checkpointed[name], value)


def _checkpoint_twice() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two backwards through one checkpoint of dropout: their gradients and the forward."""
    x = torch.ones(64, requires_grad=True)
    y = checkpoint(lambda t: F.dropout(t, 0.5, True) * t, x, **CHECKPOINT_OPTIONS)
    y.sum().backward(retain_graph=True)
    first, x.grad = x.grad, None
    y.sum().backward()  # recomputes again
    return first, x.grad, y.detach()


@pytest.mark.parametrize("where", ["outside a strategy", "one replica", "two replicas"])
def test_every_backward_through_a_checkpoint_recomputes_the_forward_s_masks(where):
    """Outside replica streams the context replays torch's own generators, so the same options
    serve everywhere; and each backward recomputes from the forward's position again."""
    torch.manual_seed(1)
    if where == "outside a strategy":
        results = [_checkpoint_twice()]
    else:
        devices = ["cpu:0", "cpu:1"][: 1 if where == "one replica" else 2]
        with mirrored.MirroredStrategy(devices) as strategy:
            results = strategy.experimental_local_results(strategy.run(_checkpoint_twice))
    for first, second, y in results:
        assert torch.equal(first, 2 * y) and torch.equal(second, 2 * y)  # d(m*t*t)/dt
        assert 0 < (y == 0).sum() < 64


def test_checkpoints_in_one_replica_leave_another_s_swapped_draws_alone():
    """Replica 0 recomputes checkpoints while replica 1 swaps its stream into the global
    generator (alpha dropout): replica 1 draws the same numbers in every run."""

    def run() -> torch.Tensor:
        torch.manual_seed(0)
        with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:

            def step():
                if mirrored.get_replica_context().replica_id_in_sync_group == 0:
                    for _ in range(100):
                        x = torch.ones(64, requires_grad=True)
                        checkpoint(
                            lambda t: F.dropout(t, 0.5, True), x, **CHECKPOINT_OPTIONS
                        ).sum().backward()
                    return torch.zeros(())
                return torch.stack(
                    [F.alpha_dropout(torch.ones(20_000), 0.5, True)[:8] for _ in range(100)]
                )

            return strategy.experimental_local_results(strategy.run(step))[1]

    first = run()
    assert all(torch.equal(run(), first) for _ in range(3))
