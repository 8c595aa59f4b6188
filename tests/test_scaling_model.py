"""The scaling model's formulas (benchmarks/scaling_model.py) on hand-computed values; no timing.

benchmarks/ is not a package: its folder is put on sys.path here to import the module.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from scaling_model import (
    NO_HOST,
    Compute,
    Host,
    Link,
    bucket_sizes,
    fit_link,
    host_seconds,
    predict_step,
    ring_all_reduce_seconds,
    scaling_efficiency,
)

# 1 GB/s and 1 ms per message: G bytes cost G / 1e9 seconds per pass.
LINK = Link("test", 1e9, 1e-3)
FREE_LATENCY = Link("no latency", 1e9, 0.0)


def test_one_device_communicates_nothing() -> None:
    assert ring_all_reduce_seconds(4e9, 1, LINK) == 0.0
    compute = Compute(forward=1.0, backward=2.0, update=0.5)
    prediction = predict_step(compute, [1_000_000, 2_000_000], 1, LINK)
    assert prediction.step == 3.5
    assert prediction.communication == 0.0
    assert prediction.exposed == 0.0
    assert scaling_efficiency(compute, [1_000_000], 1, LINK) == 1.0


def test_ring_cost_two_devices() -> None:
    # 2(N-1)/N * G/B + 2(N-1)a = 1 * 1.0 + 2 * 1e-3
    assert ring_all_reduce_seconds(1e9, 2, LINK) == pytest.approx(1.002, abs=1e-12)


def test_ring_cost_four_devices() -> None:
    # 2 * 3/4 * 4 s + 6 * 1 ms
    assert ring_all_reduce_seconds(4e9, 4, LINK) == pytest.approx(6.006, abs=1e-12)
    assert ring_all_reduce_seconds(4e9, 4, FREE_LATENCY) == pytest.approx(6.0, abs=1e-12)


def test_ring_cost_approaches_twice_the_data() -> None:
    # N = 8: 2 * 7/8 = 1.75 passes over the data, 14 messages.
    assert ring_all_reduce_seconds(8e9, 8, FREE_LATENCY) == pytest.approx(14.0, abs=1e-12)
    assert ring_all_reduce_seconds(0, 8, LINK) == pytest.approx(0.014, abs=1e-12)


def test_buckets_close_at_their_cap() -> None:
    # 100 + 200 reaches the first cap (250); 300 + 400 the next (500).
    assert bucket_sizes([100, 200, 300, 400], 250, 500) == [300, 700]
    # A tensor larger than the cap gets a bucket of its own; the rest is the last bucket.
    assert bucket_sizes([1000, 10, 20], 250, 500) == [1000, 30]
    assert bucket_sizes([], 250, 500) == []


def test_overlap_hides_communication_shorter_than_backward() -> None:
    compute = Compute(forward=1.0, backward=10.0, update=1.0)
    # Buckets of 3 GB and 2 GB over 2 devices at 1 GB/s, no latency: 3 s overlapped, 2 s exposed.
    prediction = predict_step(compute, [3_000_000_000, 2_000_000_000], 2, FREE_LATENCY)
    assert prediction.step == pytest.approx(1 + 10 + 2 + 1)
    assert prediction.communication == pytest.approx(5.0)
    assert prediction.exposed == pytest.approx(2.0)


def test_communication_longer_than_backward_shows() -> None:
    compute = Compute(forward=1.0, backward=10.0, update=1.0)
    prediction = predict_step(compute, [30_000_000_000, 2_000_000_000], 2, FREE_LATENCY)
    assert prediction.step == pytest.approx(1 + 30 + 2 + 1)
    assert prediction.exposed == pytest.approx(22.0)


def test_one_bucket_is_all_exposed() -> None:
    compute = Compute(forward=1.0, backward=10.0, update=1.0)
    prediction = predict_step(compute, [1_000_000_000], 4, LINK)
    # 2 * 3/4 * 1 s + 6 ms
    assert prediction.step == pytest.approx(12 + 1.506)
    assert scaling_efficiency(compute, [1_000_000_000], 4, LINK) == pytest.approx(12 / 13.506)


@pytest.mark.parametrize("num_devices", [1, 2, 3, 4, 8, 64])
def test_efficiency_is_at_most_one(num_devices: int) -> None:
    compute = Compute(forward=0.001, backward=0.002, update=0.0005)
    for buckets in ([], [10], [1 << 20, 3 << 20], [25 << 20] * 4):
        efficiency = scaling_efficiency(compute, buckets, num_devices, LINK)
        assert 0 < efficiency <= 1


def test_efficiency_falls_with_devices() -> None:
    compute = Compute(forward=0.001, backward=0.002, update=0.0005)
    buckets = [1 << 20, 25 << 20]
    efficiencies = [scaling_efficiency(compute, buckets, n, LINK) for n in (1, 2, 4, 8)]
    assert efficiencies == sorted(efficiencies, reverse=True)


def test_fit_link_recovers_the_parameters() -> None:
    sizes = [4096, 65536, 1 << 20, 4 << 20]
    seconds = [ring_all_reduce_seconds(s, 2, Link("true", 2e9, 3e-5)) for s in sizes]
    link = fit_link("fitted", sizes, seconds, 2)
    assert link.bandwidth == pytest.approx(2e9, rel=1e-9)
    assert link.latency == pytest.approx(3e-5, rel=1e-9)


def test_fit_link_refits_a_negative_latency_as_zero() -> None:
    # t = size / 1e9 - 1 ms: the plain fit's intercept is negative.
    sizes = [1e6, 2e6, 4e6]
    link = fit_link("fitted", sizes, [s / 1e9 - 1e-3 for s in sizes], 2)
    assert link.latency == 0.0
    # Through the origin: slope = sum(x t) / sum(x^2) with x = size.
    slope = sum(s * (s / 1e9 - 1e-3) for s in sizes) / sum(s * s for s in sizes)
    assert link.bandwidth == pytest.approx(1 / slope)


def test_fit_link_refuses_too_few_sizes() -> None:
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_link("x", [1e6, 1e6], [1e-3, 1e-3], 2)
    with pytest.raises(ValueError, match="at least 2 devices"):
        fit_link("x", [1e6, 2e6], [1e-3, 2e-3], 1)


def test_host_seconds_serializes_the_gil_held_part() -> None:
    host = Host(gil=2.0, free=3.0)
    # One replica: its own 5 s; two: 4 s of GIL-held work, still under one replica's 5 s.
    assert host_seconds(host, 1) == 5.0
    assert host_seconds(host, 2) == 5.0
    assert host_seconds(host, 4) == 8.0
    assert host_seconds(Host(gil=0.0, free=3.0), 8) == 3.0  # one interpreter per replica


def test_no_host_work_gives_the_device_prediction() -> None:
    compute = Compute(forward=1.0, backward=10.0, update=1.0)
    buckets = [3_000_000_000, 2_000_000_000]
    for num_devices in (1, 2, 8):
        assert predict_step(compute, buckets, num_devices, LINK, Host(0.0, 0.0)) == predict_step(
            compute, buckets, num_devices, LINK
        )
    assert predict_step(compute, buckets, 2, LINK).host == 0.0
    assert Host(0.0, 0.0) == NO_HOST


def test_host_work_under_the_devices_is_hidden() -> None:
    compute = Compute(forward=1.0, backward=10.0, update=1.0)
    buckets = [3_000_000_000, 2_000_000_000]
    host = Host(gil=1.0, free=1.0)  # 4 replicas: 4 s of host work against a 14 s device step
    hidden = predict_step(compute, buckets, 4, FREE_LATENCY, host)
    assert hidden.step == predict_step(compute, buckets, 4, FREE_LATENCY).step
    assert hidden.host == 4.0


def test_host_bound_step_is_the_serialized_host_work() -> None:
    compute = Compute(forward=1.0, backward=2.0, update=1.0)
    prediction = predict_step(compute, [], 8, LINK, Host(gil=1.0, free=0.5))
    assert prediction.step == 8.0
    assert prediction.exposed == 0.0
    # Without buckets the device step is compute alone; the host bound still applies at N = 1.
    assert predict_step(compute, [], 1, LINK, Host(gil=5.0)).step == 5.0


@pytest.mark.parametrize("num_devices", [2, 4, 8, 64])
def test_large_host_work_makes_efficiency_fall_as_one_over_n(num_devices: int) -> None:
    compute = Compute(forward=0.001, backward=0.002, update=0.0005)
    buckets = [1 << 20, 25 << 20]
    efficiency = scaling_efficiency(compute, buckets, num_devices, LINK, Host(gil=100.0))
    assert efficiency == pytest.approx(1 / num_devices)


@pytest.mark.parametrize("num_devices", [1, 2, 4, 8])
def test_efficiency_with_host_work_is_at_most_one(num_devices: int) -> None:
    compute = Compute(forward=0.001, backward=0.002, update=0.0005)
    for host in (Host(0.0005), Host(0.002, 0.001), Host(0.0, 0.01)):
        efficiency = scaling_efficiency(compute, [1 << 20, 25 << 20], num_devices, LINK, host)
        assert 0 < efficiency <= 1


def test_one_interpreter_per_replica_hides_the_host_behind_one_replicas_own() -> None:
    # Host-bound at every N but with no GIL-held part: t(N) = h for all N, no communication.
    compute = Compute(forward=0.001, backward=0.002, update=0.0005)
    free_threaded = Host(gil=0.0, free=0.01)
    assert scaling_efficiency(compute, [], 8, LINK, free_threaded) == 1.0
    assert scaling_efficiency(compute, [], 8, LINK, Host(gil=0.01)) == pytest.approx(1 / 8)


def test_host_refuses_negative_seconds() -> None:
    with pytest.raises(ValueError, match="gil=-1"):
        Host(-1.0)
    with pytest.raises(ValueError, match=r"free=-0\.5"):
        Host(0.0, -0.5)
    with pytest.raises(ValueError, match="num_devices=0"):
        host_seconds(Host(1.0), 0)


def test_compute_scaled() -> None:
    assert Compute(2.0, 4.0, 1.0).scaled(2.0) == Compute(1.0, 2.0, 0.5)
    assert Compute(2.0, 4.0, 1.0).total == 7.0


def test_link_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="bandwidth=0"):
        Link("x", 0, 1e-6)
