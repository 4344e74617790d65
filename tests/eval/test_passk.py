"""Pass@k and UCC@k against exact rational arithmetic and brute-force enumeration."""
import itertools
import math
import random
from fractions import Fraction

import numpy as np
import pytest

from quatro_nemo.eval.passk import distinct_correct_per_solved, pass_at_k, power_of_two_ks, ucc_at_k, unique_correct_ratio


def exact_pass_at_k(n, c, k):
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_pass_at_k_matches_exact_binomials_for_all_c_and_k_at_n_256():
    n = 256
    c = np.arange(n + 1)
    worst = 0.0
    for k in range(1, n + 1):
        got = pass_at_k(n, c, k)
        # exact value as float: C(n-c, k) / C(n, k) with big integers, one rounding at the end
        comb_n = math.comb(n, k)
        want = np.array([1.0 - float(Fraction(math.comb(n - ci, k), comb_n)) for ci in range(n + 1)])
        worst = max(worst, float(np.max(np.abs(got - want))))
    assert worst < 1e-12, worst


@pytest.mark.parametrize("n,c,k", [(5, 2, 2), (10, 0, 3), (10, 10, 1), (7, 3, 5), (256, 1, 128), (256, 255, 1)])
def test_pass_at_k_spot_values(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(float(exact_pass_at_k(n, c, k)), abs=1e-14)


def test_pass_at_k_hand_values():
    # n=4, c=1, k=2: P(the correct one is among 2 of 4) = 1/2; c=0 -> 0; n-c < k -> 1
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)   # pass@1 = c / n


@pytest.mark.parametrize("bad", [dict(n=4, c=1, k=0), dict(n=4, c=1, k=5), dict(n=4, c=5, k=1), dict(n=4, c=-1, k=1)])
def test_pass_at_k_rejects_out_of_range(bad):
    with pytest.raises(ValueError):
        pass_at_k(**bad)


def brute_force_ucc(labels, k):
    """Mean number of distinct clusters (label >= 0) over all k-subsets, as a Fraction."""
    total, count = 0, 0
    for subset in itertools.combinations(range(len(labels)), k):
        total += len({labels[i] for i in subset if labels[i] >= 0})
        count += 1
    return Fraction(total, count)


def test_ucc_at_k_matches_brute_force_enumeration():
    rng = random.Random(0)
    for trial in range(40):
        n = rng.randint(1, 11)
        num_clusters = rng.randint(0, min(4, n))
        # label -1 = incorrect; clusters 0..J-1 each non-empty
        labels = list(range(num_clusters)) + [rng.randint(-1, num_clusters - 1) for _ in range(n - num_clusters)]
        rng.shuffle(labels)
        sizes = [labels.count(j) for j in range(num_clusters)]
        for k in range(1, n + 1):
            want = brute_force_ucc(labels, k)
            assert ucc_at_k(n, sizes, k) == pytest.approx(float(want), abs=1e-12), (labels, k)


def test_ucc_at_k_special_cases():
    # one cluster holding all correct answers: UCC@k = Pass@k
    assert ucc_at_k(16, [5], 4) == pytest.approx(float(pass_at_k(16, 5, 4)))
    # all n distinct correct singletons: UCC@k = k
    assert ucc_at_k(8, [1] * 8, 3) == pytest.approx(3.0)
    # k = n: every cluster is hit
    assert ucc_at_k(10, [3, 2, 1], 10) == pytest.approx(3.0)
    assert ucc_at_k(10, [], 4) == 0.0
    with pytest.raises(ValueError):
        ucc_at_k(4, [3, 2], 2)          # more clustered samples than n


def test_ucr_and_k_grid():
    assert unique_correct_ratio(256, 32) == 0.125
    assert power_of_two_ks(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert power_of_two_ks(100) == [1, 2, 4, 8, 16, 32, 64]


def test_distinct_correct_per_solved_averages_over_solved_problems_only():
    # problems: solved with 3 clusters, unsolved (0 correct, 0 clusters), solved with 1 cluster,
    # solved with 2 clusters: (3 + 1 + 2) / 3 solved = 2, the unsolved one not counted
    assert distinct_correct_per_solved([5, 0, 1, 4], [3, 0, 1, 2]) == pytest.approx(2.0, rel=1e-12)
    assert distinct_correct_per_solved([0, 0], [0, 0]) is None
    assert distinct_correct_per_solved([], []) is None
    with pytest.raises(ValueError, match="correct counts"):
        distinct_correct_per_solved([1, 2], [1])
