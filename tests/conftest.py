"""Test setup: four logical CPU devices for the whole session, and hygiene checks.

Every test must leave no replica thread, no process group and no changed environment variable
behind (Lightning Fabric's conftest does the same).
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator

import pytest
import torch

from mirrored import config
from tests.exactness import float64  # noqa: F401  (a fixture for every test module)

NUM_LOGICAL_CPUS = 4

config.set_logical_device_configuration(
    config.list_physical_devices("CPU")[0],
    [config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS,
)


# Set by pytest itself, by torch the first time it imports its compiler stack, and by
# scikit-learn's import (the examples' data).
_IGNORED_ENV = {
    "PYTEST_CURRENT_TEST",
    "TORCHINDUCTOR_CACHE_DIR",
    "KMP_DUPLICATE_LIB_OK",
    "KMP_INIT_AT_FORK",
}


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _IGNORED_ENV}


def _replica_threads() -> list[threading.Thread]:
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith(("mirrored-replica-", "mirrored-stage-"))
    ]


@pytest.fixture(autouse=True)
def hygiene() -> Iterator[None]:
    environ = _environ()
    threads = torch.get_num_threads()
    yield
    if _replica_threads():  # a strategy not closed: collecting it ends its threads
        gc.collect()  # (only then: a full collection costs ~0.4 s once torch._dynamo is loaded)
    for thread in _replica_threads():
        thread.join(timeout=5)
    leaked = _replica_threads()
    assert not leaked, f"replica threads left running: {[t.name for t in leaked]}"
    assert _environ() == environ, "the test changed environment variables"
    assert torch.get_num_threads() == threads, "the test changed the main thread's thread count"
    if torch.distributed.is_available():
        assert not torch.distributed.is_initialized(), "the test left a process group"


@pytest.fixture
def fresh_config() -> Iterator[None]:
    """Forget the session's device configuration for one test, then restore it."""
    config._reset_for_tests()
    yield
    config._reset_for_tests()
    _forget_gpu_memory()
    config.set_logical_device_configuration(
        config.list_physical_devices("CPU")[0],
        [config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS,
    )


def _forget_gpu_memory() -> None:
    """What a test's logical GPUs leave in the process, gone before the next test splits the GPU
    afresh: the memory cap of their limits, and the memory the test's objects and streams held
    (cuBLAS keeps a workspace per stream until told to drop them), which counts against the next
    test's cap."""
    if not torch.cuda.is_initialized():
        return
    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    for index in range(torch.cuda.device_count()):
        torch.cuda.set_per_process_memory_fraction(1.0, index)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
