"""QUATRO's dual on importance-weighted samples (docs/quatro-math.md Sec. 9.3, 9.7), in float64
against independent references: scipy's root of the weighted KL, the identities computed from
the advantages in numpy, duplication against doubled weights, and today's unweighted solver."""
import math

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from scipy.special import logsumexp

from quatro_nemo.algos import QuatroConfig, get_advantage_estimator, solve_dual
from quatro_nemo.algos.adaptive_delta import achieved_kl_per_group, per_query_delta
from quatro_nemo.algos.config import DeltaPerQueryConfig
from quatro_nemo.algos.off_policy import BehaviourWeight, SampleWeights, behaviour_log_weights

from .test_dual import PATHS, solver_path

LAMBDA_MIN = 0.1


def weighted_kl(rewards: np.ndarray, weights: np.ndarray, lam: float) -> float:
    """KL(softmax(R / lam + log w̄) || w̄) in numpy (w̄ = weights / sum; zero weights add nothing)."""
    log_wbar = np.log(weights) - math.log(weights.sum())
    logits = rewards / lam + log_wbar
    log_q = logits - logsumexp(logits)
    keep = weights > 0
    return float(np.sum(np.exp(log_q[keep]) * (log_q[keep] - log_wbar[keep])))


def scipy_lambda(rewards: np.ndarray, weights: np.ndarray, delta: float) -> float:
    """The root of KL(softmax(R / lam + log w̄) || w̄) = delta (Sec. 9.3) by scipy's brentq on
    log lam: the KL falls monotonically in lam, from above delta at 1e-3 x the range to ~0."""
    spread = rewards.max() - rewards.min()
    root = brentq(lambda log_lam: weighted_kl(rewards, weights, math.exp(log_lam)) - delta,
                  math.log(1e-3 * spread), math.log(1e4 * spread), xtol=1e-14, rtol=1e-15, maxiter=500)
    return math.exp(root)


def weighted_kl_max(rewards: np.ndarray, weights: np.ndarray) -> float:
    """The lam -> 0 limit: -log of the normalised weight on the samples at the maximum reward."""
    return -math.log(weights[rewards == rewards.max()].sum() / weights.sum())


def random_case(seed, num_prompts=6, n=8, kind="continuous", spread=1.5):
    gen = torch.Generator().manual_seed(seed)
    if kind == "continuous":
        rewards = torch.randn(num_prompts, n, generator=gen, dtype=torch.float64) * 2.0
    else:
        rewards = (torch.rand(num_prompts, n, generator=gen, dtype=torch.float64) < 0.5).to(torch.float64)
        rewards[:, 0], rewards[:, 1] = 1.0, 0.0
    weights = torch.exp(spread * torch.randn(num_prompts, n, generator=gen, dtype=torch.float64))
    return rewards, weights


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["continuous", "binary"])
@pytest.mark.parametrize("n", [2, 8, 64])
def test_lambda_is_scipys_root_of_the_weighted_kl(n, kind, path):
    rewards, weights = random_case(100 + n, n=n, kind=kind)
    deltas = torch.logspace(-3, -0.7, rewards.shape[0], dtype=torch.float64)
    with solver_path(path):
        sol = solve_dual(rewards, deltas, lambda_min=LAMBDA_MIN, weights=weights)
    checked = 0
    for q in range(rewards.shape[0]):
        r, w = rewards[q].numpy(), weights[q].numpy()
        if deltas[q].item() >= weighted_kl_max(r, w):
            assert sol.inactive[q]
            continue
        reference = scipy_lambda(r, w, deltas[q].item())
        if reference < 1.5 * LAMBDA_MIN * (r.max() - r.min()):
            continue   # the floor binds (test_inactive_follows_the_weighted_kl_max)
        assert not sol.inactive[q]
        assert sol.lam[q].item() == pytest.approx(reference, rel=1e-9), (q, deltas[q].item())
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize("path", PATHS)
def test_identities_sum_w_exp_a_is_one_and_the_binding_kl_is_delta(path):
    rewards, weights = random_case(7, num_prompts=40, n=16)
    deltas = torch.rand(40, generator=torch.Generator().manual_seed(8), dtype=torch.float64) * 0.3 + 1e-3
    with solver_path(path):
        sol = solve_dual(rewards, deltas, weights=weights)
    assert not sol.inactive.any()
    a, wbar = sol.advantages.numpy(), (weights / weights.sum(dim=1, keepdim=True)).numpy()
    q = wbar * np.exp(a)                                     # q_i = w̄_i e^{A_i}: pi*'s weights
    np.testing.assert_allclose(q.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    np.testing.assert_allclose((q * a).sum(axis=1), deltas.numpy(), rtol=1e-9)   # KL(q || w̄) = sum q A
    np.testing.assert_allclose(sol.kl.numpy(), deltas.numpy(), rtol=1e-9)
    # A_i = R_i / lam - log sum_j w̄_j exp(R_j / lam), from lam alone
    lam = sol.lam.numpy()[:, None]
    expected = rewards.numpy() / lam - logsumexp(rewards.numpy() / lam, b=wbar, axis=1)[:, None]
    np.testing.assert_allclose(a, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", ["continuous", "binary"])
def test_duplicating_a_sample_is_doubling_its_weight(kind):
    rewards, weights = random_case(21, num_prompts=5, n=6, kind=kind, spread=0.7)
    duplicated = torch.cat([rewards, rewards[:, 2:3]], dim=1)                     # sample 2 twice
    duplicated_weights = torch.cat([weights, weights[:, 2:3]], dim=1)
    doubled_weights = weights.clone()
    doubled_weights[:, 2] *= 2.0
    one = solve_dual(duplicated, 0.04, weights=duplicated_weights)
    other = solve_dual(rewards, 0.04, weights=doubled_weights)
    torch.testing.assert_close(one.lam, other.lam, rtol=1e-10, atol=0)
    torch.testing.assert_close(one.advantages[:, :6], other.advantages, rtol=0, atol=1e-10)
    torch.testing.assert_close(one.advantages[:, 6], other.advantages[:, 2], rtol=0, atol=1e-10)
    # and an unweighted duplicate is a weight of 2 (against the uniform solve of the longer group)
    plain = solve_dual(torch.cat([rewards, rewards[:, 2:3]], dim=1), 0.04)
    two = torch.ones_like(rewards)
    two[:, 2] = 2.0
    torch.testing.assert_close(solve_dual(rewards, 0.04, weights=two).lam, plain.lam, rtol=1e-10, atol=0)


@pytest.mark.parametrize("path", PATHS)
def test_uniform_weights_are_todays_solver_bit_for_bit(path):
    rewards, _ = random_case(3, num_prompts=12, n=6, kind="continuous")   # 1/6: not a power of 2
    rewards[6:] = (rewards[6:] > 0).to(torch.float64)
    rewards[6:, 0], rewards[6:, 1] = 1.0, 0.0
    rewards[5] = 0.5                                               # a constant group
    uniform = torch.arange(1, 13, dtype=torch.float64).unsqueeze(1).expand(12, 6) * 0.37
    with solver_path(path):
        today, weighted = solve_dual(rewards, 0.07), solve_dual(rewards, 0.07, weights=uniform)
    for field in ("lam", "mu", "advantages", "kl", "constant", "inactive"):
        assert torch.equal(getattr(today, field), getattr(weighted, field)), field
    # the estimator given zero log weights (mu = pi_prox) returns today's advantages bit for bit
    config = QuatroConfig(delta=0.07)
    plain = get_advantage_estimator("quatro")(rewards, config)
    stale = get_advantage_estimator("quatro")(rewards, config, SampleWeights.from_log_weights(torch.zeros(12, 6)))
    assert torch.equal(plain.advantages, stale.advantages)
    assert stale.metrics["quatro/low_ess_frac"].item() == 0.0


def test_inactive_follows_the_weighted_kl_max():
    """delta >= -log(weight at the maximum) cannot bind (clamped at the floor); just below it,
    the solve is active unless the floor's e^(-1/lambda_min) term decides (it is 4.5e-5 here)."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 2, dtype=torch.float64)
    weights = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    kl_max = torch.tensor([math.log(4.0), math.log(2.0)], dtype=torch.float64)   # -log(1/4), -log(3/6)
    above = solve_dual(rewards, kl_max * 1.001, weights=weights)
    assert above.inactive.all()
    below = solve_dual(rewards, kl_max * 0.99, weights=weights)
    assert not below.inactive.any()
    torch.testing.assert_close(below.kl, kl_max * 0.99, rtol=1e-9, atol=0)


def test_zero_weight_samples_and_bad_weights():
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.2]], dtype=torch.float64)
    weights = torch.tensor([[1.0, 2.0, 0.0, 1.0]], dtype=torch.float64)
    sol = solve_dual(rewards, 0.05, weights=weights)
    keep = [0, 1, 3]
    reference = solve_dual(rewards[:, keep], 0.05, weights=weights[:, keep])
    torch.testing.assert_close(sol.lam, reference.lam, rtol=1e-10, atol=0)
    assert torch.isfinite(sol.advantages).all()
    for bad, message in ((torch.ones(1, 3), r"\[B=1, N=4\]"), (-weights, ">= 0"),
                         (torch.zeros(1, 4), "sum to 0"), (weights * math.nan, "finite")):
        with pytest.raises(ValueError, match=message):
            solve_dual(rewards, 0.05, weights=bad)


def test_effective_sample_size_hand_values_and_the_floor_makes_a_group_constant():
    log_w = torch.log(torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0], [2.0, 1.0, 1.0, 0.0]],
                                   dtype=torch.float64))
    weights = SampleWeights.from_log_weights(log_w, ess_floor=0.5)
    # (sum w)^2 / (N sum w^2): 16/16, 16/64, 16/24
    torch.testing.assert_close(weights.ess_frac, torch.tensor([1.0, 0.25, 2.0 / 3.0], dtype=torch.float64))
    assert weights.low_ess.tolist() == [False, True, False]
    torch.testing.assert_close(weights.loss_weights, torch.tensor(
        [[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0], [2.0, 1.0, 1.0, 0.0]], dtype=torch.float64))
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]] * 3, dtype=torch.float64)
    out = get_advantage_estimator("quatro")(rewards, QuatroConfig(delta=0.05), weights)
    assert (out.advantages[1] == 0).all() and (out.advantages[0] != 0).all()
    assert out.metrics["quatro/low_ess_frac"].item() == pytest.approx(1.0 / 3.0)
    assert out.metrics["adv/constant_group_frac"].item() == pytest.approx(1.0 / 3.0)


@pytest.mark.parametrize("kind", list(BehaviourWeight))
def test_behaviour_log_weights_sum_or_average_the_token_gaps(kind):
    prox = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, float("nan"), 0.0]], dtype=torch.float64)
    behaviour = torch.tensor([[-1.5, -1.0, -9.0], [-0.4, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    got = behaviour_log_weights(prox, behaviour, mask, kind).tolist()
    # row 0: 0.5 - 1.0 over 2 tokens; row 1: 0.3 over 1 token (the NaN is outside the response)
    expected = [-0.5, 0.3] if kind == "sequence" else [-0.25, 0.3]
    assert got == pytest.approx(expected, abs=1e-15)


def test_the_achieved_kl_of_a_policy_on_the_weighted_target_is_delta():
    """l_i = A_i + c (the updated policy reached pi* on the samples) gives d = delta under the
    same weights (Sec. 9.7); uniform weights give Sec. 7.1's unweighted measurement."""
    rewards, weights = random_case(31, num_prompts=8, n=8)
    sample_weights = SampleWeights.from_log_weights(weights.log(), ess_floor=0.0)
    sol = solve_dual(rewards, 0.03, weights=weights)
    shift = torch.randn(8, 1, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    achieved = achieved_kl_per_group(sol.advantages + shift, rewards, sample_weights)
    torch.testing.assert_close(achieved, torch.full((8,), 0.03, dtype=torch.float64), rtol=1e-9, atol=0)
    uniform = SampleWeights.from_log_weights(torch.zeros(8, 8), ess_floor=0.0)
    plain = solve_dual(rewards, 0.03)
    torch.testing.assert_close(achieved_kl_per_group(plain.advantages, rewards, uniform),
                               achieved_kl_per_group(plain.advantages, rewards), rtol=1e-12, atol=1e-15)
    # a group below the ESS floor is left out, as a constant one
    floor = SampleWeights(sample_weights.log_normalised, ess_floor=1.0)
    assert achieved_kl_per_group(sol.advantages, rewards, floor) is None


def test_per_query_radius_uses_the_weighted_variance():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    weights = SampleWeights.from_log_weights(torch.log(torch.tensor([[3.0, 1.0, 1.0, 1.0]], dtype=torch.float64)))
    # w̄ = (1/2, 1/6, 1/6, 1/6): weighted mean 1/2, variance 1/4 (unweighted: 3/16)
    delta_q = per_query_delta(rewards, 0.1, variance_ref=0.25, cap_fraction=0.9, lambda_min=LAMBDA_MIN,
                              sample_weights=weights)
    assert delta_q.item() == pytest.approx(0.1, rel=1e-12)
    unweighted = per_query_delta(rewards, 0.1, variance_ref=0.25, cap_fraction=0.9, lambda_min=LAMBDA_MIN)
    assert unweighted.item() == pytest.approx(0.1 * 0.75, rel=1e-12)
    config = QuatroConfig(delta=0.1, delta_per_query=DeltaPerQueryConfig(kind="reward_variance"))
    out = get_advantage_estimator("quatro")(rewards, config, weights)
    assert out.metrics["quatro/delta/mean"].item() == pytest.approx(0.1, rel=1e-12)
