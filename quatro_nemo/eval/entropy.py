"""Token-level policy entropy (quatro-math.md Sec. 6; paper Sec. 4.2 and App. C.2).

The paper's entropy is the mean over generated tokens of the full-vocabulary entropy
H_t = -sum_v p(v | context_t) log p(v | context_t). Two inputs are supported:

- per-token entropies already computed by the sampler (``entropies`` in a samples file), or full
  log-probability rows ``[..., V]`` via :func:`entropy_from_logprobs`;
- only the log-probability of each *sampled* token (``logprobs``): then
  -mean_t log p(o_t) is reported as ``nll``: the Monte-Carlo estimate of the same entropy
  rate (E_{o ~ p}[-log p(o)] = H), unbiased when the samples come from the policy at
  temperature 1, noisier per token. Reported under its own name, never mixed with the exact one.

Means are token-weighted over all responses of a set (sum of tokens / number of tokens), as in
the training metrics, not a mean of per-response means.
"""
from __future__ import annotations

from typing import Iterable, Sequence, Tuple

import numpy as np


def entropy_from_logprobs(logprobs: np.ndarray) -> np.ndarray:
    """Entropy of each distribution given as normalised log-probabilities on the last axis.

    Args:
        logprobs: [..., V] log-probabilities (each row logsumexp = 0).
    Returns:
        [...] float64: -sum_v exp(lp_v) * lp_v  (terms with p = 0 contribute 0).
    """
    lp = np.asarray(logprobs, dtype=np.float64)
    p = np.exp(lp)
    terms = p * np.where(p > 0, lp, 0.0)          # 0 * log 0 = 0, without evaluating 0 * -inf
    return -terms.sum(axis=-1)


def token_sum_and_count(per_token_values: Iterable[Sequence[float]]) -> Tuple[float, int]:
    """(sum over all tokens of all responses, number of tokens): additive across problems."""
    total, count = 0.0, 0
    for values in per_token_values:
        arr = np.asarray(values, dtype=np.float64)
        total += float(arr.sum())
        count += arr.size
    return total, count


def ratio_of_sums(pairs: Iterable[Tuple[float, int]]) -> float:
    """sum of sums / sum of counts over (sum, count) pairs; NaN when there is no token."""
    total, count = 0.0, 0
    for s, c in pairs:
        total += s
        count += c
    return total / count if count else float("nan")


def token_weighted_mean(per_token_values: Iterable[Sequence[float]]) -> float:
    """sum over all tokens of all responses / total number of tokens; NaN if there are none."""
    return ratio_of_sums([token_sum_and_count(per_token_values)])


def mean_token_entropy(per_token_entropies: Iterable[Sequence[float]]) -> float:
    """Mean full-vocabulary entropy over all generated tokens (paper App. C.2)."""
    return token_weighted_mean(per_token_entropies)


def mean_sampled_nll(per_token_logprobs: Iterable[Sequence[float]]) -> float:
    """-mean over all generated tokens of log p(sampled token): Monte-Carlo entropy estimate."""
    return -token_weighted_mean(per_token_logprobs)
