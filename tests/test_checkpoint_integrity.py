"""checkpoint's checksums: every flipped bit and every truncation of each kind of file mirrored
writes is refused with a ValueError naming the file, or loads exactly the original values; a
file without checksums loads with a warning; an interrupted save raises KeyboardInterrupt."""

from __future__ import annotations

import contextlib
import io
import os
import random
import shutil
import signal
import struct
import threading
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import mirrored
from mirrored import checkpoint
from mirrored.checkpoint import checksums

FLIPS = 200  # random bits of a whole file, per kind
DATA_FLIPS = 100  # random bits of its tensor data, per kind
TRUNCATIONS = 200


class CopyBackup(mirrored.callbacks.Callback):
    """Copies BackupAndRestore's file once it has written one (it deletes it when fit ends)."""

    def __init__(self, backup: mirrored.callbacks.BackupAndRestore, to: Path) -> None:
        super().__init__()
        self.backup, self.to = backup, to

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if batch == 2:
            shutil.copy(self.backup.path, self.to)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One file of each kind mirrored writes, from a short fit on two replicas."""
    folder = tmp_path_factory.mktemp("kinds")
    torch.manual_seed(0)
    x, y = torch.randn(48, 6), torch.randint(0, 3, (48,))
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        with strategy.scope():
            model = mirrored.Model(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))
            model.compile(
                optimizer="adam",
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        backup = mirrored.callbacks.BackupAndRestore(folder / "backup", save_freq=1)
        copy = CopyBackup(backup, folder / "backup.pt")
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[backup, copy])
        model.save_weights(folder / "weights.pt")
        model.save(folder / "model.pt")
    module = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(module.parameters())
    module(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    step = torch.tensor(5)
    saved = mirrored.Checkpoint(model=module, optimizer=optimizer, step=step).save(folder / "c")
    return {
        "save_weights": folder / "weights.pt",
        "Model.save": folder / "model.pt",
        "BackupAndRestore": folder / "backup.pt",
        "Checkpoint": Path(saved),
    }


KINDS = ["save_weights", "Model.save", "BackupAndRestore", "Checkpoint"]


def _identical(actual: Any, expected: Any) -> bool:
    """Equal to the bit: same types, dtypes, shapes, bytes; floats by their representation."""
    if type(actual) is not type(expected):
        return False
    if isinstance(expected, torch.Tensor):
        return (
            actual.dtype == expected.dtype
            and actual.shape == expected.shape
            and actual.requires_grad == expected.requires_grad
            and torch.equal(_bytes(actual), _bytes(expected))
        )
    if isinstance(expected, dict):
        return list(actual) == list(expected) and all(
            _identical(actual[key], value) for key, value in expected.items()
        )
    if isinstance(expected, (list, tuple)):
        return len(actual) == len(expected) and all(map(_identical, actual, expected))
    return repr(actual) == repr(expected)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def _load(path: Path) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a damaged file never passes for one without checksums
        return checkpoint.load(path)


def _refused_or_identical(path: Path, original: Any) -> str:
    """'refused' (a ValueError naming the file) or 'identical'; anything else fails."""
    try:
        loaded = _load(path)
    except ValueError as error:
        assert str(path) in str(error)
        return "refused"
    assert _identical(loaded, original), f"{path.name}: a changed value loaded silently"
    return "identical"


def _flip(data: bytes, bit: int) -> bytes:
    flipped = bytearray(data)
    flipped[bit // 8] ^= 1 << (bit % 8)
    return bytes(flipped)


def _tensor_data_bits(data: bytes) -> list[int]:
    """The bits of the file that hold tensor bytes (the zip members data/N)."""
    bits = []
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for info in archive.infolist():
            if "/data/" in info.filename and info.file_size:
                name_length, extra_length = struct.unpack_from("<HH", data, info.header_offset + 26)
                start = info.header_offset + 30 + name_length + extra_length
                bits.extend(range(start * 8, (start + info.file_size) * 8))
    return bits


@pytest.mark.parametrize("kind", KINDS)
def test_every_flipped_bit_is_refused_or_changes_nothing(
    files: dict[str, Path], kind: str, tmp_path: Path
) -> None:
    original = files[kind].read_bytes()
    expected = _load(files[kind])
    rng = random.Random(f"flips of {kind}")
    target = tmp_path / "flipped.pt"
    outcomes = []
    for bit in rng.sample(range(len(original) * 8), FLIPS):
        target.write_bytes(_flip(original, bit))
        outcomes.append(_refused_or_identical(target, expected))
    assert outcomes.count("refused") > FLIPS // 2  # most bytes are tensors and their structure


@pytest.mark.parametrize("kind", KINDS)
def test_a_flipped_bit_of_tensor_data_is_refused_naming_the_entry(
    files: dict[str, Path], kind: str, tmp_path: Path
) -> None:
    original = files[kind].read_bytes()
    rng = random.Random(f"data flips of {kind}")
    target = tmp_path / "flipped.pt"
    for bit in rng.sample(_tensor_data_bits(original), DATA_FLIPS):
        target.write_bytes(_flip(original, bit))
        with pytest.raises(ValueError, match=r"is corrupt: [\w.]+(, [\w.]+)*: checksum mismatch"):
            _load(target)


@pytest.mark.parametrize("kind", KINDS)
def test_every_truncation_is_refused(files: dict[str, Path], kind: str, tmp_path: Path) -> None:
    original = files[kind].read_bytes()
    rng = random.Random(f"truncations of {kind}")
    target = tmp_path / "truncated.pt"
    for size in [0, 1, len(original) - 1, *rng.sample(range(len(original)), TRUNCATIONS)]:
        target.write_bytes(original[:size])
        with pytest.raises(ValueError, match="truncated"):
            _load(target)


def test_every_bit_of_the_zip_directory_is_refused_or_changes_nothing(tmp_path: Path) -> None:
    """The zip's directory and end record, exhaustively: where Python's zipfile and torch's
    reader could read a flipped field differently (a member flagged as a folder loaded as
    uninitialised memory)."""
    state = {"w": torch.arange(6.0).reshape(2, 3), "n": 3}
    path = checkpoint.save(state, tmp_path / "small.pt")
    original = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        directory = archive.start_dir
    target = tmp_path / "flipped.pt"
    for bit in range(directory * 8, len(original) * 8):
        target.write_bytes(_flip(original, bit))
        _refused_or_identical(target, state)


def test_the_error_names_the_entries_of_the_damaged_tensor(tmp_path: Path) -> None:
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    module[1].weight = module[0].weight  # tied: one storage, two entries
    path = checkpoint.save({"model": module.state_dict(), "step": 1}, tmp_path / "c.pt")
    data = path.read_bytes()
    path.write_bytes(_flip(data, _tensor_data_bits(data)[0]))
    with pytest.raises(ValueError, match=r"model\.0\.weight, model\.1\.weight: checksum mismatch"):
        checkpoint.load(path)
    structure = data.index(b"archive/data.pkl") + len("archive/data.pkl") + 64  # in the pickle
    path.write_bytes(_flip(data, structure * 8))
    with pytest.raises(ValueError, match=r"the structure \(data\.pkl.*checksum mismatch"):
        checkpoint.load(path)


def test_the_files_are_plain_torch_load_files(files: dict[str, Path]) -> None:
    weights = torch.load(files["save_weights"], weights_only=True)
    assert list(weights) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert _identical(weights, _load(files["save_weights"]))


def test_a_file_without_checksums_loads_with_one_warning(tmp_path: Path) -> None:
    state = {"w": torch.ones(3), "n": 2}
    torch.save(state, tmp_path / "old.pt")
    with pytest.warns(UserWarning, match=r"old\.pt' has no checksums.*without being verified") as w:
        assert _identical(checkpoint.load(tmp_path / "old.pt"), state)
    assert len(w) == 1


def test_files_are_checked_where_torch_computed_no_crc32(tmp_path: Path) -> None:
    state = {"w": torch.arange(4.0)}
    torch.serialization.set_crc32_options(False)
    try:
        path = checkpoint.save(state, tmp_path / "c.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    with zipfile.ZipFile(path) as archive:
        assert archive.getinfo("archive/data/0").CRC == 0  # torch left it out
    assert _identical(_load(path), state)
    data = path.read_bytes()
    path.write_bytes(_flip(data, _tensor_data_bits(data)[5]))
    with pytest.raises(ValueError, match=r"w: checksum mismatch"):
        _load(path)


@pytest.mark.parametrize(
    "state",
    [{"w": torch.arange(4.0)}, {"s": torch.eye(3).to_sparse()}],
    ids=["meta", "sparse"],
)
def test_storages_torch_holds_elsewhere_are_checked_from_the_file(
    tmp_path: Path, state: dict[str, torch.Tensor]
) -> None:
    """Tensors loaded onto another device (here meta), or without one storage (sparse)."""
    location = "meta" if "w" in state else "cpu"
    path = checkpoint.save(state, tmp_path / "c.pt")
    assert list(checkpoint.load(path, map_location=location)) == list(state)
    data = path.read_bytes()
    path.write_bytes(_flip(data, _tensor_data_bits(data)[-1]))
    with pytest.raises(ValueError, match=r"checksum mismatch"):
        checkpoint.load(path, map_location=location)


def test_a_newer_format_of_checksums_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checksums, "_FORMAT", 2)
    path = checkpoint.save({"w": torch.ones(2)}, tmp_path / "c.pt")
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"c\.pt' lists its checksums in format 2.*newer"):
        checkpoint.load(path)


@pytest.mark.parametrize(
    "content",
    [b"", b"not a checkpoint", b"PK\x05\x06" + bytes(18)],  # empty, text, an empty zip
    ids=["empty", "text", "empty zip"],
)
def test_a_foreign_file_is_refused_naming_it(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "c.pt").write_bytes(content)
    with pytest.raises(ValueError, match=r"c\.pt' is not a readable checkpoint"):
        _load(tmp_path / "c.pt")  # and no warning that it has no checksums


def test_a_damaged_file_without_checksums_is_a_value_error(tmp_path: Path) -> None:
    """torch's own decoding errors (OSError, RuntimeError, KeyError...) become a ValueError."""
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(3)}, buffer)
    original = buffer.getvalue()
    with zipfile.ZipFile(buffer) as archive:
        pickle_start = archive.getinfo("archive/data.pkl").header_offset + 64
    (tmp_path / "old.pt").write_bytes(
        original[:pickle_start] + b"\xff" * 8 + original[pickle_start + 8 :]
    )
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"old\.pt' is not a readable"):
        checkpoint.load(tmp_path / "old.pt")


# -- interrupts --------------------------------------------------------------------------------


class FailingFile(io.BufferedRandom):
    """A real file whose write number ``fail_at`` raises ``failure``."""

    def __init__(self, path: str | os.PathLike[str], fail_at: int, failure: BaseException) -> None:
        super().__init__(io.FileIO(path, "x+"))
        self.writes, self.fail_at, self.failure = 0, fail_at, failure

    def write(self, data: Any) -> int:
        self.writes += 1
        if self.writes == self.fail_at:
            raise self.failure
        return super().write(data)


def _temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("fail_at", [1, 3, 6, 12])  # the pickle, a header, tensor data, the end
@pytest.mark.parametrize(
    ("failure", "expected"),
    [(KeyboardInterrupt(), KeyboardInterrupt), (OSError(28, "No space left"), OSError)],
    ids=["interrupt", "disk full"],
)
def test_a_failed_write_is_raised_as_itself(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fail_at: int,
    failure: BaseException,
    expected: type[BaseException],
) -> None:
    """torch's writer turns what its write callback raised into a RuntimeError: not here."""
    path = checkpoint.save({"version": 1}, tmp_path / "c.pt")
    state = {f"w{i}": torch.randn(64) for i in range(4)}

    def failing_open(file: str, mode: str) -> FailingFile:
        return FailingFile(file, fail_at, failure)

    monkeypatch.setattr(checkpoint, "open", failing_open, raising=False)
    with pytest.raises(expected):
        checkpoint.save(state, path)
    monkeypatch.undo()
    assert _load(path) == {"version": 1}
    assert _temporaries(tmp_path) == []


def test_a_write_failure_torch_swallows_is_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = checkpoint.save({"version": 1}, tmp_path / "c.pt")

    def swallowing(obj: Any, file: Any) -> None:
        with contextlib.suppress(BaseException):
            file.write(b"partial")

    def failing_open(file: str, mode: str) -> FailingFile:
        return FailingFile(file, 1, KeyboardInterrupt())

    monkeypatch.setattr(checkpoint, "open", failing_open, raising=False)
    monkeypatch.setattr(torch, "save", swallowing)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save({"version": 2}, path)
    monkeypatch.undo()
    assert _load(path) == {"version": 1}
    assert _temporaries(tmp_path) == []


def _converting(swallow: bool) -> Any:
    """A torch.save that gets a Ctrl-C where it is no write's (pickling, its C++ writer) and
    turns it into a RuntimeError, or into nothing, leaving no trace of it."""

    def save(obj: Any, file: Any) -> None:
        file.write(b"partial")
        interrupted = False
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # Python runs the handler here, at once
        except KeyboardInterrupt:
            interrupted = True
        if interrupted and not swallow:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")

    return save


@pytest.mark.parametrize("swallow", [False, True], ids=["turned into a RuntimeError", "lost"])
def test_ctrl_c_anywhere_in_the_write_is_raised_as_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swallow: bool
) -> None:
    path = checkpoint.save({"version": 1}, tmp_path / "c.pt")
    monkeypatch.setattr(torch, "save", _converting(swallow))
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save({"version": 2}, path)
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert _load(path) == {"version": 1}
    assert _temporaries(tmp_path) == []


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signals need the main thread"
)
def test_ctrl_c_during_saves_raises_keyboard_interrupt_and_keeps_a_good_file(
    tmp_path: Path,
) -> None:
    """Real SIGINTs at random moments of saves, until some landed inside torch's writer (where
    it turns them into a RuntimeError): every one is a KeyboardInterrupt, the file on disk
    always a good one, no temporary left."""
    path = checkpoint.save({"version": 0}, tmp_path / "c.pt")
    state = {f"w{i}": torch.randn(128, 256) for i in range(16)}  # 2 MiB
    rng = random.Random(0)
    in_writer = 0
    for _ in range(300):
        timer = threading.Timer(rng.uniform(0, 0.02), os.kill, (os.getpid(), signal.SIGINT))
        with pytest.raises(KeyboardInterrupt) as interrupt:
            timer.start()
            while True:
                checkpoint.save(state, path)
        timer.join()
        in_writer += isinstance(interrupt.value.__context__, RuntimeError)
        assert _temporaries(tmp_path) == []
        if in_writer >= 3:
            break
    assert in_writer >= 3, "no Ctrl-C landed inside torch's writer: the test saw nothing"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    loaded = _load(path)
    assert loaded == {"version": 0} or _identical(loaded, state)
