"""quatro_nemo.validation: the one ConfigError, choices that OmegaConf checks while composing and
that behave as their strings, and the rules several sections share (stated once)."""
import json
import pickle
from dataclasses import dataclass

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from quatro_nemo.algos.config import LossAggMode, QuatroConfig
from quatro_nemo.engine.config import Device, TrainerConfig
from quatro_nemo.validation import (ConfigError, check_mini_batches, check_token_budget, choices, coerce_choices)

Hyphenated = choices("Hyphenated", ("token-mean", "seq-mean-token-mean"), __name__)


@dataclass
class _Section:
    mode: Hyphenated = Hyphenated("token-mean")

    def __post_init__(self):
        coerce_choices(self, "section")


def test_a_choice_is_its_string():
    member = Hyphenated("seq-mean-token-mean")
    assert member == "seq-mean-token-mean" and {"seq-mean-token-mean": 1}[member] == 1
    assert f"{member}" == str(member) == "%s" % member == "seq-mean-token-mean"
    assert json.dumps({"m": member}) == '{"m": "seq-mean-token-mean"}'
    assert pickle.loads(pickle.dumps(member)) is member


def test_omegaconf_rejects_a_bad_choice_naming_the_full_key_and_saves_the_string():
    schema = OmegaConf.structured(_Section)
    with pytest.raises(ValidationError) as error:
        OmegaConf.merge(OmegaConf.create({"section": schema}), {"section": {"mode": "token_mean"}})
    assert "section.mode" in str(error.value) and "token-mean" in str(error.value)
    merged = OmegaConf.merge(schema, {"mode": "seq-mean-token-mean"})
    assert OmegaConf.to_object(merged).mode is Hyphenated("seq-mean-token-mean")
    assert OmegaConf.to_yaml(merged).strip() == "mode: seq-mean-token-mean"


def test_sections_built_by_hand_coerce_and_refuse_choices_by_key():
    assert _Section(mode="seq-mean-token-mean").mode is Hyphenated("seq-mean-token-mean")
    with pytest.raises(ConfigError, match=r"section.mode must be one of \['token-mean', 'seq-mean-token-mean'\]"):
        _Section(mode="mean")
    assert QuatroConfig(loss_agg_mode="token-mean").loss_agg_mode is LossAggMode("token-mean")
    with pytest.raises(ConfigError, match="QuatroConfig.log_ratio"):
        QuatroConfig(log_ratio="sideways")
    assert TrainerConfig(device="cpu").device is Device.cpu
    with pytest.raises(ConfigError, match="trainer.device"):
        TrainerConfig(device="gpu")


def test_mini_batch_rule_stated_once():
    assert check_mini_batches(32, None) == 32 and check_mini_batches(32, 8, data_parallel=4) == 8
    with pytest.raises(ConfigError, match="trainer.mini_batch_prompts=5 does not divide trainer.prompts_per_step=32"):
        check_mini_batches(32, 5)
    with pytest.raises(ConfigError, match="trainer.mini_batch_prompts=8 is not divisible by data_parallel=3"):
        check_mini_batches(48, 8, data_parallel=3)


def test_token_budget_rule_stated_once():
    for off in (None, 0):
        check_token_budget(off)
    check_token_budget(2, pack=True)
    for bad in (1, -5):
        with pytest.raises(ConfigError, match=f"parallel.max_tokens_per_micro_batch={bad} must be >= 2"):
            check_token_budget(bad)
    with pytest.raises(ConfigError, match="parallel.sequence_packing"):
        check_token_budget(None, pack=True)


@pytest.mark.parametrize("overrides, key, options", [
    (["model.architecture=llama"], "model.architecture", "gpt, qwen2"),
    (["model.normalization=BatchNorm"], "model.normalization", "LayerNorm, RMSNorm"),
    (["model.position_embedding=alibi"], "model.position_embedding", "learned_absolute, rope"),
    (["model.params_dtype=float8"], "model.params_dtype", "float32, bfloat16, float16"),
    (["eval.ucc_criterion=levenshtein"], "eval.ucc_criterion", "task, code, exact"),
    (["task.reward=partial"], "task.reward", "binary, graded"),
    (["config=quatro_1p5b", "task.verifier=lean"], "task.verifier", "countdown, math, code"),
])
def test_hydra_rejects_a_bad_choice_while_composing_naming_the_key(overrides, key, options):
    from quatro_nemo.engine.config import load_config

    with pytest.raises(ConfigError) as error:
        load_config(overrides)
    message = str(error.value)
    assert f"full_key: {key}" in message and options in message, message


def test_choices_of_a_composed_run_config_are_members_that_read_as_their_strings():
    from quatro_nemo.engine.config import load_config, UccCriterion
    from quatro_nemo.megatron.models import Architecture, ParamsDtype

    cfg = load_config(["model.architecture=qwen2", "eval.ucc_criterion=rouge_l"])
    assert cfg.model.architecture is Architecture.qwen2 and cfg.model.params_dtype is ParamsDtype.float32
    assert cfg.model.normalization == "RMSNorm" and cfg.model.position_embedding == "rope"   # qwen2's flavour
    assert cfg.eval.ucc_criterion is UccCriterion("rouge_l") and f"{cfg.eval.ucc_criterion}" == "rouge_l"


def test_sandbox_cgroups_is_a_choice_named_by_its_run_config_key():
    from quatro_nemo.rewards import get_verifier
    from quatro_nemo.rewards.sandbox import CgroupMode, SandboxConfig

    assert SandboxConfig(cgroups="off").cgroups is CgroupMode.off and SandboxConfig().cgroups == "auto"
    refused = (r"SandboxConfig.cgroups \(task.verifier_options.cgroups in a run config\) must be one of "
               r"\['auto', 'required', 'off'\], got 'sometimes'")
    with pytest.raises(ConfigError, match=refused):
        SandboxConfig(cgroups="sometimes")
    with pytest.raises(ConfigError, match=refused):      # the run config's way in: task.verifier_options
        get_verifier("code", cgroups="sometimes")


def test_evaluation_ucc_metric_is_a_similarity_metric_or_precomputed():
    from quatro_nemo.eval.report import MetricsConfig, UccMetric

    assert MetricsConfig(ucc_metric="precomputed").ucc_metric is UccMetric("precomputed")
    assert MetricsConfig(ucc_metric="tfidf").ucc_threshold == 0.9     # DEFAULT_THRESHOLDS["tfidf"]
    with pytest.raises(ConfigError, match=r"MetricsConfig.ucc_metric must be one of \['code', 'exact', 'jaccard', "
                                          r"'rouge_l', 'edit', 'tfidf', 'embedding', 'precomputed'\], got 'bleu'"):
        MetricsConfig(ucc_metric="bleu")


def test_memory_plan_runtime_refuses_a_device_or_backend_outside_its_choices():
    from quatro_nemo.engine.config import RolloutBackendName
    from quatro_nemo.engine.memory_plan import PlannedDevice, Runtime

    runtime = Runtime(device="cpu", rollout_backend="megatron")
    assert runtime.device is PlannedDevice("cpu") and runtime.rollout_backend is RolloutBackendName.megatron
    assert Runtime.detect(Device.auto, RolloutBackendName.vllm).device is PlannedDevice("cuda")   # auto plans a GPU
    with pytest.raises(ConfigError, match=r"Runtime.device must be one of \['cpu', 'cuda'\], got 'auto'"):
        Runtime(device="auto")
    with pytest.raises(ConfigError, match=r"Runtime.rollout_backend must be one of \['megatron', 'vllm'\], "
                                          r"got 'sglang'"):
        Runtime(rollout_backend="sglang")
