"""Micro-batch plans and the THD packing layout (quatro_nemo.megatron.batching) on hand-built cases."""
from __future__ import annotations

import pytest
import torch

from quatro_nemo.megatron.batching import (
    MicroBatch,
    MicroBatching,
    gather_micro_batch,
    pack_layout,
    pack_micro_batch,
    pack_rows,
    packed_position_ids,
    padded_tokens,
    plan_by_rows,
    plan_by_tokens,
    plan_micro_batches,
    row_lengths,
    scatter_rows,
    unpack_rows,
    with_empty_micro_batches,
)


def _rows_and_widths(plan):
    return [(micro.rows.tolist(), micro.width) for micro in plan]


def test_token_budget_bins_sorted_rows_under_the_padded_budget():
    # Sorted: rows 1, 2 (11), 0 (5), 3 (3). Budget 22: [1, 2] costs 2 x 11 = 22; adding row 0
    # would cost 33, so it opens a bin of width 5: [0, 3] costs 10.
    plan = plan_by_tokens(torch.tensor([5, 11, 11, 3]), 22)
    assert _rows_and_widths(plan) == [([1, 2], 11), ([0, 3], 5)]
    assert padded_tokens(plan) == 32


def test_token_budget_worked_example_with_three_bins():
    # Sorted 12, 8, 6, 3 (rows 0, 1, 3, 2). Budget 22: [0] alone (12 + 12 > 22), [1, 3] = 2 x 8,
    # then row 2 would make 3 x 8 = 24 > 22: its own bin of width 3.
    plan = plan_by_tokens(torch.tensor([12, 8, 3, 6]), 22)
    assert _rows_and_widths(plan) == [([0], 12), ([1, 3], 8), ([2], 3)]


def test_token_budget_keeps_an_overlong_row_whole_and_ties_in_row_order():
    plan = plan_by_tokens(torch.tensor([4, 30, 4, 4]), 10)
    assert _rows_and_widths(plan) == [([1], 30), ([0, 2], 4), ([3], 4)]


def test_token_budget_width_is_at_least_two_tokens():
    assert _rows_and_widths(plan_by_tokens(torch.tensor([1, 1]), 8)) == [([0, 1], 2)]


def test_rows_plan_needs_no_divisor():
    plan = plan_by_rows(8, 3, 12)
    assert _rows_and_widths(plan) == [([0, 1, 2], 12), ([3, 4, 5], 12), ([6, 7], 12)]


def test_plan_micro_batches_chooses_by_config():
    batch = {"tokens": torch.zeros(4, 12, dtype=torch.long), "lengths": torch.tensor([5, 11, 11, 3])}
    assert _rows_and_widths(plan_micro_batches(batch, MicroBatching(rows=3))) == [([0, 1, 2], 12), ([3], 12)]
    assert _rows_and_widths(plan_micro_batches(batch, MicroBatching(max_tokens=22))) == [([1, 2], 11), ([0, 3], 5)]


def test_mini_batch_blocks_are_planned_each_on_their_own():
    """Rows 0-3 and 4-7 (two mini-batches of 4) never share a micro-batch; each block's plan is the
    hand-worked plan of those 4 rows alone, shifted to the block's rows."""
    lengths = torch.tensor([5, 11, 11, 3, 12, 8, 3, 6])
    batch = {"tokens": torch.zeros(8, 12, dtype=torch.long), "lengths": lengths}
    by_tokens = plan_micro_batches(batch, MicroBatching(max_tokens=22, mini_batch_rows=4))
    assert _rows_and_widths(by_tokens) == [([1, 2], 11), ([0, 3], 5), ([4], 12), ([5, 7], 8), ([6], 3)]
    by_rows = plan_micro_batches(batch, MicroBatching(rows=3, mini_batch_rows=4))
    assert _rows_and_widths(by_rows) == [([0, 1, 2], 12), ([3], 12), ([4, 5, 6], 12), ([7], 12)]
    # a block longer than the batch: the whole batch, as without blocks
    whole = MicroBatching(max_tokens=22)
    assert (_rows_and_widths(plan_micro_batches(batch, MicroBatching(max_tokens=22, mini_batch_rows=16)))
            == _rows_and_widths(plan_micro_batches(batch, whole)))
    with pytest.raises(ValueError, match="mini_batch_rows"):
        MicroBatching(mini_batch_rows=0)


def test_row_lengths_default_and_validation():
    tokens = torch.zeros(3, 6, dtype=torch.long)
    assert row_lengths({"tokens": tokens}).tolist() == [6, 6, 6]
    with pytest.raises(ValueError, match=r"lengths.*\[1, 6\]"):
        row_lengths({"tokens": tokens, "lengths": torch.tensor([2, 7, 3])})
    with pytest.raises(ValueError, match="lengths"):
        row_lengths({"tokens": tokens, "lengths": torch.tensor([2, 3])})


def test_micro_batching_errors_name_the_config_keys():
    with pytest.raises(ValueError, match="parallel.micro_batch_size"):
        MicroBatching(rows=0)
    with pytest.raises(ValueError, match="parallel.max_tokens_per_micro_batch"):
        MicroBatching(max_tokens=1)
    with pytest.raises(ValueError, match="parallel.sequence_packing"):
        MicroBatching(rows=4, pack=True)


def test_gather_trims_each_kind_of_tensor_and_builds_empty_micro_batches():
    tokens = torch.arange(24).view(3, 8)
    batch = {"tokens": tokens, "position_ids": torch.arange(8).expand(3, 8),
             "response_mask": torch.ones(3, 7), "advantages": torch.tensor([1.0, 2.0, 3.0]),
             "lengths": torch.tensor([8, 4, 3])}
    part = gather_micro_batch(batch, MicroBatch(torch.tensor([2, 1]), 4),
                              ("tokens", "position_ids", "response_mask", "advantages", "lengths", "absent"))
    assert part["tokens"].tolist() == [[16, 17, 18, 19], [8, 9, 10, 11]]
    assert part["position_ids"].tolist() == [[0, 1, 2, 3]] * 2
    assert part["response_mask"].shape == (2, 3)
    assert part["advantages"].tolist() == [3.0, 2.0]
    assert part["lengths"].tolist() == [3, 4]
    assert "absent" not in part

    empty = with_empty_micro_batches([MicroBatch(torch.tensor([0]), 8)], 2)[1]
    dummy = gather_micro_batch(batch, empty, ("tokens", "position_ids", "response_mask", "advantages", "lengths"))
    assert dummy["tokens"].tolist() == [[0, 0]] and dummy["position_ids"].tolist() == [[0, 1]]
    assert dummy["response_mask"].tolist() == [[0.0]] and dummy["advantages"].tolist() == [0.0]
    assert dummy["lengths"].tolist() == [2]
    with pytest.raises(ValueError, match="shrink"):
        with_empty_micro_batches([empty, empty], 1)


def test_gather_refuses_a_tensor_of_another_width():
    batch = {"tokens": torch.zeros(2, 5, dtype=torch.long), "odd": torch.zeros(2, 3)}
    with pytest.raises(ValueError, match=r"batch\['odd'\]"):
        gather_micro_batch(batch, MicroBatch(torch.tensor([0]), 3), ("odd",))


def test_scatter_puts_rows_back_in_original_order():
    plan = [MicroBatch(torch.tensor([2, 0]), 3), MicroBatch(torch.tensor([1]), 4),
            MicroBatch(torch.zeros(0, dtype=torch.long), 2)]
    parts = [torch.tensor([[20.0, 21.0], [0.5, 1.5]]), torch.tensor([[10.0, 11.0, 12.0]]), torch.tensor([[9.0]])]
    out = scatter_rows(parts, plan, 3, 4)
    assert out.tolist() == [[0.5, 1.5, 0.0, 0.0], [10.0, 11.0, 12.0, 0.0], [20.0, 21.0, 0.0, 0.0]]


def test_pack_layout_cu_seqlens_and_padding():
    layout = pack_layout(torch.tensor([3, 1, 2]))
    assert layout.cu_seqlens.tolist() == [0, 3, 4, 6] and layout.cu_seqlens.dtype == torch.int32
    assert layout.cu_seqlens_padded.tolist() == [0, 3, 4, 6]
    assert (layout.max_seqlen, layout.total) == (3, 6)
    padded = pack_layout(torch.tensor([3, 1, 2]), pad_to_multiple=2)
    assert padded.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert padded.cu_seqlens_padded.tolist() == [0, 4, 6, 8]
    assert (padded.max_seqlen, padded.total) == (4, 8)


def test_pack_rows_and_position_ids():
    tokens = torch.tensor([[11, 12, 13, 0], [21, 0, 0, 0], [31, 32, 0, 0]])
    layout = pack_layout(torch.tensor([3, 1, 2]))
    assert pack_rows(tokens, layout).tolist() == [[11, 12, 13, 21, 31, 32]]
    assert packed_position_ids(layout).tolist() == [[0, 1, 2, 0, 0, 1]]
    padded = pack_layout(torch.tensor([3, 1, 2]), pad_to_multiple=2)
    assert pack_rows(tokens, padded).tolist() == [[11, 12, 13, 0, 21, 0, 31, 32]]
    assert packed_position_ids(padded).tolist() == [[0, 1, 2, 3, 0, 1, 0, 1]]


def test_unpack_rows_maps_packed_predictions_to_rows():
    # Packed entry j predicts packed token j + 1. Rows of lengths 3, 1, 2 in slots of 4, 2, 2:
    # row 0 predicts its tokens 1, 2 from entries 0, 1; row 1 has nothing to predict; row 2's
    # token 1 comes from entry 6.
    layout = pack_layout(torch.tensor([3, 1, 2]), pad_to_multiple=2)
    packed = 100.0 + torch.arange(7.0).unsqueeze(0)
    assert unpack_rows(packed, layout, 3).tolist() == [[100.0, 101.0, 0.0], [0.0, 0.0, 0.0], [106.0, 0.0, 0.0]]


def test_packed_causal_computation_equals_the_padded_rows():
    """A toy causal 'model' (running sum of the tokens seen so far, restarted at every row as
    cu_seqlens-aware attention restarts) gives, after unpacking, the padded rows' values."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 2, 7, 1, 4])
    tokens = torch.randint(1, 50, (5, 7), generator=gen)
    tokens[torch.arange(7).unsqueeze(0) >= lengths.unsqueeze(1)] = 0
    padded_values = tokens.double().cumsum(dim=1)[:, :-1]   # entry t sees tokens 0..t of its row

    micro = pack_micro_batch({"tokens": tokens, "lengths": lengths}, pad_to_multiple=4)
    layout = micro["packed_layout"]
    packed = micro["packed_tokens"][0].double()
    starts = torch.repeat_interleave(layout.cu_seqlens_padded[:-1].long(),
                                     (layout.cu_seqlens_padded[1:] - layout.cu_seqlens_padded[:-1]).long())
    segment_cumsum = packed.cumsum(0) - torch.cat([torch.zeros(1), packed.cumsum(0)])[starts]
    unpacked = unpack_rows(segment_cumsum[:-1].unsqueeze(0), layout, 6)
    valid = torch.arange(6).unsqueeze(0) < (lengths - 1).unsqueeze(1)
    assert torch.equal(unpacked[valid], padded_values[valid])
    assert torch.equal(unpacked[~valid], torch.zeros(int((~valid).sum()), dtype=torch.float64))
    assert micro["packed_position_ids"][0].tolist() == [p for n in (8, 4, 8, 4, 4) for p in range(n)]
