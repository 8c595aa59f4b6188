"""The BERT masked-LM example: its masking, its input pipeline, and a tiny end-to-end run.

The session's conftest has already split the CPU into four logical devices, so the run also
checks that the example uses an existing split instead of failing on it.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from mirrored.examples import bert_mlm

from tests.exactness import assert_close_float64

SPECIAL = (0, 1, 2, 3, 4)  # [PAD] [UNK] [CLS] [SEP] [MASK]
PAD, CLS, SEP, MASK = 0, 2, 3, 4


def _masker(max_predictions: int = 19) -> bert_mlm.MaskedLMMasker:
    return bert_mlm.MaskedLMMasker(
        vocab_size=1000,
        special_ids=SPECIAL,
        pad_id=PAD,
        mask_id=MASK,
        max_predictions=max_predictions,
    )


def _sequences(num: int, seq_len: int = 64, length: int = 50) -> torch.Tensor:
    """[CLS] w1 .. w_{length-2} [SEP] [PAD] ... with words drawn from the non-special ids."""
    ids = torch.randint(5, 1000, (num, seq_len), generator=torch.Generator().manual_seed(1))
    ids[:, 0] = CLS
    ids[:, length - 1] = SEP
    ids[:, length:] = PAD
    return ids


def test_masking_follows_berts_15_percent_and_80_10_10():
    ids = _sequences(4096)
    x, labels, weights = _masker()(ids, torch.Generator().manual_seed(0))
    targets = weights.bool()
    positions = x["mask_positions"]

    assert targets.sum().item() / (4096 * 48) == pytest.approx(0.15, abs=0.005)
    assert torch.equal(labels[targets], ids.gather(1, positions)[targets])
    assert (labels[~targets] == PAD).all()
    assert not torch.isin(ids.gather(1, positions)[targets], torch.tensor(SPECIAL)).any()

    new = x["input_ids"].gather(1, positions)[targets]
    original = labels[targets]
    assert (new == MASK).float().mean().item() == pytest.approx(0.8, abs=0.01)
    assert (new == original).float().mean().item() == pytest.approx(0.1, abs=0.01)
    replaced = (new != MASK) & (new != original)
    assert replaced.float().mean().item() == pytest.approx(0.1, abs=0.01)
    assert not torch.isin(new[replaced], torch.tensor(SPECIAL)).any()

    # Nothing else changes, special tokens and padding included.
    changed = x["input_ids"] != ids
    assert changed.sum() == (new != original).sum()
    assert torch.equal(x["attention_mask"], (ids != PAD).long())


def test_masking_lists_targets_in_text_order_then_padding():
    x, _, weights = _masker(max_predictions=6)(_sequences(256), torch.Generator())
    positions = x["mask_positions"]
    for row_positions, row_weights in zip(positions, weights.bool(), strict=True):
        count = int(row_weights.sum())
        assert row_weights[:count].all() and not row_weights[count:].any()
        assert torch.equal(row_positions[:count], row_positions[:count].sort().values)
        assert len(set(row_positions[:count].tolist())) == count
        assert (row_positions[count:] == 0).all()
    assert weights.sum(1).max() == 6  # the cap binds: 15% of 48 tokens is often more than 6


def test_shuffle_buffer_is_a_seeded_permutation_that_reshuffles():
    shuffle = bert_mlm.ShuffleBuffer(range(1000), 500, torch.Generator().manual_seed(0))
    first, second = list(shuffle), list(shuffle)
    assert sorted(first) == sorted(second) == list(range(1000))
    assert first != second and first != list(range(1000))
    again = bert_mlm.ShuffleBuffer(range(1000), 500, torch.Generator().manual_seed(0))
    assert list(again) == first
    # A buffer of 10 cannot move the last element out of the last ten.
    assert list(bert_mlm.ShuffleBuffer(range(100), 10, torch.Generator())).index(99) >= 90


def test_prefetch_yields_in_order_raises_errors_and_stops_early():
    assert list(bert_mlm.Prefetch(range(50))) == list(range(50))

    def failing():
        yield 1
        raise RuntimeError("broken input")

    with pytest.raises(RuntimeError, match="broken input"):
        list(bert_mlm.Prefetch(failing()))

    iterator = iter(bert_mlm.Prefetch(range(10**6)))
    assert next(iterator) == 0
    iterator.close()
    assert not [t for t in threading.enumerate() if t.name == "bert-mlm-prefetch"]


def test_evaluation_batches_repeat_and_training_batches_change():
    ids = _sequences(40)
    valid = bert_mlm.MaskedLMBatches(ids, _masker(), 16, seed=0)
    train = bert_mlm.MaskedLMBatches(ids, _masker(), 16, seed=0, shuffle_buffer=500)
    assert len(valid) == len(train) == 3
    first, second = list(valid), list(valid)
    assert [len(labels) for _, labels, _ in first] == [16, 16, 8]
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a[0]["input_ids"], b[0]["input_ids"])
    epoch1, epoch2 = list(train), list(train)
    assert not torch.equal(epoch1[0][0]["input_ids"], epoch2[0][0]["input_ids"])


def test_model_scores_only_the_masked_positions():
    model = bert_mlm.BertMaskedLM(vocab_size=1000, max_seq_len=64).eval()
    x, _, _ = _masker()(_sequences(3), torch.Generator())
    logits = model(**x)
    assert logits.shape == (3, 19, 1000)
    assert model.head_bias.shape == (1000,)
    assert sum(p.numel() for p in model.encoder.parameters()) == 2 * (
        4 * 128 * 128 + 4 * 128 + 2 * 128 * 512 + 512 + 128 + 4 * 128
    )


def test_a_tiny_run_trains_evaluates_and_logs(tmp_path, capsys):
    log_dir = tmp_path / "logs"
    argv = ["--max-lines", "64", "--seq-len", "32", "--vocab-size", "400", "--batch-size", "16"]
    argv += ["--epochs", "1", "--logical-devices", "2", "--cpu", "--verbose", "0"]
    argv += ["--log-dir", str(log_dir)]
    metrics = bert_mlm.main(argv)

    assert set(metrics) == {"loss", "accuracy"}
    assert all(math.isfinite(value) for value in metrics.values())
    assert 0.0 <= metrics["accuracy"] <= 1.0
    assert list(log_dir.rglob("events.out.tfevents.*"))
    out = capsys.readouterr().out
    assert "2 replicas: MirroredStrategy(devices=['cpu:0', 'cpu:1']" in out
    assert out.rstrip().splitlines()[-1] == (
        f"test loss: {metrics['loss']:.4f} - test accuracy: {metrics['accuracy']:.4f}"
    )


def test_the_vocabulary_is_the_same_every_time_commonest_words_first():
    lines = bert_mlm.load_texts(None)["train"]
    first = bert_mlm.train_tokenizer(lines, 1000, 64).get_vocab()
    assert bert_mlm.train_tokenizer(lines, 1000, 64).get_vocab() == first
    assert len(first) == 1000
    assert first["[PAD]"] == 0 and first["the"] < first["module"]  # commoner words first
    encoded = bert_mlm.train_tokenizer(["a zebra"] * 3 + ["a"], 1000, 8).encode("a zebra")
    assert encoded.tokens == ["[CLS]", "a", "zebra", "[SEP]", "[PAD]", "[PAD]", "[PAD]", "[PAD]"]
    rare = bert_mlm.train_tokenizer(["a zebra"], 1000, 8).encode("a bee").tokens
    assert rare[:5] == ["[CLS]", "a", "b", "##e", "##e"]  # an unseen word spelled out


def test_the_same_command_twice_gives_bit_identical_losses_and_weights(monkeypatch, tmp_path):
    models = []
    original = bert_mlm.BertMaskedLM

    def recorded(*args, **kwargs):
        models.append(original(*args, **kwargs))
        return models[-1]

    monkeypatch.setattr(bert_mlm, "BertMaskedLM", recorded)
    argv = ["--max-lines", "48", "--seq-len", "32", "--vocab-size", "300", "--batch-size", "16"]
    argv += ["--epochs", "2", "--logical-devices", "2", "--cpu", "--verbose", "0"]
    argv += ["--seed", "3"]
    runs = [bert_mlm.main([*argv, "--log-dir", str(tmp_path / str(run))]) for run in range(2)]
    assert runs[0] == runs[1]
    first, second = (model.state_dict() for model in models)
    for name, value in first.items():
        assert torch.equal(second[name], value), name


def test_more_devices_than_the_split_is_a_clear_error():
    with pytest.raises(ValueError, match=r"--logical-devices 8: .* already split into 4"):
        bert_mlm.main(["--logical-devices", "8", "--cpu", "--max-lines", "40"])


def test_missing_wikitext_files_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"missing .*wiki\.train\.tokens"):
        bert_mlm.load_texts(tmp_path)


def test_wikitext_keeps_long_lines_and_drops_headings(tmp_path):
    long_line = " " + "word " * 30
    for split in ("train", "valid", "test"):
        text = f" = Heading = \n{long_line}\n short line \n = = {'x' * 120} = = \n"
        (tmp_path / f"wiki.{split}.tokens").write_text(text, encoding="utf-8")
    texts = bert_mlm.load_texts(tmp_path)
    assert texts == {split: [long_line.strip()] for split in ("train", "valid", "test")}


def test_help_and_bad_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bert_mlm.main(["--help"])
    assert exit_info.value.code == 0
    assert "--logical-devices" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        bert_mlm.main(["--batch-size", "0"])
    assert exit_info.value.code == 2
    assert "--batch-size 0: expected a positive integer" in capsys.readouterr().err


@pytest.mark.usefixtures("float64")
def test_bert_layer_computes_torch_s_transformer_encoder_layer():
    torch.manual_seed(0)
    ours = bert_mlm.BertLayer(32, 4, 64, dropout=0.1).eval()
    torch_s = torch.nn.TransformerEncoderLayer(
        32, 4, 64, 0.1, activation="gelu", layer_norm_eps=1e-12, batch_first=True
    ).eval()
    with torch.no_grad():
        torch_s.self_attn.in_proj_weight.copy_(ours.qkv.weight)
        torch_s.self_attn.in_proj_bias.copy_(ours.qkv.bias)
        pairs = [
            (torch_s.self_attn.out_proj, ours.attention_output),
            (torch_s.norm1, ours.attention_norm),
            (torch_s.linear1, ours.intermediate),
            (torch_s.linear2, ours.output),
            (torch_s.norm2, ours.output_norm),
        ]
        for theirs, mine in pairs:
            theirs.load_state_dict(mine.state_dict())
    hidden = torch.randn(3, 10, 32)
    attention_mask = torch.ones(3, 10, dtype=torch.long)
    attention_mask[1, 6:] = 0
    expected = torch_s(hidden, src_key_padding_mask=attention_mask == 0)
    actual = ours(hidden, (attention_mask != 0)[:, None, None, :])
    assert_close_float64(actual, expected)


@pytest.mark.usefixtures("float64")
def test_bert_layer_trains_as_hugging_face_s_bert_layer():
    """Dropout included: the same draws land on the same tensors as in Transformers' BertLayer
    (the attention weights, each block's output, nothing inside the feed-forward block)."""
    transformers_bert = pytest.importorskip("transformers.models.bert.modeling_bert")
    from transformers import BertConfig

    hidden_dim, heads, intermediate = 32, 4, 64
    config = BertConfig(
        hidden_size=hidden_dim,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        layer_norm_eps=1e-12,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    ours = bert_mlm.BertLayer(hidden_dim, heads, intermediate, dropout=0.1).train()
    theirs = transformers_bert.BertLayer(config).double().train()
    attention = theirs.attention
    with torch.no_grad():
        q, k, v = ours.qkv.weight.chunk(3)
        qb, kb, vb = ours.qkv.bias.chunk(3)
        for linear, weight, bias in (
            (attention.self.query, q, qb),
            (attention.self.key, k, kb),
            (attention.self.value, v, vb),
        ):
            linear.weight.copy_(weight)
            linear.bias.copy_(bias)
        for theirs_part, mine in (
            (attention.output.dense, ours.attention_output),
            (attention.output.LayerNorm, ours.attention_norm),
            (theirs.intermediate.dense, ours.intermediate),
            (theirs.output.dense, ours.output),
            (theirs.output.LayerNorm, ours.output_norm),
        ):
            theirs_part.load_state_dict(mine.state_dict())
    hidden = torch.randn(3, 10, hidden_dim)
    attention_mask = torch.ones(3, 10, dtype=torch.long)
    attention_mask[1, 6:] = 0
    additive = (1.0 - attention_mask[:, None, None, :].double()) * torch.finfo(torch.double).min
    torch.manual_seed(1)
    expected = theirs(hidden, attention_mask=additive)
    expected = expected[0] if isinstance(expected, tuple) else expected
    torch.manual_seed(1)
    actual = ours(hidden, (attention_mask != 0)[:, None, None, :])
    assert_close_float64(actual, expected)
    torch.manual_seed(2)
    assert not torch.allclose(ours(hidden, (attention_mask != 0)[:, None, None, :]), actual)
