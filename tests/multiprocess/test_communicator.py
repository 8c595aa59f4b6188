"""The two-level communicator with a worker group over gloo on 127.0.0.1, used alone
(tests/multiprocess/jobs.py's ``communicator_levels``): sums in replica order, then rank order,
bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.multiprocess.jobs import mixed
from tests.multiprocess.spawn import assert_all_succeeded, run_workers

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def test_collectives_run_over_the_local_replicas_then_across_the_workers(tmp_path: Path) -> None:
    assert_all_succeeded(run_workers("communicator_levels", tmp_path, logical_devices=2))
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    values = [result["values"] for result in results]
    shards = [result["shards"] for result in results]
    total = (values[0][0] + values[0][1]) + (values[1][0] + values[1][1])
    whole = torch.cat([*shards[0], *shards[1]])
    sums = [[shard.sum(0) for shard in worker] for worker in shards]
    mean = ((sums[0][0] + sums[0][1]) + (sums[1][0] + sums[1][1])) / len(whole)
    for rank, result in enumerate(results):
        assert result["layout"] == ((2, 2), rank, 2 * rank)
        for reduced in result["all_reduce"]:
            assert torch.equal(reduced, total)
        for gathered in result["all_gather"]:
            assert torch.equal(gathered, whole)
        for gathered, expected in zip(result["all_gather_mixed"], mixed(whole), strict=True):
            assert all(torch.equal(replica, expected) for replica in gathered)
        assert torch.equal(result["reduce_sum"], total)
        assert torch.equal(result["reduce_mean_axis"], mean)
        assert torch.equal(result["gather"], whole)
        # The second level alone (what ZeRO and the gradient reducer use).
        mine = slice(2 * rank, 2 * rank + 2)
        scattered = results[0]["outgoing"][mine] + results[1]["outgoing"][mine]
        assert torch.equal(result["scattered"], scattered)
        assert torch.equal(result["gathered"], torch.tensor([0.5, 0.5, 1.5, 1.5]))
        assert torch.equal(result["summed"], values[0][0] + values[1][0])
        assert result["flags"] == [2.0, 1.0]
