"""Micro-batch layouts: which rows go together, how wide each micro-batch is, and THD packing.

Pure PyTorch (no megatron import): every layout here is tested on the CPU against hand-built
cases (``tests/megatron/test_batching.py``); :mod:`quatro_nemo.megatron.forward` runs them.

A rank's batch holds ``S`` rows, each a prompt followed by a response, right-padded to the batch
width ``L`` (``docs/interfaces.md``). ``batch["lengths"]`` ``[S]`` gives each row's real length
(prompt + response tokens); without it every row counts as ``L`` long. Two ways to split:

- **Rows** (``MicroBatching(rows=k)``, ``parallel.micro_batch_size``): consecutive slices of at
  most ``k`` rows, each as wide as the batch: the padded path. The last slice may be shorter, so
  ``k`` need not divide ``S``.
- **Token budget** (``MicroBatching(max_tokens=n)``, ``parallel.max_tokens_per_micro_batch``):
  rows sorted by real length, longest first, cut into micro-batches whose padded size
  ``rows x longest row`` stays within ``n``; each micro-batch is trimmed to its own longest row.
  This is first-fit-decreasing bin packing with the cost of a bin = its row count times its first
  (longest) row: a bin that refuses a row is full for every later (shorter) row too, because its
  cost only grows with its count, so first fit reduces to filling bins in sorted order. A row
  longer than ``n`` on its own gets a micro-batch of its own (a row is never split).

Exactness: the model is causal, so a row's log-probs at positions before its length do not depend
on what follows it (padding or nothing); the losses only read response positions
(``response_mask``), all inside the row's length, and their global normalisers
(:mod:`quatro_nemo.megatron.loss`) make every micro-batch's loss an additive share whatever the
grouping. Entries past a micro-batch's width come back as 0 (never read by a loss).

**Packing** (:func:`pack_layout`): the rows of a micro-batch concatenated into one sequence of
``sum(lengths)`` tokens (megatron's ``thd`` format, ``PackedSeqParams``): ``cu_seqlens`` marks
where each row starts, position ids restart at 0 on every row, and attention kernels that read
``cu_seqlens`` (Transformer Engine's) keep rows apart, so no padding is computed at all.
``pad_to_multiple`` rounds each row's slot up (context parallelism needs multiples of ``2 x CP``,
sequence parallelism a total divisible by TP; ``cu_seqlens_padded`` then differs from
``cu_seqlens``). :func:`unpack_rows` maps the packed next-token log-probs back to ``[rows, T]``.

Not covered (no layout here uses them): sequence parallelism (off in ``models.py``) would need
each micro-batch's width, or packed total, divisible by TP; context parallelism would need the
slots padded to ``2 x CP`` and each packed sequence split over the CP ranks (megatron's
load-balanced halves), with the log-probs gathered back before :func:`unpack_rows`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

import torch

from quatro_nemo.validation import MIN_MICRO_BATCH_TOKENS, ConfigError, check_at_least, check_token_budget

MIN_WIDTH = MIN_MICRO_BATCH_TOKENS  # a micro-batch must hold one next-token prediction (T = width - 1 >= 1)


@dataclass(frozen=True)
class MicroBatching:
    """How to split a rank's rows: ``rows`` per micro-batch (padded to the batch width), or, when
    ``max_tokens`` is set, a padded-token budget per micro-batch (sorted, binned, trimmed).
    ``pack``: concatenate each micro-batch's rows into one THD sequence (Transformer Engine only).

    ``mini_batch_rows``: split each block of that many consecutive rows on its own (a mini-batch,
    one optimizer step), never across blocks (:func:`plan_micro_batches`). A pass over a whole
    rollout (pi_old's and pi_ref's log-probs) then computes every row in the very micro-batch,
    same rows and same width, that the training forward of its mini-batch computes it in, so
    pi_old's log-probs equal the first training forward's bitwise: CPU kernels round differently
    for different micro-batch shapes (AVX-512's do), and a log-ratio that should be 0 would be
    float noise that the optimizer turns into a step. None: the whole batch is one block."""

    rows: int = 1
    max_tokens: Optional[int] = None
    pack: bool = False
    mini_batch_rows: Optional[int] = None

    def __post_init__(self) -> None:
        check_at_least("parallel.micro_batch_size", self.rows, 1)
        if self.mini_batch_rows is not None:
            check_at_least("MicroBatching.mini_batch_rows", self.mini_batch_rows, 1)
        if self.max_tokens == 0:
            raise ConfigError("MicroBatching.max_tokens=0: use None for no token budget")
        check_token_budget(self.max_tokens, self.pack)

    @classmethod
    def from_parallel_config(cls, parallel, mini_batch_rows: Optional[int] = None) -> "MicroBatching":
        """From the ``parallel:`` section (``micro_batch_size``, ``max_tokens_per_micro_batch``:
        0 or None = off, ``sequence_packing``) and the rank's rows per mini-batch (training)."""
        return cls(rows=parallel.micro_batch_size, max_tokens=parallel.max_tokens_per_micro_batch or None,
                   pack=bool(getattr(parallel, "sequence_packing", False)), mini_batch_rows=mini_batch_rows)


@dataclass(frozen=True)
class MicroBatch:
    """Rows ``rows`` (indices into the rank's batch, in micro-batch order), trimmed to ``width``
    tokens. No rows: an empty micro-batch (one all-masked dummy row, see :func:`gather_micro_batch`)."""

    rows: torch.Tensor
    width: int

    @property
    def is_empty(self) -> bool:
        return self.rows.numel() == 0


def row_lengths(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``[S]`` int64 real length of every row: ``batch["lengths"]``, or the batch width ``L``."""
    num_rows, width = batch["tokens"].shape
    if "lengths" not in batch:
        return torch.full((num_rows,), width, dtype=torch.long)
    lengths = batch["lengths"].detach().to("cpu", torch.long)
    if lengths.shape != (num_rows,):
        raise ValueError(f"batch['lengths'] has shape {tuple(lengths.shape)}, expected [{num_rows}]")
    if num_rows and (int(lengths.min()) < 1 or int(lengths.max()) > width):
        raise ValueError(f"batch['lengths'] must lie in [1, {width}] (the tokens' width), got "
                         f"{int(lengths.min())}..{int(lengths.max())}")
    return lengths


def plan_by_rows(num_rows: int, rows: int, width: int) -> List[MicroBatch]:
    """Consecutive slices of at most ``rows`` rows, each ``width`` wide (the padded path)."""
    return [MicroBatch(torch.arange(start, min(start + rows, num_rows)), width)
            for start in range(0, num_rows, rows)]


def plan_by_tokens(lengths: torch.Tensor, max_tokens: int) -> List[MicroBatch]:
    """First-fit-decreasing bins of rows under a padded-token budget (module docstring).

    Rows of equal length keep their original order (a stable sort), so the plan is a pure
    function of ``lengths``: every rank of a pipeline and tensor group computes the same one.
    """
    order = torch.sort(lengths, descending=True, stable=True).indices
    plan: List[MicroBatch] = []
    current: List[int] = []
    width = 0
    for row in order.tolist():
        if current and (len(current) + 1) * width > max_tokens:
            plan.append(MicroBatch(torch.tensor(current), width))
            current = []
        if not current:
            width = max(int(lengths[row]), MIN_WIDTH)
        current.append(row)
    if current:
        plan.append(MicroBatch(torch.tensor(current), width))
    return plan


def plan_micro_batches(batch: Mapping[str, torch.Tensor], batching: MicroBatching) -> List[MicroBatch]:
    """The micro-batches of ``batch`` under ``batching``: each block of ``batching.mini_batch_rows``
    consecutive rows planned on its own (its rows offset to the block's start), the blocks' plans
    one after another; a block's plan is exactly the plan of that block as a batch of its own."""
    num_rows, width = batch["tokens"].shape
    lengths = row_lengths(batch)
    block = batching.mini_batch_rows or max(num_rows, 1)
    plan: List[MicroBatch] = []
    for start in range(0, num_rows, block):
        end = min(start + block, num_rows)
        if batching.max_tokens is None:
            block_plan = plan_by_rows(end - start, batching.rows, width)
        else:
            block_plan = plan_by_tokens(lengths[start:end], batching.max_tokens)
        plan.extend(MicroBatch(micro.rows + start, micro.width) for micro in block_plan)
    return plan


def with_empty_micro_batches(plan: List[MicroBatch], count: int) -> List[MicroBatch]:
    """``plan`` followed by empty micro-batches up to ``count`` (every data-parallel rank must run
    the same number: the schedules' collectives are per micro-batch)."""
    if count < len(plan):
        raise ValueError(f"cannot shrink a plan of {len(plan)} micro-batches to {count}")
    return plan + [MicroBatch(torch.zeros(0, dtype=torch.long), MIN_WIDTH)] * (count - len(plan))


def padded_tokens(plan: Iterable[MicroBatch]) -> int:
    """Tokens the model computes for ``plan`` without packing: rows x width summed."""
    return sum(max(micro.rows.numel(), 1) * micro.width for micro in plan)


def gather_micro_batch(batch: Mapping[str, torch.Tensor], micro: MicroBatch,
                       keys: Sequence[str]) -> Dict[str, torch.Tensor]:
    """The tensors of ``micro``: rows picked, ``[S, L]`` keys cut to ``width`` columns and
    ``[S, T]`` keys to ``width - 1``; ``[S]`` keys keep their rows.

    An empty micro-batch becomes one dummy row of ``width`` tokens: zeros everywhere (so an
    all-zero ``response_mask``: no loss, no gradient), position ids ``0 .. width-1``.
    """
    num_rows, full_width = batch["tokens"].shape
    out: Dict[str, torch.Tensor] = {}
    for key in keys:
        if key not in batch:
            continue
        value = batch[key]
        if value.shape[0] != num_rows:
            raise ValueError(f"batch[{key!r}] has {value.shape[0]} rows, tokens has {num_rows}")
        if value.dim() == 2 and value.shape[1] == full_width:
            columns = micro.width
        elif value.dim() == 2 and value.shape[1] == full_width - 1:
            columns = micro.width - 1
        elif value.dim() == 1:
            columns = None
        else:
            raise ValueError(f"batch[{key!r}] has shape {tuple(value.shape)}: expected [S], [S, L] or [S, L-1] "
                             f"with L = {full_width}")
        if micro.is_empty:
            shape = (1,) if columns is None else (1, columns)
            part = torch.zeros(shape, dtype=value.dtype, device=value.device)
            if key == "position_ids":
                part = torch.arange(columns, device=value.device).unsqueeze(0)
            elif key == "lengths":
                part.fill_(micro.width)
        else:
            part = value.index_select(0, micro.rows.to(value.device))
            if columns is not None:
                part = part[:, :columns]
        out[key] = part
    return out


def scatter_rows(parts: Sequence[torch.Tensor], plan: Sequence[MicroBatch], num_rows: int,
                 num_columns: int) -> torch.Tensor:
    """``[num_rows, num_columns]`` with each micro-batch's ``[rows, width - 1]`` part put back at
    its rows (original row order); 0 where no micro-batch computed a value. Empty micro-batches
    are skipped."""
    if len(parts) != len(plan):
        raise ValueError(f"{len(parts)} parts for {len(plan)} micro-batches")
    reference = parts[0] if parts else torch.zeros(0)
    out = torch.zeros(num_rows, num_columns, dtype=reference.dtype, device=reference.device)
    for part, micro in zip(parts, plan):
        if not micro.is_empty:
            out[micro.rows.to(out.device), :part.shape[1]] = part
    return out


# ---------------------------------------------------------------------------------------------
# Packing (THD)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedLayout:
    """Where the rows of one micro-batch sit in its packed sequence.

    ``cu_seqlens`` int32 ``[n + 1]``: cumulative real lengths (``0, l_0, l_0 + l_1, ...``);
    ``cu_seqlens_padded`` int32 ``[n + 1]``: cumulative slot sizes (each length rounded up to
    ``pad_to_multiple``); row ``i`` occupies packed positions ``cu_seqlens_padded[i] ..
    cu_seqlens_padded[i] + l_i - 1``. ``max_seqlen``: the longest slot; ``total``: the packed length.
    """

    lengths: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    total: int


def pack_layout(lengths: torch.Tensor, pad_to_multiple: int = 1) -> PackedLayout:
    """The packed layout of rows of real lengths ``lengths`` ``[n]`` (module docstring)."""
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple={pad_to_multiple} must be >= 1")
    lengths = lengths.to("cpu", torch.long)
    if lengths.numel() and int(lengths.min()) < 1:
        raise ValueError("packed rows need at least one token each")
    slots = (lengths + pad_to_multiple - 1) // pad_to_multiple * pad_to_multiple
    zero = torch.zeros(1, dtype=torch.long)
    cu_seqlens = torch.cat([zero, lengths.cumsum(0)]).to(torch.int32)
    cu_seqlens_padded = torch.cat([zero, slots.cumsum(0)]).to(torch.int32)
    return PackedLayout(lengths=lengths, cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded,
                        max_seqlen=int(slots.max()) if slots.numel() else 0, total=int(slots.sum()))


def _row_positions(layout: PackedLayout, width: int):
    """(packed index, valid) ``[n, width]``: packed position of row ``i``'s token ``t`` and whether
    ``t < l_i`` (invalid entries point at 0)."""
    offsets = torch.arange(width).unsqueeze(0)
    valid = offsets < layout.lengths.unsqueeze(1)
    index = layout.cu_seqlens_padded[:-1].long().unsqueeze(1) + offsets
    return torch.where(valid, index, torch.zeros_like(index)), valid


def pack_rows(values: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """``[n, w]`` row-major tensor (e.g. tokens) -> ``[1, total]``: each row's first ``l_i``
    entries in its slot; slot padding is 0."""
    index, valid = _row_positions(layout, values.shape[1])
    packed = torch.zeros(layout.total, dtype=values.dtype, device=values.device)
    packed[index[valid].to(values.device)] = values[valid.to(values.device)]
    return packed.unsqueeze(0)


def packed_position_ids(layout: PackedLayout, device=None) -> torch.Tensor:
    """``[1, total]`` position ids restarting at 0 on every row (slot padding continues the row)."""
    starts = layout.cu_seqlens_padded[:-1].long()
    slot_sizes = layout.cu_seqlens_padded[1:].long() - starts
    positions = torch.arange(layout.total) - torch.repeat_interleave(starts, slot_sizes)
    return positions.unsqueeze(0).to(device)


def pack_micro_batch(micro_batch: Dict[str, torch.Tensor], pad_to_multiple: int = 1) -> Dict[str, object]:
    """``micro_batch`` (from :func:`gather_micro_batch`, with ``lengths``) plus its packed form:
    ``packed_layout`` (:class:`PackedLayout`), ``packed_tokens`` and ``packed_position_ids``
    ``[1, total]``. The row-layout tensors stay for the loss."""
    layout = pack_layout(micro_batch["lengths"], pad_to_multiple)
    tokens = micro_batch["tokens"]
    return dict(micro_batch, packed_layout=layout, packed_tokens=pack_rows(tokens, layout),
                packed_position_ids=packed_position_ids(layout, tokens.device))


def unpack_rows(packed: torch.Tensor, layout: PackedLayout, num_columns: int) -> torch.Tensor:
    """Packed next-token values ``[1, total - 1]`` (entry ``j`` predicts packed token ``j + 1``)
    -> ``[n, num_columns]`` row layout: row ``i``'s entry ``t`` (predicting its token ``t + 1``)
    is packed entry ``cu_seqlens_padded[i] + t`` for ``t < l_i - 1``; 0 elsewhere (the entry at
    a row's last token would predict the next row's first token). Differentiable."""
    flat = packed.reshape(-1)
    index, valid = _row_positions(layout, num_columns)
    valid = valid & (torch.arange(num_columns).unsqueeze(0) < (layout.lengths - 1).unsqueeze(1))
    index = torch.where(valid, index, torch.zeros_like(index)).to(flat.device)
    gathered = flat.index_select(0, index.reshape(-1)).view(index.shape)
    return torch.where(valid.to(flat.device), gathered, torch.zeros_like(gathered))


__all__ = [
    "MIN_WIDTH", "MicroBatch", "MicroBatching", "PackedLayout", "gather_micro_batch", "pack_layout",
    "pack_micro_batch", "pack_rows", "packed_position_ids", "padded_tokens", "plan_by_rows", "plan_by_tokens",
    "plan_micro_batches", "row_lengths", "scatter_rows", "unpack_rows", "with_empty_micro_batches",
]
