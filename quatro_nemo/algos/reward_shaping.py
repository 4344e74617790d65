"""Data-side hooks: what an algorithm does to a rollout batch's rewards before the advantages
(``AlgorithmSpec.shape_groups``), and DAPO's pieces (arXiv:2503.14476) as pure functions."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quatro_nemo.algos.dual import check_rewards


@dataclass(frozen=True)
class ShapedGroups:
    """An algorithm's data-side view of one global rollout batch.

    rewards: [B, N] the rewards the advantage estimator sees (verifier rewards, possibly shaped).
    weights: [B] float 1/0: the groups that enter the loss (0 = dropped, e.g. DAPO's filter).
    """

    rewards: torch.Tensor
    weights: torch.Tensor


def keep_all_groups(rewards: torch.Tensor, response_lengths: torch.Tensor, max_new_tokens: int,
                    config) -> ShapedGroups:
    """The default data-side hook: verifier rewards unchanged, every group kept.

    rewards: [B, N] verifier rewards; response_lengths: [B, N] tokens (unused here).
    """
    return ShapedGroups(rewards, torch.ones(rewards.shape[0], device=rewards.device))


def dapo_shape_groups(rewards: torch.Tensor, response_lengths: torch.Tensor, max_new_tokens: int,
                      config) -> ShapedGroups:
    """DAPO's data side, in the paper's order: dynamic sampling filters groups on the verifier's
    correctness rewards (Eq. 11, ``config.dynamic_sampling``), THEN the soft overlong punishment
    (Eq. 13, ``config.overlong_buffer_len``, window capped at ``max_new_tokens``) is added to the
    rewards the advantages use. DAPO also over-samples to refill the batch; here it shrinks.
    """
    weights = (dapo_filter_groups(rewards).float() if config.dynamic_sampling
               else torch.ones(rewards.shape[0], device=rewards.device))
    shaped = rewards
    if config.overlong_buffer_len:
        shaped = rewards + overlong_penalty(response_lengths, max_new_tokens,
                                            min(config.overlong_buffer_len, max_new_tokens),
                                            config.overlong_penalty_factor)
    return ShapedGroups(shaped, weights)


def dapo_filter_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Dynamic sampling (DAPO Eq. 11, ``0 < |{o_i | is_equivalent(a, o_i)}| < G``): keep mask
    ``[B]`` of the groups whose N rewards are NOT all equal (those carry a non-zero group-relative
    advantage).

    rewards: [B, N] finite (ValueError naming bad rows otherwise): the verifier's correctness
    rewards, NOT the length-shaped ones. Eq. 11 filters on accuracy; the overlong penalty
    (Eq. 13, ``overlong_penalty``) is added afterwards, so an all-correct group with one overlong
    response is still dropped rather than trained on length-driven advantages.
    """
    check_rewards(rewards)
    return ~(rewards == rewards[:, :1]).all(dim=1)


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int, factor: float = 1.0) -> torch.Tensor:
    """Soft overlong punishment (DAPO Eq. 13), added to the reward of each response:

        0                                      if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache * factor   if L_max - L_cache < |y| <= L_max
        -factor                                if |y| > L_max

    lengths: [S] response lengths (tokens); returns float [S] penalties in [-factor, 0].
    """
    if not (isinstance(max_len, int) and isinstance(cache_len, int) and 0 < cache_len <= max_len):
        raise ValueError(f"overlong_penalty needs integers 0 < cache_len <= max_len, got cache_len={cache_len!r}, max_len={max_len!r}")
    if factor < 0:
        raise ValueError(f"overlong_penalty factor must be >= 0, got {factor!r}")
    expected = max_len - cache_len
    excess = lengths.to(torch.float64) - expected
    return (-excess.clamp(min=0.0) / cache_len * factor).clamp(min=-factor)
