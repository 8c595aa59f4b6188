"""A model of data-parallel step time: ring all-reduce cost, its overlap with backward, and the
scaling efficiency it implies. Pure functions; the inputs come from measurement (compare.py).

The model, for N devices that each run one replica on the same per-device batch (weak scaling):

- **Ring all-reduce** of G bytes over N devices on a link of bandwidth B (bytes/s) and latency
  a (s) per message: ``2(N-1)/N * G/B + 2(N-1)a``. Each device sends and receives 2(N-1)/N of the
  data in 2(N-1) steps (reduce-scatter, then all-gather); N = 1 communicates nothing.
- **Buckets.** Gradients are all-reduced in buckets, in the order backward produces them (the
  reverse of the parameters' order), as DistributedDataParallel and mirrored's gradient reducer
  do: a bucket closes once it holds at least its cap (1 MiB for the first, 25 MiB after it, their
  defaults). Each bucket is one ring all-reduce and pays the latency term once.
- **Overlap.** Every bucket but the last can run while backward runs; the last is ready only when
  backward ends, so its all-reduce is always exposed:
  ``step = t_fwd + max(t_bwd, sum of t_ar(bucket) over all but the last) + t_ar(last) + t_update``.
  Assumptions: communication and computation do not slow each other (their own cores or engines),
  the buckets before the last fit in backward's span in order, and input and dispatch cost
  nothing. On one CPU core per process the first assumption fails (gloo's thread takes the core
  from backward), so the model should under-predict there; compare.py prints by how much.
- **Host work.** Each replica's step also needs host (CPU) work: Python dispatch of every op,
  mirrored's torch-function mode, autograd's bookkeeping, the kernel launches. Of one replica's
  ``h = h_gil + h_free`` seconds, ``h_gil`` hold the interpreter's lock (GIL) and ``h_free`` do
  not (ATen's dispatch, autograd's engine, the launch itself). MirroredStrategy runs its replicas
  as threads of one process, so their GIL-held work is serialized: N replicas need at least
  ``N * h_gil`` of one interpreter per step, and each at least its own ``h``:
  ``host(N) = max(N * h_gil, h)``. CUDA launches are asynchronous, so the host runs ahead of
  the devices and the two overlap: ``step = max(device step above, host(N))``. Assumptions:
  perfect overlap (the host never waits for a device inside a step, and the GIL-held pieces of
  the replicas pack with no gap; handing the GIL over costs nothing), one core per replica for
  ``h_free``; ``h`` is measured on the CPU as the host time of a launch-bound step (tiny tensors,
  so the kernels cost nothing: host_overhead.py). ``h = 0`` gives the device-only model; with
  ``N * h_gil`` above the device step, t(N) grows as N and efficiency falls as 1/N. One
  interpreter per replica (one process per GPU, or a free-threaded CPython) makes
  ``h_gil = 0``: ``host(N) = h``. A traced replica step (``mirrored.function``) keeps one
  interpreter but runs the pieces between its host calls without the GIL: its ``h_gil`` is
  what stays in Python (the host calls, the replay's glue), host_overhead.py's traced rows.
- **Scaling efficiency** = ``t(1) / t(N)``: the share of N times one device's throughput that N
  devices reach. It is at most 1, since communication only adds time.
- **Fitting a link** from measured all-reduce times of several sizes between N processes: least
  squares on ``seconds = 2(N-1)/N * size / B + 2(N-1)a``; a negative latency is refitted as zero
  (the line through the origin).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = [
    "DDP_BUCKET_BYTES",
    "DDP_FIRST_BUCKET_BYTES",
    "GPU_LINKS",
    "Compute",
    "Host",
    "Link",
    "NO_HOST",
    "Prediction",
    "bucket_sizes",
    "fit_link",
    "host_seconds",
    "predict_step",
    "ring_all_reduce_seconds",
    "scaling_efficiency",
]

# DistributedDataParallel's defaults (first_bucket_bytes_cap, bucket_cap_mb); mirrored's gradient
# reducer uses the same (src/mirrored/strategies/multi_worker.py).
DDP_FIRST_BUCKET_BYTES = 1 << 20
DDP_BUCKET_BYTES = 25 << 20


@dataclasses.dataclass(frozen=True)
class Link:
    """A link between devices: bandwidth in bytes per second, latency per message in seconds."""

    name: str
    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or self.latency < 0:
            raise ValueError(
                f"Link({self.name!r}): bandwidth={self.bandwidth} must be > 0 and "
                f"latency={self.latency} >= 0"
            )


# Assumed, not measured: the bandwidth one ring step sees per direction, and a per-message
# latency that includes the collective library's own overhead.
GPU_LINKS = (
    Link("NVLink 4 (~300 GB/s)", 300e9, 5e-6),
    Link("PCIe 4.0 x16 (~25 GB/s)", 25e9, 10e-6),
    Link("100 Gb InfiniBand (~12 GB/s)", 12e9, 10e-6),
    Link("10 GbE (~1.25 GB/s)", 1.25e9, 50e-6),
)


@dataclasses.dataclass(frozen=True)
class Compute:
    """One replica's compute per step, in seconds, with no communication."""

    forward: float
    backward: float
    update: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.update

    def scaled(self, factor: float) -> Compute:
        """Every term divided by ``factor`` (a faster device)."""
        return Compute(self.forward / factor, self.backward / factor, self.update / factor)


@dataclasses.dataclass(frozen=True)
class Host:
    """One replica's host work per step, in seconds: ``gil`` holding the interpreter's lock,
    ``free`` without it."""

    gil: float
    free: float = 0.0

    def __post_init__(self) -> None:
        if not (self.gil >= 0 and self.free >= 0):
            raise ValueError(f"Host(gil={self.gil}, free={self.free}): both must be >= 0 seconds")


NO_HOST = Host(0.0)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A predicted step: its time, all its communication, the part of it not hidden by
    backward, and the host work of all replicas (the step when it exceeds the devices')."""

    step: float
    communication: float
    exposed: float
    host: float = 0.0


def ring_all_reduce_seconds(num_bytes: float, num_devices: int, link: Link) -> float:
    """``2(N-1)/N * G/B + 2(N-1)a`` for G = ``num_bytes`` over N = ``num_devices``; 0 when N = 1."""
    if num_devices < 1 or num_bytes < 0:
        raise ValueError(f"num_devices={num_devices} must be >= 1 and num_bytes={num_bytes} >= 0")
    steps = num_devices - 1
    return 2 * steps / num_devices * num_bytes / link.bandwidth + 2 * steps * link.latency


def bucket_sizes(
    tensor_bytes: Sequence[int],
    first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES,
    bucket_bytes: int = DDP_BUCKET_BYTES,
) -> list[int]:
    """Bucket sizes for gradients of ``tensor_bytes``, given in the order backward produces them:
    whole tensors, a bucket closing once it holds at least its cap (``first_bucket_bytes`` for
    the first, ``bucket_bytes`` after it)."""
    buckets: list[int] = []
    current = 0
    for size in tensor_bytes:
        current += size
        if current >= (bucket_bytes if buckets else first_bucket_bytes):
            buckets.append(current)
            current = 0
    if current:
        buckets.append(current)
    return buckets


def host_seconds(host: Host, num_devices: int) -> float:
    """``max(N * h_gil, h_gil + h_free)``: the host work of N replica threads of one process,
    whose GIL-held parts run one at a time."""
    if num_devices < 1:
        raise ValueError(f"num_devices={num_devices} must be >= 1")
    return max(num_devices * host.gil, host.gil + host.free)


def predict_step(
    compute: Compute,
    buckets: Sequence[int],
    num_devices: int,
    link: Link,
    host: Host = NO_HOST,
) -> Prediction:
    """``max(t_fwd + max(t_bwd, sum t_ar(b) for b in buckets[:-1]) + t_ar(buckets[-1]) +
    t_update, host(N))``: every bucket but the last overlaps backward; the last is exposed; the
    host's work overlaps the devices'."""
    times = [ring_all_reduce_seconds(size, num_devices, link) for size in buckets]
    on_host = host_seconds(host, num_devices)
    if not times:
        return Prediction(max(compute.total, on_host), 0.0, 0.0, on_host)
    overlapped, last = sum(times[:-1]), times[-1]
    device = compute.forward + max(compute.backward, overlapped) + last + compute.update
    return Prediction(max(device, on_host), sum(times), device - compute.total, on_host)


def scaling_efficiency(
    compute: Compute,
    buckets: Sequence[int],
    num_devices: int,
    link: Link,
    host: Host = NO_HOST,
) -> float:
    """``t(1) / t(N)`` for weak scaling (each device keeps its batch): at most 1."""
    one = predict_step(compute, buckets, 1, link, host).step
    return one / predict_step(compute, buckets, num_devices, link, host).step


def fit_link(name: str, sizes: Sequence[float], seconds: Sequence[float], num_devices: int) -> Link:
    """The link whose ring all-reduce fits ``seconds`` measured for ``sizes`` bytes between
    ``num_devices`` processes: least squares on ``t = 2(N-1)/N * size/B + 2(N-1)a``; a negative
    latency is refitted as zero."""
    if num_devices < 2:
        raise ValueError(f"num_devices={num_devices}: a link needs at least 2 devices to measure")
    if len(sizes) != len(seconds) or len(set(sizes)) < 2:
        raise ValueError(
            f"sizes={list(sizes)} and seconds={list(seconds)}: need one time per size and at "
            "least two distinct sizes"
        )
    # t = slope * x + intercept with x = 2(N-1)/N * size: slope = 1/B, intercept = 2(N-1)a.
    xs = [2 * (num_devices - 1) / num_devices * s for s in sizes]
    mean_x, mean_t = sum(xs) / len(xs), sum(seconds) / len(seconds)
    slope = sum((x - mean_x) * (t - mean_t) for x, t in zip(xs, seconds, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    intercept = mean_t - slope * mean_x
    if intercept < 0:
        slope = sum(x * t for x, t in zip(xs, seconds, strict=True)) / sum(x * x for x in xs)
        intercept = 0.0
    if not slope > 0:
        raise ValueError(
            f"the times {list(seconds)} do not grow with the sizes {list(sizes)}: no bandwidth "
            "can be fitted"
        )
    return Link(name, 1 / slope, intercept / (2 * (num_devices - 1)))
