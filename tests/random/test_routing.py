"""Per-replica random streams: each random op a replica issues draws from the replica's own
generator, different across replicas and reproducible from the seed."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import mirrored
from mirrored.random import routing as random_routing
from mirrored.random.step_seeds import global_generators_lock
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
    monkeypatch.setitem(random_routing._ROUTES, _checks_by_attribute, "_around")
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


def test_dropout_and_attention_take_no_process_wide_lock():
    """Replica 1 runs dropout and a training attention while replica 0 holds the lock the
    remaining swapped ops use: they do not wait for it."""
    attention = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
    seeded, held, done = threading.Event(), threading.Event(), threading.Event()
    x = torch.ones(2, 4, 8)

    def step():
        if mirrored.get_replica_context().replica_id_in_sync_group == 0:
            assert seeded.wait(10)
            with global_generators_lock:
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
    expected = draw(torch.Generator().manual_seed(21))
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        drawn = strategy.experimental_local_results(
            strategy.run(lambda: draw(torch.Generator().manual_seed(21)))
        )
    assert all(torch.equal(d, expected) for d in drawn)


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
