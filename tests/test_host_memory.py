"""Freed host memory kept for reuse once a strategy computes on the CPU
(``mirrored.config.set_host_memory_reuse``).

Each check runs in a fresh interpreter: the policy belongs to the process, and this test
process has had strategies (and so the policy) long before these tests run.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

import mirrored

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the policy is glibc's malloc's; other C libraries keep their own",
)

# Page faults of allocating, filling and freeing a 64 MiB tensor 4 times, after 12 times to warm
# up (glibc can take 8 rounds to settle on a block it reuses: torch's aligned allocations leave
# small pieces in its per-thread cache): 4 x 16384 (64 MiB of 4 KiB pages) when malloc gives the
# memory back to the system each time, near 0 when it keeps a block.
_PROBE = """
import resource, torch, mirrored

def faults():
    for _ in range(12):
        torch.ones(16 << 20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        torch.ones(16 << 20)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

def resident_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() >> 20

def strategy():
    with mirrored.MirroredStrategy(["cpu:0"]):
        pass
"""


def _run(program: str) -> list[int]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE + textwrap.dedent(program)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [int(word) for word in done.stdout.split()]


@glibc_only
def test_a_cpu_strategy_keeps_freed_memory_and_turning_it_off_gives_it_back():
    before, kept, held, given_back = _run(
        """
        print(faults())
        strategy()
        print(faults())
        blocks = [torch.ones(16 << 20) for _ in range(4)]  # 256 MiB, freed into the heap
        del blocks
        print(resident_mib())
        mirrored.config.set_host_memory_reuse(False)
        print(resident_mib())
        """
    )
    assert before > 4 * 12000, "glibc's own policy maps a 64 MiB block afresh each time"
    assert kept < 1000
    assert held - given_back > 200


@glibc_only
def test_turned_off_before_a_strategy_it_is_not_applied_until_turned_on():
    off, on = _run(
        """
        mirrored.config.set_host_memory_reuse(False)
        strategy()
        print(faults())
        mirrored.config.set_host_memory_reuse(True)
        strategy()
        print(faults())
        """
    )
    assert off > 4 * 12000
    assert on < 1000


def test_the_setting_is_a_bool():
    assert mirrored.config.get_host_memory_reuse() is True
    with pytest.raises(TypeError, match="enabled='no': expected True or False"):
        mirrored.config.set_host_memory_reuse("no")  # type: ignore[arg-type]
    assert mirrored.config.get_host_memory_reuse() is True
