"""MultiWorkerMirroredStrategy with real worker processes on 127.0.0.1 (tests/multiprocess/jobs.py).

Every worker's result is compared with the single-device program in this process; faults are
real: a worker killed with SIGKILL, a worker that stops stepping, workers that disagree.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import mirrored
from mirrored.replication.sharded_update import state_bytes
from tests.exactness import assert_close_float64
from tests.multiprocess.jobs import batch_norm_net, compile_mlp, fit_data, shuffled_loader
from tests.multiprocess.spawn import (
    assert_all_failed_saying,
    assert_all_succeeded,
    kill_workers,
    run_workers,
    start_workers,
    wait_workers,
)
from tests.reference_loops import (
    OPTIMIZERS,
    DeepNet,
    adamw,
    assert_same_state,
    make_batches,
    make_mlp,
    merge_batches,
    train_mirrored,
    train_plain,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
float64 = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py


def _results(out: Path, num_workers: int = 2) -> list[dict]:
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(num_workers)]


def _implementation(name: str, num_workers: int = 2) -> dict[int, dict[str, str]]:
    """Every worker's environment choosing ``CommunicationImplementation[name]``."""
    return {rank: {"MIRRORED_TEST_IMPLEMENTATION": name} for rank in range(num_workers)}


def _assert_close(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    for name, value in expected.items():
        assert_close_float64(actual[name], value, msg=name)


@float64
@pytest.mark.parametrize(
    (
        "optimizer",
        "logical_devices",
        "cluster",
        "user_group",
        "bytes_per_pack",
        "implementation",
        "traced",
    ),
    [
        ("sgd", 2, "torchrun", "", 0, "AUTO", ""),
        ("adam", 2, "torchrun", "", 0, "AUTO", ""),
        ("adam", 2, "torchrun", "", 0, "RING", ""),
        ("adam", 2, "torchrun", "", 256, "AUTO", ""),  # the MLP's gradients in 6 buckets
        ("adam", 1, "tf_config", "", 0, "AUTO", ""),
        ("sgd", 1, "torchrun", "env://", 0, "AUTO", ""),  # the program's own process group
        ("sgd", 1, "torchrun", "tcp://", 0, "AUTO", ""),  # Ray's, init_method="tcp": no MASTER_*
        # A traced step hands its gradients over: each bucket still crosses as backward's does.
        ("adam", 2, "torchrun", "", 256, "AUTO", "traced"),
    ],
)
def test_custom_loop_equals_one_device(
    tmp_path: Path,
    optimizer: str,
    logical_devices: int,
    cluster: str,
    user_group: str,
    bytes_per_pack: int,
    implementation: str,
    traced: str,
) -> None:
    workers = run_workers(
        "custom_loop",
        tmp_path,
        args=[optimizer, user_group, str(bytes_per_pack), "1", "", "", "", traced],
        logical_devices=logical_devices,
        cluster=cluster,
        env=_implementation(implementation),
    )
    assert_all_succeeded(workers)
    model = make_mlp()
    losses = train_plain(model, OPTIMIZERS[optimizer](model), make_batches())
    results = _results(tmp_path)
    # Each step's gradients cross in one bucket (the MLP is below the 1 MiB first bucket), or in
    # several with a small bytes_per_pack; each bucket carries a count per parameter too. With
    # AUTO the workers (all on this machine) sum through shared memory, with RING through gloo.
    steps = len(make_batches())
    transport = "gloo" if implementation == "RING" else "shared memory"
    other = "shared memory" if implementation == "RING" else "gloo"
    assert not [n for n in results[0]["all_reduces"][other] if n > 1]
    gradient_sizes = [n for n in results[0]["all_reduces"][transport] if n > 1]
    if bytes_per_pack:  # no two neighbours fit in 256 bytes: a bucket per parameter
        assert gradient_sizes == [5 + 1, 80 + 1, 16 + 1, 512 + 1, 32 + 1, 384 + 1] * steps
    else:
        assert gradient_sizes == [1029 + 6] * steps
    for rank, result in enumerate(results):
        assert result.get("replayed", False) == bool(traced)
        if user_group:  # the group's workers, both on this machine
            assert result["resolver"] == ("ProcessGroupClusterResolver", rank, 2)
        assert len(result["replicas"]) == logical_devices
        for replica in result["replicas"]:
            _assert_close(model.state_dict(), replica)
        assert_close_float64(result["losses"], losses)
    # Every replica of every worker holds bit-identical parameters.
    first = results[0]["replicas"][0]
    for result in results:
        for replica in result["replicas"]:
            assert all(torch.equal(replica[k], v) for k, v in first.items())


@float64
@pytest.mark.parametrize(
    ("logical_devices", "accumulation", "implementation", "keep_zeroed_gradients"),
    [(2, 2, "AUTO", ""), (1, 3, "RING", "zero_grad(set_to_none=False)")],
)
def test_accumulated_steps_reduce_once_per_window_and_equal_one_device_on_the_larger_batch(
    tmp_path: Path,
    logical_devices: int,
    accumulation: int,
    implementation: str,
    keep_zeroed_gradients: str,
) -> None:
    workers = run_workers(
        "custom_loop",
        tmp_path,
        args=["adam", "", "0", str(accumulation), keep_zeroed_gradients],
        logical_devices=logical_devices,
        env=_implementation(implementation),
    )
    assert_all_succeeded(workers)
    larger = merge_batches(make_batches(), accumulation)  # 13 batches of 16, the last of 11
    windows = len(larger)
    model = make_mlp()
    losses = train_plain(model, OPTIMIZERS["adam"](model), larger)
    results = _results(tmp_path)
    # One all-reduce of the gradients per window: the micro-steps in between send nothing, and
    # the unfinished last window never reaches an update.
    transport = "gloo" if implementation == "RING" else "shared memory"
    assert [n for n in results[0]["all_reduces"][transport] if n > 1] == [1029 + 6] * windows
    for result in results:
        for replica in result["replicas"]:
            _assert_close(model.state_dict(), replica)
        window_losses = [
            sum(result["losses"][w * accumulation : (w + 1) * accumulation]) / accumulation
            for w in range(windows)
        ]
        assert_close_float64(window_losses, losses)


@float64
@pytest.mark.parametrize(("logical_devices", "period"), [(1, 1), (2, 3)])
def test_local_sgd_across_workers_sends_only_the_periodic_averages(
    tmp_path: Path, logical_devices: int, period: int
) -> None:
    workers = run_workers(
        "custom_loop",
        tmp_path,
        args=["sgd", "", "0", "1", "", str(period)],
        logical_devices=logical_devices,
    )
    assert_all_succeeded(workers)
    results = _results(tmp_path)
    steps = len(make_batches())
    # No gradient all-reduce (those carry a count per parameter: 1029 + 6); one all-reduce of
    # the 1029 parameters per period.
    sizes = [n for n in results[0]["all_reduces"]["shared memory"] if n > 1]
    assert sizes == [1029] * (steps // period)
    if period == 1:  # plain SGD averaged after every update: synchronous training
        model = make_mlp()
        train_plain(model, OPTIMIZERS["sgd"](model), make_batches())
        for result in results:
            for replica in result["replicas"]:
                _assert_close(model.state_dict(), replica)
    # The last update (13 = 4 * 3 + 1) is not followed by an average when period == 3.
    first = results[0]["replicas"][0]
    identical = all(
        torch.equal(replica[k], v)
        for result in results
        for replica in result["replicas"]
        for k, v in first.items()
    )
    assert identical == (steps % period == 0)


def test_a_16_bit_sum_on_the_wire_adds_up_in_float32(tmp_path: Path) -> None:
    workers = run_workers("wire_sum", tmp_path, 3, env=_implementation("RING", 3))
    assert_all_succeeded(workers)
    for result in _results(tmp_path, 3):
        # Added in bfloat16, 1 + 2**-8 + 2**-8 would stay 1 (each addition a tie, to even).
        assert result["sum"].dtype == torch.float32
        assert torch.equal(result["sum"], torch.full((5,), 1 + 2.0**-7))


def test_training_with_16_bit_gradients_on_the_wire_converges_as_with_float32(
    tmp_path: Path,
) -> None:
    results = {}
    for compression in ["", "bf16", "fp16", "powersgd:2"]:
        out = tmp_path / (compression.replace(":", "") or "float32")
        out.mkdir()
        workers = run_workers("digits", out, args=[compression], env=_implementation("RING"))
        assert_all_succeeded(workers)
        results[compression] = _results(out)
    exact = results[""][0]
    assert exact["accuracy"] > 0.85  # 0.91 (the last 297 digits are the hardest)
    for compression in ["bf16", "fp16", "powersgd:2"]:
        first, second = results[compression]
        assert all(torch.equal(v, second["state"][k]) for k, v in first["state"].items())
        # The gradients did cross in 16 bits (the parameters are not float32 training's),
        # and training converged as well (to within 2 points on the held-out digits).
        assert any(not torch.equal(v, first["state"][k]) for k, v in exact["state"].items())
        assert first["accuracy"] > exact["accuracy"] - 0.02, (compression, first, exact)


@float64
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_shards_the_optimizer_state_over_every_replica_of_every_worker(
    tmp_path: Path, stage: int
) -> None:
    assert_all_succeeded(run_workers("zero", tmp_path, args=[str(stage)], logical_devices=2))
    results = _results(tmp_path)
    expected = DeepNet()
    optimizer = adamw(expected)
    train_plain(expected, optimizer, make_batches(num_examples=6 * 16))
    for result in results:
        for replica in result["replicas"]:
            _assert_close(expected.state_dict(), replica)
        assert_same_state(optimizer.state_dict(), result["optimizer"])
    # 4 replicas (2 workers x 2 logical devices): each holds a quarter of Adam's state (a
    # parameter cut between two keeps a step count in each).
    shares = results[0]["state_bytes"] + results[1]["state_bytes"]
    whole = sum(state_bytes([optimizer]))
    assert whole <= sum(shares) <= whole + torch.get_default_dtype().itemsize * 3  # step counts
    assert max(shares) <= whole / 4 * 1.05, shares
    # Model.save gathered the whole state on every worker; the chief wrote it.
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    _assert_close(results[0]["fitted"], saved["model"])
    _assert_close(results[1]["fitted"], saved["model"])
    trained = [p for name, p in expected.named_parameters() if "frozen" not in name]
    assert len(saved["optimizer"]["state"]) == len(trained) - 2  # the unused head has no state


def test_powersgd_sends_rank_r_factors_and_whole_vectors(tmp_path: Path) -> None:
    workers = run_workers("custom_loop", tmp_path, args=["sgd", "", "0", "1", "", "", "powersgd:2"])
    assert_all_succeeded(workers)
    results = _results(tmp_path)
    # The MLP's weights are 32 x 12, 16 x 32 and 5 x 16: per step one sum of the biases
    # (5 + 16 + 32), the 6 replica counts and the P factors ((5 + 16 + 32) x 2), then one of
    # the Q factors ((16 + 32 + 12) x 2): 285 numbers instead of 1029 + 6.
    sizes = [n for n in results[0]["all_reduces"]["shared memory"] if n > 1]
    assert sizes == [53 + 6 + 106, 120] * len(make_batches())
    first = results[0]["replicas"][0]
    assert all(torch.equal(results[1]["replicas"][0][k], v) for k, v in first.items())


@pytest.mark.parametrize("num_workers", [2, 3])
def test_workers_on_one_machine_sum_through_shared_memory_as_gloo_does(
    tmp_path: Path, num_workers: int
) -> None:
    assert_all_succeeded(run_workers("same_host_sums", tmp_path, num_workers))
    results = _results(tmp_path, num_workers)
    for result in results:
        assert result["shared_memory"]
        assert result["strided"] == (1, 4)  # summed in place, its strides kept
        for name, expected in result["gloo"].items():
            actual = result["sums"][name]
            assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
            # Two workers: one addition, gloo's bits; three: another order of the same sum.
            if num_workers == 2 or not expected.is_floating_point():
                assert torch.equal(actual, expected), name
            else:
                tolerance = 2e-2 if expected.element_size() == 2 else 1e-6
                torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)
            # Every worker holds the same bits.
            assert torch.equal(actual, results[0]["sums"][name]), name
        _assert_same_bits(result["gathered"], result["gloo_gathered"])
        assert result["gathers_by_gloo"] == 0  # all through shared memory
    assert torch.equal(
        results[0]["sums"]["int64"], torch.arange(7) * sum(range(1, num_workers + 1))
    )
    wrapped = torch.tensor(100 * num_workers).to(torch.int8)  # as int8 arithmetic wraps
    assert torch.equal(results[0]["sums"]["int8 wraps around"], wrapped.expand(5))


@pytest.mark.parametrize("fallback", ["host", "full", "attach"])
def test_workers_keep_gloo_where_shared_memory_cannot_be_set_up(
    tmp_path: Path, fallback: str
) -> None:
    assert_all_succeeded(run_workers("same_host_sums", tmp_path, args=[fallback]))
    for result in _results(tmp_path):
        assert not result["shared_memory"]
        for name, expected in result["gloo"].items():
            assert torch.equal(result["sums"][name], expected), name
        _assert_same_bits(result["gathered"], result["gloo_gathered"])
        assert result["gathers_by_gloo"] == len(result["gathered"])


def _assert_same_bits(gathered: dict[str, Any], expected: dict[str, Any]) -> None:
    """Every worker's tensor, as gloo gathers it: dtype, shape and bytes (-0.0 and a NaN's
    payload included)."""
    for name, parts in expected.items():
        assert len(gathered[name]) == len(parts), name
        for actual, wanted in zip(gathered[name], parts, strict=True):
            assert actual.dtype == wanted.dtype and actual.shape == wanted.shape, name
            as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (actual, wanted)]
            assert torch.equal(*as_bytes), name


def test_a_worker_dying_during_the_shared_memory_set_up_fails_the_others_at_once(
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    workers = run_workers("same_host_sums", tmp_path, args=["die"])
    assert workers[0].returncode == 3
    assert workers[1].returncode != 0
    assert "WorkerLostError" in workers[1].output, workers[1].output[-1500:]
    assert "same-host all-reduce: ready" in workers[1].output, workers[1].output[-1500:]
    assert time.monotonic() - started < 30  # not the 30 s timeout


def test_a_worker_s_own_failure_in_an_all_reduce_is_not_blamed_on_its_peer(
    tmp_path: Path,
) -> None:
    assert_all_succeeded(run_workers("local_failure", tmp_path))
    own, peer = (result["errors"] for result in _results(tmp_path))
    assert own[0].startswith(
        "RuntimeError: worker 0 could not take part in 'local failure [4 x float32]' (#"
    ), own
    assert "itself: RuntimeError: unsupported operation" in own[0], own
    assert own[1].startswith("RuntimeError: the workers are out of step"), own
    # Worker 1's sum completed; its next collective finds worker 0 gone from the transport.
    assert len(peer) == 1 and peer[0].startswith("WorkerLostError: worker 1 waited at"), peer


@float64
@pytest.mark.parametrize("prefetch", [0, 2])
def test_each_worker_loads_only_its_part_of_a_data_loader(tmp_path: Path, prefetch: int) -> None:
    workers = run_workers("loader_loop", tmp_path, args=[str(prefetch)], logical_devices=2)
    assert_all_succeeded(workers)
    loader = shuffled_loader()
    model = make_mlp()
    losses = train_plain(model, OPTIMIZERS["adam"](model), loader)  # type: ignore[arg-type]
    results = _results(tmp_path)
    for result in results:
        _assert_close(model.state_dict(), result["weights"])
        assert_close_float64(result["losses"], losses)
    loaded = [set(r["loaded"]) for r in results]
    assert len(results[0]["loaded"]) + len(results[1]["loaded"]) == 203
    assert loaded[0] | loaded[1] == set(range(203))


@float64
def test_per_replica_input_from_a_function_equals_one_device(tmp_path: Path) -> None:
    assert_all_succeeded(run_workers("per_replica_input", tmp_path, logical_devices=2))
    model = make_mlp()
    train_plain(model, OPTIMIZERS["sgd"](model), make_batches())
    for result in _results(tmp_path):
        for replica in result["replicas"]:
            _assert_close(model.state_dict(), replica)


@float64
def test_fit_evaluate_predict_equal_one_device(tmp_path: Path) -> None:
    assert_all_succeeded(run_workers("fit", tmp_path, logical_devices=2))
    x, y = fit_data()
    torch.manual_seed(0)
    model = mirrored.Model(make_mlp())
    compile_mlp(model)
    torch.manual_seed(3)
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    evaluation = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    predictions = model.predict(x[:37], batch_size=8, verbose=0)
    results = _results(tmp_path)
    for result in results:
        _assert_close(model.state_dict(), result["weights"])
        for name, values in history.history.items():
            assert result["history"][name] == pytest.approx(values, rel=1e-6)
        assert result["evaluation"] == pytest.approx(evaluation, rel=1e-6)
        assert_close_float64(result["predictions"], predictions)
    assert [r["should_checkpoint"] for r in results] == [True, False]


def test_collectives_cover_every_replica_of_every_worker(tmp_path: Path) -> None:
    assert_all_succeeded(run_workers("collectives", tmp_path, logical_devices=2))
    batch = torch.arange(11.0).reshape(11, 1)
    for result in _results(tmp_path):
        assert result["num_replicas_in_sync"] == 4
        torch.testing.assert_close(result["ids"], torch.tensor([0.0, 1.0, 2.0, 3.0]))
        torch.testing.assert_close(result["gathered"], batch)
        for gathered in result["replica_gathered"]:
            torch.testing.assert_close(gathered, batch)
        for total in result["sum"]:
            torch.testing.assert_close(total, torch.tensor(55.0))
        torch.testing.assert_close(result["mean_axis"], torch.tensor([5.0]))
        torch.testing.assert_close(result["sum_none"], torch.tensor([6.0]))


@float64
def test_batch_norm_buffers_cross_the_workers_in_a_fixed_number_of_collectives(
    tmp_path: Path,
) -> None:
    """Each step syncs every BatchNorm buffer across the workers (156 in MobileNetV2); packed,
    one layer or three cost the same collectives, and the buffers are those of the same
    replicas in one process."""
    collectives = {}
    for num_layers in (1, 3):
        out = tmp_path / str(num_layers)
        out.mkdir()
        assert_all_succeeded(
            run_workers("batch_norm_layers", out, args=[str(num_layers)], logical_devices=2)
        )
        results = _results(out)
        collectives[num_layers] = [result["collectives"] for result in results]
        with mirrored.MirroredStrategy([f"cpu:{i}" for i in range(4)]) as strategy:
            one_process, _, losses = train_mirrored(
                strategy, *batch_norm_net(num_layers), make_batches()
            )
            expected = one_process.replicas[0].state_dict()
        for result in results:
            assert_close_float64(result["losses"], losses)
            for replica in result["replicas"]:
                _assert_close(expected, replica)
                assert torch.equal(replica["1.num_batches_tracked"], torch.tensor(len(losses)))
        # Bit for bit on every replica of every worker: the end of a run takes the running
        # statistics the optimizer averaged as agreeing, unchecked.
        first = results[0]["replicas"][0]
        for result in results:
            for replica in result["replicas"]:
                for name, value in replica.items():
                    assert torch.equal(value, first[name]), name
    assert collectives[1] == collectives[3]


@float64
def test_only_the_chief_writes_and_every_worker_restores(tmp_path: Path) -> None:
    assert_all_succeeded(run_workers("checkpoint", tmp_path, logical_devices=2))
    saved = torch.load(tmp_path / "weights.pt", weights_only=True)
    for result in _results(tmp_path):
        _assert_close(saved, result["weights"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model.pt",
        "rank0.pt",
        "rank1.pt",
        "weights.pt",
    ]  # no temporary files, no second copy
    # 2 workers x 2 devices wrote it; one process with 3 replicas restores it.
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]) as strategy:
        with strategy.scope():
            model = mirrored.Model(make_mlp(seed=7))
            compile_mlp(model)
        model.load(tmp_path / "model.pt")
        _assert_close(saved, model.state_dict())


def test_a_chief_that_cannot_write_or_workers_that_read_other_files_fail_every_worker(
    tmp_path: Path,
) -> None:
    assert_all_succeeded(run_workers("checkpoint_faults", tmp_path))
    chief, worker = (result["errors"] for result in _results(tmp_path))
    assert len(chief) == len(worker) == 2
    assert chief[0].split(":")[0] in ("NotADirectoryError", "FileExistsError"), chief[0]
    assert worker[0].startswith(
        "RuntimeError: the chief (worker 0) failed to write the checkpoint"
    ), worker[0]
    for errors in (chief, worker):
        assert "worker(s) [1] hold other values than worker 0" in errors[1], errors[1]


def _started(out: Path, rank: int, deadline: float = 90) -> None:
    end = time.monotonic() + deadline
    while not (out / f"started{rank}").exists():
        assert time.monotonic() < end, "the workers never started training"
        time.sleep(0.05)


@pytest.mark.parametrize("implementation", ["AUTO", "RING"])
def test_a_killed_worker_fails_the_others_with_its_rank(
    tmp_path: Path, implementation: str
) -> None:
    workers = start_workers(
        "train_forever", tmp_path, args=["5"], env=_implementation(implementation)
    )
    try:
        _started(tmp_path, 1)
        os.kill(workers[1].process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_workers(workers, timeout=60)
    finally:
        kill_workers(workers)
    assert time.monotonic() - killed_at < 5 + 10  # within timeout_seconds, with diagnosis
    assert workers[0].returncode != 0
    assert "WorkerLostError" in workers[0].output
    assert "worker 1 stopped responding" in workers[0].output


@pytest.mark.parametrize("implementation", ["AUTO", "RING"])
def test_a_hung_worker_times_the_others_out_naming_it(tmp_path: Path, implementation: str) -> None:
    workers = start_workers(
        "train_forever", tmp_path, args=["3", "1"], env=_implementation(implementation)
    )
    try:
        _started(tmp_path, 1)
        hung_at = time.monotonic()
        workers[0].output, _ = workers[0].process.communicate(timeout=60)
        waited = time.monotonic() - hung_at
    finally:
        kill_workers(workers)
    assert waited < 3 + 10
    assert workers[0].returncode != 0
    assert "SyncTimeoutError" in workers[0].output
    assert "for 3.0 s: worker 1 is at" in workers[0].output, workers[0].output[-1500:]


@pytest.mark.parametrize(
    ("where", "logical_devices", "failing"),
    [("between", 1, [0]), ("replica", 2, [0, 1])],
)
def test_a_stopped_worker_or_replica_fails_the_steps_within_the_timeout(
    tmp_path: Path, where: str, logical_devices: int, failing: list[int]
) -> None:
    # Worker 1 stops between steps, or one of its two replicas stops inside its step; each
    # worker that fails must do so once, after the timeout and the peers' diagnosis (2 s), not
    # after the timeout repeated (worker 1's stuck replica used to fail it after 3 x 3 s). The
    # margin is generous for a loaded machine.
    workers = start_workers(
        "hung_peer", tmp_path, args=["3", where], logical_devices=logical_devices
    )
    try:
        for rank in failing:  # they end after their error; the other one sleeps on
            workers[rank].output, _ = workers[rank].process.communicate(timeout=120)
    finally:
        kill_workers(workers)
    results = _results(tmp_path, len(failing))
    for rank, result in enumerate(results):
        assert result["error"].startswith("SyncTimeoutError"), result["error"]
        assert result["waited"] < 3 + 2 + 3, (rank, result)


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_step_failing_on_one_worker_ends_every_worker_s_collectives(
    tmp_path: Path, failing_rank: int
) -> None:
    # The failing worker catches its error and goes on: its next step must not pair with the
    # others' previous one. Its peers fail at once (not after the 60 s timeout), naming it.
    workers = run_workers("caught_failure", tmp_path, args=[str(failing_rank)])
    assert_all_succeeded(workers)
    errors = [result["errors"] for result in _results(tmp_path)]
    failing, peer = errors[failing_rank], errors[1 - failing_rank]
    assert [(e[0], e[1]) for e in failing] == [(2, "ValueError")] + [
        (s, "RuntimeError") for s in (3, 4)
    ]
    assert "a failure on worker" in failing[1][2] and "restart the job" in failing[1][2]
    assert [(e[0], e[1]) for e in peer] == [(2, "WorkerLostError")] + [
        (s, "RuntimeError") for s in (3, 4)
    ]
    assert (
        f"worker {failing_rank} failed its step (ValueError: a failure on worker {failing_rank} "
        "only)" in peer[0][2]
    ), peer[0][2]
    assert peer[0][3] < 20


@pytest.mark.parametrize(
    ("implementation", "errors"),
    [
        ("AUTO", ("SyncMismatchError: worker {rank} reached",)),
        ("RING", ("SyncTimeoutError", "WorkerLostError")),
    ],
)
def test_an_all_reduce_of_different_sizes_is_explained(
    tmp_path: Path, implementation: str, errors: tuple[str, ...]
) -> None:
    # The shared-memory barrier compares sizes, so the workers fail at once; gloo cannot tell,
    # and the timeout's diagnosis names the difference. The first worker to time out exits, so
    # on a loaded machine its peer may see the connection break before its own timeout: either
    # way both name the difference, and at least one of them timed out.
    workers = run_workers("mismatched_all_reduce", tmp_path, env=_implementation(implementation))
    assert any(errors[0].format(rank=worker.rank) in worker.output for worker in workers)
    for worker, other in ((workers[0], "[1 x float32]"), (workers[1], "[2 x float32]")):
        assert worker.returncode != 0
        assert any(error.format(rank=worker.rank) in worker.output for error in errors), (
            worker.output[-1500:]
        )
        assert re.search(
            rf"is at the same collective \(#\d+\) with another tensor or purpose: "
            rf"'all_reduce {re.escape(other)}'",
            worker.output,
        ), worker.output[-1500:]


@pytest.mark.parametrize(
    ("cluster", "started", "message"),
    [
        ("torchrun", 0, "worker 1 (RANK=1) did not join the job within 3 s"),
        ("tf_config", 0, "worker 1 (task worker:1 at 127.0.0.1:"),
        ("tf_config", 1, "worker 1 (task worker:1 at 127.0.0.1:"),
    ],
)
def test_a_worker_that_never_starts_is_named(
    tmp_path: Path, cluster: str, started: int, message: str
) -> None:
    """The workers that did start fail after the timeout naming the one that did not (the
    chief, for one that cannot reach it), not with torch's store keys."""
    workers = start_workers(
        "train_forever", tmp_path, 2, args=["3"], cluster=cluster, ranks=[started]
    )
    (worker,) = wait_workers(workers, timeout=60)
    assert worker.returncode != 0
    expected = message if started == 0 else "could not reach the chief's rendezvous store"
    assert expected in worker.output, worker.output[-2000:]


def test_workers_with_different_models_fail_clearly(tmp_path: Path) -> None:
    workers = run_workers("different_models", tmp_path)
    assert_all_failed_saying(
        workers, "worker 1 built a different model than worker 0", "[3, 4]", "[2, 4]"
    )


@pytest.mark.parametrize(
    ("where", "message"),
    [
        (
            "mirror",
            "worker 1 has other settings of optimizer 0 than worker 0: "
            "param_groups[0]['lr'] is 0.2 there, 0.1 on worker 0",
        ),
        ("fit", "worker 1 has other optimizer settings in fit than worker 0: lr_scheduler state"),
    ],
)
def test_workers_with_different_optimizer_settings_fail_clearly(
    tmp_path: Path, where: str, message: str
) -> None:
    """A learning rate set differently on one worker trained apart, silently."""
    workers = run_workers("different_settings", tmp_path, args=[where])
    assert_all_failed_saying(workers, message)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("list", "the workers' datasets have different lengths ([5, 4], by rank)"),
        ("generator", "the input of worker(s) [1] ran out while worker(s) [0] still had batches"),
    ],
)
def test_workers_with_different_numbers_of_steps_fail_clearly(
    tmp_path: Path, kind: str, message: str
) -> None:
    workers = run_workers("uneven_input", tmp_path, args=[kind])
    assert_all_failed_saying(workers, message)


@pytest.mark.parametrize("kind", ["loader", "fit"])
def test_workers_that_shuffle_differently_fail_clearly(tmp_path: Path, kind: str) -> None:
    workers = run_workers("seeded_per_rank", tmp_path, args=[kind])
    assert_all_failed_saying(workers, "the workers' first global batches hold different examples")


def test_close_waits_for_the_heartbeat_to_leave_its_store_call(tmp_path: Path) -> None:
    """A daemon thread still in a store call when the interpreter finalizes aborts the process
    after a successful run ("terminate called without an active exception")."""
    workers = run_workers("heartbeat_at_close", tmp_path)
    assert_all_succeeded(workers)
    for rank in range(2):
        record = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert record["running after close"] == []
