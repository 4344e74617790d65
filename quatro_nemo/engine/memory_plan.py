"""Per-GPU memory and throughput plan for a run at scale (pure arithmetic, no torch, no GPU).

:func:`plan_run` plans a validated run config (``quatro_nemo.engine.config``'s typed sections):
for a model shape, a parallel layout and the batch settings, :func:`plan_memory` returns the
memory one GPU needs in each phase of a colocated RL step (training with megatron-core, rollout
with vLLM) and the rollout token budget; :func:`check_layout` refuses a layout that does not
divide, ``quatro_nemo.engine.capabilities`` one the engine cannot run, and :func:`check_plan` one
that cannot fit, each with a :class:`~quatro_nemo.validation.ConfigError` naming the setting to
change. ``recipes/plan_memory.py`` prints it (``--json`` for scripts).

It models what the engine does (issue 14), reading the keys the engine obeys
(``scale.distributed_optimizer``, ``scale.offload_optimizer_in_rollout``, ``scale.max_prompt_tokens``,
``vllm.*``, ``parallel.*``, ``trainer.*``, ``model.*``). Each term,
per GPU of the most loaded pipeline stage, with ``P`` its parameters and ``d`` the data-parallel
size (:func:`training_state_bytes`, :func:`plan_memory`):

- **Weights** ``P x 2`` (bf16) or ``P x 4`` (float32): megatron-core ``GPTModel`` parameters
  (``quatro_nemo.megatron.models.build_model``; with the distributed optimizer they become views
  of DDP's contiguous parameter buffer, no second copy).
- **Gradients** ``P x 4``: megatron-core ``DistributedDataParallel(grad_reduce_in_fp32=True)``
  allocates one float32 gradient buffer for every parameter (``param_and_grad_buffer.py``,
  ``grad_data``), unsharded even with the distributed optimizer (it reduce-scatters in place).
- **Optimizer** (``get_megatron_optimizer``, Adam): float32 main parameters (bf16 models only:
  ``Float16OptimizerWithFloat16Params`` / the distributed optimizer's ``shard_main_param``; a
  float32 model's main parameters are its weights) and Adam's ``exp_avg`` and ``exp_avg_sq``
  (8 bytes); divided by ``d`` with ``scale.distributed_optimizer``. Together: Megatron-LM
  ``docs/source/api-guide/dist_optimizer.md``, "bf16 param, fp32 grads: 18 (plain), 6 + 12/d
  (distributed)"; "fp32 param, fp32 grads: 16 and 8 + 8/d".
- **Activations** in the parameters' dtype: Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models" (arXiv:2205.05198), Sec. 4.1, redone for a pre-norm
  RMSNorm/SwiGLU/GQA layer without dropout (:func:`layer_activation_elements`); flash attention
  (Transformer Engine's layer spec) stores no ``s x s`` scores, megatron's local spec (no TE: the
  CPU, or a GPU without TE) does. Full recomputation keeps each layer's input plus one layer's
  activations. A 1F1B pipeline keeps ``min(PP, micro-batches)`` micro-batches in flight on the
  first stage (Narayanan et al. 2021, arXiv:2104.04473, Sec. 2.2).
- **Logits** of one micro-batch, ``b x s x V/TP`` elements on the last stage, at
  :data:`LOSS_BYTES_PER_LOGIT` bytes each at the peak of the loss's backward
  (``quatro_nemo.megatron.logprobs._VocabParallelLogProbsEntropy``: the float32 logits it saves
  (bf16 models: megatron's ``Float16Module`` casts the logits to float32 first), then in its
  backward ``shifted``, ``probs``, ``grad`` and three temporaries of the entropy term, whose
  incoming gradient autograd materialises as zeros although the loss does not use it: 7 x 4
  bytes). Measured on the CPU: 29.4 bytes (``tests/engine/test_memory_reality.py``).
- **Optimizer-step transients** (after the backward, so they do not add to activations):
  Transformer Engine / apex ``FusedAdam`` and ``multi_tensor_scale`` update in place (0); torch's
  ``AdamW`` fallback (megatron without TE/apex) allocates ``sqrt(exp_avg_sq)`` for the whole
  parameter group on CUDA (``foreach``: 4 bytes per optimizer parameter) or per tensor on the CPU
  (``sqrt`` and the division: 8 bytes x the largest tensor); megatron's local
  ``multi_tensor_scale`` (gradient clipping) one gradient-sized temporary at a time. On the CPU,
  gloo's reduce-scatter / all-gather of DDP's flat buffers (distributed optimizer, ``d > 1``)
  allocates one buffer-sized temporary (NCCL works in place).
- **Reference policy** (``algorithm.beta > 0``): a second model of the same dtype on the run's
  device, no gradients or optimizer.
- **Weight push to vLLM** (``quatro_nemo.megatron.checkpoint.iter_full_parameters``, one full
  tensor at a time): the TP shards gathered, their concatenation, and the previous tensor vLLM's
  ``load_weights`` still holds: 3 (TP > 1) or 2 (TP = 1) copies of the largest full tensor.
- **Rollout phase**: with ``scale.offload_optimizer_in_rollout`` the engine moves the optimizer
  state and DDP's gradient buffer to the host before vLLM wakes (NeMo-RL's
  ``offload_before_refit``), so only the weights (and pi_ref) stay.
- **KV cache**: ``2 (K and V) x layers x KV heads x head_dim x 2 bytes`` per token, KV heads split
  over the vLLM TP ranks (replicated when TP > KV heads), as vLLM allocates it.
- Parameter counts: the Qwen2 / GPT decoder layer's tensors (:func:`stage_parameter_counts`);
  checked against ``transformers``' Qwen2 and the published Qwen2.5 totals (1,543,714,304 and
  7,615,616,512 parameters).

It is a plan, not a measurement: a fixed ``cluster.reserve_gb`` covers the CUDA context, NCCL
buffers and allocator fragmentation (0 on the CPU). ``train_peak_allocated_gb`` is what
``torch.cuda.max_memory_allocated()`` should reach in training (``scripts/gpu_check.sh`` prints
the two side by side); the CPU flavour is checked against the measured peak resident memory of
real training steps (``tests/engine/test_memory_reality.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional

from quatro_nemo.engine.capabilities import (Device, RolloutBackendName, check_params_dtype, check_sequence_parallel,
                                             check_tensor_split, check_vllm_layout)
from quatro_nemo.validation import (ConfigError, check_at_least, check_mini_batches, check_token_budget, choices,
                                    coerce_choices)

if TYPE_CHECKING:
    from quatro_nemo.engine.config import ClusterConfig, ExperimentConfig, ScaleConfig, VllmConfig

GB = 1e9  # decimal gigabytes, as GPU memory is quoted (80 GB H100)


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


@dataclass
class ModelShape:
    """What the arithmetic needs from a model config (``quatro_nemo.megatron.models.ModelConfig``)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    swiglu: bool = True
    qkv_bias: bool = True
    linear_bias: bool = False
    tie_embeddings: bool = True
    bytes_per_param: int = 2  # bf16

    @classmethod
    def from_model_config(cls, cfg) -> "ModelShape":
        """From a validated ``quatro_nemo.megatron.models.ModelConfig`` (RMSNorm + RoPE decoders:
        Qwen2; the tiny CPU GPT's LayerNorm biases and position table are not counted)."""
        if cfg.normalization != "RMSNorm" or cfg.position_embedding != "rope":
            raise ConfigError(f"model.normalization='{cfg.normalization}', model.position_embedding="
                              f"'{cfg.position_embedding}': the planner covers RMSNorm + RoPE decoders (qwen2)")
        check_params_dtype(cfg.params_dtype)
        return cls(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
            num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
            ffn_hidden_size=cfg.ffn_hidden_size, swiglu=cfg.swiglu, qkv_bias=cfg.qkv_bias,
            linear_bias=cfg.linear_bias, tie_embeddings=cfg.tie_embeddings,
            bytes_per_param=4 if cfg.params_dtype == "float32" else 2,
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass
class Workload:
    """One RL step: ``prompts_per_step`` prompts x ``n`` responses, K inner loops."""

    prompts_per_step: int
    n: int
    max_prompt_tokens: int
    max_new_tokens: int
    micro_batch_size: int
    mini_batch_prompts: Optional[int] = None  # prompts per optimizer step (None: all)
    inner_loops: int = 1
    uses_reference: bool = True               # beta > 0: pi_ref log-probs each step
    max_tokens_per_micro_batch: Optional[int] = None  # parallel.max_tokens_per_micro_batch (None/0: rows)

    @property
    def sequence_length(self) -> int:
        return self.max_prompt_tokens + self.max_new_tokens

    @property
    def tokens_per_micro_batch(self) -> int:
        """Most tokens one micro-batch computes: the padded budget (a row longer than the budget
        runs alone, so at most one full-length row), else ``micro_batch_size`` full-length rows."""
        if self.max_tokens_per_micro_batch:
            return max(self.max_tokens_per_micro_batch, self.sequence_length)
        return self.sequence_length * self.micro_batch_size


@dataclass
class Layout:
    tensor_parallel: int
    pipeline_parallel: int
    full_recompute: bool = False  # megatron's recompute_granularity="full" (model.extra)
    sequence_parallel: bool = False  # megatron's sequence_parallel (model.extra)

    @classmethod
    def from_config(cls, cfg: "ExperimentConfig") -> "Layout":
        """The ``parallel:`` sizes and the ``model.extra`` switches megatron receives
        (``recompute_granularity``: the one place full recomputation is set; ``sequence_parallel``)."""
        extra = cfg.model.extra or {}
        granularity = extra.get("recompute_granularity")
        if granularity not in (None, "full", "selective"):
            raise ConfigError(f"model.extra.recompute_granularity={granularity!r}: expected full, selective or null")
        return cls(cfg.parallel.tensor, cfg.parallel.pipeline, full_recompute=granularity == "full",
                   sequence_parallel=bool(extra.get("sequence_parallel", False)))


# the device a plan is for: a trainer.device resolved (Runtime.detect plans ``auto`` as cuda)
PlannedDevice = choices("PlannedDevice", tuple(d.value for d in Device if d is not Device.auto), __name__)


@dataclass
class Runtime:
    """What the machine, not the config, decides: the device, and whether Transformer Engine (its
    layer spec: flash attention; its FusedAdam) or apex (FusedAdam) import, which selects
    megatron-core's code paths (``quatro_nemo.megatron.models._layer_spec``,
    ``megatron.core.optimizer``'s ``USING_PYTORCH_OPTIMIZER``). A choice outside its options is
    refused (ConfigError naming ``Runtime.<field>``)."""

    device: PlannedDevice = PlannedDevice("cuda")   # cuda | cpu (the CPU flavour: no CUDA reserve, gloo)
    transformer_engine: bool = True  # TE layer spec: flash attention, no s x s scores stored
    fused_adam: bool = True          # TE or apex FusedAdam (else torch.optim.AdamW)
    rollout_backend: RolloutBackendName = RolloutBackendName.vllm  # rollout.backend (megatron: no vLLM memory)

    def __post_init__(self) -> None:
        coerce_choices(self, "Runtime")

    @classmethod
    def detect(cls, device: Device, rollout_backend: RolloutBackendName) -> "Runtime":
        """This machine's runtime for ``trainer.device`` (``auto`` plans a GPU) without importing
        the packages (``importlib.util.find_spec``)."""
        from importlib.util import find_spec

        te = find_spec("transformer_engine") is not None
        return cls(device="cpu" if device == Device.cpu else "cuda", transformer_engine=te,
                   fused_adam=te or find_spec("apex") is not None, rollout_backend=rollout_backend)


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------


def layer_parameter_count(m: ModelShape) -> Dict[str, int]:
    """Parameters of one decoder layer, split into TP-sharded and replicated (norms)."""
    d, h, f = m.head_dim, m.hidden_size, m.ffn_hidden_size
    qkv_rows = (m.num_attention_heads + 2 * m.num_query_groups) * d
    sharded = h * qkv_rows + (qkv_rows if m.qkv_bias else 0)                 # linear_qkv
    sharded += m.num_attention_heads * d * h                                 # linear_proj
    fc1_rows = 2 * f if m.swiglu else f
    sharded += h * fc1_rows + f * h                                          # linear_fc1, linear_fc2
    if m.linear_bias:
        sharded += fc1_rows  # column-parallel bias
    replicated = 2 * h + ((h + h) if m.linear_bias else 0)                   # 2 norms (+ row biases)
    return {"sharded": sharded, "replicated": replicated}


def total_parameter_count(m: ModelShape) -> int:
    """Parameters of the whole model (TP=1, PP=1); tied embeddings counted once."""
    layer = layer_parameter_count(m)
    embedding = m.vocab_size * m.hidden_size
    output = 0 if m.tie_embeddings else embedding
    return m.num_layers * (layer["sharded"] + layer["replicated"]) + embedding + output + m.hidden_size


def stage_parameter_counts(m: ModelShape, layout: Layout) -> List[int]:
    """Parameters held by one GPU of each pipeline stage (TP-sharded tensors divided by TP).

    With tied embeddings and PP > 1 the last stage holds a copy of the embedding as its output
    layer (megatron's embedding group).
    """
    tp, pp = layout.tensor_parallel, layout.pipeline_parallel
    layer = layer_parameter_count(m)
    per_layer = layer["sharded"] // tp + layer["replicated"]
    layers_per_stage = m.num_layers // pp
    embedding = m.vocab_size * m.hidden_size // tp
    counts = []
    for stage in range(pp):
        count = layers_per_stage * per_layer
        if stage == 0:
            count += embedding
        if stage == pp - 1:
            count += m.hidden_size  # final norm
            if not m.tie_embeddings or pp > 1:
                count += embedding
        counts.append(count)
    return counts


GRAD_BYTES = 4         # DDP's gradient buffer: grad_reduce_in_fp32=True
MAIN_PARAM_BYTES = 4   # float32 main parameters of a bf16 model
ADAM_BYTES = 8         # Adam's exp_avg and exp_avg_sq, float32


def training_state_bytes(bytes_per_param: int, distributed_optimizer: bool, data_parallel: int) -> Dict[str, float]:
    """Bytes per parameter of the weights, DDP's gradient buffer and the optimizer (float32 main
    parameters of a bf16 model + Adam moments, sharded over DP by the distributed optimizer).
    Sums to Megatron-LM's dist_optimizer.md table: 18 / 6 + 12/d (bf16), 16 / 8 + 8/d (fp32)."""
    main_params = MAIN_PARAM_BYTES if bytes_per_param < 4 else 0  # a float32 model steps its weights
    shards = data_parallel if distributed_optimizer else 1
    return {"weights": float(bytes_per_param), "grads": float(GRAD_BYTES),
            "optimizer": (main_params + ADAM_BYTES) / shards}


def largest_tensor_elements(m: ModelShape, tp: int) -> int:
    """Elements of this GPU's largest parameter shard: the (vocab-parallel) embedding / output
    layer, or a layer's fc1 (column-parallel, ``2f x h`` with SwiGLU)."""
    fc1_rows = 2 * m.ffn_hidden_size if m.swiglu else m.ffn_hidden_size
    return max(m.vocab_size * m.hidden_size, fc1_rows * m.hidden_size) // tp


def largest_full_tensor_elements(m: ModelShape) -> int:
    """Elements of the largest full (TP-gathered) tensor the weight push streams."""
    return largest_tensor_elements(m, 1)


def optimizer_step_transient_bytes(m: ModelShape, tp: int, optimizer_parameters: float, grad_buffer_elements: int,
                                   runtime: Runtime, distributed_optimizer: bool, data_parallel: int) -> float:
    """Peak temporary memory of ``optimizer.step()`` (gradient clipping, Adam) and the DDP
    collectives around it, after the backward (module doc, "Optimizer-step transients")."""
    largest = largest_tensor_elements(m, tp)
    if runtime.fused_adam:
        adam = 0.0
    elif runtime.device == "cuda":
        adam = 4.0 * optimizer_parameters          # torch AdamW foreach: sqrt(exp_avg_sq) of the group
    else:
        adam = 8.0 * min(largest, optimizer_parameters)  # single-tensor AdamW: sqrt, then / bias correction
    clip = 0.0 if runtime.fused_adam else GRAD_BYTES * largest  # megatron's local multi_tensor_scale
    gloo = 0.0
    if runtime.device == "cpu" and distributed_optimizer and data_parallel > 1:
        gloo = float(GRAD_BYTES * grad_buffer_elements)  # reduce-scatter / all-gather temporary
    return max(adam, clip, gloo)


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------


def layer_activation_elements(m: ModelShape, tokens: int, tp: int, flash_attention: bool,
                              sequence_length: int) -> float:
    """Elements one decoder layer keeps for its backward pass, for ``tokens = s * b``.

    Korthikanti et al. 2022 Sec. 4.1, per saved tensor (no dropout, no sequence parallelism):
    norm-1 input (h), QKV GEMM input (h), Q/K/V ((heads + 2 groups) d / t), attention output
    (heads d / t, also the projection's input), norm-2 input (h), fc1 input (h), fc1 output
    (2f / t, SwiGLU's input), fc2 input (f / t). Without flash attention add the attention
    scores and softmax output (2 heads s / t per token).
    """
    d, h, f = m.head_dim, m.hidden_size, m.ffn_hidden_size
    fc1 = 2 * f if m.swiglu else f
    per_token = 4 * h + ((m.num_attention_heads + 2 * m.num_query_groups) * d
                         + m.num_attention_heads * d + fc1 + f) / tp
    if not flash_attention:
        per_token += 2 * m.num_attention_heads * sequence_length / tp
    return per_token * tokens


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------


LOSS_BYTES_PER_LOGIT = 28  # the loss's backward peak per logit element (module doc, "Logits")


@dataclass
class MemoryPlan:
    """Per-GPU figures in GB (decimal), and the rollout budget. ``train_phase_gb`` /
    ``rollout_phase_gb`` are what one GPU needs in each phase; both must fit ``gpu_memory_gb``.
    ``train_peak_allocated_gb`` is the training phase without the reserve: the tensors alone, what
    ``torch.cuda.max_memory_allocated()`` (or, on the CPU, the peak resident memory a training
    step adds) should reach."""

    world_size: int
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    full_recompute: bool
    device: PlannedDevice
    distributed_optimizer: bool
    total_parameters: int
    parameters_per_gpu: int
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    weights_grads_optimizer_gb: float
    activations_gb: float
    logits_gb: float
    optimizer_step_transient_gb: float
    reference_gb: float
    reserve_gb: float
    vllm_while_training_gb: float
    train_peak_allocated_gb: float
    train_phase_gb: float
    resident_during_rollout_gb: float
    weight_push_gb: float
    vllm_gb: float
    rollout_phase_gb: float
    peak_allocated_gb: float           # max of both phases without the reserve: max_memory_allocated()
    gpu_memory_gb: float
    kv_cache_gb: float
    kv_bytes_per_token: float
    rollout_token_budget: int          # tokens the KV cache of one vLLM engine holds
    max_concurrent_sequences: int      # full-length sequences one engine runs at once
    sequences_per_engine: int          # rollout sequences each engine must produce per step
    rollout_waves: int                 # ceil(sequences_per_engine / max_concurrent_sequences)
    num_microbatches: int              # per optimizer step per data-parallel rank
    optimizer_steps_per_rollout: int
    tokens_per_step: int               # upper bound: every sequence at full length
    train_tflops_per_step: float       # policy updates + old/ref log-probs
    estimated_train_seconds: float     # at cluster.assumed_mfu
    notes: List[str] = field(default_factory=list)

    @property
    def uses_vllm(self) -> bool:
        return self.vllm_gb > 0



def check_layout(m: ModelShape, layout: Layout, cluster: "ClusterConfig", vllm: "VllmConfig", work: Workload) -> int:
    """Divisibility and range checks of the cluster layout; returns the data-parallel size.
    ConfigError names the key."""
    tp, pp = layout.tensor_parallel, layout.pipeline_parallel
    world = cluster.nodes * cluster.gpus_per_node
    for key, value in [("parallel.tensor", tp), ("parallel.pipeline", pp), ("parallel.micro_batch_size",
                       work.micro_batch_size), ("rollout.n", work.n), ("trainer.prompts_per_step", work.prompts_per_step)]:
        check_at_least(key, value, 1)
    if tp > cluster.gpus_per_node:
        raise ConfigError(f"parallel.tensor={tp} exceeds cluster.gpus_per_node={cluster.gpus_per_node}: "
                          "tensor parallelism must stay inside a node (NVLink)")
    if m.num_query_groups % tp:
        raise ConfigError(f"parallel.tensor={tp} does not divide model.num_query_groups={m.num_query_groups} "
                          "(megatron shards whole KV groups)")
    if m.vocab_size % tp:
        raise ConfigError(f"parallel.tensor={tp} does not divide model.vocab_size={m.vocab_size}")
    if m.num_layers % pp:
        raise ConfigError(f"parallel.pipeline={pp} does not divide model.num_layers={m.num_layers}")
    if world % (tp * pp):
        raise ConfigError(f"parallel.tensor x parallel.pipeline = {tp * pp} does not divide the {world} GPUs "
                          "(cluster.nodes x cluster.gpus_per_node)")
    dp = world // (tp * pp)
    check_mini_batches(work.prompts_per_step, work.mini_batch_prompts, dp)
    check_token_budget(work.max_tokens_per_micro_batch)
    if cluster.gpus_per_node % vllm.tensor_parallel:
        raise ConfigError(f"vllm.tensor_parallel={vllm.tensor_parallel} does not divide "
                          f"cluster.gpus_per_node={cluster.gpus_per_node}")
    if m.num_attention_heads % vllm.tensor_parallel:
        raise ConfigError(f"vllm.tensor_parallel={vllm.tensor_parallel} does not divide "
                          f"model.num_attention_heads={m.num_attention_heads}")
    return dp


def check_engine_support(m: ModelShape, layout: Layout, vllm: "VllmConfig", runtime: Runtime) -> None:
    """The engine's rules (``quatro_nemo.engine.capabilities``) for the planned layout."""
    check_tensor_split(m.ffn_hidden_size, layout.tensor_parallel)
    check_sequence_parallel(layout.sequence_parallel)
    if runtime.rollout_backend == RolloutBackendName.vllm:
        check_vllm_layout(layout.pipeline_parallel, layout.tensor_parallel, vllm.tensor_parallel)


def plan_memory(m: ModelShape, layout: Layout, cluster: "ClusterConfig", scale: "ScaleConfig",
                vllm: "VllmConfig", work: Workload, runtime: Optional[Runtime] = None) -> MemoryPlan:
    """The per-GPU plan (no fit check; see :func:`check_plan`). ``runtime`` defaults to a GPU with
    Transformer Engine and the vLLM backend (the cluster image)."""
    runtime = runtime or Runtime()
    dp = check_layout(m, layout, cluster, vllm, work)
    check_engine_support(m, layout, vllm, runtime)
    notes: List[str] = []
    tp, pp = layout.tensor_parallel, layout.pipeline_parallel
    world = cluster.nodes * cluster.gpus_per_node
    s, tokens_mb = work.sequence_length, work.tokens_per_micro_batch
    on_gpu = runtime.device == "cuda"
    uses_vllm = runtime.rollout_backend == RolloutBackendName.vllm
    if scale.distributed_optimizer and dp == 1:
        notes.append("scale.distributed_optimizer with data_parallel=1 shards nothing")
    if on_gpu and not (runtime.transformer_engine and runtime.fused_adam):
        notes.append("planned for this machine's packages: without Transformer Engine megatron's local attention "
                     "stores s x s scores; without TE/apex FusedAdam torch's AdamW adds step temporaries "
                     "(run the planner where the training image's packages are installed)")

    # Weights, DDP's float32 gradient buffer, optimizer state: the most loaded stage.
    stage_counts = stage_parameter_counts(m, layout)
    per_gpu = max(stage_counts)
    state = {key: per_gpu * value for key, value in
             training_state_bytes(m.bytes_per_param, scale.distributed_optimizer, dp).items()}
    training_state = sum(state.values())
    optimizer_parameters = per_gpu / (dp if scale.distributed_optimizer else 1)
    step_transient = optimizer_step_transient_bytes(m, tp, optimizer_parameters, per_gpu, runtime,
                                                    scale.distributed_optimizer, dp)

    # Activations on the first stage (the one with the most micro-batches in flight), in the
    # parameters' dtype, for the largest micro-batch: tokens_mb tokens (the token budget, or
    # micro_batch_size full rows); without Transformer Engine megatron's local attention stores
    # s x s scores. Micro-batches per optimizer step: with a budget, at full length (an upper bound).
    mini = work.mini_batch_prompts or work.prompts_per_step
    microbatches = math.ceil(mini * work.n // dp * s / tokens_mb)
    in_flight = min(pp, microbatches)
    layers = m.num_layers // pp
    act_bytes = m.bytes_per_param
    full_layer = layer_activation_elements(m, tokens_mb, tp, runtime.transformer_engine, s) * act_bytes
    if layout.full_recompute:
        activations = in_flight * layers * (tokens_mb * m.hidden_size * act_bytes) + full_layer
    else:
        activations = in_flight * layers * full_layer
    logits = tokens_mb * (m.vocab_size / tp) * LOSS_BYTES_PER_LOGIT + tokens_mb * m.hidden_size * act_bytes

    total = total_parameter_count(m)
    reference = per_gpu * m.bytes_per_param if work.uses_reference else 0.0
    reserve = cluster.reserve_gb * GB if on_gpu else 0.0
    memory = cluster.gpu_memory_gb * GB
    engine_parameters = total + (m.vocab_size * m.hidden_size if m.tie_embeddings else 0)
    vllm_weights = engine_parameters * m.bytes_per_param / vllm.tensor_parallel
    if not uses_vllm:
        vllm_budget = 0.0
    elif vllm.kv_cache_memory_gb is not None:   # weights + the KV cache asked for + activations
        vllm_budget = vllm_weights + (vllm.kv_cache_memory_gb + vllm.activation_reserve_gb) * GB
    else:
        vllm_budget = vllm.gpu_memory_utilization * memory
    vllm_while_training = 0.0 if vllm.sleep_between_phases else vllm_budget
    train_peak = (training_state + reference + vllm_while_training
                  + max(activations + logits, step_transient))
    train_phase = train_peak + reserve

    # Rollout phase: training state kept on the GPU while vLLM wakes, receives the weights (one
    # full tensor at a time) and samples.
    offloaded = scale.offload_optimizer_in_rollout and uses_vllm
    resident = (state["weights"] if offloaded else training_state) + reference + reserve
    push = (3 if tp > 1 else 2) * largest_full_tensor_elements(m) * m.bytes_per_param if uses_vllm else 0.0

    # vLLM engine: full weights in the model's dtype split over its TP ranks (vllm_weights above: its
    # output layer is its own even for tied embeddings, quatro_nemo.engine.vllm_backend.write_engine_model_dir),
    # then KV cache.
    rollout_phase = resident + max(vllm_budget, vllm_weights + push) if uses_vllm else 0.0
    kv_heads_per_rank = max(1, m.num_query_groups // vllm.tensor_parallel)
    kv_bytes_per_token = 2 * m.num_layers * kv_heads_per_rank * m.head_dim * 2
    kv_cache = vllm_budget - vllm_weights - vllm.activation_reserve_gb * GB if uses_vllm else 0.0
    budget = max(0, int(kv_cache // kv_bytes_per_token)) if kv_cache > 0 else 0
    concurrent = min(budget // s, vllm.max_num_seqs)
    engines = world // vllm.tensor_parallel
    sequences_per_engine = math.ceil(work.prompts_per_step * work.n / engines)
    waves = math.ceil(sequences_per_engine / concurrent) if concurrent > 0 else 0
    if uses_vllm and concurrent == vllm.max_num_seqs:
        notes.append(f"concurrency capped by vllm.max_num_seqs={vllm.max_num_seqs}")

    # Compute: 6 N per trained token (x4/3 with full recompute), 2 N per token for each of the
    # old and reference log-prob passes (Kaplan et al. 2020, arXiv:2001.08361, Sec. 2.1).
    tokens = work.prompts_per_step * work.n * s
    train_factor = 6 + (2 if layout.full_recompute else 0)
    flops = total * tokens * (train_factor * work.inner_loops + 2 + (2 if work.uses_reference else 0))
    seconds = flops / (world * cluster.peak_tflops * 1e12 * cluster.assumed_mfu)

    return MemoryPlan(
        world_size=world, tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp,
        full_recompute=layout.full_recompute, device=runtime.device,
        distributed_optimizer=scale.distributed_optimizer,
        total_parameters=total, parameters_per_gpu=per_gpu,
        weights_gb=state["weights"] / GB, grads_gb=state["grads"] / GB, optimizer_gb=state["optimizer"] / GB,
        weights_grads_optimizer_gb=training_state / GB, activations_gb=activations / GB, logits_gb=logits / GB,
        optimizer_step_transient_gb=step_transient / GB,
        reference_gb=reference / GB, reserve_gb=reserve / GB, vllm_while_training_gb=vllm_while_training / GB,
        train_peak_allocated_gb=train_peak / GB, train_phase_gb=train_phase / GB,
        resident_during_rollout_gb=resident / GB if uses_vllm else 0.0, weight_push_gb=push / GB,
        vllm_gb=vllm_budget / GB, rollout_phase_gb=rollout_phase / GB,
        peak_allocated_gb=max(train_peak, rollout_phase - reserve) / GB, gpu_memory_gb=cluster.gpu_memory_gb,
        kv_cache_gb=max(kv_cache, 0.0) / GB, kv_bytes_per_token=float(kv_bytes_per_token),
        rollout_token_budget=budget, max_concurrent_sequences=concurrent,
        sequences_per_engine=sequences_per_engine, rollout_waves=waves, num_microbatches=microbatches,
        optimizer_steps_per_rollout=work.prompts_per_step // mini * work.inner_loops,
        tokens_per_step=tokens, train_tflops_per_step=flops / 1e12, estimated_train_seconds=seconds,
        notes=notes,
    )


def check_plan(plan: MemoryPlan) -> MemoryPlan:
    """Refuse a plan that cannot fit; the error names the settings that would fix it."""
    if plan.train_phase_gb > plan.gpu_memory_gb:
        raise ConfigError(
            f"the training phase needs {plan.train_phase_gb:.1f} GB per GPU > cluster.gpu_memory_gb="
            f"{plan.gpu_memory_gb:g} (weights {plan.weights_gb:.1f}, gradients {plan.grads_gb:.1f}, optimizer "
            f"{plan.optimizer_gb:.1f}, activations {plan.activations_gb:.1f}, logits {plan.logits_gb:.1f}, "
            f"reference {plan.reference_gb:.1f}, vLLM {plan.vllm_while_training_gb:.1f}): "
            "lower parallel.micro_batch_size or parallel.max_tokens_per_micro_batch, set "
            "model.extra.recompute_granularity=full, raise parallel.tensor or "
            "parallel.pipeline or cluster.nodes, or set scale.distributed_optimizer=true / "
            "vllm.sleep_between_phases=true")
    if not plan.uses_vllm:
        return plan
    if plan.rollout_phase_gb > plan.gpu_memory_gb:
        raise ConfigError(
            f"the rollout phase needs {plan.rollout_phase_gb:.1f} GB per GPU > cluster.gpu_memory_gb="
            f"{plan.gpu_memory_gb:g} (vLLM {plan.vllm_gb:.1f} + training state {plan.resident_during_rollout_gb:.1f}): "
            "lower vllm.gpu_memory_utilization or set scale.offload_optimizer_in_rollout=true")
    if plan.max_concurrent_sequences < 1:
        raise ConfigError(
            f"vLLM's KV cache ({plan.kv_cache_gb:.2f} GB) cannot hold one full-length sequence "
            f"(scale.max_prompt_tokens + rollout.max_new_tokens): raise vllm.gpu_memory_utilization or "
            "vllm.tensor_parallel")
    return plan


def plan_run(cfg: "ExperimentConfig", runtime: Optional[Runtime] = None) -> MemoryPlan:
    """The checked plan of a validated run config (its typed sections; ``model.vocab_size`` set).
    ``runtime`` defaults to :meth:`Runtime.detect` for ``trainer.device`` and ``rollout.backend``."""
    trainer, parallel = cfg.trainer, cfg.parallel
    work = Workload(
        prompts_per_step=trainer.prompts_per_step, n=cfg.rollout.n, max_prompt_tokens=cfg.scale.max_prompt_tokens,
        max_new_tokens=cfg.rollout.max_new_tokens, micro_batch_size=parallel.micro_batch_size,
        max_tokens_per_micro_batch=parallel.max_tokens_per_micro_batch or None,
        mini_batch_prompts=trainer.mini_batch_prompts, inner_loops=trainer.inner_loops,
        uses_reference=cfg.algorithm.beta > 0,
    )
    runtime = runtime or Runtime.detect(trainer.device, cfg.rollout.backend)
    plan = plan_memory(ModelShape.from_model_config(cfg.model), Layout.from_config(cfg), cfg.cluster, cfg.scale,
                       cfg.vllm, work, runtime)
    return check_plan(plan)


__all__ = [
    "GB", "LOSS_BYTES_PER_LOGIT", "Layout", "MemoryPlan", "ModelShape", "PlannedDevice", "Runtime", "Workload",
    "check_engine_support",
    "check_layout", "check_plan", "layer_activation_elements", "layer_parameter_count", "optimizer_step_transient_bytes",
    "plan_memory", "plan_run", "stage_parameter_counts", "total_parameter_count", "training_state_bytes",
]
