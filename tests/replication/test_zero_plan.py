"""ZeRO's plan (pure: sizes and dtypes in, ownership out), and that training runs by it."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import mirrored
from mirrored.replication import zero_redundancy
from mirrored.replication.zero_plan import (
    MIN_CHUNKS,
    ParameterSpec,
    Piece,
    PieceGroup,
    ZeroPlan,
    capped_chunk_bytes,
    describe_parameters,
    plan_pieces,
    plan_segments,
    plan_zero,
)
from tests.reference_loops import (
    assert_replicas_identical,
    assert_same_parameters,
    make_batches,
    train_mirrored,
    train_plain,
)

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

F32, F64 = torch.float32, torch.float64


def specs(*numels: int, dtype: torch.dtype = F32) -> list[ParameterSpec]:
    return [ParameterSpec(n, dtype, state_index=i) for i, n in enumerate(numels)]


def plan_of(parameters, replicas_per_worker, worker=0, chunk_bytes=2**20, stage=1) -> ZeroPlan:
    return plan_zero(stage, parameters, replicas_per_worker, worker, chunk_bytes)


def owned_elements(plan: ZeroPlan, numels: dict[int, int]) -> dict[int, list[int]]:
    """Per parameter position, the owner of each element, checking the pieces tile it."""
    owner_of: dict[int, list[int]] = {position: [] for position in numels}
    for piece, owner in zip(plan.pieces, plan.owners, strict=True):
        assert piece.start == len(owner_of[piece.position]), piece  # in order, no gap or overlap
        assert piece.whole == (piece.numel == numels[piece.position])
        owner_of[piece.position] += [owner] * piece.numel
    assert {p: len(o) for p, o in owner_of.items()} == numels
    return owner_of


def test_pieces_are_n_equal_ranges_of_the_parameters_end_to_end() -> None:
    # 40 elements over 4 replicas: ranges of 10; position 2 is not contiguous, so it stays
    # whole.
    numels = {0: 25, 1: 3, 2: 8, 3: 0, 4: 4}
    pieces, owners = plan_pieces(numels, {0, 1, 3, 4}, num_replicas=4)
    assert pieces == [
        Piece(0, 0, 10, False),
        Piece(0, 10, 10, False),
        Piece(0, 20, 5, False),
        Piece(1, 0, 3, True),
        Piece(2, 0, 8, True),  # replica 2 holds 5 + 3 + 8 = 16: the one ragged range
        Piece(3, 0, 0, True),
        Piece(4, 0, 4, True),
    ]
    assert owners == [0, 1, 2, 2, 2, 3, 3]


def test_segments_hold_each_workers_share_end_to_end() -> None:
    pieces = [Piece(0, 0, 5, True), Piece(1, 0, 3, False), Piece(1, 3, 4, False)]
    pieces.append(Piece(2, 0, 2, True))
    dtypes = [torch.float32] * 3 + [torch.float64]
    layouts = plan_segments(pieces, dtypes, worker_of=[0, 1, 1, 0], num_workers=2)
    by_dtype = {layout.dtype: layout for layout in layouts}
    assert by_dtype[torch.float32].segment == 7  # worker 1's 3 + 4
    assert by_dtype[torch.float32].slots == ((0, 0), (1, 7), (2, 10))
    assert by_dtype[torch.float64].segment == 2
    assert by_dtype[torch.float64].slots == ((3, 0),)


@pytest.mark.parametrize(
    ("numels", "num_replicas"),
    [
        ([25, 3, 8, 0, 4], 4),
        ([1000, 7, 1, 1, 300, 64], 3),
        ([5, 5, 5, 5, 5, 5, 5], 7),
        ([1, 1, 1], 8),  # fewer elements than replicas
        ([97], 5),  # one parameter cut in every range
    ],
)
def test_every_element_has_one_owner_and_the_shares_differ_by_one_at_most(
    numels: list[int], num_replicas: int
) -> None:
    plan = plan_of(specs(*numels), [num_replicas])
    owner_of = owned_elements(plan, dict(enumerate(numels)))
    per_replica = [sum(o.count(r) for o in owner_of.values()) for r in range(num_replicas)]
    assert max(per_replica) - min(per_replica) <= 1, per_replica
    assert sum(per_replica) == sum(numels)
    assert sum(not piece.whole for piece in plan.pieces) <= 2 * (num_replicas - 1)
    cut_parameters = {piece.position for piece in plan.pieces if not piece.whole}
    assert len(cut_parameters) <= num_replicas - 1
    for r, share in enumerate(plan.shares):  # one process: the shares are the owners'
        assert share.owned == {k for k, owner in enumerate(plan.owners) if owner == r}
        whole = {plan.pieces[k].position for k in share.owned if plan.pieces[k].whole}
        assert share.whole == whole
        assert set(share.cut) == share.owned - {k for k in share.owned if plan.pieces[k].whole}


def test_one_replica_owns_every_parameter_whole_and_sends_nothing() -> None:
    plan = plan_of(specs(12, 0, 5), [1])
    assert plan.pieces == (Piece(0, 0, 12, True), Piece(1, 0, 0, True), Piece(2, 0, 5, True))
    assert plan.owners == (0, 0, 0)
    (share,) = plan.shares
    assert share.whole == {0, 1, 2} and share.piece_groups == ()
    assert plan.transfers == () and plan.num_workers == 1 and plan.first_replica == 0


def test_a_parameter_smaller_than_the_replica_count_leaves_some_replicas_nothing() -> None:
    plan = plan_of(specs(2), [4])
    assert plan.pieces == (Piece(0, 0, 1, False), Piece(0, 1, 1, False))
    assert plan.owners == (0, 2)
    assert [share.owned for share in plan.shares] == [{0}, set(), {1}, set()]
    assert [share.cut for share in plan.shares] == [(0,), (), (1,), ()]


def test_a_parameter_that_is_not_contiguous_stays_whole() -> None:
    parameters = specs(10, 10)
    parameters[0] = ParameterSpec(10, F32, contiguous=False, state_index=0)
    plan = plan_of(parameters, [2])
    assert plan.pieces == (Piece(0, 0, 10, True), Piece(1, 0, 10, True))
    assert plan.owners == (0, 1)


def test_frozen_and_unheld_parameters_take_no_part_and_the_chief_keeps_frozen_state() -> None:
    parameters = [
        ParameterSpec(6, F32, state_index=0),
        ParameterSpec(4, F32, trainable=False, state_index=1),  # frozen after it had state
        ParameterSpec(8, F32, state_index=None),  # not the optimizer's
        ParameterSpec(6, F32, state_index=2),
    ]
    chief, other = (plan_of(parameters, [1, 1], worker=w) for w in (0, 1))
    for plan in (chief, other):
        assert plan.positions == (0, 3) and plan.frozen == (1,)
        assert {piece.position for piece in plan.pieces} == {0, 3}
        assert dict(plan.state_index) == {0: 0, 1: 1, 3: 2}
    assert chief.kept_frozen_state == {1} and other.kept_frozen_state == set()


def test_cut_pieces_are_grouped_by_the_param_group_they_come_from() -> None:
    parameters = [
        ParameterSpec(3, F32, state_index=0, param_group=1),
        ParameterSpec(10, F32, state_index=1, param_group=0),
        ParameterSpec(9, F32, state_index=2, param_group=1),
    ]
    plan = plan_of(parameters, [2])  # ranges of 11: position 1 is cut at 8
    assert plan.pieces == (
        Piece(0, 0, 3, True),
        Piece(1, 0, 8, False),
        Piece(1, 8, 2, False),
        Piece(2, 0, 9, True),
    )
    assert plan.shares[0].piece_groups == (PieceGroup(0, (1,)),)
    assert plan.shares[1].piece_groups == (PieceGroup(0, (2,)),)
    assert plan.shares[0].whole == {0} and plan.shares[1].whole == {2}


@pytest.mark.parametrize("replicas_per_worker", [[2, 1, 3], [1, 1], [4, 2]])
def test_every_worker_plans_the_same_pieces_and_the_workers_shares_partition_them(
    replicas_per_worker: list[int],
) -> None:
    parameters = specs(40, 3, 17, 1, 64, 9)
    plans = [
        plan_of(parameters, replicas_per_worker, worker=w) for w in range(len(replicas_per_worker))
    ]
    for plan in plans[1:]:
        assert (plan.pieces, plan.owners) == (plans[0].pieces, plans[0].owners)
        assert [t.layout for t in plan.transfers] == [t.layout for t in plans[0].transfers]
    owned = [k for plan in plans for share in plan.shares for k in share.owned]
    assert sorted(owned) == list(range(len(plans[0].pieces)))  # each piece once
    for w, plan in enumerate(plans):
        assert plan.first_replica == sum(replicas_per_worker[:w])
        assert len(plan.shares) == replicas_per_worker[w]
        for r, share in enumerate(plan.shares):
            assert all(plan.owners[k] == plan.first_replica + r for k in share.owned)


def test_each_dtype_gets_segments_as_long_as_the_longest_workers_share() -> None:
    parameters = [
        ParameterSpec(10, F32, state_index=0),
        ParameterSpec(6, F64, state_index=1),
        ParameterSpec(4, F32, state_index=2),
        ParameterSpec(8, F64, state_index=3),
    ]
    # Ranges of 14: worker 0 owns 10 float32 and 4 float64 (position 1 is cut), worker 1 2 + 8
    # float64 and 4 float32; each dtype's segments are 10 long.
    plan = plan_of(parameters, [1, 1])
    by_dtype = {t.layout.dtype: t for t in plan.transfers}
    assert set(by_dtype) == {F32, F64}
    for dtype, transfer in by_dtype.items():
        segment = transfer.layout.segment
        numels = [[plan.pieces[k].numel for k, _ in slots] for slots in transfer.worker_slots]
        assert segment == max(sum(share) for share in numels)
        total = sum(p.numel for p in parameters if p.dtype == dtype)
        assert segment * plan.num_workers - total == 6  # the padding
        for slots in transfer.worker_slots:  # end to end from the segment's start
            offset = 0
            for k, local in slots:
                assert local == offset and parameters[plan.pieces[k].position].dtype == dtype
                offset += plan.pieces[k].numel
            assert offset <= segment
    assert by_dtype[F32].layout.segment == 10 and by_dtype[F64].layout.segment == 10


@pytest.mark.parametrize("chunk_bytes", [4, 12, 64, 2**20])
def test_transfers_move_a_chunk_per_worker_and_their_parts_cover_every_piece(
    chunk_bytes: int,
) -> None:
    parameters = specs(23, 5, 40, 2)
    plan = plan_of(parameters, [2, 1], chunk_bytes=chunk_bytes)
    (transfer,) = plan.transfers
    segment = transfer.layout.segment
    assert transfer.chunk == max(1, min(segment, chunk_bytes // (2 * 4)))
    ranges = transfer.ranges()
    assert ranges[0][0] == 0 and ranges[-1][1] == segment
    assert all(b - a <= transfer.chunk for a, b in ranges)
    assert all(b1 == a2 for (_, b1), (a2, _) in itertools.pairwise(ranges))
    for w in range(plan.num_workers):
        covered: dict[int, list[int]] = {}
        for a, b in ranges:
            for k, lo, hi, at in transfer.parts(plan.pieces, w, a, b):
                assert at >= 0 and at + hi - lo <= b - a
                covered.setdefault(k, []).extend(range(lo, hi))
        expected = {
            k: list(range(plan.pieces[k].start, plan.pieces[k].start + plan.pieces[k].numel))
            for k, _ in transfer.worker_slots[w]
            if plan.pieces[k].numel
        }
        assert covered == expected


def test_a_dtype_with_no_elements_moves_nothing() -> None:
    parameters = [*specs(8, 4), ParameterSpec(0, F64, state_index=2)]
    plan = plan_of(parameters, [1, 1])
    empty = next(t for t in plan.transfers if t.layout.dtype == F64)
    assert empty.layout.segment == 0 and empty.chunk == 1 and empty.ranges() == []


@pytest.mark.float32  # float32 beside float64 parameters
def test_a_module_is_described_by_its_sizes_and_where_the_optimizer_holds_it() -> None:
    first, frozen, second = nn.Linear(3, 2), nn.Linear(2, 2), nn.Linear(2, 1).double()
    frozen.requires_grad_(False)
    transposed = nn.Parameter(torch.zeros(4, 3).t())
    outside = nn.Parameter(torch.zeros(5))
    optimizer = torch.optim.SGD(
        [
            {"params": [*second.parameters(), transposed]},
            {"params": [*first.parameters(), *frozen.parameters()], "lr": 0.5},
        ],
        lr=0.1,
    )
    params = [*first.parameters(), *frozen.parameters(), outside, *second.parameters(), transposed]
    assert describe_parameters(params, optimizer) == (
        ParameterSpec(6, F32, True, True, state_index=3, param_group=1),
        ParameterSpec(2, F32, True, True, state_index=4, param_group=1),
        ParameterSpec(4, F32, True, False, state_index=5, param_group=1),
        ParameterSpec(2, F32, True, False, state_index=6, param_group=1),
        ParameterSpec(5, F32, True, True, state_index=None),
        ParameterSpec(2, F64, True, True, state_index=0, param_group=0),
        ParameterSpec(1, F64, True, True, state_index=1, param_group=0),
        ParameterSpec(12, F32, False, True, state_index=2, param_group=0),
    )


class MixedNet(nn.Module):
    """A float64 layer, then a 2-element scale (fewer elements than replicas), then float32."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.first = nn.Linear(12, 8).double()
        self.scale = nn.Parameter(torch.ones(2))
        self.out = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.first(x.double())).float()
        return self.out(hidden * self.scale.repeat(4))


class TwoNumbers(nn.Module):
    """One parameter of 2 elements: over 4 replicas two of them own nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.tensor([0.3, -0.2]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :2] + self.bias


MIXED_NET_SPECS = [  # a module's own parameters come before its submodules'
    ParameterSpec(2, F32, state_index=0),
    ParameterSpec(96, F64, state_index=1),
    ParameterSpec(8, F64, state_index=2),
    ParameterSpec(40, F32, state_index=3),
    ParameterSpec(5, F32, state_index=4),
]


@pytest.mark.parametrize(
    ("make_model", "parameters", "num_replicas", "classes", "stage"),
    [
        (MixedNet, MIXED_NET_SPECS, 3, 5, 1),
        (MixedNet, MIXED_NET_SPECS, 3, 5, 2),
        (TwoNumbers, [ParameterSpec(2, F32, state_index=0)], 4, 2, 1),
        (TwoNumbers, [ParameterSpec(2, F32, state_index=0)], 4, 2, 2),
    ],
)
def test_training_runs_by_the_plan_and_equals_one_device(
    make_model, parameters, num_replicas: int, classes: int, stage: int
) -> None:
    batches = make_batches(num_examples=4 * 16, batch_size=16, classes=classes)
    expected = make_model()
    train_plain(expected, torch.optim.Adam(expected.parameters(), lr=1e-2), batches)
    model = make_model()
    devices = [f"cpu:{r}" for r in range(num_replicas)]
    with mirrored.MirroredStrategy(devices, zero_stage=stage) as strategy:
        mirrored_model, optimizer, _ = train_mirrored(
            strategy, model, torch.optim.Adam(model.parameters(), lr=1e-2), batches
        )
        zero = optimizer.update_plan.zero
        plan = plan_zero(stage, parameters, [num_replicas], 0, zero_redundancy._CHUNK_BYTES)
        assert zero.plan == plan
        for r, share in enumerate(plan.shares):
            # Each replica keeps the state of what its share names, and nothing else.
            held = {id(p) for p in optimizer.optimizers[r].state}
            assert held == {id(zero.params[r][i]) for i in share.whole}
            piece_optimizer = zero._storage.piece_optimizers[r]
            pieces = [] if piece_optimizer is None else list(piece_optimizer.state)
            expected_numels = sorted(plan.pieces[k].numel for k in share.cut)
            assert sorted(p.numel() for p in pieces) == expected_numels
        assert_same_parameters(expected, mirrored_model.module)
        assert_replicas_identical(mirrored_model)


@pytest.mark.parametrize(
    ("chunk_bytes", "total_bytes", "expected"),
    [(2**20, 800, 800 // MIN_CHUNKS), (32, 800, 32), (2**20, 3, 1), (2**20, 0, 1)],
)
def test_a_small_model_still_crosses_in_several_chunks(
    chunk_bytes: int, total_bytes: int, expected: int
) -> None:
    """Staging one chunk of every worker's share stays a fraction of what crosses: a model
    smaller than MIN_CHUNKS chunks is cut into MIN_CHUNKS (at least one byte each)."""
    assert capped_chunk_bytes(chunk_bytes, total_bytes) == expected
