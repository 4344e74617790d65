"""Per-GPU memory and throughput plan for a run at scale (pure arithmetic, no torch, no GPU).

For a model shape, a parallel layout and the batch settings, :func:`plan_memory` returns the
memory one GPU needs in each phase of a colocated RL step (training with megatron-core, rollout
with vLLM) and the rollout token budget, and :func:`check_plan` refuses a layout that cannot fit
with a :class:`PlanError` naming the setting to change. ``recipes/plan_memory.py`` prints it.

Sources of the arithmetic (each used once, in the function named):

- Parameter counts: the Qwen2 / GPT decoder layer's tensors (:func:`stage_parameter_counts`);
  checked against ``transformers``' Qwen2 and the published Qwen2.5 totals (1,543,714,304 and
  7,615,616,512 parameters).
- Weights + gradients + Adam state: Megatron-LM ``docs/source/api-guide/dist_optimizer.md``,
  bytes per parameter "bf16 param, fp32 grads: 18 (plain), 6 + 12/d (distributed optimizer)";
  "fp32 param, fp32 grads: 16 and 8 + 8/d" (:func:`weight_bytes_per_parameter`).
- Activations: the per-tensor accounting of Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models" (arXiv:2205.05198), Sec. 4.1, redone for a pre-norm
  RMSNorm/SwiGLU/GQA layer without dropout; flash attention stores no ``s x s`` scores
  (:func:`layer_activation_elements`). Full recomputation keeps each layer's input plus one
  layer's activations. A 1F1B pipeline keeps ``min(PP, micro-batches)`` micro-batches in flight on
  the first stage (Narayanan et al. 2021, arXiv:2104.04473, Sec. 2.2).
- Logits: ``[s, b, V/TP]`` in bf16 plus an fp32 copy and its fp32 gradient for the log-softmax
  (10 bytes per element) on the last stage.
- KV cache: ``2 (K and V) x layers x KV heads x head_dim x 2 bytes`` per token, KV heads split over
  the vLLM TP ranks (replicated when TP > KV heads), as vLLM allocates it.

It is a plan, not a measurement: a fixed ``cluster.reserve_gb`` covers the CUDA context, NCCL
buffers and allocator fragmentation. Check a new layout with ``scripts/gpu_check.sh`` style runs.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Mapping, Optional

GB = 1e9  # decimal gigabytes, as GPU memory is quoted (80 GB H100)


class PlanError(ValueError):
    """A layout that cannot run or cannot fit; the message names the setting to change."""


# ---------------------------------------------------------------------------------------------
# Config sections this module owns (conf/quatro_1p5b.yaml, conf/quatro_7b.yaml)
# ---------------------------------------------------------------------------------------------


@dataclass
class ClusterConfig:
    """``cluster:`` the machines a run gets."""

    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0      # H100 80 GB
    reserve_gb: float = 6.0          # CUDA context, NCCL buffers, allocator fragmentation
    peak_tflops: float = 989.0       # bf16 dense peak of one GPU (H100 SXM), for time estimates
    assumed_mfu: float = 0.3         # model FLOPs utilisation assumed for the time estimate


@dataclass
class ScaleConfig:
    """``scale:`` megatron-core settings that matter at scale (the CPU default ignores them)."""

    max_prompt_tokens: int = 512         # prompts longer than this are dropped (verl's default)
    distributed_optimizer: bool = True   # shard fp32 master weights + Adam state over DP
    flash_attention: bool = True         # TE / flash attention: no s x s scores stored
    reference_on_gpu: bool = True        # pi_ref's bf16 weights stay on the GPU (beta > 0)
    offload_optimizer_in_rollout: bool = True  # grads + optimizer state to CPU while vLLM samples


@dataclass
class VllmConfig:
    """``vllm:`` the colocated rollout engine (quatro_nemo.engine.vllm_backend)."""

    tensor_parallel: int = 1
    gpu_memory_utilization: float = 0.5  # fraction of GPU memory vLLM may take while sampling
    sleep_between_phases: bool = True    # vLLM sleep mode: weights/KV cache freed while training
    activation_reserve_gb: float = 2.0   # vLLM's forward activations and sampler buffers
    max_num_seqs: int = 256              # vLLM's scheduler cap on concurrent sequences
    enforce_eager: bool = False          # no CUDA graphs (debugging)
    seed: int = 0


PLAN_SECTIONS = {"cluster": ClusterConfig, "scale": ScaleConfig, "vllm": VllmConfig}


def section_from_dict(name: str, values: Optional[Mapping[str, object]]):
    """The typed ``name`` section (one of :data:`PLAN_SECTIONS`); unknown keys raise naming them."""
    cls = PLAN_SECTIONS[name]
    values = dict(values or {})
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise PlanError(f"unknown key(s) {[f'{name}.{k}' for k in unknown]}; known: {sorted(known)}")
    return cls(**values)


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
            raise PlanError(f"model.normalization={cfg.normalization!r}, model.position_embedding="
                            f"{cfg.position_embedding!r}: the planner covers RMSNorm + RoPE decoders (qwen2)")
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

    @staticmethod
    def recompute_from_model(model: Mapping[str, object]) -> bool:
        """Whether the ``model:`` section asks megatron for full recomputation (the one place the
        setting lives: ``model.extra.recompute_granularity``, passed to TransformerConfig)."""
        granularity = (model.get("extra") or {}).get("recompute_granularity")
        if granularity not in (None, "full", "selective"):
            raise PlanError(f"model.extra.recompute_granularity={granularity!r}: expected full, selective or null")
        return granularity == "full"


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


def weight_bytes_per_parameter(bytes_per_param: int, distributed_optimizer: bool, data_parallel: int) -> float:
    """Params + grads + Adam state per parameter (Megatron-LM dist_optimizer.md table)."""
    if bytes_per_param == 2:  # bf16 params, fp32 grads, fp32 master + Adam m, v
        return 6 + 12 / data_parallel if distributed_optimizer else 18
    return 8 + 8 / data_parallel if distributed_optimizer else 16  # fp32 params and grads


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


@dataclass
class MemoryPlan:
    """Per-GPU figures in GB (decimal), and the rollout budget. ``train_phase_gb`` /
    ``rollout_phase_gb`` are what one GPU needs in each phase; both must fit ``gpu_memory_gb``."""

    world_size: int
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    full_recompute: bool
    total_parameters: int
    parameters_per_gpu: int
    weights_grads_optimizer_gb: float
    activations_gb: float
    logits_gb: float
    reference_gb: float
    reserve_gb: float
    vllm_while_training_gb: float
    train_phase_gb: float
    resident_during_rollout_gb: float
    vllm_gb: float
    rollout_phase_gb: float
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

    def as_dict(self) -> Dict[str, object]:
        return asdict(self)

    def format(self) -> str:
        rows = [
            ("layout", f"TP={self.tensor_parallel} PP={self.pipeline_parallel} DP={self.data_parallel} "
                       f"on {self.world_size} GPUs, full recompute: {self.full_recompute}"),
            ("parameters (total / per GPU)", f"{self.total_parameters / 1e9:.3f} B / {self.parameters_per_gpu / 1e9:.3f} B"),
            ("weights + grads + optimizer", f"{self.weights_grads_optimizer_gb:7.2f} GB"),
            ("activations (in flight)", f"{self.activations_gb:7.2f} GB"),
            ("logits (last stage)", f"{self.logits_gb:7.2f} GB"),
            ("reference policy weights", f"{self.reference_gb:7.2f} GB"),
            ("vLLM while training", f"{self.vllm_while_training_gb:7.2f} GB"),
            ("reserve (context, NCCL, fragmentation)", f"{self.reserve_gb:7.2f} GB"),
            ("= training phase", f"{self.train_phase_gb:7.2f} GB of {self.gpu_memory_gb:.0f} GB"),
            ("training state kept during rollout", f"{self.resident_during_rollout_gb:7.2f} GB"),
            ("vLLM (weights + KV cache + activations)", f"{self.vllm_gb:7.2f} GB"),
            ("= rollout phase", f"{self.rollout_phase_gb:7.2f} GB of {self.gpu_memory_gb:.0f} GB"),
            ("KV cache per engine", f"{self.kv_cache_gb:7.2f} GB ({self.kv_bytes_per_token / 1e3:.1f} kB/token)"),
            ("rollout token budget per engine", f"{self.rollout_token_budget:,} tokens = "
                                                f"{self.max_concurrent_sequences} full-length sequences"),
            ("rollout sequences per engine", f"{self.sequences_per_engine} in {self.rollout_waves} wave(s)"),
            ("micro-batches per optimizer step", f"{self.num_microbatches} x {self.optimizer_steps_per_rollout} "
                                                 f"optimizer step(s) per rollout"),
            ("tokens per step (upper bound)", f"{self.tokens_per_step:,}"),
            ("training compute per step", f"{self.train_tflops_per_step:,.0f} TFLOP "
                                          f"(~{self.estimated_train_seconds:.0f} s at the assumed MFU)"),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"{name:<{width}}  {value}" for name, value in rows]
        return "\n".join(lines + [f"note: {note}" for note in self.notes])


def check_layout(m: ModelShape, layout: Layout, cluster: ClusterConfig, scale: ScaleConfig,
                 vllm: VllmConfig, work: Workload) -> int:
    """Divisibility and range checks; returns the data-parallel size. PlanError names the key."""
    tp, pp = layout.tensor_parallel, layout.pipeline_parallel
    world = cluster.nodes * cluster.gpus_per_node
    for key, value in [("parallel.tensor", tp), ("parallel.pipeline", pp), ("cluster.nodes", cluster.nodes),
                       ("cluster.gpus_per_node", cluster.gpus_per_node), ("vllm.tensor_parallel", vllm.tensor_parallel),
                       ("parallel.micro_batch_size", work.micro_batch_size), ("rollout.n", work.n),
                       ("trainer.prompts_per_step", work.prompts_per_step)]:
        if value < 1:
            raise PlanError(f"{key}={value} must be >= 1")
    if tp > cluster.gpus_per_node:
        raise PlanError(f"parallel.tensor={tp} exceeds cluster.gpus_per_node={cluster.gpus_per_node}: "
                        "tensor parallelism must stay inside a node (NVLink)")
    if m.num_query_groups % tp:
        raise PlanError(f"parallel.tensor={tp} does not divide model.num_query_groups={m.num_query_groups} "
                        "(megatron shards whole KV groups)")
    if m.vocab_size % tp:
        raise PlanError(f"parallel.tensor={tp} does not divide model.vocab_size={m.vocab_size}")
    if m.num_layers % pp:
        raise PlanError(f"parallel.pipeline={pp} does not divide model.num_layers={m.num_layers}")
    if world % (tp * pp):
        raise PlanError(f"parallel.tensor x parallel.pipeline = {tp * pp} does not divide the {world} GPUs "
                        "(cluster.nodes x cluster.gpus_per_node)")
    dp = world // (tp * pp)
    mini = work.mini_batch_prompts or work.prompts_per_step
    if work.prompts_per_step % mini:
        raise PlanError(f"trainer.mini_batch_prompts={mini} does not divide trainer.prompts_per_step="
                        f"{work.prompts_per_step}")
    if mini % dp:
        raise PlanError(f"trainer.mini_batch_prompts={mini} is not divisible by data_parallel={dp}")
    if work.max_tokens_per_micro_batch is not None and 0 < work.max_tokens_per_micro_batch < 2:
        raise PlanError(f"parallel.max_tokens_per_micro_batch={work.max_tokens_per_micro_batch} must be >= 2 "
                        "(or 0/null: off)")
    if work.prompts_per_step % dp:
        raise PlanError(f"trainer.prompts_per_step={work.prompts_per_step} is not divisible by data_parallel={dp}")
    if cluster.gpus_per_node % vllm.tensor_parallel:
        raise PlanError(f"vllm.tensor_parallel={vllm.tensor_parallel} does not divide "
                        f"cluster.gpus_per_node={cluster.gpus_per_node}")
    if m.num_attention_heads % vllm.tensor_parallel:
        raise PlanError(f"vllm.tensor_parallel={vllm.tensor_parallel} does not divide "
                        f"model.num_attention_heads={m.num_attention_heads}")
    if not 0.0 < vllm.gpu_memory_utilization < 1.0:
        raise PlanError(f"vllm.gpu_memory_utilization={vllm.gpu_memory_utilization} must be in (0, 1)")
    return dp


def plan_memory(m: ModelShape, layout: Layout, cluster: ClusterConfig, scale: ScaleConfig,
                vllm: VllmConfig, work: Workload) -> MemoryPlan:
    """The per-GPU plan (no fit check; see :func:`check_plan`)."""
    dp = check_layout(m, layout, cluster, scale, vllm, work)
    tp, pp = layout.tensor_parallel, layout.pipeline_parallel
    world = cluster.nodes * cluster.gpus_per_node
    s, tokens_mb = work.sequence_length, work.tokens_per_micro_batch
    notes: List[str] = []

    # Weights, grads, optimizer state: the most loaded stage.
    stage_counts = stage_parameter_counts(m, layout)
    per_gpu = max(stage_counts)
    weights = per_gpu * weight_bytes_per_parameter(m.bytes_per_param, scale.distributed_optimizer, dp)

    # Activations on the first stage (the one with the most micro-batches in flight), for the
    # largest micro-batch: tokens_mb tokens (the token budget, or micro_batch_size full rows).
    # Micro-batches per optimizer step: with a budget, at full length (an upper bound).
    mini = work.mini_batch_prompts or work.prompts_per_step
    microbatches = math.ceil(mini * work.n // dp * s / tokens_mb)
    in_flight = min(pp, microbatches)
    layers = m.num_layers // pp
    full_layer = layer_activation_elements(m, tokens_mb, tp, scale.flash_attention, s) * 2  # bf16
    if layout.full_recompute:
        activations = in_flight * layers * (tokens_mb * m.hidden_size * 2) + full_layer
    else:
        activations = in_flight * layers * full_layer
    logits = tokens_mb * (m.vocab_size / tp) * 10 + tokens_mb * m.hidden_size * 2

    total = total_parameter_count(m)
    reference = per_gpu * 2 if (work.uses_reference and scale.reference_on_gpu) else 0.0
    reserve = cluster.reserve_gb * GB
    memory = cluster.gpu_memory_gb * GB
    vllm_budget = vllm.gpu_memory_utilization * memory
    vllm_while_training = 0.0 if vllm.sleep_between_phases else vllm_budget
    train_phase = weights + activations + logits + reference + reserve + vllm_while_training

    # Rollout phase: training state kept on the GPU while vLLM samples.
    resident = per_gpu * m.bytes_per_param + reference + reserve
    if not scale.offload_optimizer_in_rollout:
        resident = weights + reference + reserve
    rollout_phase = resident + vllm_budget

    # vLLM engine: full bf16 weights split over its TP ranks, then KV cache.
    vllm_weights = total * 2 / vllm.tensor_parallel
    kv_heads_per_rank = max(1, m.num_query_groups // vllm.tensor_parallel)
    kv_bytes_per_token = 2 * m.num_layers * kv_heads_per_rank * m.head_dim * 2
    kv_cache = vllm_budget - vllm_weights - vllm.activation_reserve_gb * GB
    budget = max(0, int(kv_cache // kv_bytes_per_token)) if kv_cache > 0 else 0
    concurrent = min(budget // s, vllm.max_num_seqs)
    engines = world // vllm.tensor_parallel
    sequences_per_engine = math.ceil(work.prompts_per_step * work.n / engines)
    waves = math.ceil(sequences_per_engine / concurrent) if concurrent > 0 else 0
    if concurrent == vllm.max_num_seqs:
        notes.append(f"concurrency capped by vllm.max_num_seqs={vllm.max_num_seqs}")

    # Compute: 6 N per trained token (x4/3 with full recompute), 2 N per token for each of the
    # old and reference log-prob passes (Kaplan et al. 2020, arXiv:2001.08361, Sec. 2.1).
    tokens = work.prompts_per_step * work.n * s
    train_factor = 6 + (2 if layout.full_recompute else 0)
    flops = total * tokens * (train_factor * work.inner_loops + 2 + (2 if work.uses_reference else 0))
    seconds = flops / (world * cluster.peak_tflops * 1e12 * cluster.assumed_mfu)

    return MemoryPlan(
        world_size=world, tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp,
        full_recompute=layout.full_recompute,
        total_parameters=total, parameters_per_gpu=per_gpu,
        weights_grads_optimizer_gb=weights / GB, activations_gb=activations / GB, logits_gb=logits / GB,
        reference_gb=reference / GB, reserve_gb=reserve / GB, vllm_while_training_gb=vllm_while_training / GB,
        train_phase_gb=train_phase / GB, resident_during_rollout_gb=resident / GB, vllm_gb=vllm_budget / GB,
        rollout_phase_gb=rollout_phase / GB, gpu_memory_gb=cluster.gpu_memory_gb,
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
        raise PlanError(
            f"the training phase needs {plan.train_phase_gb:.1f} GB per GPU > cluster.gpu_memory_gb="
            f"{plan.gpu_memory_gb:g} (weights+optimizer {plan.weights_grads_optimizer_gb:.1f}, activations "
            f"{plan.activations_gb:.1f}, logits {plan.logits_gb:.1f}, vLLM {plan.vllm_while_training_gb:.1f}): "
            "lower parallel.micro_batch_size or parallel.max_tokens_per_micro_batch, set "
            "model.extra.recompute_granularity=full, raise parallel.tensor or "
            "parallel.pipeline, or set scale.distributed_optimizer=true / vllm.sleep_between_phases=true")
    if plan.rollout_phase_gb > plan.gpu_memory_gb:
        raise PlanError(
            f"the rollout phase needs {plan.rollout_phase_gb:.1f} GB per GPU > cluster.gpu_memory_gb="
            f"{plan.gpu_memory_gb:g} (vLLM {plan.vllm_gb:.1f} + training state {plan.resident_during_rollout_gb:.1f}): "
            "lower vllm.gpu_memory_utilization or set scale.offload_optimizer_in_rollout=true")
    if plan.max_concurrent_sequences < 1:
        raise PlanError(
            f"vLLM's KV cache ({plan.kv_cache_gb:.2f} GB) cannot hold one full-length sequence "
            f"(scale.max_prompt_tokens + rollout.max_new_tokens): raise vllm.gpu_memory_utilization or "
            "vllm.tensor_parallel")
    return plan


def plan_from_sections(model: Mapping[str, object], parallel: Mapping[str, object], trainer: Mapping[str, object],
                       rollout: Mapping[str, object], algorithm: Mapping[str, object],
                       cluster: Mapping[str, object], scale: Mapping[str, object],
                       vllm: Mapping[str, object]) -> MemoryPlan:
    """Plan from the config sections as plain dicts (the composed run config), then check it."""
    scale_cfg = section_from_dict("scale", scale)
    work = Workload(
        prompts_per_step=int(trainer["prompts_per_step"]), n=int(rollout["n"]),
        max_prompt_tokens=scale_cfg.max_prompt_tokens, max_new_tokens=int(rollout["max_new_tokens"]),
        micro_batch_size=int(parallel["micro_batch_size"]),
        max_tokens_per_micro_batch=parallel.get("max_tokens_per_micro_batch") or None,
        mini_batch_prompts=trainer.get("mini_batch_prompts"), inner_loops=int(trainer.get("inner_loops", 1)),
        uses_reference=float(algorithm.get("beta", 0.0) or 0.0) > 0,
    )
    layout = Layout(int(parallel["tensor"]), int(parallel["pipeline"]), Layout.recompute_from_model(model))
    from quatro_nemo.megatron.models import ModelConfig

    try:
        model_cfg = ModelConfig(**model)
    except TypeError as exc:  # an unknown key
        raise PlanError(f"model section: {exc}") from exc
    plan = plan_memory(ModelShape.from_model_config(model_cfg), layout, section_from_dict("cluster", cluster),
                       scale_cfg, section_from_dict("vllm", vllm), work)
    return check_plan(plan)


__all__ = [
    "ClusterConfig", "Layout", "MemoryPlan", "ModelShape", "PLAN_SECTIONS", "PlanError", "ScaleConfig",
    "VllmConfig", "Workload", "check_layout", "check_plan", "layer_activation_elements",
    "layer_parameter_count", "plan_from_sections", "plan_memory", "section_from_dict",
    "stage_parameter_counts", "total_parameter_count", "weight_bytes_per_parameter",
]
