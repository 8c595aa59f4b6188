"""Per-replica random streams: dropout and other random ops differ across replicas, and a run is
reproducible bit for bit from ``torch.manual_seed``.

PyTorch's random ops draw from one process-wide generator per device, so replicas running at
once would interleave their draws nondeterministically. Each replica therefore draws from
generators of its own, one per device it draws on, seeded for each step from one seed: the
number the caller's global generator draws next (``StepSeed``). That draw is taken when the step
ends, and only if a replica needed randomness. So a step without random ops leaves the caller's
random stream untouched (a shuffling DataLoader sees the same stream as in a plain loop), and
``torch.manual_seed(s)`` before training reproduces it.

A thread-local ``TorchFunctionMode`` on each replica's thread routes random ops to them:

- an op that takes ``generator=`` (``rand``, ``bernoulli_``, ``randperm``, ``nn.init``...) gets
  the replica's generator for the op's device: no global state, so replicas draw at once;
- dropout and attention dropout on the CPU, which take no generator, draw their mask from it
  (twice as fast as ATen's own mask: ``_cpu_dropout``) and attend as ATen's CPU math path does;
- torch's Python functions around random ops (``F.dropout2d``, ``F.gumbel_softmax``,
  ``F.multi_head_attention_forward``...) run with the mode active inside, so that the ops in them
  are routed the same way (a mode is otherwise off while a function it intercepted runs);
- the rest (alpha dropout, recurrent layers' dropout, CUDA's fused dropout and attention
  kernels, and any tensor our CPU mask does not take: nested, sparse, subclasses, ``vmap``-ped)
  swaps the replica's state into the device's global generator under a process-wide lock; on a
  GPU the lock spans kernel launches, not kernels.

Backward passes a replica starts run with its mode on, so random ops in them draw from its
streams too. Activation checkpointing (``torch.utils.checkpoint``) saves and restores only
torch's global generators around a recomputation; inside a replica it replays the replica's
streams instead, with torch's and Hugging Face's default arguments (:mod:`mirrored.torch_compat`
patches the two places torch saves and restores them).

Every random op used to run under that lock: a training transformer's whole attention forward
did, and two CPU replicas of BERT-tiny waited 33-37 ms of a 130 ms forward for each other
(benchmarks/RESULTS.md). Non-random ops pass through untouched (one Python call each).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mirrored import rng_state, torch_compat
from mirrored._torch_internals import (
    PRIVATE_SAMPLERS,
    aten_takes_generator,
    body_without_torch_function_check,
    is_functorch_wrapped,
    outside_functorch,
    safe_softmax,
)

__all__ = ["ReplicaRandomness", "StepSeed", "activation_checkpoint_contexts"]

_global_rng_lock = threading.Lock()

_Args = tuple[Any, ...]
_Kwargs = dict[str, Any]
_Position = tuple["StepSeed", dict[torch.device, torch.Tensor]]


def _arg(args: _Args, kwargs: _Kwargs, index: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


_SAMPLERS: list[Callable[..., Any]] = [
    torch.rand,
    torch.rand_like,
    torch.randn,
    torch.randn_like,
    torch.randint,
    torch.randint_like,
    torch.randperm,
    torch.normal,
    torch.bernoulli,
    torch.multinomial,
    torch.poisson,
    torch.binomial,
    *PRIVATE_SAMPLERS,
    torch.Tensor.uniform_,
    torch.Tensor.normal_,
    torch.Tensor.bernoulli_,
    torch.Tensor.bernoulli,
    torch.Tensor.random_,
    torch.Tensor.exponential_,
    torch.Tensor.geometric_,
    torch.Tensor.log_normal_,
    torch.Tensor.cauchy_,
    torch.Tensor.multinomial,
]
_INITIALIZERS: list[Callable[..., Any]] = [
    torch.nn.init.uniform_,
    torch.nn.init.normal_,
    torch.nn.init.trunc_normal_,
    torch.nn.init.xavier_uniform_,
    torch.nn.init.xavier_normal_,
    torch.nn.init.kaiming_uniform_,
    torch.nn.init.kaiming_normal_,
    torch.nn.init.orthogonal_,
    torch.nn.init.sparse_,
]
_DROPOUTS: list[Callable[..., Any]] = [
    torch.dropout,
    torch.dropout_,
    torch.feature_dropout,
    torch.feature_dropout_,
]
_FEATURE_DROPOUTS = {torch.feature_dropout, torch.feature_dropout_}
_IN_PLACE_DROPOUTS = {torch.dropout_, torch.feature_dropout_}
_OTHER_DROPOUTS: list[Callable[..., Any]] = [
    torch.alpha_dropout,
    torch.alpha_dropout_,
    torch.feature_alpha_dropout,
    torch.feature_alpha_dropout_,
    torch.native_dropout,
]
# torch's Python functions whose random ops must reach the mode.
_AROUND_RANDOM_OPS: list[Callable[..., Any]] = [
    F.dropout,
    F.dropout1d,
    F.dropout2d,
    F.dropout3d,
    F.alpha_dropout,
    F.feature_alpha_dropout,
    F.rrelu,
    F.gumbel_softmax,
    F.fractional_max_pool2d,  # no check of its own (boolean_dispatch): swapped
    F.fractional_max_pool3d,
    F.fractional_max_pool2d_with_indices,
    F.fractional_max_pool3d_with_indices,
    F.multi_head_attention_forward,
]
_RECURRENT: list[Callable[..., Any]] = [torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu]
# Which ReplicaRandomness method handles each random op (one lookup per op); samplers without a
# generator= argument in this torch swap the replica's state in.
_ROUTES: dict[Callable[..., Any], str] = {
    **dict.fromkeys(_SAMPLERS + _INITIALIZERS, "_swapped"),
    **{f: "_with_generator" for f in _SAMPLERS if aten_takes_generator(f.__name__)},
    **{
        f: "_with_generator"
        for f in _INITIALIZERS
        if "generator" in inspect.signature(f).parameters
    },
    torch.rrelu: "_rrelu",
    torch.rrelu_: "_rrelu",
    **dict.fromkeys(_DROPOUTS, "_dropout"),
    **dict.fromkeys(_OTHER_DROPOUTS, "_other_dropout"),
    **dict.fromkeys(_RECURRENT, "_recurrent"),
    F.scaled_dot_product_attention: "_attention",
    **dict.fromkeys(_AROUND_RANDOM_OPS, "_around"),
    torch.Tensor.backward: "_backward",
    torch.autograd.backward: "_backward",
    torch.autograd.grad: "_autograd_pass",
}


def _device_of(args: _Args, kwargs: _Kwargs) -> torch.device:
    """Where a random op draws: its ``device=``, else its first tensor's, else the default."""
    device = kwargs.get("device")
    if device is None:
        tensor = next(
            (a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)),
            None,
        )
        device = tensor.device if tensor is not None else torch.get_default_device()
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")  # "cpu:0" is the same generator's
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _real(value: Any) -> float | None:
    """A real number given as a Python or numpy number or a 0-dim tensor (torch accepts each
    for ``p``), as a float; None for anything else."""
    if isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.dim() == 0):
        return float(value)
    return None


def _is_plain(tensor: Any) -> bool:
    """A dense tensor of torch's own type: not nested, sparse, a subclass, or a tensor that
    ``vmap`` or ``grad`` wrapped (their random ops follow rules of their own: torch's kernels)."""
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.layout == torch.strided
        and not tensor.is_nested
        and not is_functorch_wrapped(tensor)
    )


def _math_attention_fits(
    query: Any, key: Any, value: Any, attn_mask: Any, is_causal: bool, gqa: bool
) -> bool:
    """Whether ``_cpu_attention`` computes what torch's CPU attention would for these
    arguments; for any other (other devices or dtypes, arguments torch refuses, or the math
    backend turned off with ``torch.nn.attention.sdpa_kernel``) torch's own kernel runs, and
    raises its own errors."""
    if not torch.backends.cuda.math_sdp_enabled():  # ATen's flag for every device's math path
        return False
    tensors = (query, key, value)
    if not all(_is_plain(t) and t.device.type == "cpu" and t.dim() >= 2 for t in tensors):
        return False
    if query.dtype not in (torch.float32, torch.float64) or {t.dtype for t in tensors} != {
        query.dtype
    }:
        return False
    if attn_mask is not None and (
        is_causal or not _is_plain(attn_mask) or attn_mask.dtype not in (torch.bool, query.dtype)
    ):
        return False
    return not gqa or (key.dim() >= 3 and query.size(-3) % key.size(-3) == 0)


def _cpu_dropout(
    input: torch.Tensor, p: float, feature: bool, in_place: bool, generator: torch.Generator
) -> torch.Tensor:
    """Dropout on the CPU with the mask drawn from ``generator``: each element (each channel for
    feature dropout) is kept when a uniform 32-bit integer falls below ``(1 - p) * 2**32``, and
    kept ones are scaled by ``2**32 / that``, so the mean is kept exactly and ``p`` is honoured
    to 2**-32. Two such integers come from each 64-bit draw: 2.1x faster than ATen's
    ``bernoulli_`` mask (serial mt19937 either way; 2M elements, one thread: 10.9 ms vs 23.2)."""
    shape = (input.size(0), input.size(1)) + (1,) * (input.dim() - 2) if feature else input.shape
    numel = math.prod(shape)
    words = torch.empty((numel + 1) // 2, dtype=torch.int64, device=input.device)
    words.random_(-(2**63), None, generator=generator)  # the full 64-bit range
    uniform = words.view(torch.int32)[:numel].view(shape)
    keep = min(max(round((1 - p) * 2**32), 1), 2**32 - 1)
    noise = (uniform < keep - 2**31).to(input.dtype).mul_(2**32 / keep)
    return input.mul_(noise) if in_place else input * noise


def _cpu_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    generator: torch.Generator,
) -> torch.Tensor:
    """The math path of ``scaled_dot_product_attention``, which ATen takes on the CPU whenever
    dropout is on, with the dropout mask drawn from ``generator``."""
    if enable_gqa:
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    # ATen scales query and key by the square root each, for numerical stability.
    root = math.sqrt(1 / math.sqrt(query.size(-1)) if scale is None else scale)
    scores = (query * root) @ (key.transpose(-2, -1) * root)
    if is_causal:
        length, source = query.size(-2), key.size(-2)
        causal = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, -math.inf)
        else:
            scores = scores + attn_mask
    # A row with every position masked out attends to nothing (zeros), as in ATen, not NaN.
    weights = safe_softmax(scores, -1)
    return _cpu_dropout(weights, dropout_p, False, False, generator) @ value


_entered = threading.local()  # the ReplicaRandomness modes this thread is in, innermost last


def activation_checkpoint_contexts() -> tuple[
    AbstractContextManager[None], AbstractContextManager[None]
]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False,
    context_fn=mirrored.activation_checkpoint_contexts)``: every recomputation in backward draws
    the random numbers the forward drew (its dropout masks), so the gradients are those of the
    forward, with ``preserve_rng_state`` on or off.

    Inside a replica it replays the replica's own streams, as torch's ``preserve_rng_state``
    does there too (:mod:`mirrored.torch_compat`); elsewhere (outside ``strategy.run``, or a
    ``MirroredStrategy`` of one replica) the states the CPU's and every initialised CUDA
    device's generators had at the forward, as ``preserve_rng_state`` would. It does not combine
    with torch's selective checkpointing (``create_selective_checkpoint_contexts``), which replays
    the replica's streams with ``preserve_rng_state`` alone."""
    replay = replica_replay()
    if replay is None:
        replay = _Replay(rng_state.capture_torch, rng_state.restore_torch, None)
    return nullcontext(), replay


def replica_replay() -> _Replay | None:
    """The replay of the calling thread's replica from its streams' position now: what a
    checkpoint beginning its forward recomputes inside; None outside replicas."""
    modes = getattr(_entered, "modes", None)
    if not modes:
        return None
    replica = modes[-1]
    # The mode is entered for the recomputation too: autograd's device threads, where a GPU
    # backward recomputes, have no _entered of their own.
    return _Replay(replica.position, replica.restore, replica)


class _Replay:
    """The recompute context of one checkpoint, made as its forward begins: each time it is
    entered (every backward through the checkpoint recomputes) the streams ``position`` reads and
    ``restore`` sets draw from where they were at the forward, with ``mode`` (a replica's)
    entered, and go on from where they were afterwards."""

    def __init__(
        self,
        position: Callable[[], Any],
        restore: Callable[[Any], None],
        mode: ReplicaRandomness | None,
    ) -> None:
        self._position = position
        self._restore = restore
        self._mode = mode
        self._forward = position()
        self._resume: list[Any] = []

    def __enter__(self) -> None:
        resume = self._position()
        self._restore(self._forward)
        self._resume.append(resume)
        if self._mode is not None:
            try:
                self._mode.__enter__()
            except BaseException:
                self._restore(self._resume.pop())
                raise

    def __exit__(self, *exc_info: Any) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc_info)
        finally:
            self._restore(self._resume.pop())


@dataclasses.dataclass
class _SeedDraws:
    """Step seeds claimed in this process and the draws the caller's generator took for them,
    counted under ``_global_rng_lock``: a seed claimed while another step's draw is pending
    (strategies stepping at once from two threads) skips it, so every step has a seed of its
    own."""

    claimed: int = 0
    taken: int = 0


_seed_draws = _SeedDraws()


class StepSeed:
    """The seed of one step: the number the caller's generator draws next as the step begins.
    Replicas read it from a copy of that generator; the caller's own takes one draw when the
    step ends, and only if some replica needed the seed. So mirrored draws nothing from the
    caller's generator while replicas run, where a save and restore of it in a replica thread
    (a ``fork_rng``) could undo the draw; draws others make from it meanwhile (a prefetching
    input's augmentations) are kept.

    Use it as a context manager around the step."""

    def __init__(self) -> None:
        self._start: torch.Tensor | None = None
        self._taken_at_start = 0
        self._seed: int | None = None

    def __enter__(self) -> StepSeed:
        with _global_rng_lock:
            self._start = torch.default_generator.get_state()
            self._taken_at_start = _seed_draws.taken
        return self

    def get(self) -> int:
        with _global_rng_lock:
            if self._seed is None:
                if self._start is None:
                    raise RuntimeError("a replica drew random numbers outside a step")
                copy = torch.Generator()
                copy.set_state(self._start)
                pending = _seed_draws.claimed - self._taken_at_start  # other steps' seeds
                with outside_functorch():  # a draw for the step, not for each vmap-ped example
                    draws = torch.empty(pending + 1, dtype=torch.int64).random_(generator=copy)
                self._seed = int(draws[-1])
                _seed_draws.claimed += 1
            return self._seed

    def __exit__(self, *exc_info: object) -> None:
        if self._seed is not None:
            with _global_rng_lock, outside_functorch():
                torch.empty((), dtype=torch.int64).random_()
                _seed_draws.taken += 1


class ReplicaRandomness(TorchFunctionMode):
    """The random stream of one replica; enter it on the replica's thread around its work."""

    def __init__(
        self,
        replica_id: int,
        device: torch.device,
        on_backward: Callable[[tuple[torch.Tensor, ...]], None] | None = None,
    ) -> None:
        super().__init__()
        self.replica_id = replica_id
        self.device = device
        # Told of each backward pass the replica starts (its root tensors) before it runs: the
        # strategy checks the loss's scaling and counts the passes there.
        self.on_backward = on_backward
        self._step_seed = StepSeed()
        self._generators: dict[torch.device, torch.Generator] = {}
        self._running_bodies: set[Callable[..., Any]] = set()
        self._autograd_passes = 0  # running now, started from this replica
        torch_compat.route_checkpoint_recomputes(replica_replay)

    def start_step(self, step_seed: StepSeed) -> None:
        """Before a step: its streams will derive from ``step_seed`` when first needed."""
        self._step_seed = step_seed
        self._generators = {}

    def __enter__(self) -> ReplicaRandomness:
        super().__enter__()
        _entered.__dict__.setdefault("modes", []).append(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        super().__exit__(*exc_info)
        _entered.modes.pop()

    def position(self) -> _Position:
        """Where this replica's streams are: the step's seed and each generator's state (a
        generator not created yet starts from the seed when it is)."""
        return self._step_seed, {d: g.get_state() for d, g in self._generators.items()}

    def restore(self, position: _Position) -> None:
        """Draw from ``position`` (one ``position()`` returned earlier) on."""
        step_seed, states = position
        generators = {}
        for device, state in states.items():
            generators[device] = torch.Generator(device=device)
            generators[device].set_state(state)
        self._step_seed, self._generators = step_seed, generators

    def _generator(self, device: torch.device) -> torch.Generator:
        """This step's generator of this replica on ``device`` (each device a stream of its
        own: two GPUs, or the CPU and a GPU, never repeat each other's numbers)."""
        generator = self._generators.get(device)
        if generator is None:
            step_seed = self._step_seed.get()
            where = (0,) if device.type == "cpu" else (1, device.index or 0)
            words = np.random.SeedSequence([step_seed, self.replica_id], spawn_key=where)
            seed = int(words.generate_state(1, np.uint64)[0])
            generator = torch.Generator(device=device).manual_seed(seed)
            self._generators[device] = generator
        return generator

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: _Args = (),
        kwargs: _Kwargs | None = None,
    ) -> Any:
        route = _ROUTES.get(func)
        if route is None:
            return func(*args, **(kwargs or {}))
        handle: Callable[..., Any] = getattr(self, route)
        return handle(func, args, kwargs or {})

    def _with_generator(self, func: Callable[..., Any], args: _Args, kwargs: _Kwargs) -> Any:
        if kwargs.get("generator") is not None or any(
            isinstance(a, torch.Generator) for a in args
        ):  # the caller's own stream
            return func(*args, **kwargs)
        device = _device_of(args, kwargs)
        if device.type not in ("cpu", "cuda"):  # meta tensors draw nothing
            return func(*args, **kwargs)
        try:
            return func(*args, **{**kwargs, "generator": self._generator(device)})
        except TypeError:  # no overload with generator= for these arguments (names=, a
            # positional None): torch parses arguments before it draws, so nothing was drawn
            return self._swapped(func, args, kwargs)

    def _rrelu(self, func: Callable[..., Any], args: _Args, kwargs: _Kwargs) -> Any:
        if not _arg(args, kwargs, 3, "training", False):  # evaluation: the mean slope
            return func(*args, **kwargs)
        return self._with_generator(func, args, kwargs)

    def _dropout(self, func: Callable[..., Any], args: _Args, kwargs: _Kwargs) -> Any:
        input = _arg(args, kwargs, 0, "input", None)
        p = _real(_arg(args, kwargs, 1, "p", None))
        train = _arg(args, kwargs, 2, "train", None)
        if train is not None and not train:
            return func(*args, **kwargs)
        if not isinstance(input, torch.Tensor) or p is None:
            return self._swapped(func, args, kwargs)  # torch decides, on our stream
        if not 0 < p < 1 or input.numel() == 0 or input.device.type == "meta":
            return func(*args, **kwargs)  # nothing to draw (p = 1 zeroes; others raise)
        feature = func in _FEATURE_DROPOUTS
        # Our mask is for plain floating-point CPU tensors; torch's own kernel for the rest.
        if (
            not _is_plain(input)
            or input.device.type != "cpu"
            or not input.is_floating_point()
            or (feature and input.dim() < 2)
        ):
            return self._swapped(func, args, kwargs)
        generator = self._generator(input.device)
        return _cpu_dropout(input, p, feature, func in _IN_PLACE_DROPOUTS, generator)

    def _other_dropout(self, func: Callable[..., Any], args: _Args, kwargs: _Kwargs) -> Any:
        train = _arg(args, kwargs, 2, "train", None)  # native_dropout: None means training
        if (train is not None and not train) or _real(_arg(args, kwargs, 1, "p", None)) == 0:
            return func(*args, **kwargs)
        return self._swapped(func, args, kwargs)

    def _recurrent(self, func: Callable[..., Any], args: _Args, kwargs: _Kwargs) -> Any:
        """``torch.lstm`` / ``gru`` / ``rnn_*``: dropout between layers, drawn in C++. Their
        arguments end ``num_layers, dropout, train, ...`` in both the padded and the packed
        form."""
        index = next((i for i, a in enumerate(args) if type(a) is float), None)
        if index is not None and 0 < index < len(args) - 1:
            num_layers, dropout, train = args[index - 1 : index + 2]
            if not (train and dropout > 0 and num_layers > 1):
                return func(*args, **kwargs)
        return self._swapped(func, args, kwargs)

    def _attention(self, func: Callable[..., Any], args: _Args, kwargs: _Kwargs) -> Any:
        dropout_p = _real(_arg(args, kwargs, 4, "dropout_p", 0.0))
        if dropout_p == 0:
            return func(*args, **kwargs)
        query = _arg(args, kwargs, 0, "query", None)
        key = _arg(args, kwargs, 1, "key", None)
        value = _arg(args, kwargs, 2, "value", None)
        attn_mask = _arg(args, kwargs, 3, "attn_mask", None)
        is_causal = bool(_arg(args, kwargs, 5, "is_causal", False))
        given_scale = kwargs.get("scale")
        scale = _real(given_scale)
        gqa = bool(kwargs.get("enable_gqa", False))
        if (
            dropout_p is not None
            and 0 < dropout_p < 1
            and _math_attention_fits(query, key, value, attn_mask, is_causal, gqa)
            # Our math path takes square roots of the scale, as ATen's does of a positive one.
            and (given_scale is None or (scale is not None and scale > 0))
        ):
            generator = self._generator(query.device)
            return _cpu_attention(
                query, key, value, attn_mask, dropout_p, is_causal, scale, gqa, generator
            )
        if isinstance(query, torch.Tensor) and query.device.type == "meta":
            return func(*args, **kwargs)
        return self._swapped(func, args, kwargs)  # torch's kernel (or its error)

    def _around(self, func: Callable[..., Any], args: _Args, kwargs: _Kwargs) -> Any:
        body = body_without_torch_function_check(func)
        # A body that dispatches anyway (its check is not one of the globals the copy replaces)
        # comes back here: then torch's function runs whole, on our stream.
        if body is None or func in self._running_bodies:
            return self._swapped(func, args, kwargs)
        self._running_bodies.add(func)
        try:
            with self:
                return body(*args, **kwargs)
        finally:
            self._running_bodies.discard(func)

    def _backward(self, func: Callable[..., Any], args: _Args, kwargs: _Kwargs) -> Any:
        """``loss.backward()`` / ``torch.autograd.backward``: ``on_backward`` sees the roots
        first, so that a loss it refuses changes no gradient. A backward that a running pass
        starts (a reentrant checkpoint's) is part of that pass."""
        if self.on_backward is not None and not self._autograd_passes:
            roots = _arg(args, kwargs, 0, "tensors", ())
            self.on_backward((roots,) if isinstance(roots, torch.Tensor) else tuple(roots))
        return self._autograd_pass(func, args, kwargs)

    def _autograd_pass(self, func: Callable[..., Any], args: _Args, kwargs: _Kwargs) -> Any:
        """A backward pass or ``torch.autograd.grad`` with this mode on, so that random ops in it
        (a checkpoint's recomputation, a hook's) draw from this replica's streams: on this
        thread, and on autograd's device threads, which take the torch-function modes a pass
        began with. It runs the function's body: its own check would hand it back here."""
        body = body_without_torch_function_check(func)
        if body is None:
            return func(*args, **kwargs)
        self._autograd_passes += 1
        try:
            with self:
                return body(*args, **kwargs)
        finally:
            self._autograd_passes -= 1

    def _swapped(self, func: Callable[..., Any], args: _Args, kwargs: _Kwargs) -> Any:
        """``func`` with this replica's states in the global CPU generator and, for an op on a
        GPU, that GPU's: under the lock, since every thread shares them."""
        device = _device_of(args, kwargs)
        cpu = self._generator(torch.device("cpu"))
        gpu = self._generator(device) if device.type == "cuda" else None
        with _global_rng_lock:
            saved_cpu = torch.default_generator.get_state()
            torch.default_generator.set_state(cpu.get_state())
            if gpu is not None:
                global_gpu = torch.cuda.default_generators[device.index or 0]
                saved_gpu = global_gpu.get_state()
                global_gpu.set_state(gpu.get_state())
            try:
                return func(*args, **kwargs)
            finally:
                cpu.set_state(torch.default_generator.get_state())
                torch.default_generator.set_state(saved_cpu)
                if gpu is not None:
                    gpu.set_state(global_gpu.get_state())
                    global_gpu.set_state(saved_gpu)
