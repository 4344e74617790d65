"""Advantage estimators and the registry (hand-derived values; numpy for quantiles)."""
import numpy as np
import pytest
import torch

from quatro_nemo.algos import (
    ALGORITHMS,
    GPGConfig,
    GRPOConfig,
    QuatroConfig,
    get_advantage_estimator,
    get_algorithm,
    get_policy_loss,
    solve_dual,
)


def test_grpo_hand_values():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    # mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5.
    out = get_advantage_estimator("grpo")(rewards, GRPOConfig(eps=0.0))
    torch.testing.assert_close(out.advantages, torch.tensor([[1.5, -0.5, -0.5, -0.5], [0.0, 0.0, 0.0, 0.0]]))
    assert out.metrics["adv/constant_group_frac"].item() == 0.5
    no_std = get_advantage_estimator("grpo")(rewards, GRPOConfig(norm_by_std=False))
    torch.testing.assert_close(no_std.advantages, torch.tensor([[0.75, -0.25, -0.25, -0.25], [0.0] * 4]))


def test_gpg_alpha_hand_values():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    out = get_advantage_estimator("gpg")(rewards, GPGConfig())
    # alpha = 12 samples / 8 samples in non-constant groups = 1.5
    assert out.metrics["gpg/alpha"].item() == pytest.approx(1.5)
    expected = 1.5 * torch.tensor([[0.75, -0.25, -0.25, -0.25], [0.0] * 4, [-0.5, 0.5, 0.5, -0.5]])
    torch.testing.assert_close(out.advantages, expected)


def test_quatro_estimator_metrics():
    gen = torch.Generator().manual_seed(2)
    rewards = (torch.rand(20, 8, generator=gen) < 0.5).float()
    rewards[:3] = 1.0  # constant groups, excluded from lambda statistics
    config = QuatroConfig(delta=0.05)
    out = get_advantage_estimator("quatro")(rewards, config)
    sol = solve_dual(rewards, 0.05, lambda_min=config.lambda_min)
    assert out.advantages.dtype == torch.float32
    torch.testing.assert_close(out.advantages, sol.advantages.float())
    lam = sol.lam[~sol.constant].numpy()
    m = out.metrics
    assert m["quatro/lambda/mean"].item() == pytest.approx(lam.mean(), rel=1e-12)
    assert m["quatro/lambda/min"].item() == pytest.approx(lam.min(), rel=1e-12)
    assert m["quatro/lambda/max"].item() == pytest.approx(lam.max(), rel=1e-12)
    for q in (10, 50, 90):
        assert m[f"quatro/lambda/p{q}"].item() == pytest.approx(np.quantile(lam, q / 100), rel=1e-12)
    assert m["adv/constant_group_frac"].item() == pytest.approx(sol.constant.float().mean().item())
    assert m["quatro/tr_inactive_frac"].item() == pytest.approx(sol.inactive.float().mean().item())
    assert m["quatro/kl/mean"].item() == pytest.approx(sol.kl[~sol.constant].mean().item(), rel=1e-12)
    assert all(v.dim() == 0 for v in m.values())
    # All groups constant: same keys, zeros, never NaN.
    flat = get_advantage_estimator("quatro")(torch.ones(4, 8), config)
    assert flat.metrics.keys() == m.keys()
    assert (flat.advantages == 0).all() and flat.metrics["quatro/lambda/mean"].item() == 0.0
    assert all(torch.isfinite(v) for v in flat.metrics.values())


def test_estimators_reject_bad_rewards():
    for name in ("quatro", "grpo", "gpg"):
        spec_config = {"quatro": QuatroConfig(), "grpo": GRPOConfig(), "gpg": GPGConfig()}[name]
        bad = torch.zeros(4, 3)
        bad[2, 1] = float("nan")
        with pytest.raises(ValueError, match=r"\[2\]"):
            get_advantage_estimator(name)(bad, spec_config)
        with pytest.raises(ValueError, match="N >= 2"):
            get_advantage_estimator(name)(torch.zeros(4, 1), spec_config)


def test_registry_lists_every_algorithm_and_rejects_unknown():
    assert set(ALGORITHMS) == {"quatro", "grpo", "gspo", "gmpo", "dapo", "cispo", "gpg"}
    for name in ALGORITHMS:
        spec = get_algorithm(name)
        assert spec.name == name and callable(spec.advantage_estimator) and callable(spec.policy_loss)
        spec.config_cls()  # defaults are valid
    with pytest.raises(ValueError, match="known"):
        get_algorithm("ppo")
    with pytest.raises(ValueError, match="known"):
        get_policy_loss("nope")
    with pytest.raises(ValueError, match="known"):
        get_advantage_estimator("nope")
