"""A tiny Hugging Face ``BertForMaskedLM`` (random weights from a config, no download) trained by
a custom loop with AdamW, plain and under MirroredStrategy.

Labels are -100 except at the ~15% masked positions, so shards hold different numbers of
predicted tokens (in the first batch the last two rows have none, so with 3 and 4 replicas one
shard predicts nothing): the replica's loss must be its part of the mean over the global batch's
masked tokens, which ``compute_weighted_average_loss`` and ``scale_shard_mean`` both give.
"""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, get_linear_schedule_with_warmup

import mirrored
from tests.clients.hf_loop import (
    VOCAB_SIZE,
    Batch,
    LoopOptions,
    PlainRun,
    assert_checkpointing_changes_nothing,
    assert_mirrored_equals_plain,
    assert_reproducible_with_dropout,
    padded_sequences,
    per_token_average,
    run_plain,
    train_mirrored,
)

PAD, MASK = 0, 4  # ids 0..4 are special tokens


def make_bert(dropout: float = 0.0) -> BertForMaskedLM:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    return BertForMaskedLM(config)


def masked_batches(steps: int = 4, batch_size: int = 8, length: int = 16) -> list[Batch]:
    """Padded sequences of random words with ~15% of the words masked (labels -100 elsewhere)."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        lengths = torch.randint(length // 2, length + 1, (batch_size, 1), generator=generator)
        ids, attention_mask = padded_sequences(generator, lengths, length, 5, PAD)
        masked = (torch.rand(ids.shape, generator=generator) < 0.15) & (attention_mask == 1)
        labels = torch.where(masked, ids, -100)
        batch = {"input_ids": ids.masked_fill(masked, MASK), "attention_mask": attention_mask}
        batches.append({**batch, "labels": labels})
    batches[0]["labels"][-2:] = -100
    return batches


def per_token_loss(model: mirrored.MirroredModule, batch: Batch) -> torch.Tensor:
    return per_token_average(model(**batch).logits, batch["labels"])


def models_own_loss(model: mirrored.MirroredModule, batch: Batch) -> torch.Tensor:
    return mirrored.scale_shard_mean(model(**batch).loss, (batch["labels"] != -100).sum())


@pytest.fixture(scope="module")
def plain_run() -> PlainRun:
    """The plain loop's model and losses (no test changes them)."""
    return run_plain(make_bert, masked_batches())


@pytest.mark.parametrize("replica_loss", [per_token_loss, models_own_loss])
@pytest.mark.parametrize("num_devices", [2, 3, 4])
def test_mirrored_training_equals_the_plain_loop(plain_run, num_devices, replica_loss):
    assert_mirrored_equals_plain(plain_run, make_bert, masked_batches(), num_devices, replica_loss)


def test_with_dropout_a_seed_reproduces_a_run_bit_for_bit():
    assert_reproducible_with_dropout(
        lambda: make_bert(dropout=0.1), masked_batches(), per_token_loss
    )


def test_the_models_own_mean_loss_unscaled_is_refused_at_backward():
    with pytest.raises(ValueError, match=r"scale_shard_mean\(out.loss, count\)"):
        train_mirrored(make_bert(), masked_batches(), 2, lambda model, batch: model(**batch).loss)


def _warmup_then_linear_decay(
    optimizer: torch.optim.Optimizer,
) -> torch.optim.lr_scheduler.LRScheduler:
    return get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=5)


def _assert_equals_the_plain_loop(options: LoopOptions) -> None:
    batches = masked_batches()
    plain = run_plain(make_bert, batches, options)
    assert_mirrored_equals_plain(plain, make_bert, batches, 2, per_token_loss, options)


def test_a_transformers_schedule_on_the_mirrored_optimizer_stepped_after_each_run():
    _assert_equals_the_plain_loop(LoopOptions(schedule=_warmup_then_linear_decay))


def test_a_schedule_stepped_inside_the_replica_function():
    """Where the Transformers docs' custom loop steps it: after optimizer.step(), in the step."""
    _assert_equals_the_plain_loop(
        LoopOptions(schedule=_warmup_then_linear_decay, schedule_in_step=True)
    )


@pytest.mark.parametrize("parameter_device", ["cpu:0", "cpu:3"])
def test_central_storage_with_a_schedule_and_clipping(parameter_device):
    """The update on the parameter device (a replica's, or one apart) with the Transformers
    schedule and the Trainer's clipping."""
    _assert_equals_the_plain_loop(
        LoopOptions(
            schedule=_warmup_then_linear_decay,
            max_grad_norm=0.5,
            parameter_device=parameter_device,
        )
    )


def test_traced_steps_with_clipping_and_a_schedule_in_the_step_equal_the_plain_loop():
    """The same program under mirrored.function: Transformers' model traces, and the clipping
    and the schedule stepped inside the step run at every replay."""
    _assert_equals_the_plain_loop(
        LoopOptions(
            schedule=_warmup_then_linear_decay,
            schedule_in_step=True,
            max_grad_norm=0.5,
            traced=True,
        )
    )


def test_gradient_clipping_by_the_global_norm_inside_the_replica_function():
    """run_mlm_no_trainer.py and the Trainer's max_grad_norm clip between backward and step."""
    _assert_equals_the_plain_loop(LoopOptions(max_grad_norm=0.5))


def test_gradient_checkpointing_in_its_default_form_equals_the_plain_loop(plain_run):
    assert_mirrored_equals_plain(
        plain_run,
        make_bert,
        masked_batches(),
        3,
        per_token_loss,
        LoopOptions(gradient_checkpointing=True),
    )


def test_with_dropout_gradient_checkpointing_recomputes_the_forwards_masks():
    assert_checkpointing_changes_nothing(
        lambda: make_bert(dropout=0.1), masked_batches(), per_token_loss
    )
