"""ZeRO's optimizer state as the plain single-optimizer state dict, and back.

Under ZeRO no replica holds the whole state, yet a checkpoint must load into a run with any
number of replicas (or none of ours). So ``state_dict()`` gathers every owner's share, joins the
pieces of a cut parameter back into whole tensors and returns what one optimizer would; loading
slices each parameter's state to the pieces a replica owns. Across workers the gather is a
collective: entries travel as JSON (layout, plain values) and their tensors end to end, a chunk
at a time, never as pickles.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mirrored.core.param_groups import hyperparameters
from mirrored.replication.zero_plan import Piece, ReplicaShare, ZeroPlan, capped_chunk_bytes

if TYPE_CHECKING:
    from mirrored.comm.worker_group import WorkerGroup
    from mirrored.replication.zero_storage import ShardStorage

__all__ = ["consolidated_state", "dtype_name", "gather_state", "local_entries", "pieces_state"]

# One optimizer's state entries by slot: "w<index>" a whole parameter's (its index in the
# optimizer's state_dict), "p<piece>" a cut piece's.
Entries = dict[str, dict[str, Any]]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (``getattr(torch, name)`` turns it back)."""
    return str(dtype).removeprefix("torch.")


def local_entries(optimizers: Sequence[torch.optim.Optimizer], storage: ShardStorage) -> Entries:
    """The state entries this worker's replicas own: their optimizers' and their pieces'."""
    mine: Entries = {}
    for optimizer in optimizers:
        for index, state in optimizer.state_dict()["state"].items():
            mine[f"w{index}"] = state
    for piece_optimizer, pieces in zip(storage.piece_optimizers, storage.piece_params, strict=True):
        for k, piece_param in pieces.items():
            if piece_optimizer is not None and piece_param in piece_optimizer.state:
                mine[f"p{k}"] = dict(piece_optimizer.state[piece_param])
    return mine


def consolidated_state(
    plan: ZeroPlan, gathered: Entries, params: Sequence[nn.Parameter]
) -> dict[Any, dict[str, Any]]:
    """The state of every parameter from every owner's entries (``params``: one replica's), the
    pieces of a cut one joined; one never stepped has none, as on one device."""
    state: dict[Any, dict[str, Any]] = {
        int(key[1:]): value for key, value in gathered.items() if key[0] == "w"
    }
    split: dict[int, list[int]] = {}
    for k, piece in enumerate(plan.pieces):
        if not piece.whole:
            split.setdefault(piece.position, []).append(k)
    for position, ks in split.items():
        parts = [gathered[f"p{k}"] for k in ks if f"p{k}" in gathered]
        if len(parts) == len(ks):
            state[plan.state_index[position]] = _joined(parts, params[position])
    return dict(sorted(state.items()))


def pieces_state(plan: ZeroPlan, share: ReplicaShare, state_dict: dict[str, Any]) -> dict[str, Any]:
    """A replica's pieces' ranges of ``state_dict`` (a plain single-optimizer state dict), as
    the state dict of its piece optimizer (so torch places and casts each tensor on loading)."""
    piece_state: dict[int, dict[str, Any]] = {}
    piece_groups = []
    j = 0
    for group in share.piece_groups:
        indices = []
        for k in group.pieces:
            piece = plan.pieces[k]
            whole = state_dict["state"].get(plan.state_index[piece.position])
            if whole is not None:
                piece_state[j] = _sliced(whole, piece)
            indices.append(j)
            j += 1
        settings = hyperparameters(state_dict["param_groups"][group.param_group])
        piece_groups.append({**settings, "params": indices})
    return {"state": piece_state, "param_groups": piece_groups}


def gather_state(
    group: WorkerGroup, worker: int, device: torch.device, mine: Entries, chunk_bytes: int
) -> Entries:
    """Every worker's state entries (``mine``: this one's); a collective. Tensors come back
    where their owner kept them: on the CPU if there, else on ``device``. Each dtype's entries
    cross end to end, ``chunk_bytes`` of every worker's at a time, straight into tensors of
    their own: the only tensors of the state's size made are the other workers' entries."""
    entries = _describe(mine)
    try:
        everyone = group.all_gather_json(entries, "ZeRO: optimizer state entries")
    except TypeError as error:
        raise TypeError(
            f"ZeRO gathers an optimizer's state across workers as tensors and JSON values; {error}"
        ) from error
    gathered: Entries = {}
    for w, worker_entries in enumerate(everyone):
        _unpack(gathered, worker_entries, device, mine if w == worker else None)
    for name in sorted({_tensor_dtype(e) for w in everyone for e in w} - {""}):
        layouts = [_layout(worker_entries, name) for worker_entries in everyone]
        _gather_dtype(group, worker, device, gathered, layouts, name, chunk_bytes)
    return gathered


# One worker's tensors of one dtype, end to end: (slot, key, offset, numel) each.
Layout = list[tuple[str, str, int, int]]


def _layout(entries: list[list[Any]], name: str) -> Layout:
    """Where ``entries``' tensors of dtype ``name`` sit, end to end in their order."""
    layout: Layout = []
    offset = 0
    for slot, key, description in entries:
        if _tensor_dtype([slot, key, description]) == name:
            numel = math.prod(description["tensor"][0])
            layout.append((slot, key, offset, numel))
            offset += numel
    return layout


def _gather_dtype(
    group: WorkerGroup,
    worker: int,
    device: torch.device,
    gathered: Entries,
    layouts: Sequence[Layout],
    name: str,
    chunk_bytes: int,
) -> None:
    """Every worker's tensors of dtype ``name`` (``layouts``: per worker) into ``gathered``'s,
    elements ``a`` to ``a + chunk`` of every worker's at a time (``chunk_bytes``, capped for a
    small state so that the staging stays well below what it gathers)."""
    dtype = getattr(torch, name)
    size = max((offset + numel for layout in layouts for _, _, offset, numel in layout), default=0)
    chunk = max(1, capped_chunk_bytes(chunk_bytes, size * dtype.itemsize) // dtype.itemsize)
    staging = torch.zeros(chunk, dtype=dtype, device=device)
    for a in range(0, size, chunk):
        b = min(a + chunk, size)
        out = staging[: b - a]
        for slot, key, lo, hi, at in _overlaps(layouts[worker], a, b):
            out[at : at + hi - lo].copy_(gathered[slot][key].reshape(-1)[lo:hi])
        parts = group.all_gather(out, f"ZeRO: optimizer state ({name}, from {a})")
        for w, part in enumerate(parts):
            if w != worker:
                for slot, key, lo, hi, at in _overlaps(layouts[w], a, b):
                    gathered[slot][key].view(-1)[lo:hi].copy_(part[at : at + hi - lo])


def _overlaps(layout: Layout, a: int, b: int) -> list[tuple[str, str, int, int, int]]:
    """The tensors of ``layout`` in its elements ``a`` to ``b``: (slot, key, first and last + 1
    of their elements, place in the range)."""
    return [
        (slot, key, max(a, offset) - offset, min(b, offset + numel) - offset, max(a, offset) - a)
        for slot, key, offset, numel in layout
        if max(a, offset) < min(b, offset + numel)
    ]


def _describe(mine: Entries) -> list[list[Any]]:
    """``mine`` as JSON: per entry its slot, key and either a plain value or a tensor's shape,
    dtype name and where it is kept ("cpu" or "device")."""
    entries: list[list[Any]] = []
    for slot in sorted(mine):
        for key, value in sorted(mine[slot].items()):
            if isinstance(value, torch.Tensor):
                where = "cpu" if value.device.type == "cpu" else "device"
                description = {"tensor": [list(value.shape), dtype_name(value.dtype), where]}
            else:
                description = {"value": value}
            entries.append([slot, key, description])
    return entries


def _unpack(
    gathered: Entries, entries: list[list[Any]], device: torch.device, own: Entries | None
) -> None:
    """A worker's ``entries`` into ``gathered``: plain values as they are; this worker's own
    tensors (``own``) as they are; another worker's as tensors to fill, where their owner keeps
    them (torch keeps Adam's step count on the CPU)."""
    for slot, key, description in entries:
        state = gathered.setdefault(slot, {})
        if "value" in description:
            state[key] = description["value"]
        elif own is not None:
            state[key] = own[slot][key]
        else:
            shape, name, where = description["tensor"]
            place = torch.device("cpu") if where == "cpu" else device
            state[key] = torch.empty(shape, dtype=getattr(torch, name), device=place)


def _joined(parts: Sequence[dict[str, Any]], param: nn.Parameter) -> dict[str, Any]:
    """One parameter's state from its pieces' (in order): their per-element tensors end to end,
    shaped as the parameter; the rest (the step count) is the same in every piece."""
    joined = {}
    for key, value in parts[0].items():
        if isinstance(value, torch.Tensor) and value.dim() == 1:
            pieces = [part[key].to(value.device) for part in parts]
            joined[key] = torch.cat(pieces).view(param.shape)
        else:
            joined[key] = value
    return joined


def _sliced(state: dict[str, Any], piece: Piece) -> dict[str, Any]:
    """A piece's share of a whole parameter's ``state``: its range of each per-element tensor;
    the rest (the step count) as it is."""
    return {
        key: value.reshape(-1)[piece.start : piece.start + piece.numel].clone()
        if isinstance(value, torch.Tensor) and value.dim() > 0
        else copy.deepcopy(value)
        for key, value in state.items()
    }


def _tensor_dtype(entry: list[Any]) -> str:
    """The dtype name of a gathered state entry that is a tensor ("": a plain value)."""
    description = entry[2]
    return str(description["tensor"][1]) if "tensor" in description else ""
