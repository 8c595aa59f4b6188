"""glibc's malloc told to keep freed memory for reuse, and told back.

glibc gives every large allocation (above its mmap threshold, which grows to 32 MiB at most)
pages of its own from the system and hands them back when the block is freed, and it returns
the heap's free top above its trim threshold. A training step on the CPU allocates the same large
activations and gradients every step, so each step faults all of them in again, page by page,
and the kernel zeroes every page. With no mmap per allocation and no trimming, freed blocks stay
in the heap and the next step's tensors reuse them, as a caching allocator reuses device memory.
Other C libraries (musl, macOS) are left as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from typing import Any

__all__ = ["keep_freed_memory", "restore_default_policy"]

# mallopt(3) parameters; -1 as the trim threshold turns trimming off.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_KEEP = {_M_MMAP_MAX: 0, _M_TRIM_THRESHOLD: -1}
# glibc's initial values (setting them again fixes the thresholds where glibc would let them grow).
_DEFAULTS = {_M_MMAP_MAX: 65536, _M_MMAP_THRESHOLD: 128 * 1024, _M_TRIM_THRESHOLD: 128 * 1024}


def _glibc() -> Any | None:
    """The C library when it is glibc, else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def _mallopt(libc: Any, settings: dict[int, int]) -> None:
    for parameter, value in settings.items():
        if libc.mallopt(parameter, value) != 1:
            raise OSError(f"glibc refused mallopt({parameter}, {value})")


def keep_freed_memory() -> bool:
    """Keep freed memory in malloc's heap from now on; False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    _mallopt(libc, _KEEP)
    return True


def restore_default_policy() -> None:
    """glibc's own thresholds again, and the heap's free memory given back to the system."""
    libc = _glibc()
    if libc is not None:
        _mallopt(libc, _DEFAULTS)
        libc.malloc_trim(0)
