"""Freed host memory kept for reuse once a strategy computes on the CPU
(``mirrored.config.set_host_memory_reuse``).

Each check runs in a fresh interpreter: the policy belongs to the process, and this test
process has had strategies (and so the policy) long before these tests run.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

import mirrored
from mirrored import _glibc_malloc, config

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the policy is glibc's malloc's; other C libraries keep their own",
)

# Where a 64 MiB tensor's memory comes from and where it goes (malloc's own counts, the same on
# every CPU and page size): the MiB malloc mapped apart for single blocks while the tensor
# lives (glibc's policy maps a block this large afresh: at least 64), and the MiB free in its
# heap once the tensor is freed (kept for reuse: at least 64; given back: less).
_PROBE = """
import ctypes, resource, threading, torch, mirrored

FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
          "fordblks", "keepcost")
libc = ctypes.CDLL(None)
if hasattr(libc, "mallinfo2"):  # glibc 2.33 and later
    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]
    mallinfo = libc.mallinfo2
else:
    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_int) for name in FIELDS]
    mallinfo = libc.mallinfo
mallinfo.restype = Info

def served(mib=64):
    before = mallinfo().hblkhd
    tensor = torch.ones(mib << 18)
    mapped = (mallinfo().hblkhd - before) >> 20
    del tensor
    print(mapped, mallinfo().fordblks >> 20)

def served_on_a_thread():
    thread = threading.Thread(target=served)
    thread.start()
    thread.join()

def resident_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() >> 20

def strategy():
    with mirrored.MirroredStrategy(["cpu:0"]):
        pass
"""


def _mapped_then_kept(pair: list[int], kept: bool) -> bool:
    mapped, free_after = pair
    return mapped < 64 <= free_after if kept else free_after < 64 <= mapped


def _run(program: str, **environment: str) -> list[int]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE + textwrap.dedent(program)],
        env={**os.environ, **environment},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [int(word) for word in done.stdout.split()]


@glibc_only
def test_a_cpu_strategy_keeps_freed_memory_and_turning_it_off_gives_it_back():
    values = _run(
        """
        served()
        strategy()
        served()
        blocks = [torch.ones(16 << 20) for _ in range(4)]  # 256 MiB, freed into the heap
        del blocks
        print(resident_mib())
        mirrored.config.set_host_memory_reuse(False)
        print(resident_mib())
        """
    )
    assert _mapped_then_kept(values[0:2], kept=False), values
    assert _mapped_then_kept(values[2:4], kept=True), values
    held, given_back = values[4:6]
    assert held - given_back > 200


@glibc_only
def test_turned_off_large_blocks_are_mapped_apart_at_glibc_s_settled_threshold():
    """Before any large block (glibc serves one from a free block its heap already has)."""
    mapped_64, _, mapped_16, _ = _run(
        """
        strategy()
        mirrored.config.set_host_memory_reuse(False)
        served()
        served(16)
        """
    )
    assert mapped_64 >= 64
    assert mapped_16 == 0, "16 MiB is under the 32 MiB threshold glibc's adaptive one settles at"


@glibc_only
def test_turned_off_before_a_strategy_it_is_applied_once_turned_on():
    served = _run(
        """
        mirrored.config.set_host_memory_reuse(False)
        strategy()
        served()
        mirrored.config.set_host_memory_reuse(True)  # a CPU device is in use: at once
        served()
        """
    )
    assert _mapped_then_kept(served[0:2], kept=False), served
    assert _mapped_then_kept(served[2:4], kept=True), served


@glibc_only
def test_threads_share_the_main_heap_which_keeps_blocks_of_any_size():
    served = _run(
        """
        strategy()
        served_on_a_thread()
        """
    )
    assert _mapped_then_kept(served, kept=True), served


@glibc_only
def test_malloc_configured_by_hand_is_left_as_it_is():
    served = _run(
        """
        strategy()
        served()
        """,
        MALLOC_ARENA_MAX="4",
    )
    assert _mapped_then_kept(served, kept=False), served


def test_gpu_devices_leave_malloc_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(config, "_host_memory_kept", False)
    monkeypatch.setattr(_glibc_malloc, "keep_freed_memory", lambda: calls.append(1) or True)
    gpu = config.PhysicalDevice("/physical_device:GPU:0", "GPU", 0)
    config.mark_in_use([config.LogicalDevice("/device:GPU:0", "GPU", 0, gpu, 0)])
    assert calls == []
    config.mark_in_use(config.list_logical_devices("CPU")[:1])
    assert calls == [1]


def test_a_c_library_that_refuses_is_a_warning_not_an_error(monkeypatch):
    def refuse() -> bool:
        raise OSError("glibc refused mallopt(-4, 0)")

    monkeypatch.setattr(config, "_host_memory_kept", False)
    monkeypatch.setattr(_glibc_malloc, "keep_freed_memory", refuse)
    refused = r"not kept for reuse \(glibc refused mallopt"
    with pytest.warns(RuntimeWarning, match=refused), mirrored.MirroredStrategy(["cpu:0"]):
        pass


def test_the_setting_is_a_bool():
    assert mirrored.config.get_host_memory_reuse() is True
    with pytest.raises(TypeError, match="enabled='no': expected True or False"):
        mirrored.config.set_host_memory_reuse("no")  # type: ignore[arg-type]
    assert mirrored.config.get_host_memory_reuse() is True
