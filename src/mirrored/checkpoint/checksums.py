"""Checksums of checkpoint files: written by ``save``, checked by ``load`` before it returns.

``torch.save`` writes a zip archive: each tensor storage is one member (``data/N``, its bytes)
and ``data.pkl`` holds the rest (keys, numbers, strings, and each tensor's dtype, shape, stride
and storage). ``add_checksums`` appends one member, ``.data/mirrored_checksums.json``, listing
the CRC32 of every member, and marks the archive's comment. The CRC32s are those torch's writer
computed as it wrote, so a save costs no extra pass; the object ``torch.load`` returns is
unchanged (a ``save_weights`` file stays a plain state dict), the archive only holds one member
more. TensorFlow checks a CRC32C per tensor the same way; a CRC32 catches every
single flipped bit and every burst up to 32 bits. torch's reader checks none of this: a flipped
bit in a tensor loads silently.

``check_archive`` checks everything but the tensor storages before ``torch.load`` reads the
file: the comment and the list, the member names, each member's header (uncompressed, not a
folder), and the bytes of data.pkl and the other small members, so that torch decodes a
structure that is known good. ``Checked.check_storages`` then checks each storage's bytes in
the tensors ``torch.load`` returned, where they are on the CPU, and from the file otherwise or
where they differ (torch swaps the bytes of a file of the other byte order): verifying the file
first would read it twice, twice the time of a load from disk (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import io
import json
import mmap
import os
import pickle
import struct
import zipfile
import zlib
from collections import OrderedDict, defaultdict
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import torch

__all__ = ["Checked", "add_checksums", "check_archive", "unreadable"]

LISTING = ".data/mirrored_checksums.json"  # the member add_checksums adds, in the archive folder
_FORMAT = 1  # of that member: {"format": 1, "crc32": {member name: CRC32}}
# The archive comment: with the member, two marks, so that no single flipped bit makes a checked
# file pass for one written before checksums.
_MARKER = b"mirrored checksums: " + LISTING.encode()
_LOCAL_HEADER = struct.Struct("<26xHH")  # a member's local header: its name and extra lengths
_DIRECTORY = 0x10  # the MS-DOS attribute of a member that is a folder
_STRUCTURE = "data.pkl"


def add_checksums(file: IO[bytes]) -> None:
    """Append the list of every member's CRC32 to the archive ``torch.save`` just wrote into
    ``file`` (open for reading and writing), and mark its comment. A CRC32 torch's writer left
    0 (``torch.serialization.set_crc32_options(False)``) is computed here from the bytes."""
    file.seek(0)
    with zipfile.ZipFile(file) as archive:
        members = archive.infolist()
    prefix = members[0].filename.partition("/")[0] + "/"
    unknown = {m.filename: _data_span(file, m) for m in members if m.file_size and not m.CRC}
    computed = _file_crc32s(file, {name: span for name, span in unknown.items() if span})
    listing = {m.filename.removeprefix(prefix): computed.get(m.filename, m.CRC) for m in members}
    with zipfile.ZipFile(file, "a") as archive:
        entry = json.dumps({"format": _FORMAT, "crc32": listing}, separators=(",", ":"))
        archive.writestr(zipfile.ZipInfo(prefix + LISTING), entry)
        archive.comment = _MARKER


def unreadable(source: Path, error: BaseException) -> ValueError:
    """The error for a file that is no checkpoint at all, or that torch cannot decode."""
    return ValueError(
        f"{str(source)!r} is not a readable checkpoint (truncated, corrupt, not written by "
        "checkpoint.save or torch.save, or it holds objects other than tensors, numbers, "
        f"strings, lists and dicts): {type(error).__name__}: {error}"
    )


def _corrupt(source: Path, what: str) -> ValueError:
    return ValueError(
        f"checkpoint {str(source)!r} is corrupt: {what}. It changed after it was written (a "
        "disk, copy or transfer error, or another program); load an earlier checkpoint or backup"
    )


class Checked:
    """A checkpoint whose structure matched its checksums; its tensor storages are checked
    against what ``torch.load`` made of them (``check_storages``)."""

    def __init__(
        self,
        file: IO[bytes],
        source: Path,
        expected: Mapping[str, int],
        storages: Mapping[str, zipfile.ZipInfo],
        structure: Any,
    ) -> None:
        self._file, self._source, self._expected = file, source, expected
        self._storages, self._structure = storages, structure

    def check_storages(self, loaded: Any) -> None:
        """Compare each storage's CRC32 with the list: in memory where ``loaded`` holds it on
        the CPU, from the file otherwise, and from the file again where memory differs (the
        file decides: only a damaged file is refused)."""
        in_memory = {
            name: _bytes_of(tensor.untyped_storage())
            for name, tensor in self._tensors_by_storage(loaded).items()
            if name in self._storages
        }
        crcs = _crc32s(in_memory)
        spans = {
            name: _data_span(self._file, info)
            for name, info in self._storages.items()
            if crcs.get(name) != self._expected[name]
        }
        damaged = {name: "damaged zip header" for name, span in spans.items() if span is None}
        crcs = _file_crc32s(self._file, {name: span for name, span in spans.items() if span})
        damaged |= {n: "checksum mismatch" for n, crc in crcs.items() if crc != self._expected[n]}
        if damaged:
            raise _corrupt(self._source, _describe(damaged, _entries(self._structure)))

    def _tensors_by_storage(self, loaded: Any) -> dict[str, torch.Tensor]:
        """A CPU tensor of ``loaded`` on each storage member it holds, found by the entry that
        holds that storage in data.pkl."""
        tensors = dict(_leaves(loaded, ()))
        found: dict[str, torch.Tensor] = {}
        for path, storage in _leaves(self._structure, ()):
            tensor = tensors.get(path)
            if (
                isinstance(storage, _Storage)
                and isinstance(tensor, torch.Tensor)
                and tensor.device.type == "cpu"
                and tensor.layout == torch.strided
            ):
                found.setdefault(f"data/{storage.key}", tensor)
        return found


def check_archive(file: IO[bytes], source: Path) -> Checked | None:
    """Check all but the tensor storages of the checkpoint in ``file``; None when it carries
    no checksums (written before them, or by ``torch.save``). Anything that does not match is
    a ``ValueError`` naming the file and, where known, the entries."""
    try:
        archive = zipfile.ZipFile(file)
    except Exception as error:  # BadZipFile, or what a damaged directory makes zipfile raise
        raise unreadable(source, error) from error
    with archive:
        names = archive.namelist()
        if not any(name.endswith(f"/{_STRUCTURE}") for name in names):
            raise unreadable(source, ValueError(f"a zip archive without {_STRUCTURE}"))
        listing_name = next((n for n in names if n.endswith(f"/{LISTING}")), "")
        if not listing_name and archive.comment != _MARKER:
            return None
        if not listing_name or archive.comment != _MARKER:
            raise _corrupt(source, f"its {'end' if listing_name else LISTING} is damaged")
        prefix = listing_name.removesuffix(LISTING)
        expected = _listing(archive, listing_name, source)
        members = {
            info.filename.removeprefix(prefix): info
            for info in archive.infolist()
            if info.filename != listing_name
        }
        if members.keys() != expected.keys():
            missing, unexpected = expected.keys() - members, members.keys() - expected
            raise _corrupt(
                source, f"members missing {sorted(missing)}, unexpected {sorted(unexpected)}"
            )
        # Read no storage's header yet: reads spread over the file slow torch's read of it.
        storages = {name: info for name, info in members.items() if name.startswith("data/")}
        damaged = {n: "damaged zip header" for n, info in members.items() if not _as_is(info)}
        spans = {
            name: _data_span(file, info)
            for name, info in members.items()
            if name not in storages and name not in damaged
        }
        damaged |= {name: "damaged zip header" for name, span in spans.items() if span is None}
        located = {name: span for name, span in spans.items() if span}
        crcs = _file_crc32s(file, located)  # data.pkl, the version, the byte order...
        damaged |= {n: "checksum mismatch" for n, crc in crcs.items() if crc != expected[n]}
        if damaged:
            raise _corrupt(source, _describe(damaged, {}))
        structure = _structure(file, located[_STRUCTURE]) if _STRUCTURE in located else None
    return Checked(file, source, expected, storages, structure)


def _listing(archive: zipfile.ZipFile, name: str, source: Path) -> dict[str, int]:
    """The CRC32 of each member, by its name in the archive's folder, as listed."""
    try:
        listing = json.loads(archive.read(name))  # zipfile checks this member's own CRC32
        written_format = listing["format"]
        crcs = {member: int(crc) for member, crc in listing["crc32"].items()}
    except Exception as error:
        raise _corrupt(source, f"its list of checksums ({LISTING}) is damaged") from error
    if written_format != _FORMAT:
        raise ValueError(
            f"checkpoint {str(source)!r} lists its checksums in format {written_format!r}, which "
            f"this mirrored does not read (it reads {_FORMAT}): written by a newer mirrored? "
            "Upgrade mirrored to load it"
        )
    return crcs


def _as_is(info: zipfile.ZipInfo) -> bool:
    """Whether torch's reader takes the member's bytes as they are: stored uncompressed, and no
    folder (into which it would read nothing, leaving the tensor's memory as it found it)."""
    return info.compress_type == zipfile.ZIP_STORED and not info.external_attr & _DIRECTORY


def _data_span(file: IO[bytes], info: zipfile.ZipInfo) -> tuple[int, int] | None:
    """Where a member's bytes lie in the file (start, length); None past its end."""
    file.seek(info.header_offset)
    header = file.read(_LOCAL_HEADER.size)
    if len(header) < _LOCAL_HEADER.size:
        return None
    name_length, extra_length = _LOCAL_HEADER.unpack(header)
    return info.header_offset + _LOCAL_HEADER.size + name_length + extra_length, info.file_size


def _crc32s(buffers: Mapping[str, Any]) -> dict[str, int]:
    """The CRC32 of each buffer, on a thread per core (zlib releases the GIL): about 20 ms for
    a 200 MB state dict on 2 cores (benchmarks/RESULTS.md)."""
    if not buffers:
        return {}
    workers = min(len(buffers), os.cpu_count() or 1)
    with ThreadPoolExecutor(workers, thread_name_prefix="mirrored-crc32") as pool:
        return dict(zip(buffers, pool.map(zlib.crc32, buffers.values()), strict=True))


def _file_crc32s(file: IO[bytes], spans: Mapping[str, tuple[int, int]]) -> dict[str, int]:
    """The CRC32 of each span of the file, read through a memory map (no copy)."""
    if not spans:
        return {}
    with (
        mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped,
        memoryview(mapped) as view,
    ):
        parts = {name: view[start : start + size] for name, (start, size) in spans.items()}
        try:
            return _crc32s(parts)
        finally:
            for part in parts.values():
                part.release()


def _bytes_of(storage: torch.UntypedStorage) -> Any:
    """The bytes of a CPU storage, as a buffer zlib reads without a copy."""
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy()


def _describe(damaged: Mapping[str, str], entries: Mapping[str, list[str]]) -> str:
    """What is damaged, in the words of the saved object: the entries a storage holds."""
    names = {_STRUCTURE: "the structure (data.pkl: keys, numbers, strings, dtypes, shapes)"}
    return "; ".join(
        f"{names.get(member) or ', '.join(entries.get(member, [])) or member}: {why}"
        for member, why in damaged.items()
    )


class _Storage:
    """A tensor's storage in data.pkl, by the key of its member (``data/<key>``)."""

    def __init__(self, key: str) -> None:
        self.key = key


class _StandIn:
    """Every global data.pkl names, in place of the real one: nothing is imported or run. A call
    given a storage (a tensor rebuilt from it) returns that storage, anything else a
    placeholder that takes whatever the pickle does with it."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        for arg in args:
            for value in arg if isinstance(arg, tuple) else (arg,):
                if isinstance(value, _Storage):
                    return value
        return super().__new__(cls)

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _StructureReader(pickle.Unpickler):
    """Reads data.pkl as dicts, lists and tuples whose tensors are their storages."""

    def find_class(self, module: str, name: str) -> Any:
        return OrderedDict if (module, name) == ("collections", "OrderedDict") else _StandIn

    def persistent_load(self, pid: Any) -> _Storage:
        return _Storage(str(pid[2]))  # ("storage", storage type, key, location, numel)


def _read(file: IO[bytes], span: tuple[int, int]) -> bytes:
    file.seek(span[0])
    return file.read(span[1])


def _structure(file: IO[bytes], span: tuple[int, int]) -> Any:
    """The object an intact data.pkl describes, each tensor its ``_Storage``; None for a pickle
    this reader does not follow (the storages are then checked from the file, and named by
    member; torch refuses what is not a checkpoint)."""
    try:
        return _StructureReader(io.BytesIO(_read(file, span))).load()
    except Exception:
        return None


def _entries(structure: Any) -> dict[str, list[str]]:
    """Each storage member (``data/0``) with the entries whose tensors it holds
    (``optimizer.state.0.exp_avg``)."""
    entries: dict[str, list[str]] = defaultdict(list)
    for path, storage in _leaves(structure, ()):
        if isinstance(storage, _Storage):
            entries[f"data/{storage.key}"].append(".".join(map(str, path)) or "the checkpoint")
    return entries


def _leaves(value: Any, path: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every value below the dicts, lists and tuples of ``value``, with its path of keys."""
    if isinstance(value, (dict, list, tuple)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            yield from _leaves(item, (*path, key))
    else:
        yield path, value
