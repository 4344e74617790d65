"""QUATRO's KL-adaptive learning rate and the algorithm-state hook (issue 29 / 30;
quatro_nemo/algos/lr_control.py, step_state.py; docs/quatro-math.md Sec. 7.4).

References are independent of the code under test: multipliers derived by hand from the rule's
equation, and trust-region KLs of log-ratios computed with numpy in float64.
"""
import dataclasses
import io

import numpy as np
import pytest
import torch

from quatro_nemo.algos import QuatroConfig, get_algorithm
from quatro_nemo.algos.config import DeltaControllerConfig, LrControlConfig
from quatro_nemo.algos.lr_control import KlAdaptiveLr
from quatro_nemo.algos.step_state import StepMeasurements


def test_rule_follows_the_hand_derived_sequence():
    # delta = 0.1: above 2 delta = 0.2 divide by 1.5, below delta / 2 = 0.05 multiply, else keep;
    # nothing measured (None, 0, nan) keeps; bounds [0.1, 4].
    control = KlAdaptiveLr(factor=1.5, low=0.1, high=4.0)
    measured = [0.5, 0.15, 0.01, 0.04, None, 0.0, float("nan"), 0.03, 0.01, 0.01, 0.2, 0.05]
    expected = [2 / 3, 2 / 3, 1.0, 1.5, 1.5, 1.5, 1.5, 2.25, 3.375, 4.0, 4.0, 4.0]
    got = [control.update(kl, delta=0.1) for kl in measured]
    assert got == pytest.approx(expected, rel=1e-12)
    for _ in range(10):   # 4 / 1.5^9 = 0.104 > 0.1, 4 / 1.5^10 = 0.069: the floor holds
        control.update(1.0, delta=0.1)
    assert control.multiplier == 0.1


def test_rule_brings_an_overshooting_step_into_the_band():
    # A plant whose achieved KL is proportional to the lr: KL = 1.0 at the configured lr, delta 0.1.
    # m = 1 / 1.5^k until 1.0 m <= 0.2: k = 4 (0.1975), then it stays (inside [0.05, 0.2]).
    control = KlAdaptiveLr(factor=1.5, low=0.01, high=10.0)
    for _ in range(20):
        control.update(1.0 * control.multiplier, delta=0.1)
    assert control.multiplier == pytest.approx(1.5 ** -4, rel=1e-12)


@dataclasses.dataclass
class _Trainer:
    lr: float


@dataclasses.dataclass
class _RunConfig:
    algorithm: QuatroConfig
    trainer: _Trainer


def _numpy_trust_region_kl(log_ratios):
    """KL(softmax(l) || uniform_N) per row, float64 numpy (Sec. 2's functional)."""
    l = np.asarray(log_ratios, dtype=np.float64)
    w = np.exp(l - l.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    return (w * np.log(w * l.shape[1])).sum(axis=1)


def _measurements(step):
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    log_ratios = torch.tensor([[0.3, -0.2, 0.1, 0.5], [2.0, -1.0, 0.0, 0.0], [0.05, 0.1, -0.1, 0.0]],
                              dtype=torch.float64) * 3.0 * (1.0 + step)
    return rewards, log_ratios


def _run_hook(state, cfg, steps):
    records = []
    for step in steps:
        step_cfg = state.config_for_step(cfg)
        rewards, log_ratios = _measurements(step)
        state.observe(StepMeasurements(rewards, log_ratios))
        records.append((step_cfg.algorithm.delta, step_cfg.trainer.lr, state.metrics()))
    return records


def test_quatro_state_sets_the_step_config_and_logs_the_achieved_kl():
    config = QuatroConfig(delta=0.02, lr_control=LrControlConfig(kind="kl_adaptive"),
                          delta_controller=DeltaControllerConfig(kind="kl", target=0.01))
    state = get_algorithm("quatro").make_state(config)
    assert state.needs_policy_shift
    cfg = _RunConfig(config, _Trainer(lr=1e-3))
    records = _run_hook(state, cfg, range(3))

    rewards, log_ratios = _measurements(0)
    kl = _numpy_trust_region_kl(log_ratios.numpy()[[0, 2]])   # the constant group (row 1) is left out
    delta0, lr0, metrics0 = records[0]
    assert (delta0, lr0) == (0.02, 1e-3)
    assert metrics0["trust_region/achieved_kl"] == pytest.approx(kl.mean(), rel=1e-12)
    assert metrics0["trust_region/achieved_kl_max"] == pytest.approx(kl.max(), rel=1e-12)
    assert metrics0["trust_region/achieved_over_delta"] == pytest.approx(kl.mean() / 0.02, rel=1e-12)
    assert metrics0["trust_region/lr_multiplier"] == 1.0
    # Step 2's lr: the rule on step 1's KL and radius, by hand.
    assert kl.mean() > 2 * 0.02                          # the step overshot: the lr is cut
    expected_m = 1 / 1.5
    assert records[1][1] == pytest.approx(1e-3 * expected_m, rel=1e-12)
    assert records[1][2]["trust_region/lr_multiplier"] == pytest.approx(expected_m, rel=1e-12)
    # Step 2's radius: the delta controller's rule on the same KL, by hand.
    factor = min(max((0.01 / kl.mean()) ** 0.5, 0.5), 2.0)
    assert records[1][0] == pytest.approx(0.02 * factor, rel=1e-12)
    assert records[1][2]["quatro/delta_used"] == records[1][0]
    assert cfg.trainer.lr == 1e-3 and cfg.algorithm.delta == 0.02   # the run config itself is untouched


def test_quatro_state_resumes_exactly_through_a_pickled_state_dict():
    config = QuatroConfig(delta=0.02, lr_control=LrControlConfig(kind="kl_adaptive"),
                          delta_controller=DeltaControllerConfig(kind="kl", target=0.01))
    cfg = _RunConfig(config, _Trainer(lr=1e-3))
    straight = get_algorithm("quatro").make_state(config)
    expected = _run_hook(straight, cfg, range(5))
    first = get_algorithm("quatro").make_state(config)
    _run_hook(first, cfg, range(2))
    buffer = io.BytesIO()
    torch.save({"algorithm_state": first.state_dict()}, buffer)
    buffer.seek(0)
    resumed = get_algorithm("quatro").make_state(config)
    resumed.load_state_dict(torch.load(buffer, weights_only=False)["algorithm_state"])
    assert _run_hook(resumed, cfg, range(2, 5)) == expected[2:]
    assert resumed.lr_control.multiplier == straight.lr_control.multiplier


def test_fixed_lr_and_other_algorithms_leave_the_config_alone():
    quatro = get_algorithm("quatro").make_state(QuatroConfig())
    cfg = _RunConfig(QuatroConfig(), _Trainer(lr=3e-4))
    assert quatro.config_for_step(cfg) is cfg and quatro.needs_policy_shift   # log_achieved_kl: on for QUATRO
    assert not get_algorithm("quatro").make_state(QuatroConfig(log_achieved_kl=False)).needs_policy_shift
    grpo_spec = get_algorithm("grpo")
    grpo = grpo_spec.make_state(grpo_spec.config_cls())
    assert not grpo.needs_policy_shift and grpo.state_dict() == {}
    grpo = grpo_spec.make_state(grpo_spec.config_cls(log_achieved_kl=True))
    rewards, log_ratios = _measurements(0)
    grpo.observe(StepMeasurements(rewards, log_ratios))
    assert set(grpo.metrics()) == {"trust_region/achieved_kl", "trust_region/achieved_kl_max"}
    grpo.observe(StepMeasurements(torch.zeros(3, 4, dtype=torch.float64), log_ratios))   # all constant
    assert grpo.metrics() == {}


@pytest.mark.parametrize("field, value", [("kind", "line_search"), ("factor", 1.0), ("min", 1.5), ("max", 0.5)])
def test_bad_lr_control_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"QuatroConfig\.lr_control\.{field}\b"):
        QuatroConfig.from_dict({"lr_control": {field: value}})



def test_the_lr_control_section_sets_the_controller():
    assert KlAdaptiveLr.from_config(QuatroConfig()) is None
    controller = KlAdaptiveLr.from_config(QuatroConfig(lr_control=LrControlConfig(kind="kl_adaptive", factor=2.0,
                                                                                  min=0.5, max=4.0)))
    assert (controller.multiplier, controller.factor, controller.low, controller.high) == (1.0, 2.0, 0.5, 4.0)
