"""checkpoint: atomic writes, weights_only reads, all-or-nothing module loads."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
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


@pytest.mark.parametrize(
    ("failure", "expected", "message"),
    [
        (KeyboardInterrupt(), KeyboardInterrupt, None),  # interrupted mid-write
        (
            OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
            OSError,
            r"could not write the checkpoint .*c\.pt.*the disk is full",
        ),
    ],
)
def test_a_failed_write_leaves_the_old_file(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    failure: BaseException,
    expected: type[BaseException],
    message: str | None,
) -> None:
    path = checkpoint.save({"version": 1}, tmp_path / "c.pt")

    def failing(obj: Any, file: Any) -> None:
        file.write(b"partial")
        raise failure

    monkeypatch.setattr(torch, "save", failing)
    with pytest.raises(expected, match=message):
        checkpoint.save({"version": 2}, path)
    monkeypatch.undo()
    assert checkpoint.load(path) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


_KILLED_WRITER = """
import os, signal, sys, torch
from mirrored import checkpoint

def killed_midway(obj, file):
    file.write(b"x" * 4096)
    file.flush()
    os.kill(os.getpid(), signal.SIGKILL)

torch.save = killed_midway
checkpoint.save({"version": 2}, sys.argv[1])
"""


def _temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_the_temporary_file_of_a_killed_write_is_removed_by_the_next(tmp_path: Path) -> None:
    path = checkpoint.save({"version": 1}, tmp_path / "c.pt")
    killed = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(path)], check=False)
    assert killed.returncode == -signal.SIGKILL
    assert checkpoint.load(path) == {"version": 1}
    (left,) = _temporaries(tmp_path)  # the killed write's, full size
    assert left.startswith(".c.pt.") and (tmp_path / left).stat().st_size >= 4096
    checkpoint.save({"version": 3}, path)
    assert _temporaries(tmp_path) == []
    assert checkpoint.load(path) == {"version": 3}


def test_only_temporaries_of_ended_writers_of_the_same_file_on_this_machine_go(
    tmp_path: Path,
) -> None:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        machine = checkpoint._machine()
        names = {
            "ended": f".c.pt.{machine}.{ended.pid}.0a1b2c3d.tmp",
            "live": f".c.pt.{machine}.{live.pid}.0a1b2c3d.tmp",
            "elsewhere": f".c.pt.other-machine.{ended.pid}.0a1b2c3d.tmp",
            "other file": f".d.pt.{machine}.{ended.pid}.0a1b2c3d.tmp",
            "not ours": ".c.pt.notes.tmp",
        }
        for name in names.values():
            (tmp_path / name).write_bytes(b"partial")
        assert checkpoint.remove_stale_temporaries(tmp_path / "c.pt") == [tmp_path / names["ended"]]
        assert _temporaries(tmp_path) == sorted(v for k, v in names.items() if k != "ended")
    finally:
        live.kill()
        live.wait()


def test_a_read_only_file_system_is_named_and_keeps_the_last_good_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = checkpoint.save({"version": 1}, tmp_path / "c.pt")

    def read_only(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(file))

    monkeypatch.setattr(checkpoint, "open", read_only, raising=False)  # creating the temporary
    with pytest.raises(OSError, match=r"c\.pt.*the file system is read-only"):
        checkpoint.save({"version": 2}, path)
    monkeypatch.undo()
    assert checkpoint.load(path) == {"version": 1}
    assert _temporaries(tmp_path) == []


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0,
    reason="needs a user whom file permissions bind (root writes into read-only folders)",
)
def test_a_read_only_folder_is_named_and_keeps_the_last_good_file(tmp_path: Path) -> None:
    path = checkpoint.save({"version": 1}, tmp_path / "c.pt")
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match=r"c\.pt.*no permission to write there"):
            checkpoint.save({"version": 2}, path)
    finally:
        tmp_path.chmod(0o755)
    assert checkpoint.load(path) == {"version": 1}
    assert _temporaries(tmp_path) == []


def test_pickled_code_is_refused(tmp_path: Path) -> None:
    checkpoint.save({"module": nn.Linear(1, 1)}, tmp_path / "pickle.pt")  # torch.save pickles it
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
