"""Typed configs: validation errors name the field; from_dict rejects unknown keys by name."""
import pytest

from quatro_nemo.algos import (
    ALGORITHMS,
    DAPOConfig,
    GRPOConfig,
    QuatroConfig,
    build_algorithm,
    get_algorithm,
)

BAD_VALUES = [
    (QuatroConfig, "delta", 0.0),
    (QuatroConfig, "delta", -1.0),
    (QuatroConfig, "delta", float("inf")),
    (QuatroConfig, "lambda_min", 0.0),
    (QuatroConfig, "log_ratio", "token"),
    (QuatroConfig, "log_ratio_clamp", -1.0),
    (QuatroConfig, "solver_max_iter", 0),
    (QuatroConfig, "beta", -0.001),
    (QuatroConfig, "loss_agg_mode", "mean"),
    (GRPOConfig, "clip_low", 0.0),
    (GRPOConfig, "eps", -1.0),
    (GRPOConfig, "norm_by_std", "yes"),
    (GRPOConfig, "kl_clamp", -1.0),
    (GRPOConfig, "clip_ratio_c", 1.0),
    (DAPOConfig, "clip_ratio_c", float("inf")),
    (DAPOConfig, "overlong_buffer_len", 0),
    (DAPOConfig, "overlong_penalty_factor", -1.0),
]


@pytest.mark.parametrize("cls,field,value", BAD_VALUES, ids=[f"{c.__name__}.{f}={v}" for c, f, v in BAD_VALUES])
def test_bad_value_names_field(cls, field, value):
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field}"):
        cls(**{field: value})


def test_quatro_clip_needs_both_bounds():
    with pytest.raises(ValueError, match="clip_low"):
        QuatroConfig(clip_low=0.2)


def test_from_dict_rejects_unknown_keys_by_name():
    with pytest.raises(ValueError, match=r"algorithm: unknown key\(s\) \['delt'\]"):
        QuatroConfig.from_dict({"delt": 0.1})
    config = QuatroConfig.from_dict({"delta": 0.05, "log_ratio": "seq_mean"})
    assert config.delta == 0.05 and config.log_ratio == "seq_mean"
    # QUATRO's sections (and their old flat keys) on another algorithm are unknown there, not
    # "renamed": that algorithm has no algorithm.delta_controller.kind to point at.
    for section in ({"delta_controller": {"kind": "kl"}}, {"delta_controller": "kl"}, {"lr_control_factor": 2.0}):
        with pytest.raises(ValueError, match=r"algorithm: unknown key\(s\) \['(delta_controller|lr_control_factor)'\] "
                                             r"for GRPOConfig"):
            GRPOConfig.from_dict(section)
    with pytest.raises(ValueError, match=r"algorithm.delta_controller is now algorithm.delta_controller.kind"):
        QuatroConfig.from_dict({"delta_controller": "kl"})


def test_build_algorithm_from_section():
    spec, config = build_algorithm({"name": "dapo", "clip_high": 0.3})
    assert spec.name == "dapo" and isinstance(config, DAPOConfig) and config.clip_high == 0.3
    with pytest.raises(ValueError, match="algorithm.name"):
        build_algorithm({"delta": 0.1})
    with pytest.raises(ValueError, match="unknown key"):
        build_algorithm({"name": "grpo", "delta": 0.1})


def test_omegaconf_section_round_trip():
    omegaconf = pytest.importorskip("omegaconf")
    section = omegaconf.OmegaConf.create({"name": "quatro", "delta": 0.02, "log_ratio_clamp": None})
    spec, config = build_algorithm(section)
    assert config == QuatroConfig(delta=0.02)


def test_documented_defaults():
    assert QuatroConfig().beta == 0.001 and QuatroConfig().log_ratio == "seq_sum"
    assert (DAPOConfig().clip_low, DAPOConfig().clip_high, DAPOConfig().loss_agg_mode) == (0.2, 0.28, "token-mean")
    gspo = get_algorithm("gspo").config_cls()
    assert (gspo.clip_low, gspo.clip_high) == (3e-4, 4e-4)
    for name in ALGORITHMS:
        assert get_algorithm(name).config_cls().beta == 0.001
