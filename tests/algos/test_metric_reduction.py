"""Each metric's reduction comes from its declaration (quatro_nemo/algos/metric_reduction.py),
not from its name; every metric a policy loss returns is declared, and declared right.

References: hand-computed means/maxima/minima, and the identities a micro-batch of padding rows
must give under each reduction (0 for a share, -inf for a max, +inf for a min), which follow from
the losses' maths, not from the declarations.
"""
import math

import pytest
import torch

from quatro_nemo.algos import LossNormalizer, get_algorithm
from quatro_nemo.algos.metric_reduction import METRIC_REDUCTIONS, Reduction, reduce_over_updates
from quatro_nemo.megatron.loss import reduce_metrics
from tests.algos.test_losses import LOSS_CASES, make_batch


def test_metric_reduction_kinds_over_updates():
    updates = [{"policy/loss": 1.0, "policy/ratio/max": 1.2, "policy/ratio/min": 0.9},
               {"policy/loss": 3.0, "policy/ratio/max": 1.1, "policy/ratio/min": 0.7}]
    assert reduce_over_updates(updates) == {"policy/loss": 2.0, "policy/ratio/max": 1.2, "policy/ratio/min": 0.7}
    assert reduce_over_updates([]) == {}
    assert math.isfinite(reduce_over_updates(updates)["policy/loss"])


def test_the_reduction_is_the_declared_one_not_the_name_suffix(monkeypatch):
    monkeypatch.setitem(METRIC_REDUCTIONS, "policy/ratio/max", Reduction.MIN)   # a /max key declared a minimum
    monkeypatch.setitem(METRIC_REDUCTIONS, "probe/peak", Reduction.MAX)         # no suffix, declared a maximum
    updates = [{"policy/ratio/max": 1.2, "probe/peak": 4.0}, {"policy/ratio/max": 1.1, "probe/peak": 1.0}]
    assert reduce_over_updates(updates) == {"policy/ratio/max": 1.1, "probe/peak": 4.0}


def test_an_undeclared_metric_is_an_error_naming_it():
    with pytest.raises(KeyError, match="policy/undeclared.*METRIC_REDUCTIONS"):
        reduce_over_updates([{"policy/undeclared": 1.0}])
    with pytest.raises(KeyError, match="policy/undeclared"):   # raised before any collective
        reduce_metrics([{"policy/undeclared": torch.ones(())}], dp_group=object())


IDENTITY = {Reduction.SHARE: 0.0, Reduction.MAX: float("-inf"), Reduction.MIN: float("inf")}


@pytest.mark.parametrize("name,overrides", LOSS_CASES, ids=[f"{n}-{sorted(o)}" for n, o in LOSS_CASES])
def test_every_loss_metric_is_declared_with_the_reduction_padding_shows(name, overrides):
    """A micro-batch of padding rows must leave every metric unchanged when merged, so its value
    is the identity of the metric's true reduction: that identity must match the declaration."""
    spec = get_algorithm(name)
    config = spec.config_cls(**{"beta": 0.05, **overrides})
    logprobs, old, ref, _, adv, entropy = make_batch(num_seqs=3, length=4, seed=12)
    _, metrics = spec.policy_loss(logprobs, old, adv, torch.zeros(3, 4, dtype=old.dtype), config,
                                  LossNormalizer(5, 17), ref_logprobs=ref, entropy=entropy)
    assert metrics
    for key, value in metrics.items():
        assert key in METRIC_REDUCTIONS, key
        assert value.item() == IDENTITY[METRIC_REDUCTIONS[key]], key
