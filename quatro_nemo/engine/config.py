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
the engine's sections below (``cluster``/``scale``/``vllm`` included: what the memory planner
plans), ``model`` (quatro_nemo.megatron.models.ModelConfig), ``algorithm`` (the chosen
algorithm's config, quatro_nemo.algos.schema), ``task`` (quatro_nemo.engine.task) and ``warmstart``
(quatro_nemo.tasks.countdown.warmstart). Composition order (later wins): the schema's defaults, group
options, the primary file's own keys, command-line overrides. Unknown keys, ill-typed values and
a choice outside its options (:class:`~quatro_nemo.validation.Choice` fields) fail while Hydra
composes (OmegaConf struct mode against the schema); :func:`validate` then builds the dataclasses,
whose ``__post_init__`` checks the values with :mod:`quatro_nemo.validation`'s rules, applies the
engine's capability rules (:mod:`quatro_nemo.engine.capabilities`) and, for a cluster run, the
memory plan (:mod:`quatro_nemo.engine.memory_plan`). It is the one place that turns any config
(Hydra's, or a run's saved config.yaml) into an :class:`ExperimentConfig`. Every error is a
:class:`~quatro_nemo.validation.ConfigError` naming the key.
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
from quatro_nemo.algos.config import RENAMED_KEYS, migrate_renamed_keys, renamed_key_error
from quatro_nemo.algos.importance import ImportanceCorrection
from quatro_nemo.algos.off_policy import OffPolicyCorrection
from quatro_nemo.algos.schema import algorithm_schema, register_algorithm_schemas
from quatro_nemo.engine.capabilities import Device, RolloutBackendName, check_engine_support
from quatro_nemo.engine.memory_plan import MemoryPlan, plan_run
from quatro_nemo.engine.pipeline import PipelineConfig
from quatro_nemo.engine.task import TASK_SCHEMAS, register_task_schemas, task_vocab_size
from quatro_nemo.eval.similarity import SIMILARITY_METRICS
from quatro_nemo.megatron.models import ModelConfig
from quatro_nemo.tasks.countdown.warmstart import WarmStartConfig
from quatro_nemo.validation import (ConfigError, check_at_least, check_in_unit_interval, check_mini_batches,
                                    check_number, check_positive, check_token_budget, choice_values, choices,
                                    coerce_choices)

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf")
PRIMARY_KEY = "config"          # config=NAME on the command line: the primary config conf/NAME.yaml
DEFAULT_PRIMARY = "config"      # conf/config.yaml, the embedded CPU default
HYDRA_VERSION_BASE = "1.3"


# --------------------------------------------------------------------------------------------
# Sections owned by the engine; each checks its values in __post_init__ (quatro_nemo.validation).
# --------------------------------------------------------------------------------------------


# distinct correct solutions for UCC@k: "task" (the task's canonical form of a solution) or a
# near-duplicate metric of quatro_nemo.eval.similarity (quatro_nemo.engine.evaluation.cluster_sizes)
UccCriterion = choices("UccCriterion", ("task", *SIMILARITY_METRICS), __name__)


@dataclass
class RunConfig:
    dir: str = "runs/cpu_default"   # run directory: config, metrics, checkpoints, report
    seed: int = 1234
    resume: bool = True             # restart the same command -> continue from the last checkpoint
    progress_bar: bool = True       # a tqdm bar on a terminal; else a line per logged step (engine/progress.py)


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
            check_positive(f"parallel.{key}", getattr(self, key))
        check_token_budget(self.max_tokens_per_micro_batch, self.sequence_packing)


@dataclass
class TrainerConfig:
    device: Device = Device.auto
    """auto | cpu | cuda (auto: cuda when available)."""
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
        coerce_choices(self, "trainer")
        for key in ("steps", "prompts_per_step", "inner_loops", "lr"):
            check_positive(f"trainer.{key}", getattr(self, key))
        check_mini_batches(self.prompts_per_step, self.mini_batch_prompts)
        for key in ("grad_clip", "weight_decay", "checkpoint_every", "eval_every"):
            check_number(f"trainer.{key}", getattr(self, key), non_negative=True)


# rollout.importance_correction: one of ImportanceCorrection's modes, or auto (resolve_importance_correction)
ImportanceCorrectionSetting = choices("ImportanceCorrectionSetting", ("auto", *choice_values(ImportanceCorrection)),
                                      __name__)


def resolve_importance_correction(setting: str, backend: str, params_dtype: str,
                                  proximal_pipeline: bool = False) -> ImportanceCorrection:
    """``rollout.importance_correction``: ``auto`` -> token-level truncated importance sampling
    where the engine and the trainer compute the log-probs with different kernels at a precision
    where that shows, none where they agree or where the rollout pipeline's proximal correction
    already weights the loss by pi_prox / mu (``proximal_pipeline``: max_staleness > 0 with
    correction=proximal, docs/quatro-math.md Sec. 9.5); any other setting as it is.

    ============  ===============  ========  ==================================================
    backend       params_dtype     auto ->   why
    ============  ===============  ========  ==================================================
    megatron      any              none      the trained model samples itself: the same kernels
    vllm          float32          none      vLLM's kernels vs megatron's, in float32: a gap of
                                             float rounding (~1e-7 nats per token on the CPU,
                                             docs/quatro-math.md Sec. 8)
    vllm          bfloat16         token     vLLM's bf16 kernels vs megatron/TE's: bf16 rounding
                                             in different reduction orders, summed over
                                             thousands of response tokens
    ============  ===============  ========  ==================================================

    The device does not enter: vLLM's kernels differ from megatron's on the CPU and on a GPU alike;
    the precision decides whether the difference matters. ``token`` as verl's ``rollout_is`` and
    Yao et al. 2025 ("Your efficient RL framework secretly brings you off-policy RL training")
    weight tokens, with ``rollout.importance_cap`` (C = 2, theirs)."""
    if setting != "auto":
        return ImportanceCorrection(setting)
    if backend == RolloutBackendName.vllm and params_dtype != "float32" and not proximal_pipeline:
        return ImportanceCorrection.token
    return ImportanceCorrection.none


@dataclass
class RolloutConfig:
    backend: RolloutBackendName = RolloutBackendName.megatron
    """megatron (CPU/GPU: the trained model samples) | vllm (a colocated vLLM engine)."""
    n: int = 8                      # N: responses per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32        # maximum response length in tokens
    importance_correction: ImportanceCorrectionSetting = ImportanceCorrectionSetting.auto
    """auto | none | token | sequence: truncated importance sampling between the engine's sampling
    policy and pi_old (vllm only; quatro_nemo.algos.importance, docs/quatro-math.md Sec. 8); auto is
    resolved at start-up (:func:`resolve_importance_correction`), the run's config.yaml saves what
    it resolved to."""
    importance_cap: float = 2.0     # the cap C of the importance weights
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Rollouts sampled k steps ahead of training (quatro_nemo.engine.pipeline; docs/quatro-math.md Sec. 9)."""

    def __post_init__(self) -> None:
        coerce_choices(self, "rollout")
        if self.weighs_by_proximal_ratio() and self.importance_correction not in ("auto", "none"):
            raise ConfigError("rollout.importance_correction and rollout.pipeline.correction=proximal both weight "
                              "the loss by pi_prox / mu when rollout.pipeline.max_staleness > 0: set one of them "
                              "to none (docs/quatro-math.md Sec. 9.5)")
        check_positive("rollout.max_new_tokens", self.max_new_tokens)
        check_positive("rollout.importance_cap", self.importance_cap)
        if self.importance_correction not in ("auto", "none") and self.backend != "vllm":
            raise ConfigError("rollout.importance_correction needs rollout.backend=vllm (the megatron backend "
                              "samples from the trained model itself: there is no gap to correct)")
        check_positive("rollout.temperature", self.temperature)
        check_at_least("rollout.n", self.n, 2, "a group needs several responses")
        check_in_unit_interval("rollout.top_p", self.top_p)

    def weighs_by_proximal_ratio(self) -> bool:
        """Whether the rollout pipeline's proximal correction weights the loss by pi_prox / mu."""
        return self.pipeline.max_staleness > 0 and self.pipeline.correction == OffPolicyCorrection.proximal


@dataclass
class EvalConfig:
    num_problems: int = 64          # held-out problems evaluated
    n_samples: int = 32             # samples per problem (the paper uses 256)
    temperature: float = 1.0
    top_p: float = 0.7              # paper: top-p 0.7 at evaluation
    ucc_criterion: UccCriterion = UccCriterion("exact")   # near-duplicate criterion for UCC@k (UccCriterion)
    ucc_threshold: float = 1.0

    def __post_init__(self) -> None:
        check_positive("eval.n_samples", self.n_samples)
        check_positive("eval.temperature", self.temperature)
        check_in_unit_interval("eval.top_p", self.top_p)
        check_number("eval.num_problems", self.num_problems, non_negative=True)
        coerce_choices(self, "eval")


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "quatro-nemo"


@dataclass
class ClusterConfig:
    """``cluster:`` the machines a run gets (quatro_nemo.engine.memory_plan plans them)."""

    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0      # nominal size of one GPU (H100 80 GB): every phase must fit it
    gpu_total_mib: Optional[int] = None
    """The GPU's own total memory as nvidia-smi prints it (MiB), which vllm.gpu_memory_utilization
    multiplies; None: the known total of a cluster.gpu_memory_gb card
    (quatro_nemo.engine.memory_phases.KNOWN_GPU_TOTAL_MIB: 80 -> 81,920)."""
    reserve_gb: float = 6.0          # CUDA context, NCCL buffers, allocator fragmentation
    host_memory_gb: float = 1000.0   # host memory of one node: a checkpoint save must fit it
    host_reserve_gb: float = 10.0    # host memory of one rank's process (libraries, CUDA context, data)
    peak_tflops: float = 989.0       # bf16 dense peak of one GPU (H100 SXM), for time estimates
    assumed_mfu: float = 0.3         # model FLOPs utilisation assumed for the time estimate
    memory_bandwidth_tb_s: float = 3.35  # HBM bandwidth of one GPU (H100 SXM), for the decoding time
    assumed_mbu: float = 0.5         # memory bandwidth utilisation assumed for decoding
    checkpoint_write_gb_s: float = 1.0   # one node's write bandwidth to the run directory, for the save time

    def __post_init__(self) -> None:
        for key in ("nodes", "gpus_per_node"):
            check_at_least(f"cluster.{key}", getattr(self, key), 1)
        for key in ("gpu_memory_gb", "host_memory_gb", "peak_tflops", "memory_bandwidth_tb_s",
                    "checkpoint_write_gb_s"):
            check_positive(f"cluster.{key}", getattr(self, key))
        check_number("cluster.gpu_total_mib", self.gpu_total_mib, positive=True, optional=True, integer=True)
        for key in ("reserve_gb", "host_reserve_gb"):
            check_number(f"cluster.{key}", getattr(self, key), non_negative=True)
        for key in ("assumed_mfu", "assumed_mbu"):
            check_in_unit_interval(f"cluster.{key}", getattr(self, key))


@dataclass
class ScaleConfig:
    """``scale:`` megatron-core settings that matter at scale (the CPU default ignores them)."""

    max_prompt_tokens: int = 512
    """Training and held-out prompts longer than this (in tokens) are dropped when the task is
    built, with a logged count (verl's ``filter_overlong_prompts``); the planner plans this length."""
    distributed_optimizer: bool = True   # shard fp32 main weights + Adam state over DP (megatron)
    offload_optimizer_in_rollout: bool = True  # grads + optimizer state to the host while vLLM samples

    def __post_init__(self) -> None:
        check_at_least("scale.max_prompt_tokens", self.max_prompt_tokens, 1)


@dataclass
class VllmConfig:
    """``vllm:`` the colocated rollout engine (quatro_nemo.engine.vllm_backend)."""

    tensor_parallel: int = 1
    gpu_memory_utilization: float = 0.5  # fraction of GPU memory vLLM may take while sampling
    # The KV cache's size in GB, set explicitly (vLLM's kv_cache_memory_bytes); None: what
    # gpu_memory_utilization leaves after the weights. vLLM's CPU build needs it: it sizes its KV
    # cache from the machine's memory less the whole process's resident memory, the trainer's included.
    kv_cache_memory_gb: Optional[float] = None
    sleep_between_phases: bool = True    # vLLM sleep mode: weights/KV cache freed while training
    # What vLLM keeps on each GPU asleep (level 2): its CUDA-graph pool, NCCL and custom
    # all-reduce buffers, the model runner's own buffers. An estimate for the planner;
    # scripts/gpu_check.sh reads vLLM's "Sleep mode freed X GiB, Y GiB still in use".
    sleep_residual_gb: float = 2.0
    activation_reserve_gb: float = 2.0   # vLLM's forward activations and sampler buffers
    max_num_seqs: int = 256              # vLLM's scheduler cap on concurrent sequences
    enforce_eager: bool = False          # no CUDA graphs (debugging)
    seed: int = 0
    # After every push, run the engine's layers against megatron's weights (engine/push_check.py:
    # engine_push/* metrics); scripts/gpu_check.sh turns it on. One engine per rank only.
    check_push: bool = False

    def __post_init__(self) -> None:
        check_at_least("vllm.tensor_parallel", self.tensor_parallel, 1)
        check_at_least("vllm.max_num_seqs", self.max_num_seqs, 1)
        for key in ("sleep_residual_gb", "activation_reserve_gb"):
            check_number(f"vllm.{key}", getattr(self, key), non_negative=True)
        check_in_unit_interval("vllm.gpu_memory_utilization", self.gpu_memory_utilization, closed_high=False)
        if self.check_push and self.tensor_parallel != 1:
            raise ConfigError(f"vllm.check_push compares one whole engine per rank with megatron's full weights: "
                              f"it needs vllm.tensor_parallel=1, not {self.tensor_parallel}")


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
    cluster: ClusterConfig = field(default_factory=ClusterConfig)   # cluster-scale settings
    scale: ScaleConfig = field(default_factory=ScaleConfig)
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
    if isinstance(composed.get("scale"), dict):  # older runs saved scale.reference_on_gpu (always true: removed)
        composed["scale"].pop("reference_on_gpu", None)
    if isinstance(composed.get("algorithm"), dict):  # older runs saved QUATRO's flat delta_* / lr_control_* keys
        composed["algorithm"] = migrate_renamed_keys(composed["algorithm"])
    tree = _typed_tree(composed)
    sections = {f.name: _section_object(tree, f.name) for f in dataclasses.fields(ExperimentSections)}
    rollout = sections["rollout"]
    tree.rollout.importance_correction = rollout.importance_correction = ImportanceCorrectionSetting(
        resolve_importance_correction(rollout.importance_correction, rollout.backend, sections["model"].params_dtype,
                                      rollout.weighs_by_proximal_ratio()))
    raw = OmegaConf.create(OmegaConf.to_container(tree, enum_to_str=True))  # plain data: choices as strings
    experiment = ExperimentConfig(algorithm_name=tree.algorithm.name, raw=raw, **sections)
    check_engine_support(experiment)
    if is_planned(experiment):   # refuse layouts that cannot fit before any GPU is touched
        memory_plan(experiment)
    return experiment


def is_planned(c: ExperimentConfig) -> bool:
    """Cluster runs (vLLM rollouts on GPUs) are planned (:func:`memory_plan`); a run on the CPU
    (vLLM's CPU build, config=cpu_vllm) is not planned against the cluster's GPUs."""
    return c.rollout.backend == "vllm" and c.trainer.device != "cpu"


def memory_plan(c: ExperimentConfig) -> MemoryPlan:
    """The checked per-GPU memory and throughput plan of a run (:func:`quatro_nemo.engine.memory_plan.plan_run`;
    ConfigError if it cannot fit); a null ``model.vocab_size`` is the task's
    (:func:`quatro_nemo.engine.task.task_vocab_size`), as in training."""
    if not c.model.vocab_size:
        try:
            c = dataclasses.replace(c, model=dataclasses.replace(c.model, vocab_size=task_vocab_size(c.task)))
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    return plan_run(c)


def memory_plan_at_world(c: ExperimentConfig, world_size: int) -> MemoryPlan:
    """:func:`memory_plan` for the machines a run got: ``cluster.nodes`` from its world size (the
    job's ``#SBATCH --nodes`` does not reach the config) when it is a whole number of nodes."""
    nodes, rest = divmod(world_size, c.cluster.gpus_per_node)
    if nodes and not rest:
        c = dataclasses.replace(c, cluster=dataclasses.replace(c.cluster, nodes=nodes))
    return memory_plan(c)


# --------------------------------------------------------------------------------------------
# Composition with Hydra
# --------------------------------------------------------------------------------------------


def split_primary(argv: Sequence[str], default: Optional[str] = DEFAULT_PRIMARY) -> Tuple[Optional[str], List[str]]:
    """(primary config name, the other arguments): ``config=NAME`` chooses conf/NAME.yaml, as
    Hydra's ``--config-name=NAME`` does (the last one wins; ``default`` without one)."""
    names = [arg[len(PRIMARY_KEY) + 1:] for arg in argv if arg.startswith(PRIMARY_KEY + "=")]
    return (names[-1] if names else default), [arg for arg in argv if not arg.startswith(PRIMARY_KEY + "=")]


def _renamed_key(override: str) -> Optional[str]:
    """The flat QUATRO key of :data:`~quatro_nemo.algos.config.RENAMED_KEYS` that a command-line
    override sets (``algorithm.delta_controller_target=0.02`` -> ``delta_controller_target``);
    None for any other override, and for a whole section given as ``{...}``."""
    key, is_assignment, value = override.lstrip("+~").partition("=")
    old = key.removeprefix("algorithm.") if key.startswith("algorithm.") else None
    if old not in RENAMED_KEYS or (is_assignment and value.lstrip().startswith("{")):
        return None
    return old


def renamed_override(override: str) -> Optional[str]:
    """A command-line override of a flat QUATRO key that became a nested one, written with the new
    key (``algorithm.delta_controller_target=0.02`` -> ``algorithm.delta_controller.target=0.02``);
    None for any other override."""
    old = _renamed_key(override)
    return None if old is None else override.replace(f"algorithm.{old}", f"algorithm.{RENAMED_KEYS[old]}", 1)


def check_renamed_overrides(overrides: Sequence[str]) -> None:
    """Refuse an override of a renamed key (:func:`renamed_override`) naming the new key, before
    Hydra composes (whose own message says only that the key is unknown or ill-typed)."""
    for override in overrides:
        old = _renamed_key(override)
        if old is not None:
            raise ConfigError(f"{override}: {renamed_key_error(old)} (write {renamed_override(override)})")


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
    """Run a ``@hydra.main`` function on a recipe's arguments (``config=NAME`` as ``--config-name=NAME``;
    everything else, overrides and flags, is Hydra's as given); its exit code (Hydra exits 1 after
    printing an override it rejected, which names the key)."""
    primary, rest = split_primary(argv, default=None)
    sys.argv = [sys.argv[0], *([f"--config-name={primary}"] if primary else []), *rest]
    try:
        with config_errors_exit():
            check_renamed_overrides(rest)
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
    check_renamed_overrides(overrides)
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
