"""Unbiased Pass@k and UCC@k estimators (quatro-math.md Sec. 6; paper Sec. 4 and App. C.3-C.4).

Pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", Eq. 1): with n
samples of which c are correct, the probability that a uniformly random k-subset contains at
least one correct sample is

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n-c+1}^{n} (1 - k / i)

The product form never builds a binomial coefficient, so it is exact to ~1e-15 in float64 even
for n = 256 (C(256, 128) ~ 5.8e75 would lose everything in a difference of ratios).

UCC@k (paper Sec. 4.2, "Unique Correct Count"): the correct samples are grouped into clusters
of near-duplicates with sizes m_1..m_J. The number of distinct clusters hit by a random k-subset
has expectation  sum_j P(cluster j is hit) = sum_j [1 - C(n - m_j, k) / C(n, k)],
i.e. the sum of pass@k over the clusters, each treated as the "correct" set.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


def power_of_two_ks(n: int) -> list:
    """k in {1, 2, 4, ..., <= n}, the grid of the paper's tables (App. C.3)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks


def _check_counts(n: int, c: np.ndarray, k: int) -> None:
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got k={k}")
    if np.any(c < 0) or np.any(c > n):
        raise ValueError(f"correct counts must be in [0, n={n}], got min {c.min()} max {c.max()}")


def pass_at_k(n: int, c, k: int) -> np.ndarray:
    """Unbiased pass@k, product form (Chen et al. 2021, Eq. 1).

    Args:
        n: number of samples per problem (the same for every entry of `c`).
        c: number(s) of correct samples, int or int array of any shape, each in [0, n].
        k: subset size, 1 <= k <= n.
    Returns:
        float64 array with the shape of `c`: 1 - C(n-c, k) / C(n, k).
    """
    c = np.asarray(c, dtype=np.int64)
    _check_counts(n, c, k)
    # 1 - prod_{i=n-c+1}^{n} (1 - k/i): factor i contributes only when i > n - c.
    i = np.arange(1, n + 1, dtype=np.float64)                   # [n]
    factors = np.maximum(1.0 - k / i, 0.0)                      # 0 where i <= k: C(n-c, k) = 0
    # suffix[j] = prod_{i=n-j+1}^{n} (1 - k/i) for j = 0..n (suffix[0] = 1, the empty product)
    suffix = np.concatenate([[1.0], np.cumprod(factors[::-1])])
    prob_all_wrong = suffix[c]                                  # C(n-c, k) / C(n, k)
    return 1.0 - prob_all_wrong


def ucc_at_k(n: int, cluster_sizes: Sequence[int], k: int) -> float:
    """Expected number of distinct correct clusters in a random k-subset (paper Sec. 4.2).

    Args:
        n: number of samples of the problem (correct and incorrect).
        cluster_sizes: sizes m_j of the clusters of correct samples (sum <= n).
        k: subset size, 1 <= k <= n.
    Returns:
        sum_j [1 - C(n - m_j, k) / C(n, k)].
    """
    sizes = np.asarray(list(cluster_sizes), dtype=np.int64)
    if sizes.size and (sizes.min() < 1 or sizes.sum() > n):
        raise ValueError(f"cluster sizes must be >= 1 and sum to <= n={n}, got {sizes.tolist()}")
    if sizes.size == 0:
        _check_counts(n, sizes, k)
        return 0.0
    return float(pass_at_k(n, sizes, k).sum())


def unique_correct_ratio(n: int, num_clusters: int) -> float:
    """UCR: distinct correct clusters / n (paper App. C.7, "Temperature Variation")."""
    if n < 1 or not 0 <= num_clusters <= n:
        raise ValueError(f"need 0 <= num_clusters <= n, n >= 1; got {num_clusters}, {n}")
    return num_clusters / n


def distinct_correct_per_solved(num_correct: Sequence[int], num_distinct: Sequence[int]) -> Optional[float]:
    """Mean number of distinct correct solutions (clusters J, as in UCC@k) over the problems solved
    at least once (c > 0), from each problem's correct count and distinct-correct count: the
    diversity RL can keep or lose (issue 16). None when no problem was solved."""
    if len(num_correct) != len(num_distinct):
        raise ValueError(f"{len(num_correct)} correct counts for {len(num_distinct)} distinct counts")
    solved = [d for c, d in zip(num_correct, num_distinct) if c > 0]
    return sum(solved) / len(solved) if solved else None
