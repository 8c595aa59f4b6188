"""Pretrain a BERT-tiny masked-language model on N logical devices carved out of one device.

The users' third program (MISSION.md): one physical device split into four logical ones (four
2 GiB GPUs out of one card under CUDA, four CPU devices here), a BERT masked-language model
(2 layers, 2 heads, hidden 128, intermediate 512) trained from scratch with ``mirrored.Model.fit``
under a MirroredStrategy: Adam with a learning rate decaying polynomially from 1e-4 to 0 over all
steps, early stopping (patience 2), TensorBoard logs, then evaluation on the test split.

The input pipeline is the article's tf.data one, step by step:

- *lines longer than 100 characters*: WikiText-2's paragraphs (``--data DIR`` with
  ``wiki.{train,valid,test}.tokens``; its `` = Heading = `` lines are dropped), or by default the
  prose that ships with CPython (``pydoc_data.topics``, the text of ``help()``): its paragraphs
  longer than 100 characters, every tenth one to validation and the next to test.
- *cache*: the WordPiece tokenizer (trained on the training split only) runs once; the token ids
  are kept in memory as one tensor per split.
- *shuffle 500*: each epoch reads the cached examples through a 500-example shuffle buffer, as
  ``tf.data.Dataset.shuffle(500)`` does (reshuffled every epoch, seeded).
- *batch 128*: global batches of 128 sequences, the last one smaller; the strategy splits each
  across the replicas.
- masking (BERT's recipe: 15% of the real tokens, of which 80% become [MASK], 10% a random token,
  10% stay) is drawn afresh for every training batch, so each epoch sees new masks; validation and
  test masks are the same on every pass.
- *prefetch*: a background thread prepares the next two batches while the replicas train.

Each batch is ``({"input_ids", "attention_mask", "mask_positions"}, labels, sample_weight)``: the
model predicts only at the masked positions (up to ``max_predictions`` per sequence, padded;
sample weight 0 on the padding), as Keras-NLP's MaskedLM does. The reported loss is Keras's
``sum_over_batch_size``: padded prediction slots count in its denominator, so it reads about
half the cross-entropy per masked token (likely why the article reports 1.93 at 6% accuracy); the
accuracy is over masked tokens only.

What to expect: the article's figures (test accuracy 0.35) came from pretrained weights. From
scratch, 1e-4 decaying to 0 over 35 steps (857 training lines by default) barely moves the model
off predicting the commonest tokens: test accuracy about 0.02, in about 75 s on two CPU cores.
Raise ``--lr`` and ``--epochs`` to watch it learn: ``--lr 1e-3 --epochs 20`` reaches a test
accuracy of about 0.11 in about 4 minutes. A run repeats bit for bit with the same ``--seed``.

    python examples/bert_mlm.py                          # CPython's docs, 4 logical devices
    python examples/bert_mlm.py --data wikitext-2 --seq-len 128
    tensorboard --logdir runs/bert_mlm
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
import torch.nn.functional as F
from mirrored.examples.command_line import example_parser
from mirrored.examples.devices import add_device_arguments, strategy_from_arguments
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from torch import Tensor, nn

import mirrored

T = TypeVar("T")
Batch = tuple[dict[str, Tensor], Tensor, Tensor]

SPLITS = ("train", "valid", "test")
MIN_LINE_CHARS = 100
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


# The value options after the device ones, in --help's order: (flag, type, default, help).
_VALUE_OPTIONS: tuple[tuple[str, type, object, str], ...] = (
    ("--epochs", int, 5, "passes over the training set (default %(default)s)"),
    ("--batch-size", int, 128, "global batch size (default %(default)s)"),
    ("--seq-len", int, 64, "tokens per sequence (default %(default)s)"),
    ("--vocab-size", int, 8000, "WordPiece vocabulary size (default %(default)s)"),
    ("--lr", float, 1e-4, "initial Adam learning rate (default %(default)s)"),
    ("--shuffle-buffer", int, 500, "shuffle buffer size (default %(default)s)"),
    ("--patience", int, 2, "EarlyStopping patience (default %(default)s)"),
    (
        "--max-lines",
        int,
        None,
        "keep at most this many lines of each split, for smoke runs (default: all)",
    ),
    ("--log-dir", Path, Path("runs/bert_mlm"), "TensorBoard log directory (default %(default)s)"),
    ("--seed", int, 0, "seeds init, shuffling and masking (default %(default)s)"),
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = example_parser(__doc__)
    parser.add_argument(
        "--data",
        type=Path,
        help="WikiText-2 folder with wiki.{train,valid,test}.tokens "
        "(default: the CPython documentation text in pydoc_data.topics)",
    )
    add_device_arguments(parser)
    for flag, kind, default, text in _VALUE_OPTIONS:
        parser.add_argument(flag, type=kind, default=default, help=text)
    parser.add_argument(
        "--verbose",
        choices=["auto", "0", "1", "2"],
        default="auto",
        help="fit's progress output (default %(default)s)",
    )
    args = parser.parse_args(argv)
    counts = ["logical_devices", "epochs", "batch_size", "seq_len", "vocab_size", "shuffle_buffer"]
    for name in [*counts, "max_lines"]:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} {value}: expected a positive integer")
    if args.seq_len < 8:
        parser.error(f"--seq-len {args.seq_len}: expected at least 8 tokens")
    if args.vocab_size < 2 * len(SPECIAL_TOKENS):
        parser.error(f"--vocab-size {args.vocab_size}: expected at least {2 * len(SPECIAL_TOKENS)}")
    if args.patience < 0:
        parser.error(f"--patience {args.patience}: expected 0 or more")
    if not args.lr > 0:
        parser.error(f"--lr {args.lr}: expected a positive learning rate")
    return args


# --- Text -------------------------------------------------------------------------------------


def keep_line(line: str) -> bool:
    """The article's filter: lines longer than 100 characters (never a WikiText heading)."""
    is_heading = line.startswith("=") and line.endswith("=")
    return len(line) > MIN_LINE_CHARS and not is_heading


def read_wikitext(folder: Path) -> dict[str, list[str]]:
    paths = {split: folder / f"wiki.{split}.tokens" for split in SPLITS}
    missing = [str(path) for path in paths.values() if not path.is_file()]
    if missing:
        raise ValueError(
            f"--data {folder}: missing {missing}; pass the WikiText-2 folder holding "
            "wiki.train.tokens, wiki.valid.tokens and wiki.test.tokens"
        )
    splits = {}
    for split, path in paths.items():
        lines = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
        splits[split] = [line for line in lines if keep_line(line)]
    return splits


def read_python_docs() -> dict[str, list[str]]:
    """The paragraphs of CPython's own documentation text (offline, a few hundred kB of prose),
    split 80/10/10 by position so that the split never changes."""
    from pydoc_data.topics import topics

    paragraphs = (
        " ".join(paragraph.split())
        for name in sorted(topics)
        for paragraph in topics[name].split("\n\n")
    )
    lines = list(dict.fromkeys(line for line in paragraphs if keep_line(line)))  # no repeats
    return {
        "train": [line for i, line in enumerate(lines) if i % 10 < 8],
        "valid": lines[8::10],
        "test": lines[9::10],
    }


def load_texts(data: Path | None, max_lines: int | None = None) -> dict[str, list[str]]:
    splits = read_python_docs() if data is None else read_wikitext(data)
    for split, lines in splits.items():
        if not lines:
            raise ValueError(f"the {split} split has no line longer than {MIN_LINE_CHARS} chars")
    return {split: lines[:max_lines] for split, lines in splits.items()}


def token_id(tokenizer: Tokenizer, token: str) -> int:
    found = tokenizer.token_to_id(token)
    if found is None:
        raise ValueError(f"the tokenizer has no {token} token; train it with SPECIAL_TOKENS")
    return found


def wordpiece_vocabulary(lines: Iterable[str], vocab_size: int) -> dict[str, int]:
    """A WordPiece vocabulary of ``lines``: the special tokens, every character (alone and as a
    ``##`` continuation, so no word is unknown), then the commonest words, ties in alphabetical
    order. Built here rather than by the tokenizers package's trainer, which breaks ties between
    merges in hash-map order (huggingface/tokenizers#1794): its vocabulary, and so the whole
    run, changed from one run to the next."""
    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    counts: collections.Counter[str] = collections.Counter()
    for line in lines:
        words = pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(line))
        counts.update(word for word, _ in words)
    characters = sorted({character for word in counts for character in word})
    tokens = [*SPECIAL_TOKENS, *characters, *(f"##{c}" for c in characters)]
    known = set(tokens)
    by_count = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    tokens += [word for word, _ in by_count if word not in known][
        : max(vocab_size - len(tokens), 0)
    ]
    return {token: index for index, token in enumerate(tokens)}


def train_tokenizer(lines: Iterable[str], vocab_size: int, seq_len: int) -> Tokenizer:
    """BERT's uncased WordPiece over ``wordpiece_vocabulary(lines)``; encodes
    ``[CLS] text [SEP]`` padded or truncated to ``seq_len`` tokens."""
    vocabulary = wordpiece_vocabulary(lines, vocab_size)
    tokenizer = Tokenizer(models.WordPiece(vocabulary, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    cls_id, sep_id = token_id(tokenizer, "[CLS]"), token_id(tokenizer, "[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)]
    )
    tokenizer.enable_truncation(max_length=seq_len)
    tokenizer.enable_padding(length=seq_len, pad_id=token_id(tokenizer, "[PAD]"))
    return tokenizer


def encode(tokenizer: Tokenizer, lines: Sequence[str]) -> Tensor:
    """Token ids [lines, seq_len], int64: the cache every epoch reads."""
    return torch.tensor([encoding.ids for encoding in tokenizer.encode_batch(list(lines))])


# --- Masking ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MaskedLMMasker:
    """BERT's masking (Devlin et al. 2019, 3.1): ``mask_rate`` of the maskable tokens are chosen
    as targets, of which 80% become [MASK], 10% a random token and 10% stay as they are.

    At most ``max_predictions`` targets per sequence (a random subset beyond that), listed in text
    order and padded to that length with position 0 and sample weight 0, as Keras-NLP's
    MaskedLMMaskGenerator lays them out. Random replacements are drawn from the non-special tokens.
    """

    vocab_size: int
    special_ids: tuple[int, ...]
    pad_id: int
    mask_id: int
    max_predictions: int
    mask_rate: float = 0.15
    mask_token_rate: float = 0.8
    random_token_rate: float = 0.1

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, seq_len: int) -> MaskedLMMasker:
        """``max_predictions``: the expected target count plus three standard deviations, so the
        cap almost never drops a target (for 64 full tokens a cap of 13 drops 1.5% of the
        targets, this one, 19, drops 0.01%)."""
        ids = tuple(token_id(tokenizer, token) for token in SPECIAL_TOKENS)
        rate = 0.15
        spread = 3 * math.sqrt(seq_len * rate * (1 - rate))
        return cls(
            vocab_size=tokenizer.get_vocab_size(),
            special_ids=ids,
            pad_id=token_id(tokenizer, "[PAD]"),
            mask_id=token_id(tokenizer, "[MASK]"),
            max_predictions=min(seq_len, math.ceil(seq_len * rate + spread)),
            mask_rate=rate,
        )

    def __call__(self, input_ids: Tensor, generator: torch.Generator) -> Batch:
        batch_size, seq_len = input_ids.shape
        num_slots = min(self.max_predictions, seq_len)
        special = torch.tensor(self.special_ids)
        maskable = ~torch.isin(input_ids, special)
        chosen = maskable & (torch.rand(input_ids.shape, generator=generator) < self.mask_rate)

        # Keep a random subset of at most num_slots targets per row, then put them in text order.
        priority = torch.where(chosen, torch.rand(input_ids.shape, generator=generator), -1.0)
        top, positions = priority.topk(num_slots, dim=1)
        weights = top >= 0
        order = torch.where(weights, positions, seq_len).argsort(dim=1)
        positions = torch.where(weights, positions, 0).gather(1, order)
        weights = weights.gather(1, order)
        labels = torch.where(weights, input_ids.gather(1, positions), self.pad_id)

        action = torch.rand(batch_size, num_slots, generator=generator)
        to_mask = action < self.mask_token_rate
        to_random = ~to_mask & (action < self.mask_token_rate + self.random_token_rate)
        candidates = torch.ones(self.vocab_size, dtype=torch.bool)
        candidates[special] = False
        candidate_ids = candidates.nonzero().squeeze(1)
        draws = torch.randint(len(candidate_ids), (batch_size, num_slots), generator=generator)
        replacement = torch.where(to_mask, self.mask_id, labels)
        replacement = torch.where(to_random, candidate_ids[draws], replacement)

        masked_ids = input_ids.clone()
        rows = torch.arange(batch_size).unsqueeze(1).expand(-1, num_slots)
        masked_ids[rows[weights], positions[weights]] = replacement[weights]
        x = {
            "input_ids": masked_ids,
            "attention_mask": (input_ids != self.pad_id).long(),
            "mask_positions": positions,
        }
        return x, labels, weights.float()


# --- Input pipeline ---------------------------------------------------------------------------


class ShuffleBuffer(Generic[T]):
    """``tf.data.Dataset.shuffle(buffer_size)``: each element out is drawn at random from a buffer
    of the next ``buffer_size`` elements in, so the order is only as random as the buffer is big."""

    def __init__(self, items: Iterable[T], buffer_size: int, generator: torch.Generator) -> None:
        self.items = items
        self.buffer_size = buffer_size
        self.generator = generator

    def _draw(self, n: int) -> int:
        return int(torch.randint(n, (), generator=self.generator))

    def __iter__(self) -> Iterator[T]:
        buffer: list[T] = []
        for item in self.items:
            if len(buffer) < self.buffer_size:
                buffer.append(item)
                continue
            i = self._draw(len(buffer))
            yield buffer[i]
            buffer[i] = item
        while buffer:
            i = self._draw(len(buffer))
            buffer[i], buffer[-1] = buffer[-1], buffer[i]
            yield buffer.pop()


class Prefetch(Generic[T]):
    """``tf.data.Dataset.prefetch(buffer_size)``: a background thread produces up to
    ``buffer_size`` items ahead of the consumer. Errors reach the consumer; leaving the loop early
    stops the thread."""

    def __init__(self, items: Iterable[T], buffer_size: int = 2) -> None:
        self.items = items
        self.buffer_size = buffer_size

    def __iter__(self) -> Iterator[T]:
        slots: queue.Queue[tuple[str, Any]] = queue.Queue(self.buffer_size)
        stop = threading.Event()

        def put(kind: str, value: Any) -> bool:
            while not stop.is_set():
                try:
                    slots.put((kind, value), timeout=0.05)
                    return True
                except queue.Full:
                    pass
            return False

        def produce() -> None:
            try:
                for item in self.items:
                    if not put("item", item):
                        return
                put("end", None)
            except BaseException as error:  # handed to the consumer, raised there
                put("error", error)

        thread = threading.Thread(target=produce, name="bert-mlm-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                kind, value = slots.get()
                if kind == "end":
                    return
                if kind == "error":
                    raise value
                yield value
        finally:
            stop.set()
            thread.join()


class MaskedLMBatches:
    """The input pipeline over cached token ids: one pass is one epoch of global batches
    ``(x, labels, sample_weight)``. With ``shuffle_buffer`` (training) the order and the masks
    change every epoch; without (evaluation) every pass yields the same batches."""

    def __init__(
        self,
        token_ids: Tensor,
        masker: MaskedLMMasker,
        batch_size: int,
        *,
        seed: int,
        shuffle_buffer: int | None = None,
        prefetch: int = 2,
    ) -> None:
        self.token_ids = token_ids
        self.masker = masker
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        self.prefetch = prefetch
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return math.ceil(len(self.token_ids) / self.batch_size)

    def _batches(self) -> Iterator[Batch]:
        if self.shuffle_buffer is None:
            self.generator.manual_seed(self.seed)
        order: Iterable[int] = range(len(self.token_ids))
        if self.shuffle_buffer is not None:
            order = ShuffleBuffer(order, self.shuffle_buffer, self.generator)
        chunk: list[int] = []
        for index in order:
            chunk.append(index)
            if len(chunk) == self.batch_size:
                yield self.masker(self.token_ids[chunk], self.generator)
                chunk = []
        if chunk:
            yield self.masker(self.token_ids[chunk], self.generator)

    def __iter__(self) -> Iterator[Batch]:
        return iter(Prefetch(self._batches(), self.prefetch))


# --- Model ------------------------------------------------------------------------------------


class BertLayer(nn.Module):
    """One BERT encoder layer (post-norm): self-attention, then a GELU feed-forward block, each
    added back to its input and layer-normalised, dropout on the attention weights and on each
    block's output.

    BERT's layer as Hugging Face's ``BertLayer`` and KerasHub's ``TransformerEncoder`` compute
    it, so that the example does the work its peers do: unlike ``nn.TransformerEncoderLayer``,
    no dropout inside the feed-forward block (on its widest tensor, the intermediate
    activations). One ``scaled_dot_product_attention`` call on views of the packed q/k/v
    projection: torch's layer splits that projection with copies and zero-filled gradients.
    Inside a strategy's replicas the attention's dropout draws from the replica's own random
    stream, as every dropout does.
    """

    def __init__(self, hidden_dim: int, num_heads: int, intermediate_dim: int, dropout: float):
        super().__init__()
        if hidden_dim % num_heads:
            raise ValueError(f"hidden_dim {hidden_dim} is not a multiple of num_heads {num_heads}")
        self.num_heads = num_heads
        self.attention_dropout = dropout
        self.qkv = nn.Linear(hidden_dim, 3 * hidden_dim)
        self.attention_output = nn.Linear(hidden_dim, hidden_dim)
        self.attention_norm = nn.LayerNorm(hidden_dim, eps=1e-12)
        self.intermediate = nn.Linear(hidden_dim, intermediate_dim)
        self.output = nn.Linear(intermediate_dim, hidden_dim)
        self.output_norm = nn.LayerNorm(hidden_dim, eps=1e-12)
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden: Tensor, attend: Tensor) -> Tensor:
        """``attend``: [batch, 1, 1, seq_len], True at the tokens that may be attended to."""
        batch, seq_len, width = hidden.shape
        qkv = self.qkv(hidden).view(batch, seq_len, 3, self.num_heads, width // self.num_heads)
        query, key, value = qkv.permute(2, 0, 3, 1, 4)  # each [batch, heads, seq_len, head_dim]
        attended = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attend,
            dropout_p=self.attention_dropout if self.training else 0.0,
        )
        attended = attended.transpose(1, 2).reshape(batch, seq_len, width)
        hidden = self.attention_norm(hidden + self.dropout(self.attention_output(attended)))
        expanded = F.gelu(self.intermediate(hidden))
        return self.output_norm(hidden + self.dropout(self.output(expanded)))


class BertMaskedLM(nn.Module):
    """A BERT encoder with its masked-LM head, scored only at ``mask_positions``.

    BERT-tiny by default (Turc et al. 2019: 2 layers, 2 heads, hidden 128, intermediate 512); the
    output layer shares its weights with the token embedding, as in BERT. Returns logits
    ``[batch, max_predictions, vocab_size]``.
    """

    def __init__(
        self,
        vocab_size: int,
        max_seq_len: int,
        *,
        hidden_dim: int = 128,
        num_layers: int = 2,
        num_heads: int = 2,
        intermediate_dim: int = 512,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, hidden_dim)
        self.position_embedding = nn.Embedding(max_seq_len, hidden_dim)
        self.embedding_norm = nn.LayerNorm(hidden_dim, eps=1e-12)
        self.dropout = nn.Dropout(dropout)
        self.encoder = nn.ModuleList(
            BertLayer(hidden_dim, num_heads, intermediate_dim, dropout) for _ in range(num_layers)
        )
        self.head_dense = nn.Linear(hidden_dim, hidden_dim)
        self.head_norm = nn.LayerNorm(hidden_dim, eps=1e-12)
        self.head_bias = nn.Parameter(torch.zeros(vocab_size))
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """BERT's initialisation: weights N(0, 0.02), biases 0."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, mask_positions: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.token_embedding(input_ids) + self.position_embedding(positions)
        hidden = self.dropout(self.embedding_norm(hidden))
        attend = (attention_mask != 0)[:, None, None, :]
        for layer in self.encoder:
            hidden = layer(hidden, attend)
        index = mask_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
        hidden = hidden.gather(1, index)
        hidden = self.head_norm(F.gelu(self.head_dense(hidden)))
        return F.linear(hidden, self.token_embedding.weight, self.head_bias)


# --- Devices and training ---------------------------------------------------------------------


class EpochTimer(mirrored.callbacks.Callback):
    """Seconds per epoch (fit's validation included), for the table."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []
        self._start = 0.0

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def format_table(history: dict[str, list[float]], seconds: Sequence[float]) -> str:
    """The article's per-epoch figures, one row per epoch."""
    columns = ["loss", "accuracy", "val_loss", "val_accuracy"]
    lines = ["epoch" + "".join(f"{name:>14}" for name in columns) + f"{'seconds':>10}"]
    for epoch, elapsed in enumerate(seconds):
        cells = "".join(
            f"{history[name][epoch]:14.4f}" if epoch < len(history.get(name, [])) else f"{'-':>14}"
            for name in columns
        )
        lines.append(f"{epoch + 1:5d}{cells}{elapsed:10.1f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    texts = load_texts(args.data, args.max_lines)
    tokenizer = train_tokenizer(texts["train"], args.vocab_size, args.seq_len)
    masker = MaskedLMMasker.for_tokenizer(tokenizer, args.seq_len)
    token_ids = {split: encode(tokenizer, lines) for split, lines in texts.items()}
    train = MaskedLMBatches(
        token_ids["train"],
        masker,
        args.batch_size,
        seed=args.seed,
        shuffle_buffer=args.shuffle_buffer,
    )
    valid = MaskedLMBatches(token_ids["valid"], masker, args.batch_size, seed=args.seed + 1)
    test = MaskedLMBatches(token_ids["test"], masker, args.batch_size, seed=args.seed + 2)
    print(
        f"{', '.join(f'{len(v)} {k}' for k, v in texts.items())} lines; vocabulary "
        f"{tokenizer.get_vocab_size()} WordPieces; sequences of {args.seq_len} tokens, up to "
        f"{masker.max_predictions} masked; prepared in {time.perf_counter() - start:.1f} s"
    )

    with strategy_from_arguments(args) as strategy:
        print(f"{strategy.num_replicas_in_sync} replicas: {strategy}")
        with strategy.scope():
            model = mirrored.Model(BertMaskedLM(tokenizer.get_vocab_size(), args.seq_len))
            schedule = mirrored.optimizers.schedules.PolynomialDecay(
                args.lr, decay_steps=args.epochs * len(train), end_learning_rate=0.0
            )
            model.compile(
                optimizer=mirrored.optimizers.Adam(learning_rate=schedule),
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
                weighted_metrics=["accuracy"],
            )
        timer = EpochTimer()
        callbacks: list[mirrored.callbacks.Callback] = [
            mirrored.callbacks.EarlyStopping(patience=args.patience),
            mirrored.callbacks.TensorBoard(log_dir=str(args.log_dir)),
            timer,
        ]
        verbose = args.verbose if args.verbose == "auto" else int(args.verbose)
        history = model.fit(
            train, epochs=args.epochs, validation_data=valid, callbacks=callbacks, verbose=verbose
        )
        print(format_table(history.history, timer.seconds))
        results = model.evaluate(test, verbose=verbose, return_dict=True)
    metrics = {"loss": float(results["loss"]), "accuracy": float(results["accuracy"])}
    print(f"test loss: {metrics['loss']:.4f} - test accuracy: {metrics['accuracy']:.4f}")
    return metrics


if __name__ == "__main__":
    main()
