"""Per-GPU memory and throughput plan for a run at scale (pure arithmetic, no torch, no GPU).

:func:`plan_run` plans a validated run config (``quatro_nemo.engine.config``'s typed sections):
for a model shape, a parallel layout and the batch settings, :func:`plan_memory` returns the
memory one GPU needs in each phase of a colocated RL run (start-up, resume, rollout with vLLM,
training with megatron-core, held-out evaluation, checkpoint save), the host memory of a save, the
rollout token budget and the seconds of a step, an evaluation and a save; :func:`check_layout`
refuses a layout that does not divide, ``quatro_nemo.engine.capabilities`` one the engine cannot
run, and :func:`check_plan` one where any phase cannot fit, each with a
:class:`~quatro_nemo.validation.ConfigError` naming the settings to change.
``recipes/plan_memory.py`` prints it (``--json`` for scripts).

It models what the engine does (issues 14 and 38), reading the keys the engine obeys
(``scale.*``, ``vllm.*``, ``parallel.*``, ``trainer.*``, ``eval.*``, ``model.*``) and the
machine's (``cluster.*``). The terms (what each allocation is, with its source) are in
:mod:`quatro_nemo.engine.memory_terms`, the phases (what is on the GPU when) in
:mod:`quatro_nemo.engine.memory_phases`, the seconds in :mod:`quatro_nemo.engine.phase_times`.

It is a plan, not a measurement: a fixed ``cluster.reserve_gb`` covers the CUDA context, NCCL
buffers and allocator fragmentation (0 on the CPU), ``vllm.sleep_residual_gb`` what vLLM keeps
on the GPU asleep. ``train_peak_allocated_gb`` is what ``torch.cuda.max_memory_allocated()``
should reach in training (``scripts/gpu_check.sh`` prints the two side by side); the CPU flavour
is checked against the measured peak resident memory of real training steps
(``tests/engine/test_memory_reality.py``), vLLM's terms against the real engine's CPU build
(``tests/vllm/test_memory_plan_real_engine.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional

from quatro_nemo.engine.capabilities import (RolloutBackendName, check_sequence_parallel, check_tensor_split,
                                             check_vllm_layout)
from quatro_nemo.engine.memory_phases import PhaseInputs, device_total_bytes, host_save, phase_bytes
from quatro_nemo.engine.memory_terms import (GB, LOGPROB_FORWARD_BYTES_PER_LOGIT, LOSS_BYTES_PER_LOGIT, Layout,
                                             ModelShape, PlannedDevice, Runtime, Workload, largest_full_tensor_elements,
                                             largest_tensor_elements,
                                             layer_activation_elements, layer_parameter_count, load_transient_elements,
                                             logits_bytes, optimizer_step_transient_bytes, stage_parameter_counts,
                                             total_parameter_count, training_state_bytes)
from quatro_nemo.engine.phase_times import (EngineRates, PhaseSeconds, compute_seconds, sampling_seconds,
                                            save_seconds, train_flops)
from quatro_nemo.validation import ConfigError, check_at_least, check_mini_batches, check_token_budget

if TYPE_CHECKING:
    from quatro_nemo.engine.config import ClusterConfig, ExperimentConfig, ScaleConfig, VllmConfig


@dataclass
class MemoryPlan:
    """Per-GPU figures in GB (decimal), the host figures of a save, the rollout budget and the
    seconds of each phase. ``phases`` maps each phase of
    :data:`~quatro_nemo.engine.memory_phases.PHASES` to what one GPU needs in it; every one must
    fit ``gpu_memory_gb`` (``train_phase_gb`` / ``rollout_phase_gb`` are two of them), and
    ``host_save_gb_per_node`` must fit ``host_memory_gb``. ``train_peak_allocated_gb`` is the
    training phase without the reserve: the tensors alone, what ``torch.cuda.max_memory_allocated()``
    (or, on the CPU, the peak resident memory a training step adds) should reach."""

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
    optimizer_gb: float                # float32 main parameters + Adam's moments
    adam_moments_gb: float             # the part that exists only after the first step (or a resume)
    weights_grads_optimizer_gb: float
    activations_gb: float
    logits_gb: float
    logprob_forward_gb: float          # a forward-only log-prob micro-batch (pi_old, pi_ref, evaluation)
    optimizer_step_transient_gb: float
    load_transient_gb: float           # a checkpoint load's transient (resume)
    reference_gb: float
    reserve_gb: float
    vllm_while_training_gb: float      # vLLM between its phases: asleep (its residual) or awake
    train_peak_allocated_gb: float
    train_phase_gb: float
    resident_during_rollout_gb: float
    weight_push_gb: float
    vllm_gb: float
    rollout_phase_gb: float
    phases: Dict[str, float]           # GB per GPU of each phase (memory_phases.PHASES)
    peak_allocated_gb: float           # the largest phase without the reserve: max_memory_allocated()
    gpu_memory_gb: float               # cluster.gpu_memory_gb: what every phase must fit
    device_total_gb: float             # the device's own total: what vllm.gpu_memory_utilization multiplies
    host_offload_gb_per_rank: float    # the optimizer state kept on the host (scale.offload_optimizer_in_rollout)
    checkpoint_written_gb_per_rank: float
    host_save_gb_per_rank: float
    host_save_gb_per_node: float
    host_memory_gb: float              # cluster.host_memory_gb: what a node's save must fit
    kv_cache_gb: float
    kv_bytes_per_token: float
    rollout_token_budget: int          # tokens the KV cache of one vLLM engine holds
    max_concurrent_sequences: int      # full-length sequences one engine runs at once
    max_num_seqs: int                  # vllm.max_num_seqs
    proposed_max_num_seqs: int         # all of an engine's sequences, or as many as its KV cache holds at full length
    sequences_per_engine: int          # rollout sequences each engine must produce per step
    rollout_waves: int                 # ceil(sequences_per_engine / max_concurrent_sequences)
    num_microbatches: int              # per optimizer step per data-parallel rank
    optimizer_steps_per_rollout: int
    tokens_per_step: int               # upper bound: every sequence at full length
    train_tflops_per_step: float       # policy updates + old/ref log-probs
    estimated_train_seconds: float     # at cluster.assumed_mfu
    rollout_seconds: float             # phase_times: vLLM's sampling of one step
    step_seconds: float                # rollout + training
    eval_seconds: float                # one held-out evaluation
    save_seconds: float                # one checkpoint save
    preemption_lead_seconds: float     # step + eval + save: what #SBATCH --signal=B:USR1@N must cover
    notes: List[str] = field(default_factory=list)

    @property
    def uses_vllm(self) -> bool:
        return self.vllm_gb > 0

    @property
    def phase_seconds(self) -> PhaseSeconds:
        return PhaseSeconds(rollout=self.rollout_seconds, train=self.estimated_train_seconds, eval=self.eval_seconds,
                            save=self.save_seconds)


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
    per_gpu = max(stage_parameter_counts(m, layout))
    state = training_state_bytes(m.bytes_per_param, scale.distributed_optimizer, dp).times(per_gpu)
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
    logits = logits_bytes(m, tokens_mb, tp, LOSS_BYTES_PER_LOGIT)
    logprob_forward = logits_bytes(m, tokens_mb, tp, LOGPROB_FORWARD_BYTES_PER_LOGIT) + full_layer
    load_transient = load_transient_elements(m, layout) * m.bytes_per_param

    total = total_parameter_count(m)
    reference = per_gpu * m.bytes_per_param if work.uses_reference else 0.0
    reserve = cluster.reserve_gb * GB if on_gpu else 0.0
    device_total, guessed_total = device_total_bytes(cluster)
    engine_parameters = total + (m.vocab_size * m.hidden_size if m.tie_embeddings else 0)
    vllm_weights = engine_parameters * m.bytes_per_param / vllm.tensor_parallel
    if not uses_vllm:
        vllm_budget = 0.0
    elif vllm.kv_cache_memory_gb is not None:   # weights + the KV cache asked for + activations
        vllm_budget = vllm_weights + (vllm.kv_cache_memory_gb + vllm.activation_reserve_gb) * GB
    else:   # vLLM takes its share of the device's own total (memory_phases module doc)
        vllm_budget = vllm.gpu_memory_utilization * device_total
        if guessed_total:
            notes.append(guessed_total)
    sleeps = vllm.sleep_between_phases and on_gpu   # vLLM's CPU build has no sleep mode
    vllm_while_training = (vllm.sleep_residual_gb * GB if sleeps else vllm_budget) if uses_vllm else 0.0
    train_transient = max(activations + logits, step_transient)
    train_peak = state.full + reference + vllm_while_training + train_transient
    train_phase = train_peak + reserve

    # Rollout phase: training state kept on the GPU while vLLM wakes, receives the weights (one
    # full tensor at a time) and samples. vLLM's engine: full weights in the model's dtype split
    # over its TP ranks (its output layer is its own even for tied embeddings,
    # quatro_nemo.engine.vllm_backend.write_engine_model_dir), then the KV cache.
    offloaded = scale.offload_optimizer_in_rollout and uses_vllm
    resident = (state.weights if offloaded else state.full) + reference + reserve
    push = (3 if tp > 1 else 2) * largest_full_tensor_elements(m) * m.bytes_per_param if uses_vllm else 0.0
    rollout_phase = resident + max(vllm_budget, vllm_weights + push) if uses_vllm else 0.0
    kv_heads_per_rank = max(1, m.num_query_groups // vllm.tensor_parallel)
    kv_bytes_per_token = 2 * m.num_layers * kv_heads_per_rank * m.head_dim * 2
    kv_cache = vllm_budget - vllm_weights - vllm.activation_reserve_gb * GB if uses_vllm else 0.0
    budget = max(0, int(kv_cache // kv_bytes_per_token)) if kv_cache > 0 else 0
    room = budget // s   # full-length sequences the KV cache holds at once
    concurrent = min(room, vllm.max_num_seqs)
    engines = world // vllm.tensor_parallel
    sequences_per_engine = math.ceil(work.prompts_per_step * work.n / engines)
    waves = math.ceil(sequences_per_engine / concurrent) if concurrent > 0 else 0
    proposed_max_num_seqs = min(sequences_per_engine, room) if uses_vllm else 0
    if uses_vllm and vllm.max_num_seqs < proposed_max_num_seqs:
        notes.append(f"vllm.max_num_seqs={vllm.max_num_seqs} caps each engine below the {proposed_max_num_seqs} "
                     f"sequences it could run at once: set vllm.max_num_seqs={proposed_max_num_seqs}")

    phases = phase_bytes(PhaseInputs(
        state=state, reference=reference, reserve=reserve, engine_asleep=vllm_while_training,
        engine_build=vllm_budget, train_transient=train_transient, logprob_forward=logprob_forward,
        load_transient=load_transient, rollout=rollout_phase))
    unsharded_optimizer = training_state_bytes(m.bytes_per_param, False, 1).optimizer * per_gpu
    host = host_save(unsharded_optimizer, state.weights, largest_tensor_elements(m, tp) * m.bytes_per_param, dp,
                     offload_bytes=state.optimizer if offloaded else 0.0, reserve_bytes=cluster.host_reserve_gb * GB)

    # Seconds (quatro_nemo.engine.phase_times): the step's sampling and training, one held-out
    # evaluation (its problems split over DP ranks, then over the engines of a TP group; its
    # entropy pass), one save.
    tokens = work.prompts_per_step * work.n * s
    flops = train_flops(total, tokens, layout.full_recompute, work.inner_loops, work.uses_reference)
    train_seconds = compute_seconds(flops, world, cluster)
    engine = EngineRates(weight_bytes=vllm_weights, kv_bytes_per_token=kv_bytes_per_token,
                         parameters=engine_parameters, tensor_parallel=vllm.tensor_parallel, max_concurrent=concurrent)
    engines_per_group = max(1, tp // vllm.tensor_parallel)
    eval_sequences = math.ceil(math.ceil(work.eval_problems / dp) / engines_per_group) * work.eval_samples
    rollout_seconds, eval_sampling = ((sampling_seconds(engine, sequences_per_engine, work.max_prompt_tokens,
                                                        work.max_new_tokens, cluster),
                                       sampling_seconds(engine, eval_sequences, work.max_prompt_tokens,
                                                        work.max_new_tokens, cluster))
                                      if uses_vllm else (0.0, 0.0))
    eval_seconds = eval_sampling + compute_seconds(2 * total * work.eval_problems * work.eval_samples * s, world,
                                                   cluster)
    seconds = PhaseSeconds(rollout=rollout_seconds, train=train_seconds, eval=eval_seconds,
                           save=save_seconds(host.written, cluster))

    return MemoryPlan(
        world_size=world, tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp,
        full_recompute=layout.full_recompute, device=runtime.device,
        distributed_optimizer=scale.distributed_optimizer,
        total_parameters=total, parameters_per_gpu=per_gpu,
        weights_gb=state.weights / GB, grads_gb=state.grads / GB, optimizer_gb=state.optimizer / GB,
        adam_moments_gb=state.adam / GB, weights_grads_optimizer_gb=state.full / GB,
        activations_gb=activations / GB, logits_gb=logits / GB, logprob_forward_gb=logprob_forward / GB,
        optimizer_step_transient_gb=step_transient / GB,
        load_transient_gb=load_transient / GB,
        reference_gb=reference / GB, reserve_gb=reserve / GB, vllm_while_training_gb=vllm_while_training / GB,
        train_peak_allocated_gb=train_peak / GB, train_phase_gb=train_phase / GB,
        resident_during_rollout_gb=resident / GB if uses_vllm else 0.0, weight_push_gb=push / GB,
        vllm_gb=vllm_budget / GB, rollout_phase_gb=rollout_phase / GB,
        phases={name: value / GB for name, value in phases.items()},
        peak_allocated_gb=(max(phases.values()) - reserve) / GB, gpu_memory_gb=cluster.gpu_memory_gb,
        device_total_gb=device_total / GB,
        host_offload_gb_per_rank=host.offload / GB, checkpoint_written_gb_per_rank=host.written / GB,
        host_save_gb_per_rank=host.per_rank / GB, host_save_gb_per_node=host.per_rank * cluster.gpus_per_node / GB,
        host_memory_gb=cluster.host_memory_gb,
        kv_cache_gb=max(kv_cache, 0.0) / GB, kv_bytes_per_token=float(kv_bytes_per_token),
        rollout_token_budget=budget, max_concurrent_sequences=concurrent, max_num_seqs=vllm.max_num_seqs,
        proposed_max_num_seqs=proposed_max_num_seqs,
        sequences_per_engine=sequences_per_engine, rollout_waves=waves, num_microbatches=microbatches,
        optimizer_steps_per_rollout=work.prompts_per_step // mini * work.inner_loops,
        tokens_per_step=tokens, train_tflops_per_step=flops / 1e12, estimated_train_seconds=train_seconds,
        rollout_seconds=seconds.rollout, step_seconds=seconds.step, eval_seconds=seconds.eval,
        save_seconds=seconds.save, preemption_lead_seconds=seconds.preemption_lead,
        notes=notes,
    )


# What each phase holds (its terms) and what would make it fit, for check_plan's message.
_PHASE_FIXES = {
    "startup": "set vllm.sleep_between_phases=true (the engine sleeps as soon as it is built), lower "
               "vllm.gpu_memory_utilization, raise cluster.nodes or parallel.tensor, or set "
               "scale.distributed_optimizer=true",
    "resume": "raise cluster.nodes or parallel.tensor (smaller optimizer shards), set scale.distributed_optimizer=true "
              "or vllm.sleep_between_phases=true",
    "train": "lower parallel.micro_batch_size or parallel.max_tokens_per_micro_batch, set "
             "model.extra.recompute_granularity=full, raise parallel.tensor or parallel.pipeline or cluster.nodes, or "
             "set scale.distributed_optimizer=true / vllm.sleep_between_phases=true",
    "rollout": "lower vllm.gpu_memory_utilization or set scale.offload_optimizer_in_rollout=true",
    "eval": "lower vllm.gpu_memory_utilization, or parallel.max_tokens_per_micro_batch / parallel.micro_batch_size",
    "save": "raise cluster.nodes or parallel.tensor, or set scale.distributed_optimizer=true / "
            "vllm.sleep_between_phases=true",
}


def _phase_terms(plan: MemoryPlan, phase: str) -> str:
    state = (f"reference {plan.reference_gb:.1f}, vLLM asleep {plan.vllm_while_training_gb:.1f}, "
             f"reserve {plan.reserve_gb:.1f}")
    before_first_step = plan.weights_grads_optimizer_gb - plan.adam_moments_gb
    return {
        "startup": f"training state before the first step {before_first_step:.1f}, {state}; vLLM at construction "
                   f"{plan.vllm_gb:.1f} beside the weights {plan.weights_gb:.1f}",
        "resume": f"training state with Adam's moments {plan.weights_grads_optimizer_gb:.1f}, load transient "
                  f"{plan.load_transient_gb:.1f}, {state}",
        "train": f"weights {plan.weights_gb:.1f}, gradients {plan.grads_gb:.1f}, optimizer {plan.optimizer_gb:.1f}, "
                 f"activations {plan.activations_gb:.1f}, logits {plan.logits_gb:.1f}, reference "
                 f"{plan.reference_gb:.1f}, vLLM {plan.vllm_while_training_gb:.1f}",
        "rollout": f"vLLM {plan.vllm_gb:.1f} + training state {plan.resident_during_rollout_gb:.1f}",
        "eval": f"the rollout phase {plan.rollout_phase_gb:.1f}, or the training state "
                f"{plan.weights_grads_optimizer_gb:.1f} with a log-prob forward {plan.logprob_forward_gb:.1f}, {state}",
        "save": f"training state {plan.weights_grads_optimizer_gb:.1f}, {state}",
    }[phase]


_PHASE_NAMES = {"startup": "start-up", "resume": "resume", "rollout": "rollout", "train": "training",
                "eval": "evaluation", "save": "checkpoint-save"}


def check_plan(plan: MemoryPlan) -> MemoryPlan:
    """Refuse a plan where any phase cannot fit (every failing phase in one error, each with the
    settings that would fix it)."""
    problems = [f"the {_PHASE_NAMES[name]} phase needs {needed:.1f} GB per GPU > cluster.gpu_memory_gb="
                f"{plan.gpu_memory_gb:g} ({_phase_terms(plan, name)}): {_PHASE_FIXES[name]}"
                for name, needed in plan.phases.items() if needed > plan.gpu_memory_gb]
    if plan.host_save_gb_per_node > plan.host_memory_gb:
        ranks = round(plan.host_save_gb_per_node / plan.host_save_gb_per_rank) if plan.host_save_gb_per_rank else 0
        problems.append(
            f"a checkpoint save needs {plan.host_save_gb_per_node:.0f} GB of host memory per node > "
            f"cluster.host_memory_gb={plan.host_memory_gb:g} ({ranks} ranks x {plan.host_save_gb_per_rank:.1f} GB: "
            f"the optimizer state kept on the host {plan.host_offload_gb_per_rank:.1f}, the writer's staging of "
            f"the {plan.checkpoint_written_gb_per_rank:.1f} GB each rank writes, cluster.host_reserve_gb): raise "
            "cluster.nodes (smaller shards per rank), set scale.offload_optimizer_in_rollout=false, or set "
            "cluster.host_memory_gb to what the nodes have")
    if plan.uses_vllm and plan.max_concurrent_sequences < 1:
        problems.append(
            f"vLLM's KV cache ({plan.kv_cache_gb:.2f} GB) cannot hold one full-length sequence "
            f"(scale.max_prompt_tokens + rollout.max_new_tokens): raise vllm.gpu_memory_utilization or "
            "vllm.tensor_parallel")
    if problems:
        raise ConfigError("; ".join(problems))
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
        uses_reference=cfg.algorithm.beta > 0, eval_problems=cfg.eval.num_problems, eval_samples=cfg.eval.n_samples,
    )
    runtime = runtime or Runtime.detect(trainer.device, cfg.rollout.backend)
    plan = plan_memory(ModelShape.from_model_config(cfg.model), Layout.from_config(cfg), cfg.cluster, cfg.scale,
                       cfg.vllm, work, runtime)
    return check_plan(plan)


__all__ = [
    "GB", "LOGPROB_FORWARD_BYTES_PER_LOGIT", "LOSS_BYTES_PER_LOGIT", "Layout", "MemoryPlan", "ModelShape",
    "PlannedDevice", "Runtime", "Workload", "check_engine_support", "check_layout", "check_plan",
    "layer_activation_elements", "layer_parameter_count", "optimizer_step_transient_bytes", "plan_memory", "plan_run",
    "stage_parameter_counts", "total_parameter_count", "training_state_bytes",
]
