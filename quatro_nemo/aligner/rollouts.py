"""Rollout bookkeeping for the NeMo-Aligner trainer: grouping, advantages, data-parallel shards.

Pure PyTorch (no NeMo import), so it is tested in the main environment as well.

NeMo-Aligner 0.7.0's ``ReinforceTrainer`` (``nemo_aligner/algorithms/reinforce.py``)
- groups responses by identical prompt TOKENS (``calculate_rloo_baseline``): two problems that
  tokenize alike share a baseline, and one problem whose prompt is padded differently does not;
- gathers the rollout batch on every data-parallel (DP) rank and then trains every rank on the
  WHOLE global batch (``ReinforceRolloutBatch.chunk`` ignores ``rank`` and ``split_size``).

This module provides what the QUATRO trainer does instead:

1. :func:`grouped_order` puts the global batch in the project's grouped layout
   (``docs/interfaces.md``: rows ``g*N .. g*N+N-1`` are the N responses of prompt ``g``), keyed by
   the DATASET ID of each response's problem.
2. :func:`grouped_advantages` runs the registry's advantage estimator once on the global
   ``[B, N]`` reward matrix (QUATRO: one vectorised dual solve over all B queries).
3. :func:`dp_shard_indices` gives each DP rank its rows: optimizer step ``t`` uses the global
   mini-batch ``rows[t*G : (t+1)*G]`` (``G`` = ``model.global_batch_size``), of which rank ``r``
   holds the ``r``-th contiguous ``G / dp`` slice. NeMo-Aligner's ``fit`` then splits the local
   shard into consecutive chunks of ``G / dp`` rows, so local chunk ``t`` is exactly rank r's part
   of global mini-batch ``t``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

# Keys of the rollout batch that the QUATRO trainer adds to NeMo-Aligner's.
PROMPT_IDS = "prompt_ids"  # [S] int64 dataset id of each response's problem
REWARDS = "rewards"  # [S] float



def grouped_order(prompt_ids: torch.Tensor, num_responses: int) -> torch.Tensor:
    """Permutation that sorts a rollout batch into groups of ``num_responses`` per dataset id.

    Args:
        prompt_ids: [S] int, the dataset id of the problem each response answers.
        num_responses: N, the number of responses per prompt (``num_rollouts_per_prompt``).

    Returns:
        [S] int64 ``order`` with ``prompt_ids[order]`` grouped: groups appear in the order of
        their first response in ``prompt_ids``, and responses keep their order within a group
        (a stable sort, so every rank computes the same permutation from the same batch).

    Raises:
        ValueError: a dataset id does not occur exactly ``num_responses`` times.
    """
    if prompt_ids.dim() != 1:
        raise ValueError(f"prompt_ids must be 1-D [S], got shape {tuple(prompt_ids.shape)}")
    if num_responses < 1:
        raise ValueError(f"num_responses must be >= 1, got {num_responses}")
    num_sequences = prompt_ids.numel()
    unique_ids, group_of_row, counts = torch.unique(prompt_ids, return_inverse=True, return_counts=True)
    wrong = counts != num_responses
    if bool(wrong.any()):
        details = ", ".join(f"id {int(i)}: {int(c)}" for i, c in zip(unique_ids[wrong], counts[wrong]))
        raise ValueError(
            f"every prompt must have exactly num_rollouts_per_prompt = {num_responses} responses in "
            f"the global rollout batch; got {details} (is a dataset id repeated in the batch?)"
        )
    rows = torch.arange(num_sequences)
    first_row = torch.full((unique_ids.numel(),), num_sequences, dtype=torch.long)
    first_row = first_row.scatter_reduce(0, group_of_row, rows, reduce="amin")
    group_rank = torch.empty_like(first_row)
    group_rank[torch.argsort(first_row)] = torch.arange(unique_ids.numel())
    return torch.argsort(group_rank[group_of_row], stable=True)


def grouped_advantages(
    rewards: torch.Tensor,
    num_responses: int,
    estimator: Callable[[torch.Tensor, Any], Any],
    config: Any,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Advantages of a grouped rollout batch from a registry estimator (``docs/interfaces.md``).

    Args:
        rewards: [S] float, grouped (rows ``g*N .. g*N+N-1`` belong to prompt ``g``).
        num_responses: N.
        estimator: ``get_advantage_estimator(name)``: ``estimator(rewards [B, N], config)``
            returns an object with ``.advantages`` [B, N] and ``.metrics``.
        config: the algorithm's typed config.

    Returns:
        ([S] advantages in the same grouped order, the estimator's metrics).
    """
    if rewards.dim() != 1 or rewards.numel() % num_responses != 0:
        raise ValueError(
            f"rewards must be [S] with S a multiple of N = {num_responses}, got shape {tuple(rewards.shape)}"
        )
    out = estimator(rewards.view(-1, num_responses), config)
    return out.advantages.reshape(-1), dict(out.metrics)


def dp_shard_indices(
    num_sequences: int, global_batch_size: int, dp_rank: int, dp_size: int
) -> torch.Tensor:
    """Rows of the global rollout batch that data-parallel rank ``dp_rank`` trains on.

    Optimizer step ``t`` uses global rows ``[t*G, (t+1)*G)`` (``G = global_batch_size``), split
    into ``dp_size`` contiguous slices of ``G / dp_size`` rows; rank ``r`` gets slice ``r`` of
    every step, concatenated in step order. The shards of all ranks partition the batch.

    Returns:
        [S / dp_size] int64 row indices.
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    if global_batch_size % dp_size != 0:
        raise ValueError(
            f"model.global_batch_size ({global_batch_size}) must be divisible by the data-parallel "
            f"size ({dp_size})"
        )
    if num_sequences % global_batch_size != 0:
        raise ValueError(
            f"the rollout batch ({num_sequences} sequences = prompts x num_rollouts_per_prompt) must be "
            f"a multiple of model.global_batch_size ({global_batch_size})"
        )
    per_rank = global_batch_size // dp_size
    step_starts = torch.arange(0, num_sequences, global_batch_size)
    offsets = torch.arange(per_rank) + dp_rank * per_rank
    return (step_starts[:, None] + offsets[None, :]).reshape(-1)


def shuffled_groups_order(num_groups: int, num_responses: int, seed: Optional[int]) -> torch.Tensor:
    """Row permutation that shuffles whole groups (responses of a prompt stay together).

    ``seed=None`` keeps the order (identity). The same seed gives the same permutation on every
    rank, which keeps the DP shards consistent.
    """
    if seed is None:
        return torch.arange(num_groups * num_responses)
    generator = torch.Generator().manual_seed(int(seed))
    group_perm = torch.randperm(num_groups, generator=generator)
    return (group_perm[:, None] * num_responses + torch.arange(num_responses)[None, :]).reshape(-1)


def response_mask(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, num_positions: int) -> torch.Tensor:
    """[S, T] float mask of response tokens in the log-prob layout (``docs/interfaces.md``).

    Entry ``t`` scores ``tokens[t+1]``; response tokens are ``tokens[prompt_len : response_len]``
    (NeMo-Aligner's ``response_lengths`` count prompt + response, EOS included), so the mask is 1
    for ``prompt_len - 1 <= t < response_len - 1``: the same as NeMo-Aligner's
    ``ppo_utils.create_mask``, vectorised.
    """
    positions = torch.arange(num_positions)[None, :]
    start = (prompt_lengths.long() - 1)[:, None]
    end = (response_lengths.long() - 1)[:, None]
    return ((positions >= start) & (positions < end)).float()


def shard_global_rollouts(
    global_batch: Mapping[str, torch.Tensor],
    num_responses: int,
    estimator: Any,
    algorithm_config: Any,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    shuffle_seed: Optional[int] = None,
) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """Steps 2-3 of the module doc, on tensors: group, advantages on the global batch, DP shard.

    Args:
        global_batch: the gathered rollout batch (same on every DP rank), [S, ...] tensors with
            ``prompt_ids`` [S] and ``rewards`` [S].
        num_responses: N responses per prompt.
        estimator: ``AlgorithmSpec.advantage_estimator``; ``algorithm_config`` its config.
        global_batch_size: sequences per optimizer step over all DP ranks (``model.global_batch_size``).
        shuffle_seed: None keeps the groups in order, else shuffles whole groups with this seed.

    Returns:
        (this rank's shard: every key of ``global_batch`` plus ``advantages`` [S / dp], in grouped
        order; the estimator's metrics).
    """
    order = grouped_order(global_batch[PROMPT_IDS].cpu(), num_responses)
    grouped = {key: value[order.to(value.device)] for key, value in global_batch.items()}
    advantages, metrics = grouped_advantages(grouped[REWARDS].cpu().double(), num_responses, estimator,
                                             algorithm_config)
    grouped["advantages"] = advantages.to(device=grouped[REWARDS].device, dtype=torch.float32)
    num_sequences = order.numel()
    rows = shuffled_groups_order(num_sequences // num_responses, num_responses, shuffle_seed)
    rows = rows[dp_shard_indices(num_sequences, global_batch_size, dp_rank, dp_size)]
    return {key: value[rows.to(value.device)] for key, value in grouped.items()}, metrics


def gather_rows(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` [n_r, ...] along dim 0, in rank order, on every rank.

    The same result as NeMo-Aligner's ``rebalance_nd_tensor`` (zero-filled buffer, own rows
    copied in, SUM all-reduce), but it all-gathers the row counts as 1-D tensors: NeMo-Aligner's
    0-dim ``all_gather_into_tensor`` input is rejected by gloo, so its version runs on NCCL only.
    Trailing dimensions must agree across ranks.
    """
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    counts = torch.zeros(world_size, dtype=torch.int64, device=tensor.device)
    dist.all_gather_into_tensor(counts, torch.tensor([tensor.size(0)], dtype=torch.int64, device=tensor.device),
                                group=group)
    offsets = [0] + torch.cumsum(counts, 0).tolist()
    output = torch.zeros(offsets[-1], *tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
    output[offsets[rank]:offsets[rank + 1]] = tensor
    dist.all_reduce(output, op=dist.ReduceOp.SUM, group=group)
    return output
