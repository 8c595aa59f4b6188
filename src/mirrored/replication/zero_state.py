"""ZeRO's optimizer state as the plain single-optimizer state dict, and back.

Under ZeRO no replica holds the whole state, yet a checkpoint must load into a run with any
number of replicas (or none of ours). So ``state_dict()`` gathers every owner's share, joins the
pieces of a cut parameter back into whole tensors and returns what one optimizer would; loading
slices each parameter's state to the pieces a replica owns. Across workers the gather is a
collective: entries travel as JSON (layout, plain values) and one flat tensor per dtype, never as
pickles.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mirrored.core.param_groups import hyperparameters
from mirrored.replication.zero_plan import Piece, ReplicaShare, ZeroPlan

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


def gather_state(group: WorkerGroup, worker: int, device: torch.device, mine: Entries) -> Entries:
    """Every worker's state entries (``mine``: this one's); a collective. Tensors come back
    where their owner kept them: on the CPU if there, else on ``device``."""
    entries = _describe(mine)
    try:
        everyone = group.all_gather_json(entries, "ZeRO: optimizer state entries")
    except TypeError as error:
        raise TypeError(
            f"ZeRO gathers an optimizer's state across workers as tensors and JSON values; {error}"
        ) from error
    dtypes = sorted({_tensor_dtype(e) for w in everyone for e in w} - {""})
    flats: dict[str, list[torch.Tensor]] = {}
    for name in dtypes:
        sizes = [
            sum(math.prod(e[2]["tensor"][0]) for e in w if _tensor_dtype(e) == name)
            for w in everyone
        ]
        flat = torch.zeros(max(sizes), dtype=getattr(torch, name), device=device)
        offset = 0
        for entry in (e for e in entries if _tensor_dtype(e) == name):
            value = mine[entry[0]][entry[1]]
            flat[offset : offset + value.numel()].copy_(value.reshape(-1))
            offset += value.numel()
        flats[name] = group.all_gather(flat, f"ZeRO: optimizer state ({name})")
    gathered: Entries = {}
    for w, worker_entries in enumerate(everyone):
        flats_of_w = {name: flat[w] for name, flat in flats.items()}
        _unpack(gathered, worker_entries, flats_of_w, device, mine if w == worker else None)
    return gathered


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
    gathered: Entries,
    entries: list[list[Any]],
    flats: dict[str, torch.Tensor],
    device: torch.device,
    own: Entries | None,
) -> None:
    """A worker's ``entries`` into ``gathered``, its tensors read in order from its flat tensor
    per dtype (``flats``), or from ``own`` for this worker's own entries."""
    offsets = dict.fromkeys(flats, 0)
    for slot, key, description in entries:
        state = gathered.setdefault(slot, {})
        if "value" in description:
            state[key] = description["value"]
            continue
        shape, name, where = description["tensor"]
        numel = math.prod(shape)
        if own is not None:
            state[key] = own[slot][key]
        else:  # where its owner keeps it (torch keeps Adam's step count on the CPU)
            part = flats[name][offsets[name] : offsets[name] + numel]
            place = torch.device("cpu") if where == "cpu" else device
            state[key] = part.view(shape).to(place, copy=True)
        offsets[name] += numel


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
