"""The articles' BERT job in one sitting: TensorFlow + KerasHub, plain PyTorch loops, mirrored.

The job (MISSION.md's third program): a BERT-tiny masked-language model (2 layers, 2 heads,
hidden 128, intermediate 512) trained from scratch on lines longer than 100 characters, shuffle
500, batch 128, cache, prefetch, Adam with a learning rate decaying polynomially from 1e-4 to 0
over all steps. Every side trains on the same token ids (tokenised once here, written to a
temporary ``.npy`` file the sides read), the same shapes (``--seq-len`` 128, global batch 128,
a 8192-row vocabulary in the model, ``--max-predictions`` masked slots per sequence: by default
the example's, 32 at 128 tokens, as its masker pads them) and the
same number of steps (``--steps-per-epoch`` 13 times ``--epochs`` 3). Each side runs in a process
of its own, one after another (``--rounds``: the order rotated by one per round):

- ``keras-hub-4``: the articles' program. ``keras_hub.models.BertMaskedLM`` on a randomly
  initialised ``BertBackbone`` of the bert_tiny shape (no download, ``preprocessor=None``) under
  ``tf.distribute.MirroredStrategy`` on 4 logical CPU devices, compiled with Keras's Adam on
  ``PolynomialDecay(1e-4, steps, 0.0)``, ``SparseCategoricalCrossentropy(from_logits=True)`` and
  weighted ``SparseCategoricalAccuracy`` (KerasHub's defaults for the task; ``jit_compile=False``,
  which is also what "auto" gives on a CPU-only machine), trained with ``fit`` on the tf.data
  pipeline ``shuffle(500).batch(128)``, masked by KerasHub's ``MaskedLMMaskGenerator`` (what
  ``BertMaskedLMPreprocessor`` runs), then ``cache()`` and ``prefetch(AUTOTUNE)``: the masks are
  made in the first epoch and kept for the later ones, the stronger TensorFlow (masking on the
  fly costs it CPU on 2 cores; the article masks on the fly). TensorFlow's oneDNN kernels on
  (``TF_ENABLE_ONEDNN_OPTS=1`` unless set, as compare.py: TensorFlow turns them on by itself
  only on some CPUs). Only when tensorflow and keras_hub import (``pip install -e
  '.[tensorflow]'``); else one line says so;
- ``plain``: ``examples/bert_mlm.py``'s ``BertMaskedLM`` in the loop a PyTorch user writes
  (:func:`hand_loop`): every epoch's batches prepared ahead in memory (the example's pipeline run
  to the end before timing, so the same batches the mirrored sides get), ``torch.optim.Adam``
  with ``PolynomialLR`` (power 1: the same schedule), ``F.cross_entropy`` on the flattened slots
  reduced as Keras reduces it (the weighted sum over every slot over the slot count), torch's
  own dropout, and the weighted accuracy the fit sides keep;
- ``hf-plain``: an independent model in the same loop: Transformers' ``BertForMaskedLM`` at the
  bert-tiny configuration, its prediction head applied at the masked slots only, as the
  example's and KerasHub's (only when transformers imports);
- ``mirrored-1``, ``-2``, ``-4``: the example as it runs: its model and input pipeline,
  ``mirrored.Model`` compiled as its ``main`` compiles it, ``fit`` under ``MirroredStrategy`` on
  1, 2 and 4 logical CPU devices (``mirrored.examples.devices.logical_devices``).

No side validates, stops early or writes TensorBoard logs (the article's fit does): what is
timed is training alone, the same on every side.

Data: WikiText-2 with ``--data DIR`` (``wiki.{train,valid,test}.tokens``), else the example's
default text (CPython's ``pydoc_data.topics``); the example's WordPiece tokenizer is trained on
its training lines with ``--vocab-size`` pieces, and its first ``steps-per-epoch x batch`` lines
(taken again from the start when the text has fewer) are the training set.

Timing: a callback on every side (Keras: ``on_train_batch_begin``/``end``; mirrored: its own
callbacks; the plain loop calls the same recorder around its step): per step, the seconds from
batch begin to batch end (Keras's end is after the step's logs reach Python, so the step has
finished; TensorFlow's step also takes the batch from its iterator, mirrored's and the plain
loop's take it before ``begin``); per epoch, the seconds from epoch begin to the first step's end
(the epoch start); per run, the wall time of the whole ``fit`` call (the plain loop: all its
epochs). Printed per side: median step, sequences per second at that step, overall sequences
per second (every sequence trained over the whole fit time: tracing, iterators and epoch starts
included), the median interval between successive step ends within an epoch (input waits
included on every side), the time outside steps; then the ratios (throughput: above 1, the
first is faster): mirrored-1 over plain per step (goal >= 0.97x), plain over hf-plain per step
(the example's model against Transformers' at equal work: goal >= 1/1.05 = 0.952x), and
mirrored-4 over keras-hub-4 per step (goal >= 1.0x) and overall.

Run from the repository root (about 8-15 minutes a round on 2 cores):
``.venv/bin/python benchmarks/seed_bert.py [--data wikitext-2] [--json PATH]``; ``--epochs``,
``--steps-per-epoch``, ``--rounds``, ``--sides``, ``--no-tf``, ``--max-predictions``,
``--vocab-size``, ``--seq-len``, ``--batch-size``, ``--seed``. ``--device cuda`` runs the PyTorch
sides on the first GPU (mirrored-N on N logical devices of it; a step ends when the GPU has
finished it) and leaves TensorFlow out: where kernels take microseconds, what is left of a step
is host work, which N replica threads of one process share under one GIL.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from mirrored.examples.bert_mlm import (
    BertMaskedLM,
    MaskedLMBatches,
    MaskedLMMasker,
    encode,
    load_texts,
    train_tokenizer,
)
from overhead import machine_description, settings_of, write_report
from torch import nn

import mirrored
from mirrored import config

KERAS_SIDE = "keras-hub-4"
KERAS_DEVICES = 4
MIRRORED_DEVICES = {"mirrored-1": 1, "mirrored-2": 2, "mirrored-4": 4}
HF_SIDE = "hf-plain"
SIDES = (KERAS_SIDE, "plain", HF_SIDE, *MIRRORED_DEVICES)
RATIOS = (  # (mine, peer, throughput, goal: the least ratio that meets it)
    ("mirrored-1", "plain", "step_sequences_per_s", 0.97),
    ("plain", HF_SIDE, "step_sequences_per_s", 1 / 1.05),
    ("mirrored-4", KERAS_SIDE, "step_sequences_per_s", 1.0),
    ("mirrored-4", KERAS_SIDE, "overall_sequences_per_s", 1.0),
)
# Turc et al. 2019's smallest BERT, in KerasHub's names (the example's model's defaults).
BERT_TINY = {"num_layers": 2, "num_heads": 2, "hidden_dim": 128, "intermediate_dim": 512}
Forward = Callable[[Any, dict[str, torch.Tensor]], torch.Tensor]  # the logits at the slots
DETAILS = ("versions", "replicas", "onednn", "strategy", "threads")  # printed after the table


@dataclasses.dataclass(frozen=True)
class Job:
    """What every side trains, written once as JSON for the side processes."""

    tokens: str  # .npy of int32 token ids [sequences, seq_len]
    masker: dict[str, Any]  # MaskedLMMasker's fields
    model_vocab_size: int
    seq_len: int
    batch_size: int
    epochs: int
    steps_per_epoch: int
    learning_rate: float
    shuffle_buffer: int
    seed: int
    device: str  # the PyTorch sides': "cpu", or "cuda" (the first GPU)

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def torch_masker(self) -> MaskedLMMasker:
        fields = dict(self.masker, special_ids=tuple(self.masker["special_ids"]))
        return MaskedLMMasker(**fields)

    def torch_batches(self) -> MaskedLMBatches:
        """The example's training pipeline over the shared token ids."""
        token_ids = torch.from_numpy(np.load(self.tokens)).long()
        return MaskedLMBatches(
            token_ids,
            self.torch_masker(),
            self.batch_size,
            seed=self.seed,
            shuffle_buffer=self.shuffle_buffer,
        )


class StepLog:
    """Timestamps (``time.perf_counter``) of epoch begins and of each step's begin and end; on a
    GPU a step ends when the device has finished its work."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.epoch_begins: list[float] = []
        self.steps: list[tuple[int, float, float]] = []  # (epoch, begin, end)
        self._begin = 0.0

    def epoch_begin(self) -> None:
        self.epoch_begins.append(time.perf_counter())

    def batch_begin(self) -> None:
        self._begin = time.perf_counter()

    def batch_end(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.steps.append((len(self.epoch_begins) - 1, self._begin, time.perf_counter()))

    def record(self, fit_seconds: float, **details: Any) -> dict[str, Any]:
        return {
            "epoch_begins": self.epoch_begins,
            "steps": self.steps,
            "fit_seconds": fit_seconds,
            **details,
        }


class MirroredStepLog(mirrored.callbacks.Callback):
    """The recorder as a mirrored callback."""

    def __init__(self, log: StepLog) -> None:
        super().__init__()
        self.log = log

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.log.epoch_begin()

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.log.batch_begin()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.log.batch_end()

    def reads_batch_logs(self, hook: str) -> bool:
        return False  # a timer: fit need not compute the metrics' results every step


# -- the sides (each in a process of its own) ------------------------------------------------------


def slot_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the flattened slots, reduced as Keras reduces it: the weighted sum over
    every slot over the slot count."""
    losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    return (losses * weights.flatten()).sum() / weights.numel()


def hand_loop(job: Job, model: nn.Module, forward: Forward) -> dict[str, Any]:
    """A PyTorch user's loop: every epoch's batches prepared ahead (the example's pipeline, run
    to the end before timing: the batches the mirrored sides get), ``torch.optim.Adam`` with
    ``PolynomialLR`` (power 1: the same schedule), cross-entropy on the flattened slots reduced
    as Keras reduces it (the weighted sum over every slot over the slot count), torch's own
    dropout, and the weighted accuracy the fit sides keep."""
    pipeline = job.torch_batches()
    device = torch.device(job.device)
    epochs = [
        [
            (
                {key: value.to(device) for key, value in x.items()},
                labels.to(device),
                weights.to(device),
            )
            for x, labels, weights in pipeline
        ]
        for _ in range(job.epochs)
    ]
    model = model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=job.learning_rate)
    schedule = torch.optim.lr_scheduler.PolynomialLR(
        optimizer, total_iters=job.total_steps, power=1.0
    )
    model.train()
    log, loss = StepLog(job.device), torch.zeros(())
    correct, counted = torch.zeros((), device=device), torch.zeros((), device=device)
    start = time.perf_counter()
    for batches in epochs:
        log.epoch_begin()
        for x, labels, weights in batches:
            log.batch_begin()
            logits = forward(model, x)
            loss = slot_loss(logits, labels, weights)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            correct += ((logits.detach().argmax(-1) == labels).float() * weights).sum()
            counted += weights.sum()
            log.batch_end()
    seconds = time.perf_counter() - start
    return log.record(
        seconds,
        loss=float(loss.detach()),
        accuracy=float(correct / counted),
        threads=torch.get_num_threads(),
    )


def run_plain(job: Job) -> dict[str, Any]:
    """The example's model in the hand loop."""
    torch.manual_seed(job.seed)
    model = BertMaskedLM(job.model_vocab_size, job.seq_len)
    return hand_loop(job, model, lambda model, x: model(**x))


def hugging_face_bert(vocab_size: int, seq_len: int, pad_id: int) -> tuple[nn.Module, Forward]:
    """Transformers' ``BertForMaskedLM`` of the bert-tiny shape, and its forward to the logits
    at the masked slots only (its prediction head applied there, as the example's and
    KerasHub's), so that it does the work they do."""
    import transformers

    model = transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=vocab_size,
            hidden_size=BERT_TINY["hidden_dim"],
            num_hidden_layers=BERT_TINY["num_layers"],
            num_attention_heads=BERT_TINY["num_heads"],
            intermediate_size=BERT_TINY["intermediate_dim"],
            max_position_embeddings=seq_len,
            pad_token_id=pad_id,
        )
    )

    def forward(model: Any, x: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = model.bert(
            input_ids=x["input_ids"], attention_mask=x["attention_mask"]
        ).last_hidden_state
        index = x["mask_positions"].unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
        return model.cls(hidden.gather(1, index))

    return model, forward


def run_hugging_face(job: Job) -> dict[str, Any]:
    """Transformers' BERT in the hand loop."""
    import transformers

    torch.manual_seed(job.seed)
    model, forward = hugging_face_bert(job.model_vocab_size, job.seq_len, job.masker["pad_id"])
    record = hand_loop(job, model, forward)
    record["versions"] = f"transformers {transformers.__version__}"
    return record


def run_mirrored(job: Job, num_devices: int) -> dict[str, Any]:
    from mirrored.examples.devices import logical_devices

    kind = "GPU" if job.device == "cuda" else "CPU"
    devices = logical_devices(config.list_physical_devices(kind)[0], num_devices)
    torch.manual_seed(job.seed)
    batches = job.torch_batches()
    with mirrored.MirroredStrategy(devices) as strategy:
        with strategy.scope():  # as examples/bert_mlm.py's main compiles it
            model = mirrored.Model(BertMaskedLM(job.model_vocab_size, job.seq_len))
            schedule = mirrored.optimizers.schedules.PolynomialDecay(
                job.learning_rate, decay_steps=job.total_steps, end_learning_rate=0.0
            )
            model.compile(
                optimizer=mirrored.optimizers.Adam(learning_rate=schedule),
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
                weighted_metrics=["accuracy"],
            )
        log = StepLog(job.device)
        start = time.perf_counter()
        history = model.fit(batches, epochs=job.epochs, callbacks=[MirroredStepLog(log)], verbose=0)
        seconds = time.perf_counter() - start
        description = repr(strategy)
    return log.record(seconds, loss=history.history["loss"][-1], strategy=description)


def run_keras_hub(job: Job) -> dict[str, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    import keras
    import keras_hub
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * KERAS_DEVICES
    )
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(KERAS_DEVICES)])
    masker = job.torch_masker()
    mask_generator = keras_hub.layers.MaskedLMMaskGenerator(
        vocabulary_size=masker.vocab_size,
        mask_selection_rate=masker.mask_rate,
        mask_selection_length=masker.max_predictions,
        mask_token_rate=masker.mask_token_rate,
        random_token_rate=masker.random_token_rate,
        mask_token_id=masker.mask_id,
        unselectable_token_ids=list(masker.special_ids),
    )

    def masked(token_ids: Any) -> Any:  # BertMaskedLMPreprocessor's layout
        out = mask_generator(token_ids)
        x = {
            "token_ids": out["token_ids"],
            "segment_ids": tf.zeros_like(token_ids),
            # int32, not the preprocessor's bool: a bool input fails to train on more than one
            # replica (InvalidArgumentError: AddN of bool; tensorflow 2.21, keras 3.15)
            "padding_mask": tf.cast(token_ids != masker.pad_id, tf.int32),
            "mask_positions": out["mask_positions"],
        }
        return x, out["mask_ids"], out["mask_weights"]

    dataset = (
        tf.data.Dataset.from_tensor_slices(np.load(job.tokens))
        .shuffle(job.shuffle_buffer, seed=job.seed)
        .batch(job.batch_size)
        .map(masked, num_parallel_calls=tf.data.AUTOTUNE)
        .cache()  # masks prepared once, ahead of the later epochs: the stronger TensorFlow
        .prefetch(tf.data.AUTOTUNE)
    )
    keras.utils.set_random_seed(job.seed)
    with strategy.scope():
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=job.model_vocab_size, max_sequence_length=job.seq_len, **BERT_TINY
        )
        model = keras_hub.models.BertMaskedLM(backbone, preprocessor=None)
        schedule = keras.optimizers.schedules.PolynomialDecay(
            job.learning_rate, job.total_steps, 0.0
        )
        model.compile(
            optimizer=keras.optimizers.Adam(learning_rate=schedule),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
            jit_compile=False,
        )
    log = StepLog()

    class KerasStepLog(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            log.epoch_begin()

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            log.batch_begin()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            log.batch_end()

    start = time.perf_counter()
    history = model.fit(dataset, epochs=job.epochs, callbacks=[KerasStepLog()], verbose=0)
    seconds = time.perf_counter() - start
    return log.record(
        seconds,
        loss=float(history.history["loss"][-1]),
        replicas=strategy.num_replicas_in_sync,
        versions=f"tensorflow {tf.__version__}, keras {keras.__version__}, "
        f"keras_hub {keras_hub.__version__}",
        onednn=os.environ["TF_ENABLE_ONEDNN_OPTS"],
    )


def run_side(side: str, folder: Path) -> None:
    """The side process: read the job, train, write ``side.json`` beside it."""
    job = Job(**json.loads((folder / "job.json").read_text()))
    if side == KERAS_SIDE:
        record = run_keras_hub(job)
    elif side == "plain":
        record = run_plain(job)
    elif side == HF_SIDE:
        record = run_hugging_face(job)
    else:
        record = run_mirrored(job, MIRRORED_DEVICES[side])
    (folder / f"{side}.json").write_text(json.dumps(record))


# -- the sitting -----------------------------------------------------------------------------------


def prepare(args: argparse.Namespace, folder: Path) -> Job:
    """Tokenise once; the token ids and the job go to ``folder`` for every side."""
    texts = load_texts(args.data)
    tokenizer = train_tokenizer(texts["train"], args.vocab_size, args.seq_len)
    count = args.steps_per_epoch * args.batch_size
    lines = list(itertools.islice(itertools.cycle(texts["train"]), count))
    token_ids = encode(tokenizer, lines).numpy().astype(np.int32)
    np.save(folder / "tokens.npy", token_ids)
    masker = MaskedLMMasker.for_tokenizer(tokenizer, args.seq_len)
    if args.max_predictions is not None:
        masker = dataclasses.replace(masker, max_predictions=args.max_predictions)
    job = Job(
        tokens=str(folder / "tokens.npy"),
        masker=dataclasses.asdict(masker),
        model_vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        learning_rate=1e-4,
        shuffle_buffer=500,
        seed=args.seed,
        device=args.device,
    )
    (folder / "job.json").write_text(json.dumps(dataclasses.asdict(job)))
    source = "WikiText-2" if args.data else "CPython's pydoc topics"
    print(
        f"{source}: {len(texts['train'])} training lines, {count} sequences an epoch "
        f"({'repeated' if count > len(texts['train']) else 'the first'}); tokenizer "
        f"{tokenizer.get_vocab_size()} WordPieces, model vocabulary {args.vocab_size}; "
        f"{args.seq_len} tokens, {masker.max_predictions} prediction slots, global batch "
        f"{args.batch_size}, {args.steps_per_epoch} steps x {args.epochs} epochs",
        flush=True,
    )
    return job


def tensorflow_missing() -> str | None:
    missing = [
        name for name in ("tensorflow", "keras_hub") if importlib.util.find_spec(name) is None
    ]
    return ", ".join(missing) or None


def run_round(sides: Sequence[str], folder: Path) -> dict[str, dict[str, Any]]:
    """Each side in a fresh process, one after another; a peer's side (TensorFlow's,
    Transformers') that fails is reported and left out, one of ours that fails stops the
    sitting."""
    records = {}
    for side in sides:
        load = os.getloadavg()[0]
        print(f"-- {side} (load {load:.2f})", flush=True)
        command = [sys.executable, __file__, "--side", side, "--job", str(folder)]
        done = subprocess.run(command, check=False)
        if done.returncode != 0:
            if side not in (KERAS_SIDE, HF_SIDE):
                raise RuntimeError(f"{side} exited with {done.returncode}")
            print(f"{side} failed (exit code {done.returncode}); left out", flush=True)
            continue
        records[side] = json.loads((folder / f"{side}.json").read_text())
        records[side]["load_before"] = load
    return records


def summarize(records: Sequence[dict[str, Any]], job: Job) -> dict[str, Any]:
    """One side's rounds: steps pooled, fit times summed."""
    steps = [end - begin for r in records for _, begin, end in r["steps"]]
    intervals, epoch_starts = [], []
    for r in records:
        for epoch, begin in enumerate(r["epoch_begins"]):
            ends = [end for e, _, end in r["steps"] if e == epoch]
            epoch_starts.append(ends[0] - begin)
            intervals += [b - a for a, b in itertools.pairwise(ends)]
    trained = job.batch_size * len(steps)
    fit_seconds = sum(r["fit_seconds"] for r in records)
    median = statistics.median(steps)
    return {
        "steps": len(steps),
        "median_step_s": median,
        "step_sequences_per_s": job.batch_size / median,
        "overall_sequences_per_s": trained / fit_seconds,
        "median_interval_s": statistics.median(intervals) if intervals else None,
        "fit_seconds": fit_seconds,
        "outside_steps_s": fit_seconds - sum(steps),
        "epoch_starts_s": epoch_starts,
        "final_loss": records[-1]["loss"],
    }


def ratio(summaries: dict[str, Any], mine: str, peer: str, key: str, goal: float) -> str:
    """The throughput ratio and whether it meets its goal; "-" when a side is missing."""
    if mine not in summaries or peer not in summaries:
        return "-"
    value = summaries[mine][key] / summaries[peer][key]
    return f"{value:.3f}x (goal >= {goal:.3f}x: {'met' if value >= goal else 'NOT met'})"


def print_report(summaries: dict[str, dict[str, Any]]) -> None:
    print(
        f"\n{'side':<12} {'steps':>5} {'median s':>9} {'seq/s step':>10} {'seq/s all':>9} "
        f"{'interval s':>10} {'fit s':>7} {'outside s':>9} {'loss':>7}  epoch starts s"
    )
    for side, s in summaries.items():
        interval = "-" if s["median_interval_s"] is None else f"{s['median_interval_s']:.3f}"
        starts = " ".join(f"{t:.2f}" for t in s["epoch_starts_s"])
        print(
            f"{side:<12} {s['steps']:>5} {s['median_step_s']:>9.3f} "
            f"{s['step_sequences_per_s']:>10.1f} {s['overall_sequences_per_s']:>9.1f} "
            f"{interval:>10} {s['fit_seconds']:>7.1f} {s['outside_steps_s']:>9.1f} "
            f"{s['final_loss']:>7.4f}  {starts}"
        )
    print("\nThroughput ratios (above 1: the first is faster):")
    for mine, peer, key, goal in RATIOS:
        label = f"{mine} over {peer}, {'per step' if key.startswith('step') else 'overall'}:"
        print(f"  {label:<38} {ratio(summaries, mine, peer, key, goal)}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="WikiText-2 folder (default: pydoc topics)")
    parser.add_argument("--epochs", type=int, default=3, help="default %(default)s")
    parser.add_argument("--steps-per-epoch", type=int, default=13, help="default %(default)s")
    parser.add_argument("--batch-size", type=int, default=128, help="global (default %(default)s)")
    parser.add_argument("--seq-len", type=int, default=128, help="default %(default)s")
    parser.add_argument("--vocab-size", type=int, default=8192, help="default %(default)s")
    parser.add_argument(
        "--max-predictions",
        type=int,
        help="masked slots a sequence (default: the example's, 32 at --seq-len 128)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="default %(default)s")
    parser.add_argument(
        "--sides", default=",".join(SIDES), help="comma-separated subset (default: all)"
    )
    parser.add_argument("--no-tf", action="store_true", help=f"leave {KERAS_SIDE} out")
    parser.add_argument("--seed", type=int, default=0, help="default %(default)s")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="the PyTorch sides' device: cuda runs mirrored-N on N logical devices of the first "
        f"GPU (and leaves {KERAS_SIDE} out: it runs on the CPU); default %(default)s",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a side's process
    parser.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("epochs", "steps_per_epoch", "batch_size", "seq_len", "rounds", "max_predictions"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected at least 1")
    if args.max_predictions is not None and args.max_predictions > args.seq_len:
        parser.error(f"--max-predictions {args.max_predictions}: at most --seq-len")
    args.sides = [side for side in args.sides.split(",") if side]
    unknown = [side for side in args.sides if side not in SIDES]
    if unknown or not args.sides:
        parser.error(f"--sides {','.join(args.sides)}: choose from {','.join(SIDES)}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.side is not None:
        run_side(args.side, args.job)
        return
    machine = machine_description()
    print(", ".join(f"{key}: {value}" for key, value in machine.items()))
    sides = list(args.sides)
    if KERAS_SIDE in sides and (args.no_tf or args.device != "cpu" or tensorflow_missing()):
        why = (
            "--no-tf"
            if args.no_tf
            else f"--device {args.device}"
            if args.device != "cpu"
            else f"{tensorflow_missing()} not installed"
        )
        print(f"{KERAS_SIDE}: left out ({why}; pip install -e '.[tensorflow]' to run it)")
        sides.remove(KERAS_SIDE)
    if HF_SIDE in sides and importlib.util.find_spec("transformers") is None:
        print(f"{HF_SIDE}: left out (transformers not installed; pip install -e '.[test]')")
        sides.remove(HF_SIDE)
    with tempfile.TemporaryDirectory(prefix="seed-bert-") as folder:
        job = prepare(args, Path(folder))
        rounds = []
        for index in range(args.rounds):
            shift = index % len(sides)
            print(f"\n== round {index + 1}/{args.rounds}", flush=True)
            rounds.append(run_round(sides[shift:] + sides[:shift], Path(folder)))
    summaries = {
        side: summarize([r[side] for r in rounds if side in r], job)
        for side in sides
        if any(side in r for r in rounds)
    }
    print_report(summaries)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    for side in sides:
        record = rounds[-1].get(side, {})
        details = {key: record[key] for key in DETAILS if key in record}
        if details:
            print(f"  {side}: {details}")
    settings = settings_of(args, "side", "job", "json")
    write_report(args.json, machine, settings, rounds=rounds, summary=summaries)


if __name__ == "__main__":
    main()
