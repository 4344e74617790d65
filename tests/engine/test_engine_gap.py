"""``engine_gap_metrics``: the engine/trainer log-prob gap of a step, reduced over data-parallel
ranks, against a float64 computation over the whole batch in one process."""
from __future__ import annotations

import math

import pytest
import torch

from tests.distributed import run_ranks

pytestmark = pytest.mark.distributed


def _batch():
    generator = torch.Generator().manual_seed(3)
    engine = -torch.rand(4, 6, generator=generator, dtype=torch.float64) * 3
    trainer = engine + 0.01 * torch.randn(4, 6, generator=generator, dtype=torch.float64)
    trainer[2, 1] += 0.5                                   # one token far off: the max
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]],
                        dtype=torch.float64)              # the last row has no response (a filtered group)
    trainer[0, 5] = engine[0, 5] + 100.0                   # outside the mask: must not count
    return engine, trainer, mask


def _rank_gap(rank, world):
    from quatro_nemo.engine.loop import engine_gap_metrics
    from quatro_nemo.megatron.parallel import initialize_parallel

    initialize_parallel(1, 1)
    engine, trainer, mask = _batch()
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)  # this DP rank's rows
    return engine_gap_metrics(engine[rows].float(), trainer[rows].float(), mask[rows])


def test_the_gap_over_data_parallel_ranks_equals_the_whole_batch_in_float64():
    engine, trainer, mask = _batch()
    diff = [[float(trainer[i, t] - engine[i, t]) for t in range(6) if mask[i, t]] for i in range(4)]
    tokens = [abs(d) for row in diff for d in row]
    rows = [row for row in diff if row]
    expected = {"engine_gap/token_abs_mean": sum(tokens) / len(tokens),
                "engine_gap/token_abs_max": max(tokens),
                "engine_gap/seq_log_ratio_abs_mean": sum(abs(sum(row)) for row in rows) / len(rows),
                "engine_gap/seq_ratio_mean": sum(math.exp(sum(row)) for row in rows) / len(rows)}
    assert expected["engine_gap/token_abs_max"] > 0.45    # the planted token, not the masked one
    for world in (1, 2):
        for got in run_ranks(world, _rank_gap, world):
            assert got.keys() == expected.keys()
            for key, value in expected.items():
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
