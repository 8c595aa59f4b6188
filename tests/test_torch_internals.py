"""The torch internals mirrored reaches: each recognised on the torch CI tests, a clear error or
the documented fallback where one is missing, and one warning on an untested torch release."""

from __future__ import annotations

import functools
import subprocess
import sys
import types
import warnings

import pytest
import torch
import torch.utils.checkpoint

from mirrored import _torch_distributed, _torch_internals


def test_the_installed_torch_is_the_tested_release_and_every_internal_is_recognised():
    assert _torch_internals.untested_torch(torch.__version__) is None
    assert _torch_internals.unrecognised_checkpoint(torch.utils.checkpoint) is None
    assert _torch_internals.unrecognised_clipping(torch.nn.utils.clip_grad) is None
    assert _torch_distributed._elastic_agent_recognised()
    assert len(_torch_internals.PRIVATE_SAMPLERS) == 2
    for accessor in ("will_engine_execute_node", "amp_unscale_and_check_", "foreach_mul_"):
        assert getattr(_torch_internals, accessor).__name__ != "missing", accessor


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.13.1+cu128", "2.13.0a0+git1234"])
def test_any_build_of_the_tested_release_is_tested(version):
    assert _torch_internals.untested_torch(version) is None


@pytest.mark.parametrize("version", ["2.12.1", "2.14.0+cpu", "3.0.0", "nightly"])
def test_another_release_is_untested_and_the_message_names_both(version):
    message = _torch_internals.untested_torch(version)
    assert message is not None
    assert f"torch {version} is installed" in message and "tested with torch 2.13.x" in message


def test_an_untested_torch_warns_once_a_process(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    monkeypatch.setattr(_torch_internals, "_warned_untested", False)
    with pytest.warns(UserWarning, match=r"tested with torch 2\.13\.x, and torch 2\.14\.0 is"):
        _torch_internals.warn_if_untested_torch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _torch_internals.warn_if_untested_torch()
    assert caught == []


# Imports mirrored in a fresh process (on the torch version given, if any) and prints the
# untested-torch warnings the import gave, with the file each points at.
_IMPORT = """
import sys, warnings
import torch
if len(sys.argv) > 1:
    torch.__version__ = sys.argv[1]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import mirrored
print([(w.filename, str(w.message)) for w in caught if "tested with torch" in str(w.message)])
"""


@pytest.mark.parametrize("version", [None, "2.14.0"], ids=["installed", "untested"])
def test_import_mirrored_warns_only_on_an_untested_torch_at_the_import(version):
    argv = [sys.executable, "-c", _IMPORT] + ([version] if version else [])
    result = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120)
    seen = eval(result.stdout.strip().splitlines()[-1])
    if version is None:
        assert seen == []
    else:
        [(filename, message)] = seen
        assert filename == "<string>"  # the user's `import mirrored`, not mirrored's code
        assert "torch 2.14.0 is installed" in message


def test_a_missing_internal_fails_where_it_is_used_naming_it_and_the_tested_release():
    present = _torch_internals.required(torch, "torch", "_foreach_mul_", "scale")
    assert present is torch._foreach_mul_
    missing = _torch_internals.required(types.SimpleNamespace(), "torch._C", "_gone", "do this")
    with pytest.raises(ImportError, match=r"no torch\._C\._gone, which mirrored uses to do this"):
        missing(1)
    with pytest.raises(ImportError, match=r"install torch==2\.13\.\*"):
        missing()


def test_an_unknown_torch_checkpoint_module_is_named():
    module = types.SimpleNamespace(**vars(torch.utils.checkpoint))
    assert _torch_internals.unrecognised_checkpoint(module) is None
    module.CheckpointFunction = type("CheckpointFunction", (torch.autograd.Function,), {})
    assert "CheckpointFunction" in _torch_internals.unrecognised_checkpoint(module)


def test_an_unrecognised_elastic_agent_leaves_the_workers_to_torch(monkeypatch):
    agent = types.SimpleNamespace(_pcontext=object())
    assert _torch_distributed.elastic_worker_processes(agent) is agent._pcontext
    monkeypatch.setattr(_torch_distributed, "_elastic_agent_recognised", lambda: False)
    assert _torch_distributed.elastic_worker_processes(agent) is None


def test_generator_arguments_are_read_from_aten_s_schemas():
    assert _torch_internals.aten_takes_generator("rand")
    assert not _torch_internals.aten_takes_generator("relu")
    assert not _torch_internals.aten_takes_generator("no_such_op")


def test_a_function_s_body_is_rebuilt_only_from_code_that_checks_for_overrides():
    body = _torch_internals.body_without_torch_function_check(torch.nn.functional.dropout)
    assert body is not None and body.__code__ is torch.nn.functional.dropout.__code__
    assert torch.equal(body(torch.ones(4), 0.5, False), torch.ones(4))
    assert _torch_internals.body_without_torch_function_check(len) is None
    assert _torch_internals.body_without_torch_function_check(lambda x: x) is None


def test_code_is_read_under_decorators_and_frames_above_the_caller():
    def function():
        return _torch_internals.caller_frame(0)

    wrapped = functools.wraps(function)(lambda: None)
    assert _torch_internals.code_of(wrapped) is function.__code__
    assert _torch_internals.code_of(None) is None
    assert function().f_code is function.__code__


def test_the_agent_s_worker_polls_are_recognised():
    assert _torch_distributed._worker_polls_recognised()


def test_a_look_runs_before_each_poll_of_the_agent_s_workers(monkeypatch):
    seen = []
    agent = types.SimpleNamespace(_pcontext=object(), _monitor_workers=lambda group: f"{group} run")
    _torch_distributed.before_each_worker_poll(agent, seen.append)
    assert agent._monitor_workers("group") == "group run"
    assert seen == [agent._pcontext]


def test_an_agent_polled_otherwise_is_left_to_torch(monkeypatch):
    poll = functools.partial(str)
    agent = types.SimpleNamespace(_pcontext=object(), _monitor_workers=poll)
    monkeypatch.setattr(_torch_distributed, "_worker_polls_recognised", lambda: False)
    _torch_distributed.before_each_worker_poll(agent, pytest.fail)
    assert agent._monitor_workers is poll


def test_the_rpc_group_s_record_is_edited_under_its_membership_token():
    store = torch.distributed.HashStore()
    with _torch_distributed.rpc_group_membership_lock(store, "forget_worker1_2"):
        held = store.get("RpcGroupManagementToken").decode()
    assert held == "Token_for_forget_worker1_2_leave"
    assert store.get("RpcGroupManagementToken") == b""


@pytest.mark.parametrize("lock", [None, lambda store, name: None], ids=["missing", "other form"])
def test_an_unrecognised_rpc_group_lock_is_named(monkeypatch, lock):
    from torch.distributed.rpc import _utils

    monkeypatch.setattr(_utils, "_group_membership_management", lock)
    with pytest.raises(ImportError, match=r"rpc\._utils\._group_membership_management.*record"):
        _torch_distributed.rpc_group_membership_lock(torch.distributed.HashStore(), "forget_x")


def test_the_rpc_agent_s_store_is_reached_or_its_absence_named(monkeypatch):
    from torch.distributed.rpc import api

    store = torch.distributed.HashStore()
    monkeypatch.setattr(api, "_get_current_rpc_agent", lambda: types.SimpleNamespace(store=store))
    assert _torch_distributed.rpc_agent_store() is store
    monkeypatch.delattr(api, "_get_current_rpc_agent")
    with pytest.raises(ImportError, match=r"rpc\.api\._get_current_rpc_agent.*RPC group's store"):
        _torch_distributed.rpc_agent_store()


def test_the_default_store_is_the_process_group_s_and_a_missing_one_is_named(monkeypatch):
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        keys = store.num_keys()
        _torch_distributed.default_store().set("probe", "1")
        assert store.num_keys() == keys + 1  # written through to the group's own store
    finally:
        torch.distributed.destroy_process_group()
    monkeypatch.delattr(torch.distributed.distributed_c10d, "_get_default_store")
    with pytest.raises(ImportError, match=r"distributed_c10d\._get_default_store, which mirrored"):
        _torch_distributed.default_store()


def test_a_queued_backward_callback_runs_once_the_backward_pass_ends():
    seen = []
    weight = torch.ones(3, requires_grad=True)

    def on_grad(grad):
        _torch_internals.queue_backward_callback(lambda: seen.append(weight.grad is not None))
        seen.append("hook")
        return grad

    weight.register_hook(on_grad)
    (weight * 2).sum().backward()
    assert seen == ["hook", True]  # after the hook, once the gradient is in place


def test_torch_s_batch_norm_layers_share_the_base_mirrored_extends():
    for layer in (torch.nn.BatchNorm1d(2), torch.nn.BatchNorm2d(2), torch.nn.SyncBatchNorm(2)):
        assert isinstance(layer, _torch_internals.BatchNormBase)
    assert not isinstance(torch.nn.LayerNorm(2), _torch_internals.BatchNormBase)
