"""Config composition and start-up validation (conf/ + command-line overrides)."""
import pytest

from quatro_nemo.algos import GSPOConfig, QuatroConfig
from quatro_nemo.engine.config import ConfigError, load_config, split_arguments


def test_cpu_default_composes_into_typed_sections():
    cfg = load_config([])
    assert cfg.algorithm_name == "quatro"
    assert isinstance(cfg.algorithm, QuatroConfig)
    assert cfg.task["name"] == "countdown"
    assert cfg.rollout.n >= 2 and cfg.trainer.inner_loops == 1


def test_group_choice_and_key_overrides_from_the_command_line():
    cfg = load_config(["algorithm=gspo", "algorithm.clip_low=0.001", "trainer.inner_loops=4",
                       "rollout.n=4", "task.num_train=64"])
    assert isinstance(cfg.algorithm, GSPOConfig)
    assert cfg.algorithm.clip_low == 0.001
    assert cfg.trainer.inner_loops == 4 and cfg.rollout.n == 4 and cfg.task["num_train"] == 64
    # a field of the algorithm's dataclass that no YAML mentions is still overridable
    cfg = load_config(["algorithm.delta=0.05", "algorithm.log_ratio=seq_mean"])
    assert cfg.algorithm.delta == 0.05 and cfg.algorithm.log_ratio == "seq_mean"


def test_token_budget_is_typed_and_off_by_default():
    assert load_config([]).parallel.max_tokens_per_micro_batch is None
    cfg = load_config(["parallel.max_tokens_per_micro_batch=4096", "parallel.sequence_packing=true"])
    assert cfg.parallel.max_tokens_per_micro_batch == 4096 and cfg.parallel.sequence_packing is True
    assert load_config(["parallel.max_tokens_per_micro_batch=0"]).parallel.max_tokens_per_micro_batch == 0


def test_split_arguments_separates_primary_groups_and_keys():
    primary, groups, keys = split_arguments(["config=quatro_7b", "algorithm=dapo", "trainer.lr=1e-6"])
    assert (primary, groups, keys) == ("quatro_7b", {"algorithm": "dapo"}, ["trainer.lr=1e-6"])


@pytest.mark.parametrize("argv, named", [
    (["trainer.inner_loopz=2"], "trainer.inner_loopz"),
    (["trainer.lr=abc"], "trainer.lr"),
    (["algorithm.delta=-1"], "algorithm.delta"),
    (["algorithm.log_ratio=sideways"], "algorithm.log_ratio"),
    (["algorithm=nope"], "algorithm=nope"),
    (["rollout.n=1"], "rollout.n"),
    (["rollout.top_p=1.5"], "rollout.top_p"),
    (["eval.top_p=0"], "eval.top_p"),
    (["trainer.prompts_per_step=32", "trainer.mini_batch_prompts=5"], "trainer.mini_batch_prompts"),
    (["task.num_trainx=3"], "task.num_trainx"),
    (["parallel.max_tokens_per_micro_batch=1"], "parallel.max_tokens_per_micro_batch"),
    (["parallel.max_tokens_per_micro_batch=-5"], "parallel.max_tokens_per_micro_batch"),
    (["parallel.sequence_packing=true"], "parallel.sequence_packing"),
    (["config=does_not_exist"], "does_not_exist.yaml"),
    (["no_equals_sign"], "no_equals_sign"),
])
def test_invalid_values_fail_at_start_up_naming_the_key(argv, named):
    with pytest.raises(ConfigError) as error:
        load_config(argv)
    assert named in str(error.value)


def test_train_entry_point_reports_config_errors_with_exit_code_2(capsys):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "recipes" / "train.py"
    spec = importlib.util.spec_from_file_location("train_recipe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["algorithm.delta=0"]) == 2
    assert "algorithm.delta" in capsys.readouterr().err
