"""The run configuration: YAML files under conf/, composed Hydra-style, validated into dataclasses.

Layout of conf/ (the same as a Hydra config directory):

    conf/config.yaml            the primary config (the embedded CPU default)
    conf/<group>/<option>.yaml  one option of a config group (model/, algorithm/, ...)

A primary config starts with a Hydra-style ``defaults:`` list choosing one option per group,
e.g. ``- algorithm: quatro``. Command-line arguments are OmegaConf dot-list overrides:

    config=quatro_1p5b          choose the primary config file (conf/quatro_1p5b.yaml)
    algorithm=gspo              choose a group option (conf/algorithm/gspo.yaml)
    algorithm.delta=0.1         override one key

Composition order (later wins): group options, the primary file's own keys, command-line keys.
The ``algorithm`` and ``model`` sections start from their dataclass defaults, so every field of
the algorithm's config can be overridden without being repeated in YAML. Unknown keys and
ill-typed values fail at start-up with the full key in the message.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from quatro_nemo.algos import get_algorithm

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf")


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key or file."""


# --------------------------------------------------------------------------------------------
# Sections owned by the engine (the model, algorithm, task and warm-start sections are validated
# by their own dataclasses in quatro_nemo.megatron.models, quatro_nemo.algos and quatro_nemo.data).
# --------------------------------------------------------------------------------------------


@dataclass
class RunConfig:
    dir: str = "runs/cpu_default"   # run directory: config, metrics, checkpoints, report
    seed: int = 1234
    resume: bool = True             # restart the same command -> continue from the last checkpoint
    progress_bar: bool = True       # a tqdm bar on a terminal (never in files or under SLURM logs)


@dataclass
class ParallelConfig:
    tensor: int = 1                 # tensor-parallel size
    pipeline: int = 1               # pipeline-parallel size (data parallel = world / (tensor*pipeline))
    micro_batch_size: int = 64      # sequences per micro-batch in forward/backward (padded to the batch width)
    # Token budget per micro-batch (0/None: off, micro_batch_size applies): rows sorted by length,
    # binned so that rows x longest row <= budget, each micro-batch trimmed to its longest row.
    max_tokens_per_micro_batch: Optional[int] = None
    sequence_packing: bool = False  # THD packing of each budget micro-batch (GPU, Transformer Engine only)


@dataclass
class TrainerConfig:
    device: str = "auto"            # auto | cpu | cuda
    steps: int = 20                 # rollout steps (each: rollout -> advantages -> K inner loops)
    prompts_per_step: int = 32      # B: prompts per rollout step (the global batch)
    inner_loops: int = 1            # K: optimizer passes over the same rollouts (pi_old fixed)
    mini_batch_prompts: Optional[int] = None  # prompts per optimizer step; None = prompts_per_step
    lr: float = 1e-3
    lr_warmup_steps: int = 0        # linear warm-up in optimizer steps
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0          # global grad-norm clip; 0 disables
    checkpoint_every: int = 5       # rollout steps between checkpoints (0: only at the end/signal)
    keep_checkpoints: int = 2
    eval_every: int = 0             # rollout steps between held-out evaluations (0: start and end)
    log_every: int = 1


@dataclass
class RolloutConfig:
    backend: str = "megatron"       # megatron (CPU/GPU) | vllm (GPU)
    n: int = 8                      # N: responses per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32        # maximum response length in tokens


@dataclass
class EvalConfig:
    num_problems: int = 64          # held-out problems evaluated
    n_samples: int = 32             # samples per problem (the paper uses 256)
    temperature: float = 1.0
    top_p: float = 0.7              # paper: top-p 0.7 at evaluation
    ucc_criterion: str = "exact"    # near-duplicate criterion for UCC@k (see quatro_nemo.eval)
    ucc_threshold: float = 1.0


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "quatro-nemo"


ENGINE_SECTIONS = {
    "run": RunConfig,
    "parallel": ParallelConfig,
    "trainer": TrainerConfig,
    "rollout": RolloutConfig,
    "eval": EvalConfig,
    "logging": LoggingConfig,
}


# --------------------------------------------------------------------------------------------
# Composition
# --------------------------------------------------------------------------------------------


def _load_yaml(path: str) -> DictConfig:
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        return OmegaConf.load(path)
    except Exception as exc:  # yaml errors carry line numbers in their message
        raise ConfigError(f"cannot parse {path}: {exc}") from exc


def config_groups(conf_dir: str = CONF_DIR) -> List[str]:
    return sorted(d for d in os.listdir(conf_dir) if os.path.isdir(os.path.join(conf_dir, d)))


def _group_options(group: str, conf_dir: str) -> List[str]:
    folder = os.path.join(conf_dir, group)
    return sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))


def split_arguments(argv: Sequence[str], conf_dir: str = CONF_DIR) -> Tuple[str, Dict[str, str], List[str]]:
    """Split command-line arguments into (primary config name, group choices, key overrides)."""
    primary = "config"
    groups = config_groups(conf_dir)
    choices: Dict[str, str] = {}
    overrides: List[str] = []
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(f"argument {arg!r} is not of the form key=value")
        key, value = arg.split("=", 1)
        if key == "config":
            primary = value
        elif key in groups:
            choices[key] = value
        else:
            overrides.append(arg)
    return primary, choices, overrides


def _defaults_list(primary: DictConfig, path: str) -> Dict[str, str]:
    chosen: Dict[str, str] = {}
    for entry in primary.get("defaults", []) or []:
        if isinstance(entry, str) and entry == "_self_":
            continue
        if not isinstance(entry, DictConfig) or len(entry) != 1:
            raise ConfigError(f"{path}: each defaults entry must be 'group: option', got {entry}")
        (group, option), = entry.items()
        chosen[str(group)] = str(option)
    return chosen


def _section_defaults(section: str, given: DictConfig) -> DictConfig:
    """Dataclass defaults of a section validated by another layer, so that every field of its
    dataclass can be overridden without being repeated in YAML (empty for free-form sections)."""
    if section == "algorithm":
        name = given.get("name")
        if name is None:
            raise ConfigError("the algorithm section has no 'name'")
        spec = get_algorithm(str(name))
        return OmegaConf.merge({"name": str(name)}, dataclasses.asdict(spec.config_cls()))
    if section == "model":
        from quatro_nemo.megatron.models import ModelConfig

        # the raw field defaults: the architecture's flavour (norm, SwiGLU, RoPE...) stays None
        # until ModelConfig.__post_init__ fills it in for the chosen architecture
        return OmegaConf.create(_raw_field_defaults(ModelConfig))
    if section == "task":
        from quatro_nemo.engine.task import task_defaults

        return OmegaConf.create(task_defaults(str(given.get("name"))))
    if section == "warmstart":
        from quatro_nemo.engine.warmstart import WarmStartConfig

        return OmegaConf.create(dataclasses.asdict(WarmStartConfig()))
    from quatro_nemo.engine.memory_plan import PLAN_SECTIONS

    if section in PLAN_SECTIONS:  # cluster, scale, vllm: the cluster-scale settings
        return OmegaConf.create(dataclasses.asdict(PLAN_SECTIONS[section]()))
    return OmegaConf.create({})


def _raw_field_defaults(cls: type) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return out


def compose(argv: Sequence[str] = (), conf_dir: str = CONF_DIR) -> DictConfig:
    """Compose conf/ files and command-line overrides into one config (validated by `validate`)."""
    primary_name, cli_choices, overrides = split_arguments(argv, conf_dir)
    primary_path = os.path.join(conf_dir, primary_name + ".yaml")
    primary = _load_yaml(primary_path)
    choices = _defaults_list(primary, primary_path)
    choices.update(cli_choices)

    cfg = OmegaConf.create({name: dataclasses.asdict(cls()) for name, cls in ENGINE_SECTIONS.items()})
    for group, option in choices.items():
        options = _group_options(group, conf_dir) if os.path.isdir(os.path.join(conf_dir, group)) else []
        if option not in options:
            raise ConfigError(f"{group}={option}: no such option; choose one of {options} (conf/{group}/)")
        option_cfg = _load_yaml(os.path.join(conf_dir, group, option + ".yaml"))
        cfg[group] = OmegaConf.merge(_section_defaults(group, option_cfg), option_cfg)

    body = OmegaConf.masked_copy(primary, [k for k in primary if k != "defaults"])
    for section in body:
        if section not in cfg:  # a section the primary file introduces (task, warmstart, ...)
            cfg[section] = _section_defaults(str(section), body[section])
    try:
        # The files may add keys (each section's dataclass validates them in `validate`); the
        # command line may only override keys that exist, so a typo fails here, by name.
        cfg = OmegaConf.merge(cfg, body)
        OmegaConf.set_struct(cfg, True)
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"config key {getattr(exc, 'full_key', '?')}: {getattr(exc, 'msg', exc)} "
                          f"(check the spelling; conf/ lists every key)") from exc
    OmegaConf.set_struct(cfg, False)
    cfg["choices"] = dict(choices, config=primary_name)
    return cfg


# --------------------------------------------------------------------------------------------
# Validation into typed dataclasses
# --------------------------------------------------------------------------------------------


@dataclass
class ExperimentConfig:
    """Every section, typed. Built once at start-up by `load_config`."""

    run: RunConfig
    parallel: ParallelConfig
    trainer: TrainerConfig
    rollout: RolloutConfig
    eval: EvalConfig
    logging: LoggingConfig
    algorithm_name: str
    algorithm: Any                  # the algorithm's config dataclass (quatro_nemo.algos)
    model: Dict[str, Any]           # validated by quatro_nemo.megatron.models.ModelConfig
    task: Dict[str, Any]            # validated by the task's own config
    warmstart: Dict[str, Any] = field(default_factory=dict)
    other: Dict[str, Any] = field(default_factory=dict)  # sections of other layers (cluster, scale, vllm)
    raw: Optional[DictConfig] = None  # the composed config, saved to the run directory


def _typed_section(cfg: DictConfig, name: str, cls: type) -> Any:
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cls), cfg[name])
    except OmegaConfBaseException as exc:
        raise ConfigError(f"config key {name}.{getattr(exc, 'full_key', '?')}: {getattr(exc, 'msg', exc)}") from exc
    return OmegaConf.to_object(merged)


def _positive(key: str, value: Any) -> None:
    if value is None or value <= 0:
        raise ConfigError(f"{key} must be > 0, got {value!r}")


def _check_engine_sections(c: ExperimentConfig) -> None:
    t, r, p, e = c.trainer, c.rollout, c.parallel, c.eval
    for key, value in [("trainer.steps", t.steps), ("trainer.prompts_per_step", t.prompts_per_step),
                       ("trainer.inner_loops", t.inner_loops), ("trainer.lr", t.lr),
                       ("rollout.max_new_tokens", r.max_new_tokens), ("rollout.temperature", r.temperature),
                       ("parallel.tensor", p.tensor), ("parallel.pipeline", p.pipeline),
                       ("parallel.micro_batch_size", p.micro_batch_size),
                       ("eval.n_samples", e.n_samples), ("eval.temperature", e.temperature)]:
        _positive(key, value)
    if r.n < 2:
        raise ConfigError(f"rollout.n must be >= 2 (a group needs several responses), got {r.n}")
    for key, value in [("rollout.top_p", r.top_p), ("eval.top_p", e.top_p)]:
        if not 0.0 < value <= 1.0:
            raise ConfigError(f"{key} must be in (0, 1], got {value}")
    mini = t.mini_batch_prompts or t.prompts_per_step
    if t.prompts_per_step % mini != 0:
        raise ConfigError(
            f"trainer.mini_batch_prompts ({mini}) must divide trainer.prompts_per_step ({t.prompts_per_step})")
    if t.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"trainer.device must be auto, cpu or cuda, got {t.device!r}")
    if r.backend not in ("megatron", "vllm"):
        raise ConfigError(f"rollout.backend must be megatron or vllm, got {r.backend!r}")
    if t.grad_clip < 0 or t.weight_decay < 0 or t.checkpoint_every < 0 or t.eval_every < 0:
        raise ConfigError("trainer.grad_clip, weight_decay, checkpoint_every and eval_every must be >= 0")
    if e.num_problems < 0:
        raise ConfigError(f"eval.num_problems must be >= 0, got {e.num_problems}")
    if p.max_tokens_per_micro_batch is not None and p.max_tokens_per_micro_batch != 0:
        if p.max_tokens_per_micro_batch < 2:
            raise ConfigError("parallel.max_tokens_per_micro_batch must be >= 2 tokens (or 0/null: off), "
                              f"got {p.max_tokens_per_micro_batch}")
    elif p.sequence_packing:
        raise ConfigError("parallel.sequence_packing=true needs parallel.max_tokens_per_micro_batch > 0 "
                          "(packing fills token-budget micro-batches)")


KNOWN_SECTIONS = set(ENGINE_SECTIONS) | {"algorithm", "model", "task", "warmstart", "choices"}


def _plain_section(cfg: DictConfig, name: str) -> Dict[str, Any]:
    node = cfg.get(name)
    return {} if node is None else OmegaConf.to_container(node, resolve=True)


def validate(cfg: DictConfig) -> ExperimentConfig:
    """Turn a composed config into typed sections; raise ConfigError naming the key on bad input."""
    sections = {name: _typed_section(cfg, name, cls) for name, cls in ENGINE_SECTIONS.items()}
    algo_section = OmegaConf.to_container(cfg.algorithm, resolve=True)
    algorithm_name = algo_section.pop("name")
    spec = get_algorithm(algorithm_name)
    try:
        algorithm = spec.config_cls.from_dict(algo_section, source="algorithm")
    except (ValueError, TypeError) as exc:
        message = str(exc).replace(f"{spec.config_cls.__name__}.", "algorithm.")
        raise ConfigError(f"config key {message}") from exc
    experiment = ExperimentConfig(
        algorithm_name=algorithm_name,
        algorithm=algorithm,
        model=_plain_section(cfg, "model"),
        task=_plain_section(cfg, "task"),
        warmstart=_plain_section(cfg, "warmstart"),
        other={str(k): _plain_section(cfg, str(k)) for k in cfg if k not in KNOWN_SECTIONS},
        raw=cfg,
        **sections,
    )
    _check_engine_sections(experiment)
    _check_cluster_plan(experiment)
    return experiment


def _check_cluster_plan(c: ExperimentConfig) -> None:
    """Cluster runs (vLLM rollouts): refuse layouts that cannot fit before any GPU is touched."""
    from quatro_nemo.engine.memory_plan import PLAN_SECTIONS, PlanError, plan_from_sections, section_from_dict

    try:
        for name in PLAN_SECTIONS:
            section_from_dict(name, c.other.get(name))
        if c.rollout.backend == "vllm":
            plan_from_sections(c.model, dataclasses.asdict(c.parallel), dataclasses.asdict(c.trainer),
                               dataclasses.asdict(c.rollout), dataclasses.asdict(c.algorithm),
                               c.other.get("cluster", {}), c.other.get("scale", {}), c.other.get("vllm", {}))
    except PlanError as exc:
        raise ConfigError(f"config key {exc}") from exc


def load_config(argv: Sequence[str] = (), conf_dir: str = CONF_DIR) -> ExperimentConfig:
    return validate(compose(argv, conf_dir))
