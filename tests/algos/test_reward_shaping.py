"""DAPO data-side shaping: dynamic-sampling filter and soft overlong punishment (hand values)."""
import pytest
import torch

from quatro_nemo.algos import dapo_filter_groups, overlong_penalty


def test_filter_keeps_groups_with_reward_spread():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.25]])
    assert dapo_filter_groups(rewards).tolist() == [False, True, False, True]


def test_filter_rejects_non_finite():
    with pytest.raises(ValueError, match=r"\[1\]"):
        dapo_filter_groups(torch.tensor([[0.0, 1.0], [float("nan"), 1.0]]))


def test_overlong_penalty_hand_values():
    # L_max = 20, L_cache = 4: free up to 16, linear to -factor at 20, -factor beyond.
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    expected = torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5], dtype=torch.float64)
    torch.testing.assert_close(overlong_penalty(lengths, max_len=20, cache_len=4, factor=0.5), expected)


def test_overlong_penalty_bad_arguments():
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(torch.tensor([1]), max_len=10, cache_len=0)
    with pytest.raises(ValueError, match="factor"):
        overlong_penalty(torch.tensor([1]), max_len=10, cache_len=2, factor=-1.0)


def test_all_correct_group_with_an_overlong_response_is_dropped():
    """DAPO filters on correctness (Eq. 11), then shapes lengths (Eq. 13): a group whose 4 answers
    are all correct is dropped even though one of them (length 20 of L_max 20, L_cache 4) is
    penalised -1. Filtering the shaped rewards [1, 1, 0, 1] instead would keep it and train on
    advantages driven by length alone."""
    correct = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    lengths = torch.tensor([[8, 10, 20, 12], [8, 10, 20, 12]])
    shaped = correct + overlong_penalty(lengths.flatten(), max_len=20, cache_len=4).view(2, 4)
    assert shaped.tolist() == [[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, -1.0, 0.0]]   # hand values
    assert dapo_filter_groups(correct).tolist() == [False, True]
    assert dapo_filter_groups(shaped).tolist() == [True, True]                # the bug this guards


def test_dapo_data_side_hook_filters_on_correctness_then_shapes_lengths():
    """The hook the engine calls (``get_algorithm('dapo').shape_groups``) does both steps in DAPO's
    order: the all-correct group with one overlong response gets weight 0, the other keeps 1, and
    the advantages see the hand-computed length-shaped rewards. Other algorithms keep every group
    and the verifier rewards unchanged."""
    from quatro_nemo.algos import DAPOConfig, get_algorithm

    correct = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    lengths = torch.tensor([[8, 10, 20, 12], [8, 10, 20, 12]], dtype=torch.float64)
    dapo = get_algorithm("dapo")
    groups = dapo.shape_groups(correct, lengths, 20, DAPOConfig(overlong_buffer_len=4))
    assert groups.weights.tolist() == [0.0, 1.0]
    assert groups.rewards.tolist() == [[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, -1.0, 0.0]]
    # the overlong window is capped at max_new_tokens: buffer 40 > 20 acts as 20 -> length 10 of 20
    capped = dapo.shape_groups(correct, lengths, 20, DAPOConfig(overlong_buffer_len=40))
    assert capped.rewards[1].tolist() == [1.0 - 8 / 20, -10 / 20, -1.0, -12 / 20]
    unfiltered = dapo.shape_groups(correct, lengths, 20, DAPOConfig(dynamic_sampling=False))
    assert unfiltered.weights.tolist() == [1.0, 1.0] and torch.equal(unfiltered.rewards, correct)
    for name in ("quatro", "grpo", "gspo", "gmpo", "cispo", "gpg"):
        spec = get_algorithm(name)
        kept = spec.shape_groups(correct, lengths, 20, spec.config_cls())
        assert kept.weights.tolist() == [1.0, 1.0] and torch.equal(kept.rewards, correct), name


def test_reference_model_is_needed_exactly_when_the_k3_term_is_on():
    from quatro_nemo.algos import get_algorithm

    for name in ("quatro", "grpo", "dapo", "gpg"):
        spec = get_algorithm(name)
        assert spec.needs_reference_model(spec.config_cls(beta=0.001))
        assert not spec.needs_reference_model(spec.config_cls(beta=0.0))
