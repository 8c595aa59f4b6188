"""A tiny Hugging Face ``GPT2LMHeadModel`` (random weights from a config, no download) trained as
a causal language model (labels = input_ids, -100 on padding) by a custom loop with AdamW, plain
and under MirroredStrategy.

Each sequence predicts its tokens after the first, so shards hold different numbers of
predicted tokens (in the first batch the last two rows are one token long and predict none, so
with 3 and 4 replicas one shard predicts nothing). Three ways a user scales the replica's loss
to the global batch: the per-token loss with ``compute_weighted_average_loss``, the model's own
mean with ``scale_shard_mean``, and Transformers' own ``num_items_in_batch`` (its loss is then
the sum over the shard divided by that count) with the global count from an all-reduce.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

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

PAD = 0


def make_gpt2(dropout: float = 0.0) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=32,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=PAD,
        eos_token_id=PAD,
    )
    return GPT2LMHeadModel(config)


def causal_batches(steps: int = 4, batch_size: int = 8, length: int = 16) -> list[Batch]:
    """Right-padded sequences of random words; labels are the ids, -100 on padding."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for step in range(steps):
        lengths = torch.randint(2, length + 1, (batch_size, 1), generator=generator)
        if step == 0:
            lengths[-2:] = 1
        ids, attention_mask = padded_sequences(generator, lengths, length, 1, PAD)
        labels = ids.masked_fill(attention_mask == 0, -100)
        batches.append({"input_ids": ids, "attention_mask": attention_mask, "labels": labels})
    return batches


def _predicted(labels: torch.Tensor) -> torch.Tensor:
    """The labels each position predicts: the next token's."""
    return labels[:, 1:]


def per_token_loss(model: mirrored.MirroredModule, batch: Batch) -> torch.Tensor:
    return per_token_average(model(**batch).logits[:, :-1], _predicted(batch["labels"]))


def models_own_loss(model: mirrored.MirroredModule, batch: Batch) -> torch.Tensor:
    count = (_predicted(batch["labels"]) != -100).sum()
    return mirrored.scale_shard_mean(model(**batch).loss, count)


def num_items_in_batch(model: mirrored.MirroredModule, batch: Batch) -> torch.Tensor:
    count = (_predicted(batch["labels"]) != -100).sum()
    global_count = mirrored.get_replica_context().all_reduce("sum", count)
    return model(**batch, num_items_in_batch=global_count).loss


@pytest.fixture(scope="module")
def plain_run() -> PlainRun:
    """The plain loop's model and losses (no test changes them)."""
    return run_plain(make_gpt2, causal_batches())


# The loss of num_items_in_batch is scaled, but not by a mirrored helper, which warns once.
@pytest.mark.filterwarnings("ignore::mirrored.LossScalingWarning")
@pytest.mark.parametrize("replica_loss", [per_token_loss, models_own_loss, num_items_in_batch])
@pytest.mark.parametrize("num_devices", [2, 3, 4])
def test_mirrored_training_equals_the_plain_loop(plain_run, num_devices, replica_loss):
    assert_mirrored_equals_plain(plain_run, make_gpt2, causal_batches(), num_devices, replica_loss)


def test_traced_steps_equal_the_plain_loop(plain_run):
    """The same program under mirrored.function (Transformers' GPT-2 traces)."""
    assert_mirrored_equals_plain(
        plain_run, make_gpt2, causal_batches(), 2, per_token_loss, LoopOptions(traced=True)
    )


def test_the_models_own_loss_runs_as_written_when_traced():
    """scale_shard_mean branches on the host on whether the shard has anything to average
    (the model's mean of nothing has a NaN gradient): that step cannot be replayed."""
    with pytest.raises(RuntimeWarning, match=r"reads a tensor's value on the host .*:\d+\)"):
        train_mirrored(make_gpt2(), causal_batches(), 2, models_own_loss, LoopOptions(traced=True))


def test_with_dropout_a_seed_reproduces_a_run_bit_for_bit():
    assert_reproducible_with_dropout(
        lambda: make_gpt2(dropout=0.1), causal_batches(), per_token_loss
    )


def test_gradient_checkpointing_in_its_default_form_equals_the_plain_loop(plain_run):
    assert_mirrored_equals_plain(
        plain_run,
        make_gpt2,
        causal_batches(),
        3,
        per_token_loss,
        LoopOptions(gradient_checkpointing=True),
    )


def test_with_dropout_gradient_checkpointing_recomputes_the_forwards_masks():
    assert_checkpointing_changes_nothing(
        lambda: make_gpt2(dropout=0.1), causal_batches(), per_token_loss
    )
