"""checkpoint: atomic writes, weights_only reads, all-or-nothing module loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from mirrored import checkpoint


def test_save_creates_folders_and_loads_back(tmp_path: Path) -> None:
    path = checkpoint.save({"a": torch.ones(2), "n": 3}, tmp_path / "deep" / "c.pt")
    assert checkpoint.load(path)["n"] == 3
    assert [p.name for p in path.parent.iterdir()] == ["c.pt"]


def test_a_failed_write_leaves_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = checkpoint.save({"version": 1}, tmp_path / "c.pt")

    def failing(obj: Any, file: Any) -> None:
        file.write(b"partial")
        raise KeyboardInterrupt  # interrupted mid-write

    monkeypatch.setattr(torch, "save", failing)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save({"version": 2}, path)
    monkeypatch.undo()
    assert checkpoint.load(path) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_pickled_code_is_refused(tmp_path: Path) -> None:
    torch.save({"module": nn.Linear(1, 1)}, tmp_path / "pickle.pt")
    with pytest.raises(ValueError, match="not a readable checkpoint"):
        checkpoint.load(tmp_path / "pickle.pt")


def test_mismatched_state_loads_nothing() -> None:
    module = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    bad = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2)).state_dict()
    bad["extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"unexpected keys \['extra'\].*1\.weight") as error:
        checkpoint.load_module_state(module, bad, "bad.pt")
    assert "nothing was loaded" in str(error.value)
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    with pytest.raises(ValueError, match="missing keys"):
        checkpoint.load_module_state(module, {}, "empty")
    with pytest.raises(ValueError, match="mapping"):
        checkpoint.load_module_state(module, [], "a list")  # type: ignore[arg-type]
