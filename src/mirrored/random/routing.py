"""Per-replica random streams: each random op a replica issues draws from that replica's own
generator, so dropout differs across replicas and a run is reproducible bit for bit from
``torch.manual_seed``.

PyTorch's random ops draw from one process-wide generator per device, so replicas running at
once would interleave their draws nondeterministically. Each replica therefore draws from
generators of its own, one per device it draws on, seeded for each step from one seed
(:mod:`mirrored.random.step_seeds`). A thread-local ``TorchFunctionMode`` on each replica's thread,
``ReplicaRandomness``, routes random ops to them:

- an op that takes ``generator=`` (``rand``, ``bernoulli_``, ``randperm``, ``nn.init``...) gets
  the replica's generator for the op's device: no global state, so replicas draw at once;
- dropout and attention dropout on the CPU, which take no generator, run our kernels with the
  mask drawn from it (:mod:`mirrored.random.cpu_kernels`);
- torch's Python functions around random ops (``F.dropout2d``, ``F.gumbel_softmax``,
  ``F.multi_head_attention_forward``...) run with the mode active inside, so that the ops in them
  are routed the same way (a mode is otherwise off while a function it intercepted runs);
- the rest (alpha dropout, recurrent layers' dropout, CUDA's fused dropout and attention
  kernels, and any tensor our CPU kernels do not take: nested, sparse, subclasses, ``vmap``-ped)
  swaps the replica's state into the device's global generator under a process-wide lock; on a
  GPU the lock spans kernel launches, not kernels.

Non-random ops pass through untouched (one Python call each). Backward passes a replica starts
run with its mode on, so random ops in them draw from its streams too, and activation
checkpoints replay them (:mod:`mirrored.random.activation_checkpoint`).
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mirrored._torch_internals import (
    PRIVATE_SAMPLERS,
    aten_takes_generator,
    body_without_torch_function_check,
)
from mirrored.core.trace_recording import refuse_while_recording
from mirrored.random.activation_checkpoint import entered_streams, replica_replay
from mirrored.random.cpu_kernels import cpu_attention, cpu_dropout, is_plain, math_attention_fits
from mirrored.random.step_seeds import StepSeed, global_generators_lock
from mirrored.torch_patches import hold_checkpoint_routes

__all__ = ["ReplicaRandomness", "replica_streams"]

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
        # This step's generator per device: one object per device for the replica's life,
        # reseeded each step, so that a traced step (which holds them) draws this step's stream.
        self._generators: dict[torch.device, torch.Generator] = {}
        self._streams: dict[torch.device, torch.Generator] = {}
        self._running_bodies: set[Callable[..., Any]] = set()
        self._autograd_passes = 0  # running now, started from this replica
        self._swapping = False  # this replica's states are in the global generators now
        # torch's checkpoints recompute inside the replica's replay until these streams are
        # released (their strategy closed) or collected.
        self._checkpoint_routes = hold_checkpoint_routes(self, replica_replay)

    def release(self) -> None:
        """The strategy closed: torch's checkpoints need not replay these streams any more."""
        self._checkpoint_routes.release()

    def start_step(self, step_seed: StepSeed) -> None:
        """Before a step: its streams will derive from ``step_seed`` when first needed."""
        self._step_seed = step_seed
        self._generators = {}

    def __enter__(self) -> ReplicaRandomness:
        super().__enter__()
        entered_streams().append(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        super().__exit__(*exc_info)
        entered_streams().pop()

    def position(self) -> _Position:
        """Where this replica's streams are: the step's seed and each generator's state (a
        generator not created yet starts from the seed when it is)."""
        return self._step_seed, {d: g.get_state() for d, g in self._generators.items()}

    def restore(self, position: _Position) -> None:
        """Draw from ``position`` (one ``position()`` returned earlier) on."""
        step_seed, states = position
        generators = {}
        for device, state in states.items():
            generators[device] = self._stream(device)
            generators[device].set_state(state)
        self._step_seed, self._generators = step_seed, generators

    def drawn_devices(self) -> tuple[torch.device, ...]:
        """The devices this step has drawn on so far."""
        return tuple(self._generators)

    def prepare(self, devices: Sequence[torch.device]) -> None:
        """Seed this step's generators on ``devices`` now: a traced step replays draws from
        them without asking for them first."""
        for device in devices:
            self._generator(device)

    def _stream(self, device: torch.device) -> torch.Generator:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.Generator(device=device)
        return stream

    def _generator(self, device: torch.device) -> torch.Generator:
        """This step's generator of this replica on ``device`` (each device a stream of its
        own: two GPUs, or the CPU and a GPU, never repeat each other's numbers)."""
        generator = self._generators.get(device)
        if generator is None:
            step_seed = self._step_seed.get()
            where = (0,) if device.type == "cpu" else (1, device.index or 0)
            words = np.random.SeedSequence([step_seed, self.replica_id], spawn_key=where)
            seed = int(words.generate_state(1, np.uint64)[0])
            generator = self._stream(device).manual_seed(seed)
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
            not is_plain(input)
            or input.device.type != "cpu"
            or not input.is_floating_point()
            or (feature and input.dim() < 2)
        ):
            return self._swapped(func, args, kwargs)
        generator = self._generator(input.device)
        return cpu_dropout(input, p, feature, func in _IN_PLACE_DROPOUTS, generator)

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
            and math_attention_fits(query, key, value, attn_mask, is_causal, gqa)
            # Our math path takes square roots of the scale, as ATen's does of a positive one.
            and (given_scale is None or (scale is not None and scale > 0))
        ):
            generator = self._generator(query.device)
            return cpu_attention(
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
        GPU, that GPU's: under the lock, since every thread shares them. An op that ``func``
        routes here again (a recomputation inside backward runs with this routing entered twice)
        runs as it is: the states are already swapped in, and the lock is this swap's own."""
        if self._swapping:
            return func(*args, **kwargs)
        refuse_while_recording(
            f"{getattr(func, '__name__', func)} draws from torch's global generator (swapped "
            "for the replica's), which a trace cannot replay"
        )
        device = _device_of(args, kwargs)
        cpu = self._generator(torch.device("cpu"))
        gpu = self._generator(device) if device.type == "cuda" else None
        with global_generators_lock:
            saved_cpu = torch.default_generator.get_state()
            torch.default_generator.set_state(cpu.get_state())
            if gpu is not None:
                global_gpu = torch.cuda.default_generators[device.index or 0]
                saved_gpu = global_gpu.get_state()
                global_gpu.set_state(gpu.get_state())
            self._swapping = True
            try:
                return func(*args, **kwargs)
            finally:
                self._swapping = False
                cpu.set_state(torch.default_generator.get_state())
                torch.default_generator.set_state(saved_cpu)
                if gpu is not None:
                    gpu.set_state(global_gpu.get_state())
                    global_gpu.set_state(saved_gpu)


def replica_streams(
    randomness: Sequence[ReplicaRandomness], replica_id: int, num_replicas_in_sync: int
) -> AbstractContextManager[Any]:
    """The random streams a replica's function runs under: its own, or, when it is the only
    replica in sync (on the caller's thread), none: the caller's global generator is its stream."""
    return nullcontext() if num_replicas_in_sync == 1 else randomness[replica_id]
