"""Every random generator a training run draws from, captured and restored as plain data.

``BackupAndRestore`` resumes a run bit for bit: the data order (a shuffling DataLoader draws its
seed from torch's generator when an epoch starts), dropout (each step's replica seeds come from
torch's generator) and user code drawing from numpy or ``random`` all continue where they were.
The captured state holds only tensors, ints, strings and lists, so it loads with
``weights_only=True``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture", "capture_torch", "check", "restore", "restore_torch"]


def capture_torch() -> dict[str, Any]:
    """The state of torch's CPU generator and, once CUDA is initialised, every GPU's."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_torch(state: dict[str, Any]) -> None:
    """Put back what ``capture_torch`` (or ``capture``) returned, for torch's generators."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def capture() -> dict[str, Any]:
    """The state of torch's CPU and CUDA generators, numpy's and Python's."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    version, python_state, gauss_next = random.getstate()
    return {
        **capture_torch(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {"version": version, "state": list(python_state), "gauss_next": gauss_next},
    }


def restore(state: dict[str, Any]) -> None:
    """Put back what ``capture`` returned."""
    restore_torch(state)
    saved = state["numpy"]
    np.random.set_state(
        (
            saved["kind"],
            saved["keys"].numpy().astype(np.uint32),
            saved["position"],
            saved["has_gauss"],
            saved["cached_gaussian"],
        )
    )
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss_next"]))


def check(state: Any, source: str) -> None:
    """A ValueError naming the part unless ``restore`` would take ``state`` whole: each part
    is set into a throwaway generator of its kind, so nothing of the process's changes."""
    if not isinstance(state, dict) or not {"torch", "numpy", "python"} <= set(state):
        raise ValueError(
            f"{source} is not a saved random state (expected 'torch', 'numpy' and 'python' "
            f"parts, got {sorted(state) if isinstance(state, dict) else type(state).__name__})"
        )
    try:
        torch.Generator().set_state(state["torch"])
        numpy = state["numpy"]
        keys = numpy["keys"].numpy().astype(np.uint32)
        np.random.RandomState().set_state(
            (numpy["kind"], keys, numpy["position"], numpy["has_gauss"], numpy["cached_gaussian"])
        )
        python = state["python"]
        random.Random().setstate((python["version"], tuple(python["state"]), python["gauss_next"]))
        cuda = state.get("cuda", [])
        if not isinstance(cuda, list) or not all(isinstance(t, torch.Tensor) for t in cuda):
            raise TypeError(f"'cuda' is {type(cuda).__name__}, expected a list of tensors")
    except Exception as error:
        raise ValueError(f"{source} is a damaged random state: {error!r}") from error
