"""Token entropy against scipy, flip-rate buckets against hand-derived values."""
import math

import numpy as np
import pytest
import scipy.special
import scipy.stats

from quatro_nemo.eval.entropy import (entropy_from_logprobs, mean_sampled_nll, mean_token_entropy,
                                      token_sum_and_count)
from quatro_nemo.eval.flip import bucket_index, flip_rate_by_bucket, overall_flip_rate


def test_entropy_from_logprobs_matches_scipy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 50)) * 3
    logits[0, 0, :45] = -np.inf                          # zero-probability entries contribute 0
    logprobs = logits - scipy.special.logsumexp(logits, axis=-1, keepdims=True)
    want = scipy.stats.entropy(np.exp(logprobs), axis=-1)
    np.testing.assert_allclose(entropy_from_logprobs(logprobs), want, rtol=1e-12, atol=1e-12)
    assert entropy_from_logprobs(np.log(np.full(8, 1 / 8))) == pytest.approx(math.log(8))


def test_token_means_are_token_weighted_not_means_of_means():
    per_response = [[1.0, 2.0, 3.0], [10.0]]
    assert mean_token_entropy(per_response) == pytest.approx(16 / 4)       # not (2 + 10) / 2
    assert mean_sampled_nll([[-0.5, -1.5], [-1.0]]) == pytest.approx(1.0)
    assert token_sum_and_count([[1, 2], []]) == (3.0, 2)
    assert math.isnan(mean_token_entropy([]))


def test_buckets_use_half_open_ranges_on_the_256_scale():
    counts = np.array([0, 7, 8, 31, 32, 127, 128, 255, 256])
    np.testing.assert_array_equal(bucket_index(counts, np.full(9, 256)), [0, 0, 1, 1, 2, 2, 3, 3, 3])
    # n = 64: c = 2 is 8/256 -> "hard"; c = 1 is 4/256 -> "very hard"
    np.testing.assert_array_equal(bucket_index(np.array([1, 2]), np.array([64, 64])), [0, 1])


def test_flip_rate_by_bucket_hand_derived():
    n = [256] * 6
    base = [0, 0, 0, 5, 40, 200]
    trained = [3, 0, 1, 4, 90, 200]
    buckets = flip_rate_by_bucket(base, n, trained, n)
    very_hard, hard, medium, easy = buckets
    # very hard holds base counts 0, 0, 0, 5; the three unsolved ones: two flip (3 and 1 correct)
    assert (very_hard.num_problems, very_hard.num_base_unsolved, very_hard.num_flipped) == (4, 3, 2)
    assert very_hard.flip_rate == pytest.approx(2 / 3)
    assert very_hard.improvement_rate == pytest.approx(2 / 4)               # 0->3, 0->1 improved
    assert very_hard.mean_pass1_delta == pytest.approx((3 + 0 + 1 - 1) / 256 / 4)
    assert hard.num_problems == 0 and math.isnan(hard.flip_rate) and math.isnan(hard.improvement_rate)
    assert medium.improvement_rate == 1.0 and math.isnan(medium.flip_rate)
    assert easy.improvement_rate == 0.0 and easy.mean_pass1_delta == 0.0
    assert overall_flip_rate(base, trained) == pytest.approx(2 / 3)
    assert math.isnan(overall_flip_rate([1, 2], [0, 0]))
    with pytest.raises(ValueError):
        flip_rate_by_bucket([0, 1], [256, 256], [0], [256])
