"""Start-up validation of the NeMo-Aligner recipe config (``conf/aligner/gpt_quatro_actor.yaml``).

Everything that would otherwise fail deep inside a run (or silently train on the wrong batch
layout) is checked before any model is built; each error names the config key.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from quatro_nemo.algos import AlgorithmConfig, AlgorithmSpec, build_algorithm
from quatro_nemo.algos.schema import register_algorithm_schemas
from quatro_nemo.aligner.rewards import REWARD_KINDS


@dataclass
class QuatroTrainerOptions:
    """``trainer.reinforce.quatro``: options the parent trainer does not have.

    inner_loops:    K, optimizer passes over the same rollouts (pi_old = the rollout policy).
    shuffle_groups: shuffle whole groups (seeded by ``seed + step``, the same on every rank)
                    before cutting the global batch into optimizer-step mini-batches.
    seed:           base seed of that shuffle.
    """

    inner_loops: int = 1
    shuffle_groups: bool = False
    seed: int = 1234

    def __post_init__(self) -> None:
        if isinstance(self.inner_loops, bool) or not isinstance(self.inner_loops, int) or self.inner_loops < 1:
            raise ValueError(f"trainer.reinforce.quatro.inner_loops must be a positive integer, got {self.inner_loops!r}")
        if not isinstance(self.shuffle_groups, bool):
            raise ValueError(f"trainer.reinforce.quatro.shuffle_groups must be true or false, got {self.shuffle_groups!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"trainer.reinforce.quatro.seed must be an integer, got {self.seed!r}")

    @classmethod
    def from_config(cls, section: Optional[Any]) -> "QuatroTrainerOptions":
        values = {} if section is None else dict(OmegaConf.to_container(section, resolve=True)
                                                 if OmegaConf.is_config(section) else section)
        known = {"inner_loops", "shuffle_groups", "seed"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"trainer.reinforce.quatro: unknown key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**values)


def check_save_interval(value: Any) -> None:
    """``trainer.reinforce.save_interval`` must be a positive integer: the checkpoint on
    SIGUSR1/SIGTERM (exit 75, requeue) and at the time limit is NeMo-Aligner's save, which is off
    at 0 (``check_progress``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"trainer.reinforce.save_interval must be a positive integer, got {value!r}: the checkpoint on "
            "SIGUSR1/SIGTERM (exit 75, requeue) and at the time limit is NeMo-Aligner's periodic save"
        )


def register_resolvers() -> None:
    """The OmegaConf resolvers NeMo-Aligner's configs use (conf/aligner/*.yaml)."""
    for name, fn in (("multiply", lambda x, y: x * y), ("int_div", lambda x, y: x // y),
                     ("subtract", lambda x, y: x - y)):
        OmegaConf.register_new_resolver(name, fn, replace=True)


def register_recipe_configs() -> None:
    """What composing conf/aligner/*.yaml needs, before Hydra runs: the resolvers and the algorithm
    schemas in Hydra's ConfigStore (conf/algorithm/<name>.yaml starts from schema/algorithm/<name>,
    so an unknown ``model.quatro.algorithm.*`` key fails while Hydra composes)."""
    register_resolvers()
    register_algorithm_schemas()


def _require(cfg: DictConfig, key: str) -> Any:
    value = OmegaConf.select(cfg, key, default=None)
    if value is None:
        raise ValueError(f"config key {key} is required")
    return value


def _positive_int(cfg: DictConfig, key: str) -> int:
    value = _require(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return value


def data_parallel_size(cfg: DictConfig) -> int:
    """DP size implied by the trainer and model-parallel sizes (nodes x devices / (TP x PP))."""
    world = _positive_int(cfg, "trainer.num_nodes") * _positive_int(cfg, "trainer.devices")
    model_parallel = (cfg.model.get("tensor_model_parallel_size", 1) or 1) * (
        cfg.model.get("pipeline_model_parallel_size", 1) or 1)
    if world % model_parallel != 0:
        raise ValueError(
            f"trainer.num_nodes x trainer.devices ({world}) must be divisible by "
            f"model.tensor_model_parallel_size x model.pipeline_model_parallel_size ({model_parallel})"
        )
    return world // model_parallel


def validate_recipe_config(cfg: DictConfig) -> Tuple[AlgorithmSpec, AlgorithmConfig]:
    """Check the recipe config; return the algorithm (spec, config). Raises ValueError naming the key."""
    section = _require(cfg, "model.quatro.algorithm")
    spec, algorithm_config = build_algorithm(OmegaConf.to_container(section, resolve=True),
                                             source="model.quatro.algorithm")
    reinforce = "trainer.reinforce"
    if OmegaConf.select(cfg, f"{reinforce}.initial_policy_kl_penalty", default=0) != 0:
        raise ValueError(f"{reinforce}.initial_policy_kl_penalty must be 0: the reference KL is "
                         "model.quatro.algorithm.beta (k3 in the loss)")
    check_save_interval(OmegaConf.select(cfg, f"{reinforce}.save_interval", default=None))
    num_responses = _positive_int(cfg, f"{reinforce}.num_rollouts_per_prompt")
    if num_responses < 2:
        raise ValueError(f"{reinforce}.num_rollouts_per_prompt must be >= 2 (group-relative advantages), "
                         f"got {num_responses}")
    num_prompts = _positive_int(cfg, "model.reinforce.num_rollout_samples")
    global_batch_size = _positive_int(cfg, "model.global_batch_size")
    micro_batch_size = _positive_int(cfg, "model.micro_batch_size")
    dp = data_parallel_size(cfg)
    if (num_prompts * num_responses) % global_batch_size != 0:
        raise ValueError(
            f"model.reinforce.num_rollout_samples x {reinforce}.num_rollouts_per_prompt "
            f"({num_prompts} x {num_responses}) must be a multiple of model.global_batch_size ({global_batch_size})"
        )
    if global_batch_size % (micro_batch_size * dp) != 0:
        raise ValueError(
            f"model.global_batch_size ({global_batch_size}) must be divisible by model.micro_batch_size x "
            f"data-parallel size ({micro_batch_size} x {dp})"
        )
    per_rank = num_prompts * num_responses // dp
    forward_mbs = _positive_int(cfg, "model.reinforce.forward_micro_batch_size")
    if per_rank % forward_mbs != 0:
        raise ValueError(
            f"each DP rank's rollout shard ({per_rank} sequences) must be divisible by "
            f"model.reinforce.forward_micro_batch_size ({forward_mbs})"
        )
    QuatroTrainerOptions.from_config(OmegaConf.select(cfg, f"{reinforce}.quatro"))
    kind = OmegaConf.select(cfg, "quatro.reward.kind", default="verifier")
    if kind not in REWARD_KINDS:
        raise ValueError(f"quatro.reward.kind must be one of {list(REWARD_KINDS)}, got {kind!r}")
    for key in data_files(cfg):
        path = _require(cfg, key)
        if not os.path.isfile(path):
            raise ValueError(f"{key}: no such file {path!r}")
    return spec, algorithm_config


def data_files(cfg: DictConfig) -> List[str]:
    """Config keys of the JSONL problem files the recipe reads."""
    return ["quatro.data.train_file", "quatro.data.validation_file"]
