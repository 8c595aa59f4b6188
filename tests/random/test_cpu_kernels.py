"""Our CPU dropout and attention: torch's results, with the mask drawn from a given generator."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mirrored.random.cpu_kernels import cpu_attention, cpu_dropout


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_cpu_dropout_keeps_1_minus_p_of_the_elements_and_their_mean(p):
    x = torch.full((1_000_000,), 3.0)
    y = cpu_dropout(x, p, False, False, _seeded(2))
    kept = y != 0
    assert abs(kept.double().mean().item() - (1 - p)) < 5 * (p * (1 - p) / x.numel()) ** 0.5
    assert torch.allclose(y[kept], torch.tensor(3 / (1 - p)), rtol=1e-6, atol=0)
    assert torch.equal(y, cpu_dropout(x, p, False, False, _seeded(2)))  # the stream decides
    assert not torch.equal(y, cpu_dropout(x, p, False, False, _seeded(3)))


def test_cpu_feature_dropout_drops_whole_channels_and_in_place_writes_the_input():
    x = torch.ones(64, 50, 3, 3)
    y = cpu_dropout(x, 0.5, True, True, _seeded(0))
    assert y is x
    per_channel = y.flatten(2)
    assert torch.equal(per_channel.amin(2), per_channel.amax(2))  # kept or dropped whole
    assert 0.4 < (per_channel[..., 0] != 0).float().mean().item() < 0.6


def test_cpu_dropout_s_gradient_is_its_mask():
    x = torch.randn(1000, dtype=torch.float64, requires_grad=True)
    y = cpu_dropout(x, 0.25, False, False, _seeded(5))
    y.sum().backward()
    torch.testing.assert_close(x.grad, (y / x).detach())


ATTENTION_CASES = {
    "plain": {},
    "bool mask": {"attn_mask": torch.rand(5, 6) > 0.3},
    "float mask": {"attn_mask": torch.randn(2, 3, 5, 6)},
    "a row masked out": {"attn_mask": torch.arange(6).expand(5, 6) < torch.arange(5)[:, None]},
    "causal": {"is_causal": True},
    "scale": {"scale": 0.3},
    "grouped query": {"enable_gqa": True, "kv_heads": 1},
}


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_cpu_attention_is_the_math_path_with_the_replica_s_dropout_mask(case):
    options = dict(ATTENTION_CASES[case])
    kv_heads = options.pop("kv_heads", 3)
    generator = _seeded(4)
    q = torch.randn(2, 3, 5, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, 6, 8, generator=generator, dtype=torch.float64) for _ in "kv")
    mask = options.pop("attn_mask", None)
    args = (mask, 0.4, options.get("is_causal", False), options.get("scale"))
    got = cpu_attention(q, k, v, *args, options.get("enable_gqa", False), _seeded(1))
    # The same mask drawn by hand on the weights torch computes without dropout (values = I).
    eye = torch.eye(6, dtype=torch.float64).expand(2, kv_heads, 6, 6)
    weights = F.scaled_dot_product_attention(q, k, eye, mask, **options)
    if options.get("enable_gqa"):
        v = v.repeat_interleave(3, -3)
    torch.testing.assert_close(got, cpu_dropout(weights, 0.4, False, False, _seeded(1)) @ v)
