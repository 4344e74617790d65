"""The run configuration: Hydra (hydra-core 1.3) composes conf/ into typed, validated dataclasses.

Layout of conf/ (a Hydra config directory):

    conf/config.yaml              a primary config (the embedded CPU default); also quatro_1p5b.yaml, ...
    conf/base/experiment.yaml     what every primary config starts from: the schema, Hydra's settings
    conf/<group>/<option>.yaml    one option of a config group: model/, algorithm/, task/

Command-line arguments are Hydra overrides, plus ``config=NAME`` to choose the primary config:

    config=quatro_1p5b          the primary config conf/quatro_1p5b.yaml (Hydra's --config-name)
    algorithm=gspo              a group option (conf/algorithm/gspo.yaml)
    algorithm.delta=0.1         one key;  ++key=value adds or overrides, as in any Hydra app

Every section is typed by a dataclass registered in Hydra's ConfigStore (:func:`register_configs`):
the engine's sections below, ``model`` (quatro_nemo.megatron.models.ModelConfig), ``algorithm``
(the chosen algorithm's config, quatro_nemo.algos.schema), ``task`` (quatro_nemo.engine.task),
``warmstart`` (quatro_nemo.tasks.countdown.warmstart) and ``cluster``/``scale``/``vllm``
(quatro_nemo.engine.memory_plan). Composition order (later wins): the schema's defaults, group
options, the primary file's own keys, command-line overrides. Unknown keys and ill-typed values
fail while Hydra composes (OmegaConf struct mode against the schema); :func:`validate` then builds
the dataclasses, whose ``__post_init__`` checks the values, and is the one place that turns any
config (Hydra's, or a run's saved config.yaml) into an :class:`ExperimentConfig`. Every error
names the key.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from quatro_nemo.algos import ALGORITHMS, AlgorithmConfig, build_algorithm
from quatro_nemo.algos.importance import ImportanceCorrection
from quatro_nemo.algos.schema import algorithm_schema, register_algorithm_schemas
from quatro_nemo.engine.memory_plan import (ClusterConfig, MemoryPlan, PlanError, ScaleConfig, VllmConfig,
                                           plan_from_sections)
from quatro_nemo.engine.task import TASK_SCHEMAS, register_task_schemas, task_vocab_size
from quatro_nemo.tasks.countdown.warmstart import WarmStartConfig
from quatro_nemo.megatron.models import ModelConfig

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf")
PRIMARY_KEY = "config"          # config=NAME on the command line: the primary config conf/NAME.yaml
DEFAULT_PRIMARY = "config"      # conf/config.yaml, the embedded CPU default
HYDRA_VERSION_BASE = "1.3"


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key or file."""


def _positive(key: str, value: Any) -> None:
    if value is None or value <= 0:
        raise ConfigError(f"{key} must be > 0, got {value!r}")


def _in_unit_interval(key: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ConfigError(f"{key} must be in (0, 1], got {value}")


# --------------------------------------------------------------------------------------------
# Sections owned by the engine; each checks its values in __post_init__.
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

    def __post_init__(self) -> None:
        for key in ("tensor", "pipeline", "micro_batch_size"):
            _positive(f"parallel.{key}", getattr(self, key))
        if self.max_tokens_per_micro_batch:
            if self.max_tokens_per_micro_batch < 2:
                raise ConfigError("parallel.max_tokens_per_micro_batch must be >= 2 tokens (or 0/null: off), "
                                  f"got {self.max_tokens_per_micro_batch}")
        elif self.sequence_packing:
            raise ConfigError("parallel.sequence_packing=true needs parallel.max_tokens_per_micro_batch > 0 "
                              "(packing fills token-budget micro-batches)")


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

    def __post_init__(self) -> None:
        for key in ("steps", "prompts_per_step", "inner_loops", "lr"):
            _positive(f"trainer.{key}", getattr(self, key))
        mini = self.mini_batch_prompts or self.prompts_per_step
        if self.prompts_per_step % mini != 0:
            raise ConfigError(f"trainer.mini_batch_prompts ({mini}) must divide trainer.prompts_per_step "
                              f"({self.prompts_per_step})")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"trainer.device must be auto, cpu or cuda, got {self.device!r}")
        if self.grad_clip < 0 or self.weight_decay < 0 or self.checkpoint_every < 0 or self.eval_every < 0:
            raise ConfigError("trainer.grad_clip, weight_decay, checkpoint_every and eval_every must be >= 0")


@dataclass
class RolloutConfig:
    backend: str = "megatron"       # megatron (CPU/GPU) | vllm (GPU)
    n: int = 8                      # N: responses per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32        # maximum response length in tokens
    # Truncated importance sampling between the engine's sampling policy and pi_old (vllm only;
    # quatro_nemo.algos.importance, docs/quatro-math.md Sec. 8): none | token | sequence, and the cap C.
    importance_correction: str = "none"
    importance_cap: float = 2.0

    def __post_init__(self) -> None:
        _positive("rollout.max_new_tokens", self.max_new_tokens)
        _positive("rollout.importance_cap", self.importance_cap)
        choices = [mode.value for mode in ImportanceCorrection]
        if self.importance_correction not in choices:
            raise ConfigError(f"rollout.importance_correction must be one of {choices}, got "
                              f"{self.importance_correction!r}")
        if self.importance_correction != "none" and self.backend != "vllm":
            raise ConfigError("rollout.importance_correction needs rollout.backend=vllm (the megatron backend "
                              "samples from the trained model itself: there is no gap to correct)")
        _positive("rollout.temperature", self.temperature)
        if self.n < 2:
            raise ConfigError(f"rollout.n must be >= 2 (a group needs several responses), got {self.n}")
        _in_unit_interval("rollout.top_p", self.top_p)
        if self.backend not in ("megatron", "vllm"):
            raise ConfigError(f"rollout.backend must be megatron or vllm, got {self.backend!r}")


@dataclass
class EvalConfig:
    num_problems: int = 64          # held-out problems evaluated
    n_samples: int = 32             # samples per problem (the paper uses 256)
    temperature: float = 1.0
    top_p: float = 0.7              # paper: top-p 0.7 at evaluation
    ucc_criterion: str = "exact"    # near-duplicate criterion for UCC@k (see quatro_nemo.eval)
    ucc_threshold: float = 1.0

    def __post_init__(self) -> None:
        _positive("eval.n_samples", self.n_samples)
        _positive("eval.temperature", self.temperature)
        _in_unit_interval("eval.top_p", self.top_p)
        if self.num_problems < 0:
            raise ConfigError(f"eval.num_problems must be >= 0, got {self.num_problems}")


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "quatro-nemo"


# --------------------------------------------------------------------------------------------
# The whole run, typed
# --------------------------------------------------------------------------------------------


@dataclass
class ExperimentSections:
    """Every section of a run config: the schema Hydra composes against (ConfigStore
    ``schema/experiment``, listed first by conf/base/experiment.yaml)."""

    run: RunConfig = field(default_factory=RunConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    model: ModelConfig = MISSING          # quatro_nemo.megatron.models; vocab_size null: the task's
    algorithm: AlgorithmConfig = MISSING  # the option's schema (quatro_nemo.algos.schema): config + name
    task: Any = MISSING                   # the option's schema: TASK_SCHEMAS[task.name] (engine/task.py)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)   # cluster-scale settings:
    scale: ScaleConfig = field(default_factory=ScaleConfig)         # quatro_nemo.engine.memory_plan
    vllm: VllmConfig = field(default_factory=VllmConfig)


@dataclass
class ExperimentConfig(ExperimentSections):
    """The validated run config, built once at start-up by :func:`validate`: each section its
    dataclass (``algorithm``: the algorithm's config class, e.g. QuatroConfig)."""

    algorithm_name: str = ""
    raw: Optional[DictConfig] = None  # the composed config as plain data, saved to the run directory


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore: ``schema/experiment`` (every section),
    ``schema/algorithm/<name>`` and ``schema/task/<name>`` (one per group option)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="schema", name="experiment", node=ExperimentSections)
    register_algorithm_schemas()
    register_task_schemas()


# --------------------------------------------------------------------------------------------
# Validation: the one place a composed or saved config becomes an ExperimentConfig
# --------------------------------------------------------------------------------------------


def omegaconf_error_message(exc: OmegaConfBaseException) -> str:
    """An OmegaConf error as one line naming its key (``config key KEY: what is wrong``)."""
    return f"config key {getattr(exc, 'full_key', '?')}: {str(getattr(exc, 'msg', exc)).splitlines()[0]}"


def _check_option_names(cfg: DictConfig) -> None:
    """A Hydra-composed ``algorithm``/``task`` section has its option's schema: its ``name`` must be
    that option's (the option is chosen with algorithm=<name>, not by editing the name)."""
    for group in ("algorithm", "task"):
        node = cfg.get(group) if isinstance(cfg, DictConfig) else None
        schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
        chosen = getattr(schema, "__dataclass_fields__", {}).get("name")
        if chosen is not None and node.get("name") != chosen.default:
            raise ConfigError(f"{group}.name={node.get('name')!r} does not match the chosen option "
                              f"{group}={chosen.default}: choose the option with {group}=<name>")


def _option_name(composed: dict, group: str, options: Sequence[str]) -> str:
    section = composed.get(group)
    name = section.get("name") if isinstance(section, dict) else None
    if name not in options:
        raise ConfigError(f"{group}.name={name!r}: choose one of {sorted(options)} "
                          f"(the defaults list's '{group}: <option>', or {group}=<option> on the command line)")
    return name


def _typed_tree(composed: dict) -> DictConfig:
    """``composed`` merged into the schema, with the chosen algorithm's and task's dataclasses
    (OmegaConf struct mode: an unknown key or an ill-typed value raises, naming it)."""
    schema = OmegaConf.structured(ExperimentSections)
    schema.algorithm = OmegaConf.structured(algorithm_schema(_option_name(composed, "algorithm", list(ALGORITHMS))))
    schema.task = OmegaConf.structured(TASK_SCHEMAS[_option_name(composed, "task", list(TASK_SCHEMAS))])
    try:
        return OmegaConf.merge(schema, composed)
    except OmegaConfBaseException as exc:
        raise ConfigError(omegaconf_error_message(exc)) from exc


def _section_object(tree: DictConfig, name: str) -> Any:
    """One section as its dataclass; the dataclass's own checks run here (``__post_init__``)."""
    node = tree[name]
    try:
        if name == "algorithm":  # the algorithm's config class itself, without the schema's name
            return build_algorithm(OmegaConf.to_container(node), source="algorithm")[1]
        return OmegaConf.to_object(node)
    except OmegaConfBaseException as exc:
        raise ConfigError(omegaconf_error_message(exc)) from exc
    except (ValueError, TypeError) as exc:  # messages name "<Class>.<key>" or "<section>.<key>"
        message = str(exc).replace(f"{OmegaConf.get_type(node).__name__}.", f"{name}.")
        raise ConfigError(message if isinstance(exc, ConfigError) else f"config key {message}") from exc


def validate(cfg: DictConfig) -> ExperimentConfig:
    """Turn a composed config (Hydra's, or a run's saved config.yaml) into typed sections; raise
    ConfigError naming the key on bad input."""
    _check_option_names(cfg)
    composed = OmegaConf.to_container(cfg, resolve=True)
    for key in ("hydra", "choices"):  # Hydra's own node; the group choices older runs saved
        composed.pop(key, None)
    tree = _typed_tree(composed)
    sections = {f.name: _section_object(tree, f.name) for f in dataclasses.fields(ExperimentSections)}
    experiment = ExperimentConfig(algorithm_name=tree.algorithm.name, raw=OmegaConf.create(OmegaConf.to_container(tree)),
                                  **sections)
    _check_cluster_plan(experiment)
    return experiment


def memory_plan(c: ExperimentConfig) -> MemoryPlan:
    """The per-GPU memory and throughput plan of a run (raises PlanError if it cannot fit); a null
    ``model.vocab_size`` is the task's (:func:`quatro_nemo.engine.task.task_vocab_size`), as in training."""
    model = c.model
    if not model.vocab_size:
        try:
            model = dataclasses.replace(model, vocab_size=task_vocab_size(c.task))
        except ValueError as exc:
            raise PlanError(str(exc)) from exc
    return plan_from_sections(*(dataclasses.asdict(section) for section in (
        model, c.parallel, c.trainer, c.rollout, c.algorithm, c.cluster, c.scale, c.vllm)))


def _check_cluster_plan(c: ExperimentConfig) -> None:
    """Cluster runs (vLLM rollouts): refuse layouts that cannot fit before any GPU is touched. A
    run on the CPU (``trainer.device=cpu``: vLLM's CPU build, config=cpu_vllm) is not planned
    against the ``cluster:`` GPUs."""
    if c.rollout.backend != "vllm" or c.trainer.device == "cpu":
        return
    try:
        memory_plan(c)
    except PlanError as exc:
        raise ConfigError(f"config key {exc}") from exc


# --------------------------------------------------------------------------------------------
# Composition with Hydra
# --------------------------------------------------------------------------------------------


def split_primary(argv: Sequence[str]) -> Tuple[str, List[str]]:
    """(primary config name, Hydra overrides): ``config=NAME`` chooses conf/NAME.yaml (last one wins)."""
    primary, overrides = DEFAULT_PRIMARY, []
    for arg in argv:
        if arg.startswith(PRIMARY_KEY + "="):
            primary = arg[len(PRIMARY_KEY) + 1:]
        else:
            overrides.append(arg)
    return primary, overrides


def hydra_command_line(argv: Sequence[str]) -> List[str]:
    """A recipe's arguments for ``@hydra.main``: ``config=NAME`` becomes ``--config-name=NAME``;
    everything else (overrides, ``-m``, ``--cfg job``, ...) is Hydra's as given."""
    return [f"--config-name={arg[len(PRIMARY_KEY) + 1:]}" if arg.startswith(PRIMARY_KEY + "=") else arg
            for arg in argv]


CONFIG_ERROR_EXIT_CODE = 2   # a recipe's exit code for a value that failed validation


@contextlib.contextmanager
def config_errors_exit() -> Iterator[None]:
    """Inside a Hydra job: a :class:`ConfigError` (its message names the key) is printed and the
    job exits with :data:`CONFIG_ERROR_EXIT_CODE` (Hydra passes SystemExit on)."""
    try:
        yield
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(CONFIG_ERROR_EXIT_CODE) from exc


def run_hydra_app(hydra_job: Callable[[], None], argv: Sequence[str]) -> int:
    """Run a ``@hydra.main`` function on a recipe's arguments (:func:`hydra_command_line`); its exit
    code (Hydra exits 1 after printing an override it rejected, which names the key)."""
    sys.argv = [sys.argv[0], *hydra_command_line(argv)]
    try:
        hydra_job()
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    return 0


@contextlib.contextmanager
def _hydra_initialized(conf_dir: str) -> Iterator[None]:
    """Hydra's compose API on ``conf_dir``; an enclosing Hydra app's global state is kept."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    enclosing = GlobalHydra.instance().hydra
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=os.path.abspath(conf_dir), version_base=HYDRA_VERSION_BASE):
            yield
    finally:
        GlobalHydra.instance().hydra = enclosing


def compose(argv: Sequence[str] = (), conf_dir: str = CONF_DIR) -> DictConfig:
    """Compose conf/ and command-line arguments with Hydra (validated by :func:`validate`)."""
    from hydra import compose as hydra_compose
    from hydra.errors import HydraException

    primary, overrides = split_primary(argv)
    register_configs()
    try:
        with _hydra_initialized(conf_dir):
            return hydra_compose(config_name=primary, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        cause = f" ({exc.__cause__})" if exc.__cause__ is not None else ""
        raise ConfigError(f"{exc}{cause}".replace("\n", " ")) from exc


def load_config(argv: Sequence[str] = (), conf_dir: str = CONF_DIR) -> ExperimentConfig:
    """The validated config of recipes/train.py's arguments, e.g. ``["config=quatro_1p5b", "algorithm=gspo"]``."""
    return validate(compose(argv, conf_dir))


def hydra_job_config(cfg: DictConfig) -> ExperimentConfig:
    """:func:`validate` for the job of a ``@hydra.main`` recipe. In a multirun (``-m``) every job
    trains in its own directory, Hydra's ``<run.dir>/<job number>`` (conf/base/experiment.yaml)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        cfg = OmegaConf.merge(cfg, {"run": {"dir": hydra_cfg.runtime.output_dir}})
    return validate(cfg)
