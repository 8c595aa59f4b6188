"""The torch internals mirrored reaches: each recognised on the torch CI tests, and a clear error or
the documented fallback where one is missing."""

from __future__ import annotations

import functools
import types

import pytest
import torch
import torch.utils.checkpoint

from mirrored import _torch_internals


def test_every_internal_is_recognised_on_the_installed_torch():
    assert _torch_internals.unrecognised_checkpoint(torch.utils.checkpoint) is None
    assert _torch_internals.unrecognised_clipping(torch.nn.utils.clip_grad) is None
    assert _torch_internals._elastic_agent_recognised()
    assert len(_torch_internals.PRIVATE_SAMPLERS) == 2
    for accessor in ("will_engine_execute_node", "amp_unscale_and_check_", "foreach_mul_"):
        assert getattr(_torch_internals, accessor).__name__ != "missing", accessor


def test_a_missing_internal_fails_where_it_is_used_naming_it_and_the_tested_release():
    present = _torch_internals._required(torch, "torch", "_foreach_mul_", "scale")
    assert present is torch._foreach_mul_
    missing = _torch_internals._required(types.SimpleNamespace(), "torch._C", "_gone", "do this")
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
    assert _torch_internals.elastic_worker_processes(agent) is agent._pcontext
    monkeypatch.setattr(_torch_internals, "_elastic_agent_recognised", lambda: False)
    assert _torch_internals.elastic_worker_processes(agent) is None


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
