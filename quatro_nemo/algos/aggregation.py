"""Global-batch loss aggregation: every reduction divides by counts of the WHOLE batch.

A loss computed on one micro-batch with a :class:`LossNormalizer` holding the global counts
(all micro-batches of one optimizer step, all data-parallel ranks) is its additive share of the
full-batch loss, so summing the shares gives exactly the full-batch value (NeMo-RL's
``global_valid_seqs`` / ``global_valid_toks``; verl's ``agg_loss`` modes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

Count = Union[int, float, torch.Tensor]


@dataclass(frozen=True)
class LossNormalizer:
    """Global counts for one optimizer step.

    num_sequences: sequences with at least one response token, over the global batch.
    num_tokens:    response tokens (sum of ``response_mask``), over the global batch.
    Python numbers or 0-dim tensors (e.g. the result of an all-reduce); must be > 0.
    """

    num_sequences: Count
    num_tokens: Count

    def __post_init__(self) -> None:
        for name in ("num_sequences", "num_tokens"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                if value.dim() != 0:
                    raise ValueError(f"LossNormalizer.{name} must be a 0-dim tensor or a number")
                continue  # no device sync here: tensors come from an all-reduce on the device
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"LossNormalizer.{name} must be > 0, got {value!r}")

    @classmethod
    def from_mask(cls, response_mask: torch.Tensor) -> "LossNormalizer":
        """Counts of ONE batch: correct only when this batch is the whole global batch.

        Distributed callers sum ``count_sequences`` / ``count_tokens`` over micro-batches and
        ranks instead.
        """
        return cls(num_sequences=int(count_sequences(response_mask)), num_tokens=float(count_tokens(response_mask)))


def count_sequences(response_mask: torch.Tensor) -> torch.Tensor:
    """Number of rows of ``response_mask`` [S, T] with at least one response token (0-dim)."""
    return (response_mask.sum(dim=-1) > 0).sum()


def count_tokens(response_mask: torch.Tensor) -> torch.Tensor:
    """Number of response tokens in ``response_mask`` [S, T] (0-dim)."""
    return response_mask.sum()


def sequence_lengths(mask: torch.Tensor) -> torch.Tensor:
    """[S] response lengths |o_i|, clamped to >= 1 so empty rows divide safely (their values are 0)."""
    return mask.sum(dim=-1).clamp_min(1)


def masked_values(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``m v`` where ``m != 0`` and exactly 0 elsewhere: a NaN or inf at a masked position (a log-prob
    past a row's end, say) reaches neither a sum nor a gradient, where ``v * 0`` would be NaN."""
    return torch.where(mask != 0, values * mask, torch.zeros((), dtype=values.dtype, device=values.device))


def aggregate_tokens(values: torch.Tensor, mask: torch.Tensor, mode: str,
                     normalizer: LossNormalizer) -> torch.Tensor:
    """Reduce per-token ``values`` [S, T] over the global batch (verl ``agg_loss`` modes).

    token-mean:          sum_{i,t} m v / num_tokens
    seq-mean-token-mean: sum_i (sum_t m v / |o_i|) / num_sequences
    seq-mean-token-sum:  sum_{i,t} m v / num_sequences
    (masked positions contribute exactly 0, whatever their value: :func:`masked_values`)
    """
    masked = masked_values(values, mask)
    if mode == "token-mean":
        return masked.sum() / normalizer.num_tokens
    if mode == "seq-mean-token-mean":
        return (masked.sum(dim=-1) / sequence_lengths(mask)).sum() / normalizer.num_sequences
    if mode == "seq-mean-token-sum":
        return masked.sum() / normalizer.num_sequences
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


def aggregate_sequences(values: torch.Tensor, mask: torch.Tensor,
                        normalizer: LossNormalizer) -> torch.Tensor:
    """Global mean of per-sequence ``values`` [S]: sum over non-empty rows / num_sequences (an
    empty row contributes exactly 0, whatever its value)."""
    has_tokens = (mask.sum(dim=-1) > 0).to(values.dtype)
    return masked_values(values, has_tokens).sum() / normalizer.num_sequences


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of ``values`` where ``mask`` is set; -inf (the identity of max) when nothing is set."""
    fill = torch.full_like(values, float("-inf"))
    return torch.where(mask.bool(), values, fill).max().detach()


def masked_min(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Min of ``values`` where ``mask`` is set; +inf (the identity of min) when nothing is set."""
    fill = torch.full_like(values, float("inf"))
    return torch.where(mask.bool(), values, fill).min().detach()
