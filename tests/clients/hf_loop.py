"""A Hugging Face user's custom training loop, plain and under MirroredStrategy.

The plain loop is what the Transformers docs write for a custom loop: AdamW over the model's
parameters, ``model(**batch).loss``, backward, step, zero_grad. The mirrored loop is the same
with the strategy's three changes: ``strategy.mirror``, the step in ``strategy.run`` over
``experimental_distribute_dataset``, and a loss scaled to the global batch (``replica_loss``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

import mirrored
from tests.exactness import (
    assert_values_within_reordering,
    assert_within_reordering,
    reversed_examples,
)
from tests.tracing.traces import replays

VOCAB_SIZE = 100
Batch = dict[str, torch.Tensor]
ReplicaLoss = Callable[[mirrored.MirroredModule, Batch], torch.Tensor]


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with the epsilon of BERT's own optimizer (1e-6). With torch's 1e-8, Adam turns the
    float rounding of gradients that are zero in exact arithmetic (GPT-2's attention key bias)
    into updates of about lr, so that the plain loop itself is not reproducible to 1e-5 under a
    different summation order."""
    return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)


def padded_sequences(
    generator: torch.Generator, lengths: torch.Tensor, length: int, first_word: int, pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random word ids in ``[first_word, vocabulary)`` of the given ``lengths`` (a column),
    right-padded with ``pad`` to ``length``: the ids and the attention mask."""
    ids = torch.randint(first_word, VOCAB_SIZE, (lengths.shape[0], length), generator=generator)
    attention_mask = (torch.arange(length) < lengths).long()
    return ids.masked_fill(attention_mask == 0, pad), attention_mask


def per_token_average(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The replica's part of the mean cross entropy over the global batch's labelled tokens
    (labels other than -100), from logits [batch, positions, vocabulary]."""
    labels = labels.flatten()
    per_token = F.cross_entropy(logits.flatten(0, 1), labels, reduction="none")
    return mirrored.compute_weighted_average_loss(per_token, labels != -100)


@dataclass(frozen=True)
class LoopOptions:
    """What the Transformers examples' loops add to the bare loop: gradient clipping by the global
    norm before ``optimizer.step()`` (``run_mlm_no_trainer.py``, the Trainer's
    ``max_grad_norm``) and a learning-rate schedule stepped after it (the docs' custom loop).
    ``schedule_in_step``: the mirrored loop steps the schedule inside the replica function, right
    after ``optimizer.step()`` as the plain loop does, instead of after ``strategy.run``;
    ``gradient_checkpointing``: both loops enable it in its default form; ``parameter_device``:
    the mirrored loop runs under ``CentralStorageStrategy`` with the update there; ``traced``:
    the replica step is under ``mirrored.function``, and must not fall back to running as
    written."""

    max_grad_norm: float | None = None
    schedule: Callable[[torch.optim.Optimizer], LRScheduler] | None = None
    schedule_in_step: bool = False
    gradient_checkpointing: bool = False  # model.gradient_checkpointing_enable(), its defaults
    parameter_device: str | None = None
    traced: bool = False


def _enable_gradient_checkpointing(model: nn.Module) -> None:
    """Hugging Face's default form, whose name Transformers 5 deprecates (in favour of
    ``activation_checkpointing_enable``) but still takes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()  # type: ignore[operator]


def train_plain(
    model: nn.Module, batches: Sequence[Batch], options: LoopOptions = LoopOptions()
) -> list[float]:
    if options.gradient_checkpointing:
        _enable_gradient_checkpointing(model)
    optimizer = adamw(model)
    scheduler = options.schedule(optimizer) if options.schedule else None
    model.train()
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        if options.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), options.max_grad_norm)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def train_mirrored(
    model: nn.Module,
    batches: Sequence[Batch],
    num_devices: int,
    replica_loss: ReplicaLoss,
    options: LoopOptions = LoopOptions(),
) -> list[float]:
    """Train ``model`` in place (it becomes replica 0) on ``num_devices`` logical CPU devices;
    the global loss of every step."""
    if options.gradient_checkpointing:
        _enable_gradient_checkpointing(model)
    devices = [f"cpu:{i}" for i in range(num_devices)]
    strategy = (
        mirrored.MirroredStrategy(devices)
        if options.parameter_device is None
        else mirrored.CentralStorageStrategy(devices, options.parameter_device)
    )
    with strategy:
        mirrored_model, optimizer = strategy.mirror(model, adamw(model))
        scheduler = options.schedule(optimizer) if options.schedule else None
        mirrored_model.train()

        def step(batch: Batch) -> torch.Tensor:
            loss = replica_loss(mirrored_model, batch)
            loss.backward()
            if options.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(mirrored_model.parameters(), options.max_grad_norm)
            optimizer.step()
            if scheduler is not None and options.schedule_in_step:
                scheduler.step()
            optimizer.zero_grad()
            return loss

        replica_step = mirrored.function(step) if options.traced else step
        losses = []
        for batch in strategy.experimental_distribute_dataset(batches):
            with warnings.catch_warnings():
                if options.traced:
                    warnings.filterwarnings("error", "mirrored.function", RuntimeWarning)
                result = strategy.run(replica_step, args=(batch,))
            losses.append(strategy.reduce("sum", result, axis=None))
            if scheduler is not None and not options.schedule_in_step:
                scheduler.step()
        assert not options.traced or replays(replica_step)  # TorchScript ran every piece
        return [loss.item() for loss in losses]


def _seeded_run(
    make_model: Callable[[], nn.Module],
    batches: Sequence[Batch],
    replica_loss: ReplicaLoss,
    seed: int,
    options: LoopOptions = LoopOptions(),
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A mirrored run on 2 devices after ``torch.manual_seed(seed)``: losses and final state."""
    model = make_model()
    torch.manual_seed(seed)
    losses = train_mirrored(model, batches, 2, replica_loss, options)
    return losses, model.state_dict()


def _assert_bitwise_equal(
    run: tuple[list[float], dict[str, torch.Tensor]],
    again: tuple[list[float], dict[str, torch.Tensor]],
) -> None:
    assert again[0] == run[0]
    for name, value in run[1].items():
        assert torch.equal(again[1][name], value), name


def assert_reproducible_with_dropout(
    make_model: Callable[[], nn.Module], batches: Sequence[Batch], replica_loss: ReplicaLoss
) -> None:
    """Two mirrored runs after the same ``torch.manual_seed`` are bitwise identical (parameters
    and losses); a run after another seed is not, so dropout does draw."""
    first = _seeded_run(make_model, batches, replica_loss, 5)
    _assert_bitwise_equal(first, _seeded_run(make_model, batches, replica_loss, 5))
    other_losses, other = _seeded_run(make_model, batches, replica_loss, 6)
    assert other_losses != first[0]
    assert any(not torch.equal(other[name], value) for name, value in first[1].items())


def assert_checkpointing_changes_nothing(
    make_model: Callable[[], nn.Module], batches: Sequence[Batch], replica_loss: ReplicaLoss
) -> None:
    """With dropout on, a mirrored run with gradient checkpointing in its default form is
    bitwise the run without it: every recomputation draws the forward's dropout masks."""
    checkpointed = LoopOptions(gradient_checkpointing=True)
    _assert_bitwise_equal(
        _seeded_run(make_model, batches, replica_loss, 5),
        _seeded_run(make_model, batches, replica_loss, 5, checkpointed),
    )


@dataclass
class PlainRun:
    """The plain loop's model and losses, and those of the same loop on the batches with their
    examples in reverse order: the same sums in another order, whose gap to the first is the
    plain program's own float32 rounding on this CPU (``tests.exactness``)."""

    model: nn.Module
    losses: list[float]
    reordered: nn.Module
    reordered_losses: list[float]


def run_plain(
    make_model: Callable[[], nn.Module],
    batches: Sequence[Batch],
    options: LoopOptions = LoopOptions(),
) -> PlainRun:
    """New models trained by the plain loop, on the batches and on their examples reversed."""
    model, reordered = make_model(), make_model()
    reversed_batches = [reversed_examples(batch) for batch in batches]
    return PlainRun(
        model,
        train_plain(model, batches, options),
        reordered,
        train_plain(reordered, reversed_batches, options),
    )


def assert_mirrored_equals_plain(
    plain: PlainRun,
    make_model: Callable[[], nn.Module],
    batches: Sequence[Batch],
    num_devices: int,
    replica_loss: ReplicaLoss,
    options: LoopOptions = LoopOptions(),
) -> None:
    """A new model trained by the mirrored loop ends with the parameters of the ``plain`` run
    (``run_plain`` on the same batches and options), and its losses are the plain loop's, both
    to the plain loop's own rounding."""
    model = make_model()
    losses = train_mirrored(model, batches, num_devices, replica_loss, options)
    assert_within_reordering(plain.model, model, plain.reordered)
    assert_values_within_reordering(losses, plain.losses, plain.reordered_losses)
