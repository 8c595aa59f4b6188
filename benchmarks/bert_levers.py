"""Where the BERT job's CPU step goes (issue 35): page faults, and GEMMs against TensorFlow's.

Two measurements behind benchmarks/RESULTS.md's reading of seed_bert.py:

- ``steps``: one BERT-tiny step (the example's model, seq 128, global batch 128, the example's
  32 slots, vocabulary 8192; batches made ahead by the example's masker) per side, each side in
  a process of its own, with glibc's malloc as it comes (``default``) and keeping freed memory
  (``reuse``: what a strategy on CPU devices sets, ``mirrored.config.set_host_memory_reuse``):
  the median step, and over the timed steps (after 2 warm-up steps) the process's user and
  system CPU seconds and minor page faults per step. Sides: ``hand`` (the example's model in a
  hand loop: torch's Adam, ``F.cross_entropy`` on the flattened slots, no accuracy kept),
  ``hf`` (Transformers' ``BertForMaskedLM``, head at the slots, the same loop), ``fit-1`` and
  ``fit-4`` (``mirrored.Model.fit`` on 1 and 4 logical CPU devices, keeping the weighted
  accuracy as the example compiles it). In a ``default`` process the fit sides' strategy is
  created after ``set_host_memory_reuse(False)``, so that it keeps glibc's policy.
- ``gemm``: single-thread GFLOP/s of the step's matrix products in their forward shapes (the
  head's ``[4096, 128] x [128, 8192]``, the layers' projections) in torch's ``F.linear`` (its
  BLAS: MKL in the pip wheels), in torch's bundled oneDNN (``torch.ops.mkldnn._linear_pointwise``,
  no autograd: a kernel probe) and, when TensorFlow imports, ``tf.matmul`` (oneDNN), each in a
  process of its own with one intra-op thread and freed host memory kept (a strategy sets that
  policy), so that no product pays page faults for its output; 10 calls after 10.

Run from the repository root: ``.venv/bin/python benchmarks/bert_levers.py [--json PATH]``;
``--steps`` (timed steps a side, after 2 warm-up), ``--what steps,gemm``. The TensorFlow column
needs ``pip install -e '.[tensorflow]'``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from mirrored.examples.bert_mlm import (
    BertMaskedLM,
    MaskedLMMasker,
    encode,
    load_texts,
    train_tokenizer,
)
from overhead import machine_description, settings_of, write_report
from seed_bert import hugging_face_bert, slot_loss

import mirrored
from mirrored import config

VOCAB, SEQ, BATCH = 8192, 128, 128
SIDES = ("hand", "hf", "fit-1", "fit-4")
POLICIES = ("default", "reuse")
# (m, k, n): [m, k] x [k, n], as the step computes them (the head, a layer's projections)
GEMMS = ((4096, 128, 8192), (16384, 128, 384), (16384, 128, 512), (16384, 512, 128))


WARMUP = 2  # steps before the timed ones


def batches(count: int) -> list[Any]:
    """``count`` batches of the example's masked sequences (the text taken round as needed)."""
    torch.manual_seed(0)
    texts = load_texts(None)
    tokenizer = train_tokenizer(texts["train"], VOCAB, SEQ)
    masker = MaskedLMMasker.for_tokenizer(tokenizer, SEQ)
    ids = encode(tokenizer, texts["train"])
    ids = ids.repeat(math.ceil(BATCH * count / len(ids)), 1)[: BATCH * count]
    generator = torch.Generator().manual_seed(0)
    return [masker(ids[i : i + BATCH], generator) for i in range(0, len(ids), BATCH)]


class StepClock:
    """Each step's seconds, and the process's CPU seconds and minor faults over the timed steps
    (from the first step after the warm-up to the end of the last)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.usage: list[resource.struct_rusage] = []
        self._begin = 0.0

    def begin(self) -> None:
        if len(self.times) == WARMUP:
            self.usage.append(resource.getrusage(resource.RUSAGE_SELF))
        self._begin = time.perf_counter()

    def end(self) -> None:
        self.times.append(time.perf_counter() - self._begin)

    def result(self) -> dict[str, float]:
        after = resource.getrusage(resource.RUSAGE_SELF)
        (before,) = self.usage
        timed = self.times[WARMUP:]
        return {
            "median_step_s": statistics.median(timed),
            "user_s_per_step": (after.ru_utime - before.ru_utime) / len(timed),
            "system_s_per_step": (after.ru_stime - before.ru_stime) / len(timed),
            "faults_per_step": (after.ru_minflt - before.ru_minflt) / len(timed),
        }


def train_by_hand(data: list[Any], model: Any, forward: Any, clock: StepClock) -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model.train()
    for x, labels, weights in data:
        clock.begin()
        loss = slot_loss(forward(model, x), labels, weights)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        clock.end()


def train_with_fit(data: list[Any], devices: int, clock: StepClock) -> None:
    cpu = config.list_physical_devices("CPU")[0]
    config.set_logical_device_configuration(cpu, [config.LogicalDeviceConfiguration()] * devices)

    class Timer(mirrored.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            clock.begin()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            clock.end()

        def reads_batch_logs(self, hook: str) -> bool:
            return False

    with mirrored.MirroredStrategy(config.list_logical_devices("CPU")) as strategy:
        with strategy.scope():
            model = mirrored.Model(BertMaskedLM(VOCAB, SEQ))
            model.compile(
                optimizer=mirrored.optimizers.Adam(learning_rate=1e-4),
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
                weighted_metrics=["accuracy"],
            )
        model.fit(data, epochs=1, callbacks=[Timer()], verbose=0)


def run_side(side: str, policy: str, steps: int) -> dict[str, float]:
    """One side in this process: the median step and, over the timed steps, CPU and faults."""
    if policy == "default":
        mirrored.config.set_host_memory_reuse(False)
    elif not side.startswith("fit-"):  # the hand loops get what a CPU strategy applies
        with mirrored.MirroredStrategy(["cpu:0"]):
            pass
    data = batches(steps + WARMUP)
    torch.manual_seed(0)
    clock = StepClock()
    if side.startswith("fit-"):
        train_with_fit(data, int(side.removeprefix("fit-")), clock)
    elif side == "hand":
        train_by_hand(data, BertMaskedLM(VOCAB, SEQ), lambda model, x: model(**x), clock)
    else:
        train_by_hand(data, *hugging_face_bert(VOCAB, SEQ, pad_id=0), clock)
    return clock.result()


def onednn_linear(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(a, w, b, "none", [], "")


def product(library: str, m: int, k: int, n: int) -> Callable[[], object]:
    """``[m, k] x [n, k]^T`` (a linear layer) on one thread, run to completion by each call."""
    if library == "tensorflow":
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        a, w = tf.random.normal((m, k)), tf.random.normal((n, k))
        traced = tf.function(lambda: tf.matmul(a, w, transpose_b=True))
        return lambda: traced().numpy()  # a value read: the product is done
    torch.set_num_threads(1)
    x, weight, bias = torch.randn(m, k), torch.randn(n, k), torch.zeros(n)
    linear = F.linear if library == "torch" else onednn_linear
    return lambda: linear(x, weight, bias)


def gemm_rates(library: str) -> dict[str, float]:
    """Single-thread GFLOP/s of each of GEMMS in ``library``, with freed memory kept (the policy
    a strategy sets, for every library alike): no product pays page faults for its output."""
    with mirrored.MirroredStrategy(["cpu:0"]):
        pass
    rates = {}
    for m, k, n in GEMMS:
        run = product(library, m, k, n)
        for _ in range(10):  # glibc settles on the blocks it reuses within a few rounds
            run()
        begin, repeats = time.perf_counter(), 10
        for _ in range(repeats):
            run()
        rates[f"{m}x{k}x{n}"] = 2 * m * k * n * repeats / (time.perf_counter() - begin) / 1e9
    return rates


def in_process(*arguments: str) -> Any:
    done = subprocess.run(
        [sys.executable, __file__, "--inner", *arguments],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr else "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=14, help="timed steps a side (default 14)")
    parser.add_argument("--what", default="steps,gemm", help="steps, gemm or both (default)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--inner", nargs="+", help=argparse.SUPPRESS)  # a side's process
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: expected at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.inner:
        kind, *rest = args.inner
        result = run_side(rest[0], rest[1], int(rest[2])) if kind == "side" else gemm_rates(rest[0])
        print(json.dumps(result))
        return
    machine = machine_description()
    print(", ".join(f"{key}: {value}" for key, value in machine.items()))
    results: dict[str, Any] = {}
    if "steps" in args.what:
        print(f"\nseq {SEQ}, batch {BATCH}, vocabulary {VOCAB}; {args.steps} timed steps a side")
        print(
            f"{'side':<8} {'malloc':<8} {'step s':>7} {'user s':>7} {'system s':>9} {'faults':>9}"
        )
        for side in SIDES:
            for policy in POLICIES:
                row = in_process("side", side, policy, str(args.steps))
                results[f"{side} {policy}"] = row
                if "error" in row:
                    print(f"{side:<8} {policy:<8} failed: {row['error']}")
                    continue
                print(
                    f"{side:<8} {policy:<8} {row['median_step_s']:>7.3f} "
                    f"{row['user_s_per_step']:>7.3f} {row['system_s_per_step']:>9.3f} "
                    f"{row['faults_per_step']:>9.0f}"
                )
    if "gemm" in args.what:
        libraries = ("torch", "onednn", "tensorflow")
        rates = {library: in_process("gemm", library) for library in libraries}
        results["gemm"] = rates
        print("\nsingle-thread GFLOP/s, [m, k] x [n, k]^T")
        print(f"{'m x k x n':<18}" + "".join(f"{library:>12}" for library in libraries))
        for m, k, n in GEMMS:
            key = f"{m}x{k}x{n}"
            cells = [
                f"{rates[library][key]:>12.1f}" if key in rates[library] else f"{'-':>12}"
                for library in libraries
            ]
            print(f"{key:<18}" + "".join(cells))
    write_report(args.json, machine, settings_of(args, "json", "inner"), **results)


if __name__ == "__main__":
    main()
