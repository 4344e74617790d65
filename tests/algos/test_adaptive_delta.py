"""Adaptive trust-region radius (issue 19, quatro_nemo/algos/adaptive_delta.py; quatro-math.md Sec. 7).

References are independent of the code under test: hand-derived fixed points and hand-computed
radii, numpy float64 softmax KLs and scipy's brentq root of the dual's KL equation (Sec. 2).
"""
import io
import math

import numpy as np
import pytest
import torch
from scipy.optimize import brentq

from quatro_nemo.algos import QuatroConfig, get_advantage_estimator, solve_dual
from quatro_nemo.algos.adaptive_delta import DeltaController, per_query_delta
from quatro_nemo.algos.config import DeltaControllerConfig, DeltaPerQueryConfig
from quatro_nemo.algos.step_state import StepMeasurements, TrustRegionLog


# --------------------------------------------------------------------------------------------
# The controller
# --------------------------------------------------------------------------------------------


def closed_loop(controller, kl_of_delta, steps):
    """The controller against a plant whose achieved KL is a known function of delta."""
    deltas = []
    for _ in range(steps):
        controller.update(kl_of_delta(controller.delta))
        deltas.append(controller.delta)
    return deltas


@pytest.mark.parametrize("c, p", [(0.5, 1.0), (2.0, 2.0), (0.3, 0.5), (0.2, 1.5)])
@pytest.mark.parametrize("start", [0.006, 0.9])
def test_controller_converges_to_the_delta_that_achieves_the_target(c, p, start):
    # Plant KL = c * delta^p: the fixed point is delta* = (target / c)^(1 / p), derived by hand.
    target = 0.05
    expected = (target / c) ** (1.0 / p)
    assert 0.005 < expected < 1.0  # inside the bounds, so the bounds do not decide the test
    controller = DeltaController(delta=start, target=target, gain=0.5, max_factor=2.0, delta_min=0.005, delta_max=1.0)
    deltas = closed_loop(controller, lambda d: c * d ** p, 80)
    assert deltas[-1] == pytest.approx(expected, rel=1e-9)
    assert c * deltas[-1] ** p == pytest.approx(target, rel=1e-9)
    assert controller.updates == 80


def test_controller_converges_in_log_space_at_rate_one_minus_gain_times_p():
    # e_{t+1} = (1 - gain p) e_t while no clip acts: with p = 1, gain = 0.5 the error halves.
    controller = DeltaController(delta=0.08, target=0.05, gain=0.5, max_factor=10.0, delta_min=1e-3, delta_max=1.0)
    errors = [math.log(d / 0.1) for d in closed_loop(controller, lambda d: 0.5 * d, 6)]
    start = math.log(0.08 / 0.1)
    assert errors == pytest.approx([start * 0.5 ** (t + 1) for t in range(6)], rel=1e-9)


def test_controller_holds_the_target_under_noise():
    # A noisy plant (log-normal noise, sd 0.3 in log KL): delta hovers around delta*.
    rng = np.random.default_rng(0)
    controller = DeltaController(delta=0.5, target=0.05, gain=0.3, delta_min=0.005, delta_max=1.0)
    deltas = closed_loop(controller, lambda d: 0.5 * d * math.exp(0.3 * rng.standard_normal()), 400)
    assert math.exp(np.mean(np.log(deltas[100:]))) == pytest.approx(0.1, rel=0.1)


def test_controller_steps_are_bounded_and_delta_stays_in_its_bounds():
    controller = DeltaController(delta=0.1, target=0.05, gain=1.0, max_factor=2.0, delta_min=0.01, delta_max=0.3)
    controller.update(1e-9)               # target / KL = 5e7: at most x2
    assert controller.delta == pytest.approx(0.2)
    controller.update(1e-9)
    assert controller.delta == pytest.approx(0.3)   # delta_max
    for _ in range(10):
        controller.update(100.0)          # overshooting: /2 per step down to delta_min
    assert controller.delta == pytest.approx(0.01)


@pytest.mark.parametrize("nothing", [None, 0.0, float("nan"), float("inf")])
def test_a_step_with_nothing_measured_leaves_delta(nothing):
    controller = DeltaController(delta=0.1, target=0.05)
    controller.update(nothing)
    assert controller.delta == 0.1 and controller.updates == 0


def test_controller_state_round_trips_bit_identically():
    """Stopped after 7 steps, saved as the checkpoint's common state is (torch.save of plain
    Python values), restored into a fresh controller: the next steps are the same floats."""
    rng = np.random.default_rng(1)
    measured = [float(0.5 * 0.1 * math.exp(0.4 * x)) for x in rng.standard_normal(20)]

    def fresh():
        return DeltaController(delta=0.1, target=0.03, gain=0.7, delta_min=0.005, delta_max=1.0)

    straight = fresh()
    expected = [straight.update(m) for m in measured]

    first = fresh()
    got = [first.update(m) for m in measured[:7]]
    buffer = io.BytesIO()
    torch.save({"next_step": 7, "delta_controller": first.state_dict()}, buffer)
    buffer.seek(0)
    resumed = fresh()
    resumed.load_state_dict(torch.load(buffer, weights_only=False)["delta_controller"])
    got += [resumed.update(m) for m in measured[7:]]
    assert got == expected           # exact equality of the floats
    assert resumed.state_dict() == straight.state_dict()


def test_controller_from_config_is_off_by_default():
    assert DeltaController.from_config(QuatroConfig()) is None
    controller = DeltaController.from_config(QuatroConfig(
        delta=0.2, delta_controller=DeltaControllerConfig(kind="kl", target=0.02, gain=0.3, max_factor=1.5,
                                                          min=0.05, max=0.5)))
    assert (controller.delta, controller.target, controller.gain, controller.max_factor) == (0.2, 0.02, 0.3, 1.5)
    assert (controller.delta_min, controller.delta_max) == (0.05, 0.5)
    assert controller.apply(QuatroConfig(delta=0.2, delta_controller=DeltaControllerConfig(kind="kl"))).delta == 0.2


def numpy_softmax_kl(log_weights):
    """KL(softmax(l) || uniform) per row in numpy float64 (independent reference)."""
    l = np.asarray(log_weights, dtype=np.float64)
    shifted = l - l.max(axis=1, keepdims=True)
    log_w = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return (np.exp(log_w) * (log_w + math.log(l.shape[1]))).sum(axis=1)


def achieved_kl(log_ratios, rewards):
    """The achieved KL the algorithm state measures from one step's log-ratios and rewards."""
    log = TrustRegionLog(QuatroConfig(log_achieved_kl=True))
    log.observe(StepMeasurements(rewards=rewards, log_ratios=log_ratios))
    return log.achieved_kl


def test_achieved_kl_of_the_optimum_is_delta_and_skips_constant_groups():
    # A policy that reached pi* has trajectory log-ratios l_i = A_i (Sec. 3): achieved KL = delta.
    rewards = torch.tensor([[1.0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0], [1.0] * 8], dtype=torch.float64)
    sol = solve_dual(rewards, 0.07)
    assert achieved_kl(sol.advantages + 3.0, rewards) == pytest.approx(0.07, rel=1e-9)  # shift-invariant
    shifts = torch.tensor(np.random.default_rng(2).normal(size=(3, 8)))
    assert achieved_kl(shifts, rewards) == pytest.approx(numpy_softmax_kl(shifts[:2].numpy()).mean(), rel=1e-12)
    assert achieved_kl(shifts, torch.ones(3, 8)) is None


# --------------------------------------------------------------------------------------------
# The per-query rule
# --------------------------------------------------------------------------------------------


def binary_groups(n=8):
    return torch.tensor([[1.0] * c + [0.0] * (n - c) for c in range(1, n)], dtype=torch.float64)


def test_per_query_delta_hand_computed():
    # delta_q = delta * Var / 0.25, Var = p (1 - p) for 0/1 rewards: c = 1 and 7 of 8 give
    # 0.1 * (7/64) / 0.25 = 0.04375, c = 4 gives the full 0.1; graded [1, 0.5, 0, 0]:
    # mean 0.375, Var = (0.625^2 + 0.125^2 + 2 * 0.375^2) / 4 = 0.171875 -> 0.06875.
    rewards = torch.tensor([[1.0, 0, 0, 0, 0, 0, 0, 0], [1.0] * 4 + [0.0] * 4, [1.0] * 7 + [0.0]], dtype=torch.float64)
    got = per_query_delta(rewards, 0.1, variance_ref=0.25, cap_fraction=0.9, lambda_min=0.1)
    assert got.tolist() == pytest.approx([0.04375, 0.1, 0.04375], rel=1e-12)
    graded = torch.tensor([[1.0, 0.5, 0.0, 0.0]])
    assert per_query_delta(graded, 0.1, 0.25, 0.9, 0.1).item() == pytest.approx(0.06875, rel=1e-12)
    # constant groups carry no information: they get delta (their advantages are 0 anyway)
    assert per_query_delta(torch.full((1, 4), 0.3), 0.1, 0.25, 0.9, 0.1).item() == 0.1


def test_per_query_delta_is_capped_below_the_kl_the_solver_reaches():
    # [1, 1, 1, 0] at delta = 0.5: the rule gives 0.5 * (3/16) / 0.25 = 0.375 > log(4/3) = 0.288,
    # which no finite lambda reaches; the cap is 0.9 x KL(softmax(z / 0.1) || uniform), z = [0, 0, 0, -1].
    rewards = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    cap = 0.9 * numpy_softmax_kl(np.array([[0.0, 0.0, 0.0, -10.0]]))[0]
    assert cap < 0.9 * math.log(4 / 3)
    assert per_query_delta(rewards, 0.5, 0.25, 0.9, 0.1).item() == pytest.approx(cap, rel=1e-12)


def scipy_lambda(rewards_row, delta):
    """lambda* in float64 from brentq on KL(softmax(R / lambda) || uniform) = delta (Sec. 2)."""
    r = np.asarray(rewards_row, dtype=np.float64)
    f = lambda log_lam: numpy_softmax_kl((r / math.exp(log_lam))[None, :])[0] - delta  # noqa: E731
    return math.exp(brentq(f, math.log(1e-3), math.log(1e3), xtol=1e-14, rtol=1e-14))


def constraint_test_groups():
    rng = np.random.default_rng(3)
    graded = np.round(rng.uniform(0, 1, size=(6, 8)), 2)
    graded[:3, :3] = graded[:3].max(axis=1, keepdims=True)        # a crowded maximum: n_max = 3
    graded[3:, :] = np.where(graded[3:] > 0.5, 1.0, np.round(graded[3:] * 0.5, 2))  # exact + partial
    return torch.cat([binary_groups(), torch.tensor(graded)])


@pytest.mark.parametrize("delta", [0.2, 0.5, 2.0])
def test_the_per_query_constraint_binds_where_a_fixed_delta_would_not(delta):
    rewards = constraint_test_groups()
    fixed = solve_dual(rewards, delta)
    assert bool(fixed.inactive.any())   # the fixed radius loses the trust region on some groups
    delta_q = per_query_delta(rewards, delta, 0.25, 0.9, 0.1)
    sol = solve_dual(rewards, delta_q)
    assert not bool(sol.inactive.any())
    assert sol.kl.tolist() == pytest.approx(delta_q.tolist(), rel=1e-9)   # KL = delta_q: it binds
    n_max = (rewards == rewards.amax(dim=1, keepdim=True)).sum(dim=1)
    assert bool((delta_q < torch.log(rewards.shape[1] / n_max.double())).all())
    for row in (0, 6, 7, 10):
        assert sol.lam[row].item() == pytest.approx(scipy_lambda(rewards[row].numpy(), delta_q[row].item()), rel=1e-8)


def test_variance_rule_gives_mean_centred_advantages_in_the_small_kl_limit():
    # Sec. 7.2: delta_q = delta Var / v_ref makes A_i -> sqrt(2 delta / v_ref) (R_i - mean R),
    # whereas a fixed delta gives sqrt(2 delta) (R_i - mean R) / std R (GRPO's normalisation).
    rewards = torch.cat([binary_groups(), torch.tensor([[1.0, 0.4, 0.3, 0.0, 0.9, 0.5, 0.2, 0.1]])])
    centred = (rewards - rewards.mean(dim=1, keepdim=True)).numpy()
    delta = 1e-10
    config = QuatroConfig(delta=delta, delta_per_query=DeltaPerQueryConfig(kind="reward_variance"))
    got = get_advantage_estimator("quatro")(rewards, config).advantages.numpy()
    np.testing.assert_allclose(got, math.sqrt(2 * delta / 0.25) * centred, rtol=1e-3, atol=0)
    fixed = get_advantage_estimator("quatro")(rewards, QuatroConfig(delta=delta)).advantages.numpy()
    std = rewards.std(dim=1, unbiased=False, keepdim=True).numpy()
    np.testing.assert_allclose(fixed, math.sqrt(2 * delta) * centred / std, rtol=1e-3, atol=0)


def test_estimator_reports_the_radii_only_when_adaptive():
    rewards = binary_groups()
    default = get_advantage_estimator("quatro")(rewards, QuatroConfig())
    assert not any(k.startswith("quatro/delta") for k in default.metrics)
    torch.testing.assert_close(default.advantages, solve_dual(rewards, 0.1).advantages, rtol=0, atol=0)
    adaptive = get_advantage_estimator("quatro")(rewards, QuatroConfig(delta_per_query=DeltaPerQueryConfig(kind="reward_variance")))
    expected = [0.1 * (c / 8) * (1 - c / 8) / 0.25 for c in range(1, 8)]
    assert adaptive.metrics["quatro/delta/mean"].item() == pytest.approx(np.mean(expected), rel=1e-12)
    assert adaptive.metrics["quatro/delta/min"].item() == pytest.approx(min(expected), rel=1e-12)
    assert adaptive.metrics["quatro/delta/max"].item() == pytest.approx(0.1, rel=1e-12)


# --------------------------------------------------------------------------------------------
# Config validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("section, field, value", [
    ("delta_controller", "kind", "pid"), ("delta_controller", "target", 0.0), ("delta_controller", "gain", 2.0),
    ("delta_controller", "gain", -1.0), ("delta_controller", "max_factor", 1.0), ("delta_controller", "min", 0.0),
    ("delta_controller", "max", float("nan")), ("delta_per_query", "kind", "success"),
    ("delta_per_query", "variance_ref", 0.0), ("delta_per_query", "cap_fraction", 1.0),
    ("delta_per_query", "cap_fraction", True),
])
def test_bad_adaptive_value_names_the_nested_field(section, field, value):
    with pytest.raises(ValueError, match=rf"^QuatroConfig\.{section}\.{field} must"):
        QuatroConfig.from_dict({section: {field: value}})


def test_controller_bounds_must_be_ordered():
    with pytest.raises(ValueError, match=r"delta_controller\.min .* must be below .*delta_controller\.max"):
        QuatroConfig.from_dict({"delta_controller": {"min": 0.5, "max": 0.5}})


def test_a_section_is_a_mapping_of_its_own_fields():
    assert QuatroConfig.from_dict({"delta_per_query": {"kind": "reward_variance", "cap_fraction": 0.5}}).delta_per_query \
        == DeltaPerQueryConfig(kind="reward_variance", cap_fraction=0.5)
    with pytest.raises(ValueError, match=r"algorithm\.delta_per_query: unknown key\(s\) \['cap'\]"):
        QuatroConfig.from_dict({"delta_per_query": {"cap": 0.5}})
    with pytest.raises(ValueError, match=r"QuatroConfig\.delta_controller must be a DeltaControllerConfig"):
        QuatroConfig(delta_controller="kl")
