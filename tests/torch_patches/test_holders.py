"""A patch is installed with its first holder and removed with its last, by release or
collection; what it replaced comes back exactly, and a later patch of another's stays."""

from __future__ import annotations

import gc
import sys
import threading
import types

import pytest

from mirrored.torch_patches.holders import Holding, Installation, Patch


def torch_s(value: int) -> int:
    return value


class Holder:
    """Something that needs a patch while it lives."""


def _doubling(target: types.SimpleNamespace, calls: list[int]):
    """An install that wraps ``target.f`` to count its calls and double its results, while its
    installation is in force."""

    def install(installation: Installation) -> None:
        own = target.f

        def doubled(value: int) -> int:
            if not installation.in_force:
                return own(value)
            calls.append(value)
            return 2 * own(value)

        installation.replace(target, "f", doubled)

    return install


def test_a_patch_is_removed_with_its_last_holder_released_or_collected():
    target, calls = types.SimpleNamespace(f=torch_s), []
    patch = Patch("doubling")
    first, second = Holder(), Holder()
    holdings = [Holding(h, [(patch, _doubling(target, calls))]) for h in (first, second)]
    assert target.f(3) == 6 and calls == [3]  # installed once: one wrapper for two holders
    holdings[0].release()
    holdings[0].release()  # once only: the second holder still holds it
    assert target.f(4) == 8
    del second
    gc.collect()
    assert target.f is torch_s


def test_an_attribute_the_owner_only_inherited_comes_back_inherited():
    class Base:
        def f(self) -> str:
            return "base"

    class Sub(Base):
        pass

    patch, holder = Patch("inherited"), Holder()
    holding = Holding(holder, [(patch, lambda i: i.replace(Sub, "f", lambda self: "patched"))])
    assert Sub().f() == "patched"
    holding.release()
    assert "f" not in vars(Sub) and Sub().f() == "base"


def test_a_later_patch_of_another_library_stays_and_ours_under_it_calls_torch_s_own():
    target, calls = types.SimpleNamespace(f=torch_s), []
    patch, holder = Patch("doubling"), Holder()
    holding = Holding(holder, [(patch, _doubling(target, calls))])
    ours = target.f
    assert ours is not torch_s

    def theirs(value: int) -> int:
        return ours(value) + 1

    target.f = theirs
    holding.release()
    assert target.f is theirs  # not ours to remove
    assert target.f(5) == 6 and calls == []  # ours, out of force, calls torch's own
    holding = Holding(holder, [(patch, _doubling(target, calls))])  # installed over theirs
    assert target.f(5) == 12 and calls == [5]  # doubled once, not twice
    holding.release()
    assert target.f is theirs


def test_a_failed_install_leaves_nothing_behind():
    target = types.SimpleNamespace(f=torch_s, g=torch_s)
    patch = Patch("failing")

    def install(installation: Installation) -> None:
        installation.replace(target, "f", abs)
        raise RuntimeError("torch changed")

    with pytest.raises(RuntimeError, match="torch changed"):
        Holding(Holder(), [(patch, install)])
    assert target.f is torch_s
    holder = Holder()
    holding = Holding(holder, [(patch, _doubling(target, []))])
    assert target.f(1) == 2
    holding.release()
    assert target.f is torch_s  # no holder was counted for the failed install


def test_holders_taken_and_released_on_many_threads_leave_torch_s_own():
    target, calls = types.SimpleNamespace(f=torch_s), []
    patch = Patch("doubling")
    start = threading.Barrier(8)
    failures: list[BaseException] = []

    def hold_and_release() -> None:
        start.wait()
        try:
            for _ in range(2000):
                holder = Holder()
                Holding(holder, [(patch, _doubling(target, calls))]).release()
        except BaseException as error:
            failures.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch inside an installation, as they may
    try:
        threads = [threading.Thread(target=hold_and_release) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert failures == [] and target.f is torch_s
