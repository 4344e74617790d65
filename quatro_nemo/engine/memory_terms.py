"""What one GPU holds, term by term: the inputs of the memory plan (model shape, workload, layout,
runtime) and the bytes of each thing megatron-core and the loss allocate (pure arithmetic, no
torch). :mod:`quatro_nemo.engine.memory_phases` adds these terms up into the phases of a run and
:mod:`quatro_nemo.engine.memory_plan` checks them against the machine.

Each term, per GPU of the most loaded pipeline stage, with ``P`` its parameters and ``d`` the
data-parallel size (:func:`training_state_bytes`, ``memory_plan.plan_memory``):

- **Weights** ``P x 2`` (bf16) or ``P x 4`` (float32): megatron-core ``GPTModel`` parameters
  (``quatro_nemo.megatron.models.build_model``; with the distributed optimizer they become views
  of DDP's contiguous parameter buffer, no second copy).
- **Gradients** ``P x 4``: megatron-core ``DistributedDataParallel(grad_reduce_in_fp32=True)``
  allocates one float32 gradient buffer for every parameter (``param_and_grad_buffer.py``,
  ``grad_data``), unsharded even with the distributed optimizer (it reduce-scatters in place).
- **Optimizer** (``get_megatron_optimizer``, Adam): float32 main parameters (bf16 models only:
  ``Float16OptimizerWithFloat16Params`` / the distributed optimizer's ``shard_main_param``, made
  when the optimizer is built; a float32 model's main parameters are its weights) and Adam's
  ``exp_avg`` and ``exp_avg_sq`` (8 bytes), which exist only from the first step on, or from a
  resume, which allocates them before loading (megatron-core 0.19.2
  ``optimizer/distrib_optimizer.py``, ``sharded_state_dict(is_loading=True)`` calls
  ``self.load_state_dict(self.state_dict())``); divided by ``d`` with
  ``scale.distributed_optimizer``. Together: Megatron-LM ``docs/source/api-guide/dist_optimizer.md``,
  "bf16 param, fp32 grads: 18 (plain), 6 + 12/d (distributed)"; "fp32 param, fp32 grads: 16 and 8 + 8/d".
- **Activations** in the parameters' dtype: Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models" (arXiv:2205.05198), Sec. 4.1, redone for a pre-norm
  RMSNorm/SwiGLU/GQA layer without dropout (:func:`layer_activation_elements`); flash attention
  (Transformer Engine's layer spec) stores no ``s x s`` scores, megatron's local spec (no TE: the
  CPU, or a GPU without TE) does. Full recomputation keeps each layer's input plus one layer's
  activations. A 1F1B pipeline keeps ``min(PP, micro-batches)`` micro-batches in flight on the
  first stage (Narayanan et al. 2021, arXiv:2104.04473, Sec. 2.2).
- **Logits** of one micro-batch, ``b x s x V/TP`` elements on the last stage, at
  :data:`LOSS_BYTES_PER_LOGIT` bytes each at the peak of the loss's backward and
  :data:`LOGPROB_FORWARD_BYTES_PER_LOGIT` in a forward-only log-prob pass (pi_old, pi_ref, the
  evaluation's entropy).
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
- **Checkpoint load** (:func:`load_transient_elements`): megatron's ``dist_checkpointing.load``
  reads every tensor into the model's own parameters (``ShardedTensor.data``) except SwiGLU's
  fused ``linear_fc1``, which it saves as two halves and puts back together with ``torch.cat``
  (``transformer/mlp.py``, ``apply_swiglu_sharded_factory``; ``serialization.py`` ``load`` ->
  ``apply_factory_merges``): one new ``2f x h / TP`` tensor per layer, all held until
  ``load_state_dict`` copies them in.
- **KV cache**: ``2 (K and V) x layers x KV heads x head_dim x 2 bytes`` per token, KV heads split
  over the vLLM TP ranks (replicated when TP > KV heads), as vLLM allocates it.
- Parameter counts: the Qwen2 / GPT decoder layer's tensors (:func:`stage_parameter_counts`);
  checked against ``transformers``' Qwen2 and the published Qwen2.5 totals (1,543,714,304 and
  7,615,616,512 parameters).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional

from quatro_nemo.engine.capabilities import Device, RolloutBackendName, check_params_dtype
from quatro_nemo.validation import ConfigError, choices, coerce_choices

if TYPE_CHECKING:
    from quatro_nemo.engine.config import ExperimentConfig

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
    eval_problems: int = 0                    # eval.num_problems: held-out problems per evaluation
    eval_samples: int = 0                     # eval.n_samples: responses per held-out problem

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


@dataclass
class TrainingStateBytes:
    """The training state, in bytes per parameter (:func:`training_state_bytes`) or per GPU
    (:meth:`times`): weights, DDP's float32 gradient buffer, the float32 main parameters (bf16
    models) and Adam's moments, the last two sharded by the distributed optimizer."""

    weights: float
    grads: float
    main_params: float
    adam: float

    @property
    def optimizer(self) -> float:
        return self.main_params + self.adam

    @property
    def full(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def before_first_step(self) -> float:
        """A fresh run's state: Adam's moments come with the first optimizer step."""
        return self.full - self.adam

    def times(self, count: float) -> "TrainingStateBytes":
        return TrainingStateBytes(self.weights * count, self.grads * count, self.main_params * count,
                                  self.adam * count)


def training_state_bytes(bytes_per_param: int, distributed_optimizer: bool, data_parallel: int) -> TrainingStateBytes:
    """Bytes per parameter of the weights, DDP's gradient buffer, the float32 main parameters of
    a bf16 model and Adam's moments, the last two sharded over DP by the distributed optimizer.
    Sums to Megatron-LM's dist_optimizer.md table: 18 / 6 + 12/d (bf16), 16 / 8 + 8/d (fp32)."""
    main_params = MAIN_PARAM_BYTES if bytes_per_param < 4 else 0  # a float32 model steps its weights
    shards = data_parallel if distributed_optimizer else 1
    return TrainingStateBytes(weights=float(bytes_per_param), grads=float(GRAD_BYTES),
                              main_params=main_params / shards, adam=ADAM_BYTES / shards)


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
# Logits, checkpoint load
# ---------------------------------------------------------------------------------------------

# Bytes per logit element at the peak of the loss path
# (``quatro_nemo.megatron.logprobs._VocabParallelLogProbsEntropy``), float32 each. The entropy is
# only a metric, so its gradient is never materialised (``ctx.set_materialize_grads(False)``,
# issue 38) and the backward computes the log-prob term alone, in place in one buffer: the saved
# logits and that buffer, 2 x 4 = 8. The peak is the forward's: the float32 logits (bf16 models:
# megatron's ``Float16Module`` casts them first), ``shifted``, its exponential and their product
# for the entropy, 4 x 4 = 16. Measured (``tests/engine/test_memory_reality.py``,
# ``benchmarks/bench_logprobs.py``): 16.9 on the CPU, 16.0 on an H200; 29.2 before, with the
# entropy's zero gradient materialised (three more full-vocabulary passes, 7 x 4 = 28).
LOSS_BYTES_PER_LOGIT = 16

# Bytes per logit element of a forward-only log-prob pass (``compute_logprobs`` under no_grad:
# pi_old, pi_ref, the held-out evaluation's entropy): the float32 logits, ``shifted``,
# ``exp_shifted`` and the ``exp_shifted * shifted`` temporary of the forward, 4 x 4.
LOGPROB_FORWARD_BYTES_PER_LOGIT = 16


def logits_bytes(m: ModelShape, tokens: int, tp: int, bytes_per_logit: int) -> float:
    """One micro-batch of ``tokens`` tokens on the last stage: its ``tokens x V/TP`` logits at
    ``bytes_per_logit`` each, plus the output layer's input (``tokens x h`` in the parameters' dtype)."""
    return tokens * (m.vocab_size / tp) * bytes_per_logit + tokens * m.hidden_size * m.bytes_per_param


def load_transient_elements(m: ModelShape, layout: Layout) -> int:
    """Elements a checkpoint load holds beyond the model and optimizer on the most loaded stage:
    SwiGLU's ``linear_fc1`` of every layer put back together by ``torch.cat`` (``2f x h / TP``
    each; module doc, "Checkpoint load"); 0 without SwiGLU."""
    if not m.swiglu:
        return 0
    return (m.num_layers // layout.pipeline_parallel) * 2 * m.ffn_hidden_size * m.hidden_size // layout.tensor_parallel
