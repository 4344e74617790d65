"""QUATRO algorithm core: pure PyTorch, no Megatron import.

Public API (docs/interfaces.md):
    solve_dual(rewards [B, N], delta) -> DualSolution         exact per-query dual (dual.py)
    get_advantage_estimator(name)(rewards, config)            quatro | grpo | gpg  (advantages.py)
    get_policy_loss(name)(logprobs, old, adv, mask, config, normalizer, ref_logprobs=, entropy=)
                                                              quatro | grpo | gspo | gmpo | dapo | cispo | gpg
    get_algorithm(name) -> AlgorithmSpec(name, advantage_estimator, policy_loss, config_cls, shape_groups)
    build_algorithm({"name": ..., **fields}) -> (spec, config)
    LossNormalizer(num_sequences, num_tokens)                 GLOBAL counts (aggregation.py)
    ShapedGroups, keep_all_groups, dapo_shape_groups          data-side hooks (reward_shaping.py)
    dapo_filter_groups, overlong_penalty                      DAPO data-side pieces
"""
from quatro_nemo.algos.aggregation import (
    LossNormalizer,
    aggregate_sequences,
    aggregate_tokens,
    count_sequences,
    count_tokens,
)
from quatro_nemo.algos.config import (
    AlgorithmConfig,
    CISPOConfig,
    ClippedRatioConfig,
    DAPOConfig,
    GMPOConfig,
    GPGConfig,
    GroupBaselineConfig,
    GRPOConfig,
    GSPOConfig,
    QuatroConfig,
)
from quatro_nemo.algos.dual import DualSolution, solve_dual
from quatro_nemo.algos.kl import k3_kl
from quatro_nemo.algos.registry import (
    ALGORITHMS,
    AlgorithmSpec,
    build_algorithm,
    get_advantage_estimator,
    get_algorithm,
    get_policy_loss,
    register_advantage_estimator,
    register_policy_loss,
)
from quatro_nemo.algos import advantages as _advantages  # noqa: E402,F401  (registers estimators)
from quatro_nemo.algos import losses as _losses  # noqa: E402,F401  (registers losses)
from quatro_nemo.algos.advantages import AdvantageOutput
from quatro_nemo.algos.reward_shaping import (
    ShapedGroups,
    dapo_filter_groups,
    dapo_shape_groups,
    keep_all_groups,
    overlong_penalty,
)

__all__ = [
    "ALGORITHMS", "AdvantageOutput", "AlgorithmConfig", "AlgorithmSpec", "CISPOConfig",
    "ClippedRatioConfig", "DAPOConfig", "DualSolution", "GMPOConfig", "GPGConfig",
    "GRPOConfig", "GSPOConfig", "GroupBaselineConfig", "LossNormalizer", "QuatroConfig", "ShapedGroups",
    "aggregate_sequences", "aggregate_tokens", "build_algorithm", "count_sequences",
    "count_tokens", "dapo_filter_groups", "dapo_shape_groups", "keep_all_groups", "get_advantage_estimator", "get_algorithm",
    "get_policy_loss", "k3_kl", "overlong_penalty", "register_advantage_estimator",
    "register_policy_loss", "solve_dual",
]
