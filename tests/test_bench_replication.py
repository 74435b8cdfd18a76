"""schnet_ipu.bench.replication: synthetic packed batches and the replication table."""

from __future__ import annotations

import pytest

from schnet_ipu.bench.common import format_table
from schnet_ipu.bench.replication import COLUMNS, measure_replication, synthetic_batch


def test_synthetic_batch_fills_the_packs() -> None:
    batch = synthetic_batch(0, packs=4, max_nodes=36, max_graphs=3)
    assert batch.num_nodes == 4 * 36 and batch.num_graphs == 4 * 3
    assert batch.num_molecules >= 4
    real = batch.graph[batch.node_mask]
    assert (real < batch.num_graphs).all() and batch.graph_mask[real].all()
    assert (batch.graph[~batch.node_mask] == batch.num_graphs).all()


def test_one_replica_row_in_process() -> None:
    rows = measure_replication(replicas=(1,), steps=1, warmup=0, packs=1)
    assert len(rows) == 1
    row = rows[0]
    assert (row["replicas"], row["reduction"], row["collectives_per_step"]) == (1, "none", 0)
    assert row["step_ms_median"] > 0 and row["grad_values"] > 100_000  # paper-size SchNet
    assert "collectives_per_step" in format_table(rows, COLUMNS)[0]


def test_unknown_reduction_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown reductions"):
        measure_replication(replicas=(1,), reductions=("ring",), steps=1, warmup=0, packs=1)
