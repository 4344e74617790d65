"""Dual solver (quatro-math.md Sec. 2-3) against an independent scipy minimisation of Eq. 11."""
import contextlib
import math
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize_scalar
from scipy.special import logsumexp

from quatro_nemo.algos import dual, solve_dual

LAMBDA_MIN = 0.1
# The solver takes a float32 + float64 path for batches of at least dual.FLOAT32_MIN_ATOMS atoms
# and a float64-only path below; tests marked with this run on both, whatever their size.
PATHS = ["float64", "float32+float64"]


@contextlib.contextmanager
def solver_path(path: str):
    threshold = 0 if path == "float32+float64" else 1 << 62
    with mock.patch.object(dual, "FLOAT32_MIN_ATOMS", threshold):
        yield


def scipy_lambda(rewards: np.ndarray, delta: float) -> float:
    """argmin_{lam > 0} lam * delta + lam * (logsumexp(R / lam) - log N)   (Eq. 11), by scipy's
    bounded Brent search on log lam. Independent of the solver: it minimises the dual directly."""
    n = rewards.shape[0]
    spread = rewards.max() - rewards.min()

    def dual(log_lam: float) -> float:
        lam = math.exp(log_lam)
        return lam * delta + lam * (logsumexp(rewards / lam) - math.log(n))

    centre = math.log(spread)
    res = minimize_scalar(dual, bounds=(centre - 12.0, centre + 12.0), method="bounded",
                          options={"xatol": 1e-13, "maxiter": 2000})
    return math.exp(res.x)


def kl_max(rewards: np.ndarray) -> float:
    """KL(softmax(R / lam) || uniform) as lam -> 0: log(N / n_max)."""
    return math.log(rewards.shape[0] / np.sum(rewards == rewards.max()))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [2, 8, 64, 256])
@pytest.mark.parametrize("kind", ["continuous", "binary"])
def test_lambda_matches_scipy_dual_minimiser(n, kind, path):
    gen = torch.Generator().manual_seed(1000 + n)
    num_prompts = 6
    if kind == "continuous":
        rewards = torch.randn(num_prompts, n, generator=gen, dtype=torch.float64) * 3.0
    else:
        rewards = (torch.rand(num_prompts, n, generator=gen, dtype=torch.float64) < 0.4).to(torch.float64)
        rewards[:, 0] = 1.0  # at least one correct
        rewards[:, 1] = 0.0  # and one wrong: no constant groups here
    deltas = torch.logspace(-3, 0, num_prompts, dtype=torch.float64)
    with solver_path(path):
        sol = solve_dual(rewards, deltas, lambda_min=LAMBDA_MIN)
    checked = 0
    for q in range(num_prompts):
        r = rewards[q].numpy()
        spread = r.max() - r.min()
        if deltas[q].item() >= kl_max(r):
            assert sol.inactive[q]  # cannot bind: clamped at the floor
            assert sol.lam[q].item() == pytest.approx(LAMBDA_MIN * spread, rel=1e-12)
            continue
        reference = scipy_lambda(r, deltas[q].item())
        if reference < 1.5 * LAMBDA_MIN * spread:
            continue  # the floor binds: checked in test_floor_clamps_and_counts
        assert not sol.inactive[q]
        assert sol.lam[q].item() == pytest.approx(reference, rel=1e-6), (q, deltas[q].item())
        checked += 1
    assert checked >= 3


# quatro-math.md Sec. 3 reference table: binary rewards, N = 8, c correct.
REFERENCE_TABLE = [
    (0.01, 1, 2.5686, 0.3315, -0.0578),
    (0.05, 4, 1.5409, 0.2727, -0.3762),
    (0.10, 7, 0.3612, 0.1246, -2.6436),
]


@pytest.mark.parametrize("delta,c,lam,a_correct,a_wrong", REFERENCE_TABLE)
def test_reference_table(delta, c, lam, a_correct, a_wrong):
    rewards = torch.tensor([[1.0] * c + [0.0] * (8 - c)])
    sol = solve_dual(rewards, delta)
    assert sol.lam.item() == pytest.approx(lam, abs=5e-5)
    assert sol.advantages[0, 0].item() == pytest.approx(a_correct, abs=5e-5)
    assert sol.advantages[0, -1].item() == pytest.approx(a_wrong, abs=5e-5)


@pytest.mark.parametrize("path", PATHS)
def test_identities_mean_exp_kl_and_mu(path):
    gen = torch.Generator().manual_seed(7)
    rewards = torch.rand(50, 16, generator=gen, dtype=torch.float64) * 5.0
    deltas = torch.rand(50, generator=gen, dtype=torch.float64) * 0.5 + 1e-3
    with solver_path(path):
        sol = solve_dual(rewards, deltas)
    assert not sol.inactive.any()
    # (1/N) sum_i exp(A_i) = 1 (pi* is normalised).
    torch.testing.assert_close(torch.exp(sol.advantages).mean(dim=1), torch.ones(50, dtype=torch.float64), rtol=0, atol=1e-12)
    # KL(exp(A)/N || uniform) = delta when binding, computed from A directly.
    w = torch.exp(sol.advantages) / 16
    kl_from_a = (w * torch.log(16 * w)).sum(dim=1)
    torch.testing.assert_close(kl_from_a, deltas, rtol=1e-9, atol=0)
    torch.testing.assert_close(sol.kl, deltas, rtol=1e-9, atol=0)
    # Eq. 15 with Eq. 19's mu.
    a_from_mu = (rewards - (sol.lam + sol.mu).unsqueeze(1)) / sol.lam.unsqueeze(1)
    torch.testing.assert_close(sol.advantages, a_from_mu, rtol=0, atol=1e-9)
    # Eq. 19 directly.
    lse = torch.logsumexp(rewards / sol.lam.unsqueeze(1), dim=1) - math.log(16)
    torch.testing.assert_close(sol.lam + sol.mu, sol.lam * lse, rtol=1e-12, atol=1e-12)


def test_lambda_decreases_with_delta_and_advantages_grow():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]] * 6, dtype=torch.float64)
    deltas = torch.tensor([0.002, 0.01, 0.03, 0.1, 0.2, 0.4], dtype=torch.float64)
    sol = solve_dual(rewards, deltas)
    assert (sol.lam[1:] < sol.lam[:-1]).all()
    assert (sol.advantages[1:, 0] > sol.advantages[:-1, 0]).all()
    assert (sol.advantages[1:, -1] < sol.advantages[:-1, -1]).all()


def test_binary_positive_advantage_shrinks_with_correct_count():
    # For a delta every c in 1..7 can bind (log(8/7) = 0.1335), A(correct) decreases in c.
    rewards = torch.tensor([[1.0] * c + [0.0] * (8 - c) for c in range(1, 8)])
    for delta in (0.01, 0.05, 0.1):
        sol = solve_dual(rewards, delta)
        a_correct = sol.advantages[:, 0]
        assert (a_correct[1:] < a_correct[:-1]).all(), delta
        assert (sol.advantages[:, -1] < 0).all() and (a_correct > 0).all()


def test_constant_groups_give_zero_advantage_and_no_nan():
    rewards = torch.tensor([[0.3, 0.3, 0.3], [1.0, 0.0, 0.5], [-2.0, -2.0, -2.0]])
    sol = solve_dual(rewards, 0.1)
    assert sol.constant.tolist() == [True, False, True]
    assert (sol.advantages[0] == 0).all() and (sol.advantages[2] == 0).all()
    for field in (sol.lam, sol.mu, sol.advantages, sol.kl):
        assert torch.isfinite(field).all()
    assert sol.lam[0].item() == 0.0 and sol.kl[0].item() == 0.0


def test_floor_clamps_and_counts():
    # delta >= KL_max = log(8/7): the constraint cannot bind; lambda is clamped, A stays finite.
    rewards = torch.tensor([[1.0] * 7 + [0.0], [2.0] * 7 + [0.0]])
    sol = solve_dual(rewards, 0.2, lambda_min=0.1)
    assert sol.inactive.all()
    torch.testing.assert_close(sol.lam, torch.tensor([0.1, 0.2], dtype=torch.float64))
    assert torch.isfinite(sol.advantages).all()
    # At the floor A(wrong) = -1/0.1 - log(7/8 + e^-10/8), hand-derived.
    expected_wrong = -10.0 - math.log((7 + math.exp(-10.0)) / 8)
    assert sol.advantages[0, -1].item() == pytest.approx(expected_wrong, rel=1e-12)
    assert (sol.kl < 0.2).all()


def test_non_finite_rewards_name_rows():
    rewards = torch.zeros(5, 4)
    rewards[1, 2] = float("nan")
    rewards[3, 0] = float("inf")
    with pytest.raises(ValueError, match=r"\[1, 3\]"):
        solve_dual(rewards, 0.1)


@pytest.mark.parametrize("bad", [0.0, -0.1, float("nan")])
def test_bad_delta_raises(bad):
    with pytest.raises(ValueError, match="delta"):
        solve_dual(torch.rand(2, 4), bad)


def test_single_response_raises():
    with pytest.raises(ValueError, match="N >= 2"):
        solve_dual(torch.rand(3, 1), 0.1)


@st.composite
def reward_batches(draw):
    num_prompts = draw(st.integers(1, 5))
    n = draw(st.integers(2, 40))
    levels = draw(st.integers(1, 5))  # few levels -> ties and constant groups
    scale = 10.0 ** draw(st.floats(-3, 3))
    ints = draw(st.lists(st.lists(st.integers(0, levels), min_size=n, max_size=n),
                         min_size=num_prompts, max_size=num_prompts))
    noise = draw(st.booleans())
    rewards = torch.tensor(ints, dtype=torch.float64)
    if noise:
        rewards = rewards + torch.rand(num_prompts, n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    delta = draw(st.floats(1e-3, 1.0))
    return rewards * scale, delta, scale


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=50, deadline=None)
@given(batch=reward_batches())
def test_properties(path, batch):
    with solver_path(path):
        check_properties(*batch)


def check_properties(rewards, delta, scale):
    n = rewards.shape[1]
    sol = solve_dual(rewards, delta)
    for field in (sol.lam, sol.mu, sol.advantages, sol.kl):
        assert torch.isfinite(field).all()
    spread = rewards.max(dim=1).values - rewards.min(dim=1).values
    assert torch.equal(sol.constant, spread == 0)
    assert (sol.advantages[sol.constant] == 0).all()
    live = ~sol.constant
    if live.any():
        torch.testing.assert_close(torch.exp(sol.advantages[live]).mean(dim=1),
                                   torch.ones(int(live.sum()), dtype=torch.float64), rtol=0, atol=1e-10)
        assert (sol.lam[live] >= 0.1 * spread[live] * (1 - 1e-12)).all()
        binding = live & ~sol.inactive
        torch.testing.assert_close(sol.kl[binding], torch.full_like(sol.kl[binding], delta), rtol=1e-8, atol=0)
        assert (sol.kl[sol.inactive] <= delta).all()
        # Inactive exactly when KL at the floor lam = 0.1 * spread is <= delta (numpy, per row).
        for q in torch.nonzero(live).flatten().tolist():
            x = rewards[q].numpy() / (0.1 * spread[q].item())
            log_w = x - logsumexp(x)
            kl_floor = float(np.sum(np.exp(log_w) * (log_w + math.log(n))))
            if abs(kl_floor - delta) > 1e-9:
                assert bool(sol.inactive[q]) == (kl_floor <= delta)
    # Scale and shift invariance of the advantage (lambda scales with the rewards).
    shifted = solve_dual(rewards * 3.0 + 2.0 * scale, delta)
    torch.testing.assert_close(shifted.advantages, sol.advantages, rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(shifted.lam, 3.0 * sol.lam, rtol=1e-7, atol=0)
    # Permutation equivariance within each group.
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(n))
    permuted = solve_dual(rewards[:, perm], delta)
    torch.testing.assert_close(permuted.advantages, sol.advantages[:, perm], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("path", PATHS)
def test_two_valued_fast_path_matches_general_path(path):
    # All-binary batches are solved on the two atoms {min, max}; adding one continuous row forces
    # the per-sample path. Both must agree on the shared rows.
    gen = torch.Generator().manual_seed(5)
    success_rate = torch.linspace(0.05, 0.98, 30).unsqueeze(1)  # high rates make KL_max < delta
    binary = (torch.rand(30, 64, generator=gen) < success_rate).to(torch.float64) * 2.0 - 0.5
    binary[:, 1] = -0.5
    binary[:, 0] = 1.5
    continuous_row = torch.randn(1, 64, generator=gen, dtype=torch.float64)
    deltas = torch.logspace(-3, 0, 31, dtype=torch.float64)
    with solver_path(path):
        fast = solve_dual(binary, deltas[:30])
        general = solve_dual(torch.cat([binary, continuous_row]), deltas)
    for field in ("lam", "mu", "kl"):
        torch.testing.assert_close(getattr(fast, field), getattr(general, field)[:30], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fast.advantages, general.advantages[:30], rtol=1e-10, atol=1e-10)
    assert torch.equal(fast.inactive, general.inactive[:30]) and fast.inactive.any() and (~fast.inactive).any()


def numpy_kl(rewards: np.ndarray, lam: float) -> float:
    """KL(softmax(R / lam) || uniform), float64 numpy (independent of the solver)."""
    log_w = rewards / lam - logsumexp(rewards / lam)
    return float(np.sum(np.exp(log_w) * (log_w + math.log(rewards.shape[0]))))


# A float32 phase that stops far from the root (a short expansion: s_1 to first order, radius 0.2):
# the float64 phase then needs several passes of its own and must still reach float64 precision.
COARSE_FLOAT32 = dual._Expansion(torch.float32, sums=3, radius=0.2, newton_rtol=1e-5, kl_rtol=1e-7)


@pytest.mark.parametrize("float32_expansion", [dual.FLOAT32_EXPANSION, COARSE_FLOAT32], ids=["default", "coarse"])
def test_large_mixed_batch_against_scipy_and_numpy(float32_expansion):
    # A batch above FLOAT32_MIN_ATOMS (float32 + float64 path) mixing Gaussian and heavy-tailed
    # rewards (starts far from the root: several passes), rows that cannot bind (N - 1 rewards at
    # the max) and rows whose delta is within 1e-9 of KL at the floor, where float32 cannot
    # decide and the float64 check must.
    gen = torch.Generator().manual_seed(11)
    num_prompts, n = 320, 256
    assert num_prompts * n >= dual.FLOAT32_MIN_ATOMS
    rewards = torch.randn(num_prompts, n, generator=gen, dtype=torch.float64)
    rewards[::4] = torch.empty(num_prompts // 4, n, dtype=torch.float64).exponential_(generator=gen) ** 2
    rewards[1::16] = 1.0
    rewards[1::16, 0] = 0.0
    deltas = torch.logspace(-3, 0, num_prompts, dtype=torch.float64)[torch.randperm(num_prompts, generator=gen)]
    doubt_rows = list(range(2, num_prompts, 16))
    for k, q in enumerate(doubt_rows):
        r = rewards[q].numpy()
        deltas[q] = numpy_kl(r, LAMBDA_MIN * (r.max() - r.min())) * (1.0 + (1e-9 if k % 2 else -1e-9))
    with mock.patch.object(dual, "FLOAT32_EXPANSION", float32_expansion):
        sol = solve_dual(rewards, deltas, lambda_min=LAMBDA_MIN)

    for field in (sol.lam, sol.mu, sol.advantages, sol.kl):
        assert torch.isfinite(field).all()
    torch.testing.assert_close(torch.exp(sol.advantages).mean(dim=1), torch.ones(num_prompts, dtype=torch.float64),
                               rtol=0, atol=1e-12)
    expected_inactive = []
    for q in range(num_prompts):
        r = rewards[q].numpy()
        expected_inactive.append(numpy_kl(r, LAMBDA_MIN * (r.max() - r.min())) <= deltas[q].item())
    assert sol.inactive.tolist() == expected_inactive
    assert sol.inactive[1::16].sum() >= 5 and sum(expected_inactive[q] for q in doubt_rows) == len(doubt_rows) // 2
    binding = ~sol.inactive
    torch.testing.assert_close(sol.kl[binding], deltas[binding], rtol=1e-9, atol=0)
    # lambda against scipy's minimiser of Eq. 11 on a sample of binding rows of every kind.
    sample = [q for q in range(num_prompts) if binding[q]][::9]
    assert len(sample) >= 25
    for q in sample:
        r = rewards[q].numpy()
        assert sol.lam[q].item() == pytest.approx(scipy_lambda(r, deltas[q].item()), rel=1e-6), q
    assert sol.iterations >= 3  # the heavy-tailed rows needed more than one float32 pass
