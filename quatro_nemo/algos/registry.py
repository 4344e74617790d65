"""Registries by name: advantage estimators, policy losses, and algorithms.

Adding an algorithm is one decorated function (verl's ``register_adv_est`` /
``register_policy_loss`` pattern) plus one row in ``ALGORITHMS``; the training loop looks
everything up by name and never branches on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Tuple, Type

from quatro_nemo.algos.config import (
    AlgorithmConfig,
    CISPOConfig,
    DAPOConfig,
    GMPOConfig,
    GPGConfig,
    GRPOConfig,
    GSPOConfig,
    QuatroConfig,
)
from quatro_nemo.algos.reward_shaping import dapo_shape_groups, keep_all_groups
from quatro_nemo.algos.step_state import AlgorithmState, QuatroState, TrustRegionLog

ADVANTAGE_ESTIMATORS: Dict[str, Callable] = {}
POLICY_LOSSES: Dict[str, Callable] = {}


def register_advantage_estimator(name: str) -> Callable[[Callable], Callable]:
    def decorate(fn: Callable) -> Callable:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} registered twice")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn
    return decorate


def register_policy_loss(*names: str) -> Callable[[Callable], Callable]:
    """Register one loss function under one or more names (e.g. GRPO and DAPO share PPO clip)."""
    def decorate(fn: Callable) -> Callable:
        for name in names:
            if name in POLICY_LOSSES:
                raise ValueError(f"policy loss {name!r} registered twice")
            POLICY_LOSSES[name] = fn
        return fn
    return decorate


def _lookup(table: Dict[str, Any], kind: str, name: str) -> Any:
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; known: {sorted(table)}")
    return table[name]


def get_advantage_estimator(name: str) -> Callable:
    """``estimator(rewards [B, N], config, sample_weights=None) -> AdvantageOutput(advantages [B, N],
    metrics)`` (``sample_weights``: a stale rollout's, ``off_policy.SampleWeights``)."""
    return _lookup(ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def get_policy_loss(name: str) -> Callable:
    """``loss_fn(logprobs, old_logprobs, advantages, response_mask, config, normalizer,
    ref_logprobs=None, entropy=None) -> (loss, metrics)`` (docs/interfaces.md)."""
    return _lookup(POLICY_LOSSES, "policy loss", name)


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm, as the functions the engine calls (it never looks a name up again):

    advantage_estimator: ``(rewards [B, N], config, sample_weights=None) -> AdvantageOutput``
    policy_loss:         ``(logprobs, old_logprobs, advantages, mask, config, normalizer, ...)``
    config_cls:          the typed config (``quatro_nemo.algos.config``)
    shape_groups:        the data-side hook ``(verifier rewards [B, N], response lengths [B, N],
                         max_new_tokens, config) -> ShapedGroups`` (DAPO: group filter, overlong
                         shaping; every other algorithm: ``keep_all_groups``)
    make_state:          ``(config) -> AlgorithmState``, the state carried between rollout steps
                         (``step_state.py``; QUATRO: adaptive radius and lr; others: none but the
                         achieved-KL log)
    """

    name: str
    advantage_estimator: Callable
    policy_loss: Callable
    config_cls: Type[AlgorithmConfig]
    shape_groups: Callable = keep_all_groups
    make_state: Callable[[AlgorithmConfig], AlgorithmState] = TrustRegionLog

    @staticmethod
    def needs_reference_model(config: AlgorithmConfig) -> bool:
        """The k3 KL to pi_ref is in the loss (``beta > 0``), so log pi_ref must be computed."""
        return config.beta > 0


# name -> (advantage estimator name, policy loss name, config class, data-side hook, state)
# (quatro-math.md Sec. 5)
ALGORITHMS: Dict[str, Tuple[str, str, Type[AlgorithmConfig], Callable, Callable]] = {
    "quatro": ("quatro", "quatro", QuatroConfig, keep_all_groups, QuatroState),
    "grpo": ("grpo", "grpo", GRPOConfig, keep_all_groups, TrustRegionLog),
    "gspo": ("grpo", "gspo", GSPOConfig, keep_all_groups, TrustRegionLog),
    "gmpo": ("grpo", "gmpo", GMPOConfig, keep_all_groups, TrustRegionLog),
    "dapo": ("grpo", "dapo", DAPOConfig, dapo_shape_groups, TrustRegionLog),
    "cispo": ("grpo", "cispo", CISPOConfig, keep_all_groups, TrustRegionLog),
    "gpg": ("gpg", "gpg", GPGConfig, keep_all_groups, TrustRegionLog),
}


def get_algorithm(name: str) -> AlgorithmSpec:
    estimator_name, loss_name, config_cls, shape_groups, make_state = _lookup(ALGORITHMS, "algorithm", name)
    return AlgorithmSpec(
        name=name,
        advantage_estimator=get_advantage_estimator(estimator_name),
        policy_loss=get_policy_loss(loss_name),
        config_cls=config_cls,
        shape_groups=shape_groups,
        make_state=make_state,
    )


def build_algorithm(section: Mapping[str, Any], source: str = "algorithm") -> Tuple[AlgorithmSpec, AlgorithmConfig]:
    """From an ``algorithm:`` config section ``{name: ..., <config fields>}``: (spec, validated config).

    Unknown keys raise ValueError naming them and ``source``.
    """
    values = dict(section.items())
    if "name" not in values:
        raise ValueError(f"{source}.name is required; one of {sorted(ALGORITHMS)}")
    spec = get_algorithm(values.pop("name"))
    return spec, spec.config_cls.from_dict(values, source=source)
