"""Truncated importance weights (quatro_nemo.algos.importance) against hand-computed values, and
the gradient scaling against a float64 weighted loss."""
from __future__ import annotations

import math

import pytest
import torch

from quatro_nemo.algos.importance import (ImportanceCorrection, importance_weighted_logprobs,
                                          truncated_importance_weights)

OLD = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]])
ENGINE = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, -0.7, -0.1]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def test_token_weights_are_the_capped_ratio_of_each_token():
    w = truncated_importance_weights(OLD, ENGINE, MASK, ImportanceCorrection.token, cap=2.0)
    expected = [[math.exp(0.5), math.exp(-1.0), 1.0],          # outside the response: 1
                [1.0, min(math.exp(0.2), 2.0), math.exp(-0.4)]]
    assert torch.allclose(w, torch.tensor(expected), atol=1e-6)
    capped = truncated_importance_weights(OLD, ENGINE, MASK, ImportanceCorrection.token, cap=1.2)
    assert capped[0, 0].item() == pytest.approx(1.2) and capped[0, 1].item() == pytest.approx(math.exp(-1.0))


def test_sequence_weights_are_the_capped_product_on_every_token():
    w = truncated_importance_weights(OLD, ENGINE, MASK, ImportanceCorrection.sequence, cap=5.0)
    first, second = math.exp(0.5 - 1.0), min(math.exp(0.0 + 0.2 - 0.4), 5.0)
    assert torch.allclose(w, torch.tensor([[first, first, 1.0], [second, second, second]]), atol=1e-6)
    assert truncated_importance_weights(OLD, ENGINE, MASK, ImportanceCorrection.none, cap=5.0).eq(1).all()
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_importance_weights(OLD, ENGINE, MASK, ImportanceCorrection.token, cap=0.0)


def test_weighted_log_probs_keep_values_and_scale_each_tokens_gradient():
    logprobs = torch.tensor([[-0.3, -1.2, -2.0]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[0.7, -0.4, 1.5]], dtype=torch.float64)
    weights = torch.tensor([[1.5, 0.25, 2.0]], dtype=torch.float64)
    weighted = importance_weighted_logprobs(logprobs, weights)
    assert torch.equal(weighted, logprobs)                       # values (and every metric) unchanged
    # a non-linear loss of the log-probs: its gradient is the unweighted one times w, token by token
    loss = (advantages * torch.exp(weighted - logprobs.detach() * 0.5)).sum()
    (grad,) = torch.autograd.grad(loss, logprobs)
    reference = advantages * torch.exp(logprobs.detach() * 0.5) * weights
    assert torch.allclose(grad, reference, rtol=1e-12)
