"""Patches of torch held by the objects that need them, and removed with the last of them.

A patch is installed when its first holder acquires it and removed when its last holder releases
it, by a reference count under one lock, so that a process with no strategy (or mirrored
optimizer, or replica random stream) alive runs torch's own functions, as if mirrored had never
been imported. Removal puts back exactly what each installation replaced, where it is still
there: when another library patched the same name after us, its patch stays (removing it would
undo a patch we do not own; crashing would break a program that did nothing wrong). Our wrapper
it calls then calls torch's own: an installation removed is out of force, so that a later
installation of ours, made on top of that patch, does not route the calls twice.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Holding", "Install", "Installation", "Patch"]

# One lock for every installation and removal: a reentrant one, since a holder collected while
# the lock is held on its thread releases its patches there (``weakref.finalize`` runs then).
_lock = threading.RLock()
_ABSENT = object()  # what a class or module held under a name it did not define itself


class Installation:
    """One installation of a patch: what it replaced (to put back), and whether it is in force.
    Its wrappers route while it is, and call torch's own once it is removed."""

    def __init__(self) -> None:
        self.in_force = True
        self._replaced: list[tuple[Any, str, Any, Any]] = []

    def replace(self, owner: Any, name: str, new: Any) -> None:
        """Set ``owner.name`` to ``new``, remembering what ``owner`` itself held there (a class
        that inherits the name holds nothing, and gets nothing back). Nothing once the
        installation is removed: a class defined then, through our ``__init_subclass__`` that
        another's later patch still calls, keeps its own ``step``."""
        with _lock:
            if self.in_force:
                self._replaced.append((owner, name, vars(owner).get(name, _ABSENT), new))
                setattr(owner, name, new)

    def remove(self) -> None:
        """Put back what was replaced, newest first, where ours is still there."""
        with _lock:
            self.in_force = False
            for owner, name, original, new in reversed(self._replaced):
                if vars(owner).get(name, _ABSENT) is not new:
                    continue  # another's later patch: it stays (see the module's docstring)
                if original is _ABSENT:
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)
            self._replaced.clear()


# Installs a patch: the wrappers made and set through ``Installation.replace``.
Install = Callable[[Installation], None]


class Patch:
    """One patch of torch, installed while it has holders."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._holders = 0
        self._installation: Installation | None = None

    def acquire(self, install: Install) -> None:
        """One more holder; the first installs the patch with ``install`` (the later ones' are
        not called: every holder of a patch passes the same)."""
        with _lock:
            if self._installation is None:
                installation = Installation()
                try:
                    install(installation)
                except BaseException:
                    installation.remove()
                    raise
                self._installation = installation
            self._holders += 1

    def release(self) -> None:
        """One holder fewer; the last removes the patch."""
        with _lock:
            assert self._holders > 0, f"the {self.name} patch released more than acquired"
            self._holders -= 1
            if self._holders == 0 and self._installation is not None:
                installation, self._installation = self._installation, None
                installation.remove()


class Holding:
    """A holder's hold on ``patches`` (each with its installation): released once, by
    ``release()`` (the holder's close) or when the holder is collected, whichever comes first;
    ``on_release`` then runs before the patches are released."""

    def __init__(
        self,
        holder: object,
        patches: Sequence[tuple[Patch, Install]],
        on_release: Callable[[], None] | None = None,
    ) -> None:
        acquired: list[Patch] = []
        try:
            for patch, install in patches:
                patch.acquire(install)
                acquired.append(patch)
        except BaseException:
            _release(acquired, on_release)
            raise
        # The finalizer must not reach the holder, or the holder would never be collected.
        self._finalizer = weakref.finalize(holder, _release, acquired, on_release)

    def release(self) -> None:
        """Release the patches now (nothing the second time)."""
        self._finalizer()


def _release(patches: list[Patch], on_release: Callable[[], None] | None) -> None:
    if on_release is not None:
        on_release()
    for patch in reversed(patches):
        patch.release()
