"""Config composition (Hydra over conf/) and start-up validation, through load_config and through
recipes/train.py's command line."""
import dataclasses
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from quatro_nemo.algos import GSPOConfig, QuatroConfig
from quatro_nemo.engine.config import (ConfigError, ExperimentSections, LoggingConfig, load_config, run_hydra_app,
                                       split_primary, validate)
from quatro_nemo.tasks.countdown.problems import CountdownTaskConfig
from quatro_nemo.tasks.countdown.task import CountdownTaskSection
from quatro_nemo.tasks.jsonl import JsonlTaskConfig

REPO = pathlib.Path(__file__).resolve().parents[2]
TRAIN = REPO / "recipes" / "train.py"


def test_cpu_default_composes_into_typed_sections():
    cfg = load_config([])
    assert cfg.algorithm_name == "quatro"
    assert isinstance(cfg.algorithm, QuatroConfig)
    assert isinstance(cfg.task, CountdownTaskSection) and cfg.task.name == "countdown"
    assert cfg.rollout.n >= 2 and cfg.trainer.inner_loops == 1
    # conf/config.yaml's values (hand-copied), over the dataclasses' defaults
    assert (cfg.task.max_number, cfg.task.max_target, cfg.warmstart.steps, cfg.warmstart.all_numbers) == (9, 60, 3000, 0.8)
    assert cfg.task.problems() == CountdownTaskConfig(max_number=9, max_target=60, num_train=1024, num_heldout=128)
    assert cfg.model.hidden_size == 64 and cfg.model.vocab_size is None  # null in conf/model/tiny.yaml: the task's


def test_group_choice_and_key_overrides_from_the_command_line():
    cfg = load_config(["algorithm=gspo", "algorithm.clip_low=0.001", "trainer.inner_loops=4",
                       "rollout.n=4", "task.num_train=64"])
    assert cfg.algorithm == GSPOConfig(clip_low=0.001)  # the dataclass's defaults for every other field
    assert cfg.trainer.inner_loops == 4 and cfg.rollout.n == 4 and cfg.task.num_train == 64
    # a field of the algorithm's dataclass that no YAML mentions is still overridable
    cfg = load_config(["algorithm.delta=0.05", "algorithm.log_ratio=seq_mean"])
    assert cfg.algorithm == QuatroConfig(delta=0.05, log_ratio="seq_mean")
    # Hydra's ++key=value overrides too
    assert load_config(["++algorithm.delta=0.2"]).algorithm.delta == 0.2


def test_cluster_config_has_typed_task_model_and_cluster_sections():
    cfg = load_config(["config=quatro_7b", "cluster.nodes=2"])
    assert isinstance(cfg.task, JsonlTaskConfig) and cfg.task.verifier == "math"
    assert cfg.model.num_layers == 28 and cfg.model.extra["recompute_granularity"] == "full"
    assert cfg.cluster.nodes == 2 and cfg.vllm.tensor_parallel == 2 and cfg.scale.max_prompt_tokens == 512


def test_token_budget_is_typed_and_off_by_default():
    assert load_config([]).parallel.max_tokens_per_micro_batch is None
    cfg = load_config(["parallel.max_tokens_per_micro_batch=4096", "parallel.sequence_packing=true"])
    assert cfg.parallel.max_tokens_per_micro_batch == 4096 and cfg.parallel.sequence_packing is True
    assert load_config(["parallel.max_tokens_per_micro_batch=0"]).parallel.max_tokens_per_micro_batch == 0


def test_config_argument_chooses_the_primary_config(monkeypatch):
    assert split_primary(["config=quatro_7b", "algorithm=dapo", "trainer.lr=1e-6"]) == (
        "quatro_7b", ["algorithm=dapo", "trainer.lr=1e-6"])
    assert split_primary(["trainer.lr=1e-6"]) == ("config", ["trainer.lr=1e-6"])
    # a recipe's Hydra app gets Hydra's own --config-name; everything else as given
    seen = []
    monkeypatch.setattr(sys, "argv", ["train.py"])
    assert run_hydra_app(lambda: seen.append(sys.argv[1:]), ["-m", "config=quatro_7b", "algorithm=dapo,gspo"]) == 0
    assert seen == [["--config-name=quatro_7b", "-m", "algorithm=dapo,gspo"]]


def test_config_argument_and_hydras_config_name_compose_the_same(capsys, tmp_path, monkeypatch):
    """recipes/train.py config=NAME (README, slurm/) is Hydra's --config-name=NAME."""
    monkeypatch.chdir(tmp_path)
    printed = []
    for primary in ("config=quatro_7b", "--config-name=quatro_7b"):
        assert _train_recipe().main([primary, "algorithm=gspo", "--cfg", "job"]) == 0
        printed.append(OmegaConf.create(capsys.readouterr().out))
    assert printed[0] == printed[1] and printed[0].model.hidden_size == 3584 and printed[0].algorithm.name == "gspo"


def test_saved_run_config_validates_to_the_same_config(tmp_path):
    """The run directory's config.yaml (what evaluation and generation reload) gives back the
    same typed config, and so does an older run's (a 'choices' key, no cluster sections)."""
    cfg = load_config(["algorithm=dapo", "task.num_train=64"])
    path = tmp_path / "config.yaml"
    OmegaConf.save(cfg.raw, path)
    again = validate(OmegaConf.load(path))
    assert again == cfg
    older = OmegaConf.load(path)
    for section in ("cluster", "scale", "vllm"):
        del older[section]
    older.choices = {"model": "tiny", "algorithm": "dapo", "config": "config"}
    assert validate(older).algorithm == cfg.algorithm and validate(older).task == cfg.task


def test_quatro_sections_compose_from_nested_overrides():
    """algorithm.<section>.<field> sets one field of QUATRO's nested sections, the others keep
    their defaults (a whole section as a Hydra dict works too)."""
    cfg = load_config(["algorithm.delta_controller.kind=kl", "algorithm.delta_controller.target=0.02",
                       "algorithm.delta_per_query={kind: reward_variance, cap_fraction: 0.5}",
                       "algorithm.lr_control.kind=kl_adaptive", "algorithm.lr_control.max=4"])
    algo = cfg.algorithm
    assert (algo.delta_controller.kind, algo.delta_controller.target, algo.delta_controller.gain) == ("kl", 0.02, 0.5)
    assert (algo.delta_per_query.kind, algo.delta_per_query.cap_fraction, algo.delta_per_query.variance_ref) \
        == ("reward_variance", 0.5, 0.25)
    assert (algo.lr_control.kind, algo.lr_control.max, algo.lr_control.factor) == ("kl_adaptive", 4.0, 1.5)
    assert algo.adaptive_delta and not load_config([]).algorithm.adaptive_delta


def test_a_run_saved_with_quatros_flat_keys_validates_to_the_nested_config(tmp_path):
    """A run's config.yaml written before QUATRO's sections existed (flat delta_controller_* /
    delta_per_query / delta_variance_ref / delta_cap_fraction / lr_control_* keys) reads as the
    same config written with the sections."""
    cfg = load_config(["algorithm.delta_controller.kind=kl", "algorithm.delta_controller.target=0.02",
                       "algorithm.delta_controller.max=0.5", "algorithm.delta_per_query.kind=reward_variance",
                       "algorithm.delta_per_query.variance_ref=0.2", "algorithm.lr_control.kind=kl_adaptive",
                       "algorithm.lr_control.min=0.1"])
    saved = OmegaConf.to_container(cfg.raw)
    old = {key: value for key, value in saved["algorithm"].items()
           if key not in ("delta_controller", "delta_per_query", "lr_control")}
    old.update(delta_controller="kl", delta_controller_target=0.02, delta_controller_gain=0.5,
               delta_controller_max_factor=2.0, delta_controller_min=0.001, delta_controller_max=0.5,
               delta_per_query="reward_variance", delta_variance_ref=0.2, delta_cap_fraction=0.9,
               lr_control="kl_adaptive", lr_control_factor=1.5, lr_control_min=0.1, lr_control_max=10.0)
    path = tmp_path / "config.yaml"
    OmegaConf.save(OmegaConf.create(dict(saved, algorithm=old)), path)
    assert validate(OmegaConf.load(path)) == cfg


@pytest.mark.parametrize("argv, named", [
    (["trainer.inner_loopz=2"], "trainer.inner_loopz"),
    (["++trainer.inner_loopz=2"], "trainer.inner_loopz"),
    (["++inner_loopz=2"], "inner_loopz"),
    (["trainer.lr=abc"], "trainer.lr"),
    (["algorithm.delta=-1"], "algorithm.delta"),
    (["algorithm.log_ratio=sideways"], "algorithm.log_ratio"),
    (["algorithm.loss_agg_mode=mean"], "algorithm.loss_agg_mode"),        # choices: Hydra refuses them
    (["algorithm.delta_controller.kind=pid"], "algorithm.delta_controller.kind"),
    (["algorithm.delta_controller.gain=2"], "algorithm.delta_controller.gain must be in (0, 2)"),
    (["algorithm.lr_control.factor=1"], "algorithm.lr_control.factor must be > 1"),
    (["algorithm.delta_per_query.cap_fraction=1"], "algorithm.delta_per_query.cap_fraction must be in (0, 1)"),
    (["algorithm.lr_control.facter=2"], "algorithm.lr_control.facter"),
    (["algorithm.delta_controller=kl"], "algorithm.delta_controller is now algorithm.delta_controller.kind"),
    (["algorithm.delta_controller_target=0.02"],
     "algorithm.delta_controller_target is now algorithm.delta_controller.target"),
    (["++algorithm.delta_cap_fraction=0.5"], "algorithm.delta_cap_fraction is now algorithm.delta_per_query.cap_fraction"),
    (["trainer.device=gpu"], "trainer.device"),
    (["rollout.backend=sglang"], "rollout.backend"),
    (["algorithm=gspo", "algorithm.delta=0.1"], "algorithm.delta"),  # a QUATRO key on GSPO
    (["algorithm.name=gspo"], "algorithm.name"),
    (["algorithm=nope"], "algorithm/nope"),
    (["rollout.n=1"], "rollout.n"),
    (["rollout.top_p=1.5"], "rollout.top_p"),
    (["eval.top_p=0"], "eval.top_p"),
    (["trainer.prompts_per_step=32", "trainer.mini_batch_prompts=5"], "trainer.mini_batch_prompts"),
    (["task.num_trainx=3"], "task.num_trainx"),
    (["task.name=jsonl"], "task.name"),
    (["model.hidden_size=63"], "model.hidden_size"),
    (["warmstart.steps=0"], "warmstart.steps"),
    (["cluster.nodez=2"], "cluster.nodez"),
    (["config=quatro_7b", "cluster.gpus_per_node=1"], "cluster.gpus_per_node"),
    (["parallel.max_tokens_per_micro_batch=1"], "parallel.max_tokens_per_micro_batch"),
    (["parallel.max_tokens_per_micro_batch=-5"], "parallel.max_tokens_per_micro_batch"),
    (["parallel.sequence_packing=true"], "parallel.sequence_packing"),
    (["rollout.importance_correction=token"], "rollout.importance_correction"),   # megatron: no engine gap
    (["rollout.backend=vllm", "rollout.importance_correction=tokens"], "rollout.importance_correction"),
    (["rollout.importance_cap=0"], "rollout.importance_cap"),
    (["rollout.pipeline.max_staleness=-1"], "rollout.pipeline.max_staleness"),
    (["rollout.pipeline.max_staleness=1.5"], "rollout.pipeline.max_staleness"),
    (["rollout.pipeline.ess_floor=1.5"], "rollout.pipeline.ess_floor"),
    (["rollout.pipeline.correction=decoupled"], "rollout.pipeline.correction"),
    (["rollout.pipeline.weight=token"], "rollout.pipeline.weight"),
    (["rollout.pipeline.executor=threads"], "rollout.pipeline.executor"),
    (["rollout.pipeline.executor=process", "parallel.tensor=2"], "rollout.pipeline.executor=process needs parallel.tensor=1"),
    (["rollout.pipeline.executor=process", "rollout.backend=vllm", "trainer.device=cpu"], "rollout.backend=vllm"),
    (["rollout.pipeline.take_timeout_s=0"], "rollout.pipeline.take_timeout_s"),
    (["rollout.pipeline.max_staleness=1", "rollout.backend=vllm", "rollout.importance_correction=token"],
     "rollout.pipeline.correction=proximal"),
    (["config=does_not_exist"], "does_not_exist"),
    (["no_equals_sign"], "no_equals_sign"),
])
def test_invalid_values_fail_at_start_up_naming_the_key(argv, named):
    with pytest.raises(ConfigError) as error:
        load_config(argv)
    assert named in str(error.value)


@pytest.mark.parametrize("setting, backend, params_dtype, resolved", [
    ("auto", "megatron", "float32", "none"),     # the trained model samples: the same kernels
    ("auto", "megatron", "bfloat16", "none"),
    ("auto", "vllm", "float32", "none"),         # different kernels, float32: rounding-level gap
    ("auto", "vllm", "bfloat16", "token"),       # bf16 vLLM vs megatron/TE: truncated IS per token
    ("none", "vllm", "bfloat16", "none"),        # an explicit setting is kept
    ("sequence", "vllm", "float32", "sequence"),
])
def test_importance_correction_auto_resolves_by_backend_and_precision(setting, backend, params_dtype, resolved):
    from quatro_nemo.engine.config import resolve_importance_correction

    assert resolve_importance_correction(setting, backend, params_dtype) == resolved
    # under the pipeline's proximal correction auto adds no second pi_prox / mu weight
    expected = "none" if setting == "auto" else resolved
    assert resolve_importance_correction(setting, backend, params_dtype, proximal_pipeline=True) == expected


@pytest.mark.parametrize("argv, resolved", [
    ([], "none"),                                                     # the CPU default: megatron sampler
    (["config=cpu_vllm"], "none"),                                    # vLLM's CPU build, float32
    (["config=quatro_7b"], "token"),                                  # bf16 vLLM on GPUs
    (["config=quatro_7b", "rollout.importance_correction=none"], "none"),
    # the pipeline's proximal correction already weights by pi_prox / mu (docs/quatro-math.md Sec. 9.5)
    (["config=quatro_7b", "rollout.pipeline.max_staleness=1"], "none"),
    (["rollout.pipeline.max_staleness=1"], "none"),
])
def test_the_resolved_importance_correction_is_what_the_run_uses_and_saves(argv, resolved, tmp_path):
    cfg = load_config(argv)
    assert cfg.rollout.importance_correction == resolved
    saved = tmp_path / "config.yaml"
    OmegaConf.save(cfg.raw, saved)  # what the loop writes to the run directory
    assert OmegaConf.load(saved).rollout.importance_correction == resolved
    assert validate(OmegaConf.load(saved)).rollout.importance_correction == resolved


def _train_recipe():
    spec = importlib.util.spec_from_file_location("train_recipe", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, code, named", [
    (["algorithm.delta=0"], 2, "algorithm.delta"),            # our validation: exit 2
    (["algorithm.lr_control=kl_adaptive"], 2, "algorithm.lr_control is now algorithm.lr_control.kind"),
    (["trainer.inner_loopz=2"], 1, "trainer.inner_loopz"),    # Hydra's rejection of an override: exit 1
    (["++trainer.inner_loopz=2"], 2, "trainer.inner_loopz"),
    (["trainer.lr=abc"], 1, "trainer.lr"),
    (["trainer.device=gpu"], 1, "trainer.device"),            # a choice outside its options: Hydra's rejection
    (["algorithm=nope"], 1, "algorithm/nope"),
])
def test_train_entry_point_rejects_bad_config_before_training(argv, code, named, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    assert _train_recipe().main([*argv, f"run.dir={run_dir}"]) == code
    assert named in capsys.readouterr().err
    assert not (run_dir / "config.yaml").exists()   # nothing trained
    assert set(os.listdir(tmp_path)) <= {"run"} and os.getcwd() == str(tmp_path)   # no outputs/, no chdir
    assert not os.path.exists(run_dir) or os.listdir(run_dir) == []                  # no .hydra/


def test_cfg_job_prints_the_composed_config_without_running(tmp_path):
    run_dir = tmp_path / "never_created"
    result = subprocess.run([sys.executable, str(TRAIN), "config=quatro_7b", "algorithm=gspo", "trainer.lr=2e-6",
                             f"run.dir={run_dir}", "--cfg", "job"], cwd=tmp_path, capture_output=True, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert result.returncode == 0, result.stderr
    printed = OmegaConf.create(result.stdout)
    assert printed.algorithm.name == "gspo" and printed.algorithm.clip_low == GSPOConfig().clip_low
    assert printed.trainer.lr == 2e-6 and printed.model.hidden_size == 3584 and printed.task.name == "jsonl"
    # every section of the schema, with the dataclasses' defaults where no YAML sets a key
    assert set(printed) == {f.name for f in dataclasses.fields(ExperimentSections)}
    assert printed.logging == OmegaConf.structured(LoggingConfig()) and printed.run.resume is True
    assert not run_dir.exists() and sorted(os.listdir(tmp_path)) == []   # no outputs/, no .hydra/
    # what it prints is what a run validates
    assert dataclasses.asdict(validate(printed)) == dataclasses.asdict(
        load_config(["config=quatro_7b", "algorithm=gspo", "trainer.lr=2e-6", f"run.dir={run_dir}"]))


def test_every_end_token_of_a_checkpoint_stops_responses(tmp_path):
    """Qwen2.5 base checkpoints end a response with <|endoftext|> or <|im_end|>: the tokenizer names
    one, config.json and generation_config.json (an int or a list) the others."""
    import json

    from quatro_nemo.tasks.jsonl import checkpoint_end_tokens

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 151643}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert checkpoint_end_tokens(str(tmp_path), 151643) == (151643, 151645)
    assert checkpoint_end_tokens(str(tmp_path), None) == (151643, 151645)
    (tmp_path / "generation_config.json").unlink()
    assert checkpoint_end_tokens(str(tmp_path), 7) == (7, 151643)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        checkpoint_end_tokens(str(tmp_path), None)
