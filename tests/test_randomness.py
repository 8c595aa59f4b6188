"""Per-replica random streams: different across replicas, reproducible from the seed."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

import mirrored
from mirrored import randomness
from mirrored.randomness import _cpu_attention, _cpu_dropout, _global_rng_lock
from tests.reference_loops import make_batches


def _dropout_masks(strategy):
    return strategy.experimental_local_results(
        strategy.run(lambda: F.dropout(torch.ones(64), p=0.5, training=True))
    )


def test_dropout_differs_across_replicas_and_repeats_with_the_seed():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]) as strategy:
        torch.manual_seed(7)
        first = _dropout_masks(strategy)
        second = _dropout_masks(strategy)
        torch.manual_seed(7)
        again = _dropout_masks(strategy)
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])
    assert not torch.equal(first[0], second[0])  # the stream advances
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_a_step_without_random_ops_leaves_the_callers_random_stream_alone():
    torch.manual_seed(3)
    expected = torch.rand(4)
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        torch.manual_seed(3)
        strategy.run(lambda: torch.ones(3) * 2)
        assert torch.equal(torch.rand(4), expected)


RANDOM_OPS = {
    "rand": lambda: torch.rand(8),
    "randn": lambda: torch.randn(8),
    "uniform_": lambda: torch.empty(8).uniform_(),
    "normal_": lambda: torch.empty(8).normal_(),
    "randint": lambda: torch.randint(0, 10**6, (8,)).float(),
    "randperm": lambda: torch.randperm(64).float(),
    "bernoulli": lambda: torch.bernoulli(torch.full((64,), 0.5)),
    "multinomial": lambda: torch.multinomial(torch.ones(64), 8).float(),
    "dropout": lambda: F.dropout(torch.ones(64), 0.5, True),
    "module_dropout": lambda: nn.Dropout(0.5)(torch.ones(64)),
    "gamma": lambda: torch.distributions.Gamma(torch.ones(8), torch.ones(8)).sample(),
    "dirichlet": lambda: torch.distributions.Dirichlet(torch.ones(8)).sample(),
    "binomial": lambda: torch.distributions.Binomial(100, torch.full((8,), 0.5)).sample(),
    "sdpa_dropout": lambda: F.scaled_dot_product_attention(
        torch.ones(1, 4, 4), torch.ones(1, 4, 4), torch.ones(1, 4, 4), dropout_p=0.5
    ),
    "sdpa_dropout_causal": lambda: F.scaled_dot_product_attention(
        torch.ones(1, 4, 4), torch.ones(1, 4, 4), torch.ones(1, 4, 4), None, 0.5, is_causal=True
    ),
    "sdpa_dropout_half": lambda: F.scaled_dot_product_attention(  # swapped in, under the lock
        *[torch.ones(1, 4, 4, dtype=torch.bfloat16)] * 3, dropout_p=0.5
    ).float(),
    # torch's Python functions around random ops: the ops inside reach the replica's stream.
    "dropout2d": lambda: F.dropout2d(torch.ones(2, 64, 1, 1), 0.5, True),
    "alpha_dropout": lambda: F.alpha_dropout(torch.ones(64), 0.5, True),
    "rrelu": lambda: F.rrelu(-torch.ones(64), training=True),
    "gumbel_softmax": lambda: F.gumbel_softmax(torch.zeros(64)),
    "fractional_max_pool": lambda: F.fractional_max_pool2d(IMAGE, 2, output_size=9),
    "fractional_max_pool_indices": lambda: F.fractional_max_pool2d(
        IMAGE, 2, output_size=9, return_indices=True
    )[1].float(),
    "attention_module": lambda: ATTENTION(*[torch.ones(1, 4, 8)] * 3, need_weights=False)[0],
    "attention_module_weights": lambda: ATTENTION(*[torch.ones(1, 4, 8)] * 3)[1],
    "init_normal": lambda: nn.init.normal_(torch.empty(8)),
    "init_kaiming": lambda: nn.init.kaiming_uniform_(torch.empty(4, 4)),
    # Arguments in every form torch takes them.
    "dropout_numpy_p": lambda: F.dropout(torch.ones(64), np.float32(0.5), True),
    "dropout_tensor_p": lambda: torch.dropout(torch.ones(64), torch.tensor(0.5), True),
    "rrelu_in_place": lambda: F.rrelu_(-torch.ones(64), training=True),
    "native_dropout_train_none": lambda: torch.native_dropout(torch.ones(64), 0.5, None)[0],
    "poisson_none_generator": lambda: torch.poisson(torch.full((8,), 3.0), None),
    "init_none_generator": lambda: nn.init.uniform_(torch.empty(8), 0.0, 1.0, None),
    # Tensors our CPU mask leaves to torch's kernels, and dropout drawn inside C++.
    "nested_dropout": lambda: F.dropout(
        torch.nested.nested_tensor([torch.ones(3, 4), torch.ones(5, 4)], layout=torch.jagged),
        0.5,
        True,
    ).values(),
    "vmap_dropout": lambda: torch.func.vmap(
        lambda t: F.dropout(t, 0.5, True), randomness="different"
    )(torch.ones(3, 64)),
    "lstm_dropout": lambda: RECURRENT["lstm"](torch.ones(5, 1, 8))[0],
    "gru_dropout": lambda: RECURRENT["gru"](torch.ones(5, 1, 8))[0],
    "lstm_dropout_packed": lambda: (
        RECURRENT["lstm"](nn.utils.rnn.pack_sequence([torch.ones(5, 8), torch.ones(3, 8)]))[0].data
    ),
}
RECURRENT = {
    "lstm": nn.LSTM(8, 8, num_layers=2, dropout=0.5),
    "gru": nn.GRU(8, 8, num_layers=2, dropout=0.5),
    "one_layer_lstm": nn.LSTM(8, 8),
}
ATTENTION = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
IMAGE = torch.randn(1, 1, 16, 16, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", sorted(RANDOM_OPS))
def test_each_random_op_uses_the_replica_stream(name):
    op = RANDOM_OPS[name]
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        torch.manual_seed(11)
        first = strategy.experimental_local_results(strategy.run(op))
        torch.manual_seed(11)
        again = strategy.experimental_local_results(strategy.run(op))
        # The caller's stream moved by exactly the one seed draw of the step, whatever the op.
        torch.manual_seed(123)
        torch.empty((), dtype=torch.int64).random_()
        expected_next = torch.rand(4)
        torch.manual_seed(123)
        strategy.run(op)
        assert torch.equal(torch.rand(4), expected_next)
    assert not torch.equal(first[0], first[1]), "replicas drew the same numbers"
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_eval_mode_dropout_and_plain_ops_are_not_random():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        outputs = strategy.experimental_local_results(
            strategy.run(lambda: F.dropout(torch.ones(8), p=0.5, training=False))
        )
        assert all(torch.equal(o, torch.ones(8)) for o in outputs)


NOT_RANDOM = {
    "dropout_eval": lambda: F.dropout(torch.ones(8), 0.5, training=False),
    "rrelu_eval": lambda: nn.RReLU().eval()(-torch.ones(8)),
    "lstm_eval": lambda: RECURRENT["lstm"].eval()(torch.ones(5, 1, 8))[0],
    "one_layer_lstm": lambda: RECURRENT["one_layer_lstm"](torch.ones(5, 1, 8))[0],
    "dropout_on_meta": lambda: F.dropout(torch.ones(8, device="meta"), 0.5, True).shape,
    "attention_without_dropout": lambda: F.scaled_dot_product_attention(*[torch.ones(1, 4, 4)] * 3),
}


@pytest.mark.parametrize("name", sorted(NOT_RANDOM))
def test_ops_that_draw_nothing_leave_the_caller_s_stream_alone(name):
    torch.manual_seed(3)
    expected = torch.rand(4)
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        torch.manual_seed(3)
        strategy.run(NOT_RANDOM[name])
        assert torch.equal(torch.rand(4), expected)
    RECURRENT["lstm"].train()


def test_every_device_of_a_replica_draws_a_stream_of_its_own():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        same = strategy.run(lambda: torch.equal(torch.rand(8), torch.rand(8, device="cpu:0")))
    assert same is False  # "cpu:0" is the CPU's one generator, not a second with the seed


@pytest.mark.filterwarnings("ignore:.*(Flash attention|fused kernels):UserWarning")
def test_arguments_torch_refuses_raise_torch_s_error_in_a_replica():
    sparse = torch.ones(4, 4).to_sparse()
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        with pytest.raises(NotImplementedError, match="SparseCPU"):
            strategy.run(lambda: F.dropout(sparse, 0.5, True))
        with pytest.raises(RuntimeError, match="Expected attn_mask dtype"):
            strategy.run(
                lambda: F.scaled_dot_product_attention(
                    *[torch.ones(1, 4, 4)] * 3, torch.ones(4, 4, dtype=torch.long), 0.5
                )
            )
        # Flash attention cannot drop out on a CPU.
        with (
            sdpa_kernel([SDPBackend.FLASH_ATTENTION]),
            pytest.raises(RuntimeError, match="No available kernel"),
        ):
            strategy.run(
                lambda: F.scaled_dot_product_attention(*[torch.ones(1, 4, 4)] * 3, None, 0.5)
            )


def _checks_by_attribute(x):
    """A torch-style function whose override check _body cannot turn off (nn.init's kind)."""
    if torch.overrides.has_torch_function_unary(x):
        return torch.overrides.handle_torch_function(_checks_by_attribute, (x,), x)
    return torch.dropout(x, 0.5, True)


def test_a_function_whose_body_dispatches_anyway_runs_whole_on_the_replica_s_stream(
    monkeypatch,
):
    monkeypatch.setitem(randomness._ROUTES, _checks_by_attribute, "_around")
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        torch.manual_seed(4)
        first = strategy.experimental_local_results(
            strategy.run(lambda: _checks_by_attribute(torch.ones(64)))
        )
        torch.manual_seed(4)
        again = strategy.experimental_local_results(
            strategy.run(lambda: _checks_by_attribute(torch.ones(64)))
        )
    assert not torch.equal(first[0], first[1])
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def _train_with_dropout(seed):
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 5))
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]) as strategy:
        model, optimizer = strategy.mirror(module, torch.optim.Adam(module.parameters(), 1e-2))

        def step(batch):
            x, y = batch
            loss = F.cross_entropy(model(x), y, reduction="none")
            mirrored.compute_average_loss(loss).backward()
            optimizer.step()
            optimizer.zero_grad()

        for batch in strategy.experimental_distribute_dataset(make_batches()):
            strategy.run(step, args=(batch,))
        return model.state_dict()


def test_training_with_dropout_is_reproducible_bit_for_bit():
    first, second, other = _train_with_dropout(0), _train_with_dropout(0), _train_with_dropout(1)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_one_replica_draws_exactly_what_the_plain_loop_draws():
    torch.manual_seed(5)
    expected = F.dropout(torch.ones(32), p=0.5, training=True)
    with mirrored.MirroredStrategy(["cpu:0"]) as strategy:
        torch.manual_seed(5)
        assert torch.equal(strategy.run(lambda: F.dropout(torch.ones(32), 0.5, True)), expected)


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_cpu_dropout_keeps_1_minus_p_of_the_elements_and_their_mean(p):
    x = torch.full((1_000_000,), 3.0)
    y = _cpu_dropout(x, p, False, False, _seeded(2))
    kept = y != 0
    assert abs(kept.double().mean().item() - (1 - p)) < 5 * (p * (1 - p) / x.numel()) ** 0.5
    assert torch.allclose(y[kept], torch.tensor(3 / (1 - p)), rtol=1e-6, atol=0)
    assert torch.equal(y, _cpu_dropout(x, p, False, False, _seeded(2)))  # the stream decides
    assert not torch.equal(y, _cpu_dropout(x, p, False, False, _seeded(3)))


def test_cpu_feature_dropout_drops_whole_channels_and_in_place_writes_the_input():
    x = torch.ones(64, 50, 3, 3)
    y = _cpu_dropout(x, 0.5, True, True, _seeded(0))
    assert y is x
    per_channel = y.flatten(2)
    assert torch.equal(per_channel.amin(2), per_channel.amax(2))  # kept or dropped whole
    assert 0.4 < (per_channel[..., 0] != 0).float().mean().item() < 0.6


def test_cpu_dropout_s_gradient_is_its_mask():
    x = torch.randn(1000, dtype=torch.float64, requires_grad=True)
    y = _cpu_dropout(x, 0.25, False, False, _seeded(5))
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
    got = _cpu_attention(q, k, v, *args, options.get("enable_gqa", False), _seeded(1))
    # The same mask drawn by hand on the weights torch computes without dropout (values = I).
    eye = torch.eye(6, dtype=torch.float64).expand(2, kv_heads, 6, 6)
    weights = F.scaled_dot_product_attention(q, k, eye, mask, **options)
    if options.get("enable_gqa"):
        v = v.repeat_interleave(3, -3)
    torch.testing.assert_close(got, _cpu_dropout(weights, 0.4, False, False, _seeded(1)) @ v)


def test_dropout_and_attention_take_no_process_wide_lock():
    """Replica 1 runs dropout and a training attention while replica 0 holds the lock the
    remaining swapped ops use: they do not wait for it."""
    attention = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
    seeded, held, done = threading.Event(), threading.Event(), threading.Event()
    x = torch.ones(2, 4, 8)

    def step():
        if mirrored.get_replica_context().replica_id_in_sync_group == 0:
            assert seeded.wait(10)
            with _global_rng_lock:
                held.set()
                return "waited", done.wait(10)
        torch.rand(1)  # the step's seed is drawn under the lock: draw it before
        seeded.set()
        assert held.wait(10)
        F.dropout(x, 0.5, True)
        F.scaled_dot_product_attention(x, x, x, dropout_p=0.5)
        attention(x, x, x, need_weights=False)
        done.set()
        return "drew", True

    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        results = strategy.experimental_local_results(strategy.run(step))
    assert results == (("waited", True), ("drew", True))


@pytest.mark.parametrize(
    "draw",
    [
        lambda g: torch.rand(8, generator=g),
        lambda g: torch.poisson(torch.full((8,), 3.0), g),  # generator passed by position
        lambda g: nn.init.uniform_(torch.empty(8), 0.0, 1.0, g),
    ],
)
def test_a_generator_of_the_caller_s_own_is_used_as_given(draw):
    expected = draw(_seeded(21))
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        drawn = strategy.experimental_local_results(strategy.run(lambda: draw(_seeded(21))))
    assert all(torch.equal(d, expected) for d in drawn)


CHECKPOINT_OPTIONS = {
    "use_reentrant": False,
    "preserve_rng_state": False,
    "context_fn": mirrored.activation_checkpoint_contexts,
}


def _train_checkpointed(checkpointed: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 5))
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), 0.1))

        def step(batch):
            x, y = batch
            logits = checkpoint(model, x, **CHECKPOINT_OPTIONS) if checkpointed else model(x)
            loss = F.cross_entropy(logits, y, reduction="none")
            mirrored.compute_average_loss(loss).backward()
            optimizer.step()
            optimizer.zero_grad()

        for batch in strategy.experimental_distribute_dataset(make_batches()):
            strategy.run(step, args=(batch,))
        return {k: v.clone() for k, v in model.state_dict().items()}


def test_activation_checkpointing_recomputes_with_the_forward_s_dropout_masks():
    plain, checkpointed = _train_checkpointed(False), _train_checkpointed(True)
    for name, value in plain.items():
        torch.testing.assert_close(checkpointed[name], value, rtol=1e-6, atol=1e-7)


def _checkpoint_twice() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two backwards through one checkpoint of dropout: their gradients and the forward."""
    x = torch.ones(64, requires_grad=True)
    y = checkpoint(lambda t: F.dropout(t, 0.5, True) * t, x, **CHECKPOINT_OPTIONS)
    y.sum().backward(retain_graph=True)
    first, x.grad = x.grad, None
    y.sum().backward()  # recomputes again
    return first, x.grad, y.detach()


@pytest.mark.parametrize("where", ["outside a strategy", "one replica", "two replicas"])
def test_every_backward_through_a_checkpoint_recomputes_the_forward_s_masks(where):
    """Outside replica streams the context replays torch's own generators, so the same options
    serve everywhere; and each backward recomputes from the forward's position again."""
    torch.manual_seed(1)
    if where == "outside a strategy":
        results = [_checkpoint_twice()]
    else:
        devices = ["cpu:0", "cpu:1"][: 1 if where == "one replica" else 2]
        with mirrored.MirroredStrategy(devices) as strategy:
            results = strategy.experimental_local_results(strategy.run(_checkpoint_twice))
    for first, second, y in results:
        assert torch.equal(first, 2 * y) and torch.equal(second, 2 * y)  # d(m*t*t)/dt
        assert 0 < (y == 0).sum() < 64


def test_checkpoints_in_one_replica_leave_another_s_swapped_draws_alone():
    """Replica 0 recomputes checkpoints while replica 1 swaps its stream into the global
    generator (alpha dropout): replica 1 draws the same numbers in every run."""

    def run() -> torch.Tensor:
        torch.manual_seed(0)
        with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:

            def step():
                if mirrored.get_replica_context().replica_id_in_sync_group == 0:
                    for _ in range(100):
                        x = torch.ones(64, requires_grad=True)
                        checkpoint(
                            lambda t: F.dropout(t, 0.5, True), x, **CHECKPOINT_OPTIONS
                        ).sum().backward()
                    return torch.zeros(())
                return torch.stack(
                    [F.alpha_dropout(torch.ones(20_000), 0.5, True)[:8] for _ in range(100)]
                )

            return strategy.experimental_local_results(strategy.run(step))[1]

    first = run()
    assert all(torch.equal(run(), first) for _ in range(3))


@pytest.mark.parametrize("pass_", ["backward", "grad"])
def test_random_ops_in_backward_draw_from_the_replica_s_stream(pass_):
    """A hook drawing random numbers in backward: different across replicas, reproducible from
    the seed, and the caller's generator takes only the step's one draw."""

    def step():
        x = torch.ones(8, requires_grad=True)
        x.register_hook(lambda grad: grad * torch.rand(8))
        loss = mirrored.compute_average_loss(x * 2)
        if pass_ == "grad":
            return torch.autograd.grad(loss, x)[0]
        loss.backward()
        return x.grad

    def run():
        torch.manual_seed(5)
        with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
            grads = strategy.experimental_local_results(strategy.run(step))
        return grads, torch.get_rng_state()

    torch.manual_seed(5)
    torch.empty((), dtype=torch.int64).random_()  # the step's seed
    after_one_draw = torch.get_rng_state()
    grads, after = run()
    again, _ = run()
    assert not torch.equal(grads[0], grads[1])
    assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True))
    assert torch.equal(after, after_one_draw)


def test_draws_from_the_caller_s_generator_during_a_step_are_kept():
    """A prefetching input's augmentations draw from the global generator while replicas run:
    the next step does not draw the same numbers again."""
    torch.manual_seed(8)
    expected = []
    for _ in range(2):
        expected.append(torch.rand(4))
        torch.empty((), dtype=torch.int64).random_()  # the step's seed
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        torch.manual_seed(8)

        def step():
            F.dropout(torch.ones(8), 0.5, True)
            if mirrored.get_replica_context().replica_id_in_sync_group == 0:
                return torch.rand(4, generator=torch.default_generator)
            return None

        drawn = [strategy.experimental_local_results(strategy.run(step))[0] for _ in range(2)]
    assert all(torch.equal(d, e) for d, e in zip(drawn, expected, strict=True))


def test_strategies_stepping_at_once_draw_streams_of_their_own():
    torch.manual_seed(0)
    meet = threading.Barrier(2)
    drawn = {}

    def step():
        if mirrored.get_replica_context().replica_id_in_sync_group == 0:
            meet.wait(timeout=30)  # both steps have begun before either claims its seed
        return torch.rand(4)

    def train(name, strategy):
        drawn[name] = strategy.experimental_local_results(strategy.run(step))

    with (
        mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as a,
        mirrored.MirroredStrategy(["cpu:2", "cpu:3"]) as b,
    ):
        threads = [threading.Thread(target=train, args=item) for item in (("a", a), ("b", b))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    after = torch.get_rng_state()
    assert len({tuple(t.tolist()) for t in (*drawn["a"], *drawn["b"])}) == 4
    torch.manual_seed(0)
    torch.empty(2, dtype=torch.int64).random_()  # one draw for each step's seed
    assert torch.equal(after, torch.get_rng_state())


def test_the_caller_s_generator_is_left_alone_while_replicas_run_and_takes_one_draw_after():
    """Replicas read the step's seed from a copy: torch's own saves and restores of the global
    generator in replica threads (checkpoint's preserve_rng_state) cannot undo the draw."""
    torch.manual_seed(8)
    before = torch.get_rng_state()
    torch.empty((), dtype=torch.int64).random_()
    after_one_draw = torch.get_rng_state()
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        torch.manual_seed(8)

        def step():
            F.dropout(torch.ones(8), 0.5, True)
            return torch.equal(torch.get_rng_state(), before)

        assert all(strategy.experimental_local_results(strategy.run(step)))
        assert torch.equal(torch.get_rng_state(), after_one_draw)
