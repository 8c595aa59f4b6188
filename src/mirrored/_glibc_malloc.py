"""glibc's malloc told to keep freed memory for reuse, and told back.

glibc gives every large allocation (above its mmap threshold, which grows to 32 MiB at most)
pages of its own from the system and hands them back when the block is freed, and it returns
the heap's free top above its trim threshold. A training step on the CPU allocates the same large
activations and gradients every step, so each step faults all of them in again, page by page,
and the kernel zeroes every page. With no mmap per allocation and no trimming, freed blocks stay
in the heap and the next step's tensors reuse them, as a caching allocator reuses device memory.
No new arena either: a thread's own arena grows in heaps of at most 64 MiB and maps any larger
block apart, which replica threads' logits and gradients often are. A thread that allocates for
the first time from then on shares the arenas that exist, the main heap first (glibc hands them
out in turn); one that already has its own arena keeps it.

The arena limit is glibc's for good once a thread has used it: turning reuse off brings the
thresholds back, not per-thread arenas. A process whose malloc was configured by hand
(``MALLOC_*_`` variables, ``GLIBC_TUNABLES``) and other C libraries (musl, macOS) are left as
they are.
"""

from __future__ import annotations

import ctypes
import os
import platform
from typing import Any

__all__ = ["keep_freed_memory", "restore_adaptive_thresholds"]

# mallopt(3) parameters; -1 as the trim threshold turns trimming off.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_KEEP = {_M_MMAP_MAX: 0, _M_TRIM_THRESHOLD: -1, _M_ARENA_MAX: 1}
# Once set, glibc's thresholds no longer adapt; these are the values where its adaptive ones
# settle for large blocks (mmap threshold 32 MiB, trim threshold twice that).
_SETTLED = {_M_MMAP_MAX: 65536, _M_MMAP_THRESHOLD: 32 << 20, _M_TRIM_THRESHOLD: 64 << 20}
_USER_SETTINGS = (
    "MALLOC_ARENA_MAX",
    "MALLOC_MMAP_MAX_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_TRIM_THRESHOLD_",
)


def _glibc() -> Any | None:
    """The process's C library when it is glibc and nobody configured its malloc, else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    if any(name in os.environ for name in _USER_SETTINGS):
        return None
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return None
    libc = ctypes.CDLL(None)  # the symbols the process already has
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def _mallopt(libc: Any, settings: dict[int, int]) -> None:
    for parameter, value in settings.items():
        if libc.mallopt(parameter, value) != 1:
            raise OSError(f"glibc refused mallopt({parameter}, {value})")


def keep_freed_memory() -> bool:
    """Keep freed memory in malloc's heap from now on; False where this module leaves malloc as
    it is (not glibc, or configured by hand)."""
    libc = _glibc()
    if libc is None:
        return False
    _mallopt(libc, _KEEP)
    return True


def restore_adaptive_thresholds() -> None:
    """Map large blocks apart and trim the heap again, at the thresholds glibc's adaptive ones
    settle at (they no longer adapt), and give the heap's free memory back to the system."""
    libc = _glibc()
    if libc is not None:
        _mallopt(libc, _SETTLED)
        libc.malloc_trim(0)
