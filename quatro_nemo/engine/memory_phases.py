"""The phases of a run and what one GPU (and, for the checkpoint save, the host) holds in each:
the terms of :mod:`quatro_nemo.engine.memory_terms` added up in the order the engine allocates
them (pure arithmetic, no torch). :mod:`quatro_nemo.engine.memory_plan` fills them in and checks
each against the machine.

Phases, per GPU of the most loaded pipeline stage (``quatro_nemo.engine.loop``: ``build_run``,
``train_step``, ``train``):

- **startup** (a fresh run): the policy's weights exist when the vLLM engine is built, which takes
  ``vllm.gpu_memory_utilization`` x the device's total (vLLM checks that much is free,
  ``vllm/v1/worker/utils.py`` ``request_memory``, and sizes its KV cache to fill it) and then
  sleeps at once (level 2, ``VllmRolloutBackend.__init__``, as NeMo-RL's ``finish_generation()``
  and verl do), leaving its residual; then megatron's DDP (float32 gradient buffer), the
  optimizer (float32 main parameters; Adam's moments come with the first step) and pi_ref.
- **resume**: the same, plus Adam's moments, which the distributed optimizer allocates before
  loading (``sharded_state_dict(is_loading=True)`` -> ``load_state_dict(state_dict())``), plus the
  load's transient (``memory_terms.load_transient_elements``). The routine checkpoint is
  megatron's ``dp_reshardable`` optimizer format read through ``FullyParallelLoadStrategyWrapper``
  over the data-parallel group: each rank reads its own optimizer shard into its own tensors
  (``distrib_optimizer.py`` ``sharded_param_state_dp_reshardable``: "fully parallel save and load
  without any inter-process communication or intermediate buffers/copies") and a share of the
  model's replicated tensors, broadcast into the others' parameters in place
  (``dist_checkpointing/exchange_utils.py`` ``exchange_loaded_tensors_broadcast``: the receive
  buffer is the ``ShardedTensor``'s own data).
- **rollout**: the training state (only the weights with ``scale.offload_optimizer_in_rollout``)
  and pi_ref stay while vLLM wakes, receives the weights and samples.
- **train**: the whole training state, pi_ref, vLLM's residual, and the larger of the step's
  activations + logits and the optimizer step's temporaries.
- **eval**: the held-out evaluation samples like a rollout, then measures the entropy with a
  forward-only pass (``compute_logprobs``) over the whole training state.
- **save**: the whole training state, pi_ref and vLLM's residual; the ``dp_reshardable`` tensors
  are the optimizer's own (no GPU copy, no gather: the same function as above), and
  ``FullyParallelSaveStrategyWrapper`` spreads the model's replicated tensors over the
  data-parallel group (``dist_checkpointing/strategies/fully_parallel.py``
  ``apply_saving_parallelization``), so each rank writes about ``1/d`` of its model shard and
  its own optimizer shard. The writer stages everything a rank writes in host memory before
  writing it (``strategies/filesystem_async.py`` ``preload_tensors``: ``tensor.to("cpu",
  non_blocking=True)``, which pins the copy: ATen ``_to_copy``'s ``pin_out``), through torch's
  caching host allocator, which rounds each block up to a power of two
  (:data:`PINNED_ROUNDING`), and keeps it cached for the next save.

The host per rank during a save: the optimizer state :class:`~quatro_nemo.megatron.training.HostTrainingState`
holds in host buffers (allocated once, with ``scale.offload_optimizer_in_rollout``), the save's
staging, and ``cluster.host_reserve_gb`` (the process: libraries, CUDA context, data); per node
``cluster.gpus_per_node`` ranks, against ``cluster.host_memory_gb``.

vLLM's share is ``vllm.gpu_memory_utilization`` x the device's total memory as torch reports it
(``torch.accelerator.get_memory_info``, ``vllm/utils/mem_utils.py`` ``MemorySnapshot``), which is
more than the nominal size (an "80 GB" H100: 81,559 MiB = 85.5 GB): :func:`device_total_bytes`.
The fit itself is checked against the nominal ``cluster.gpu_memory_gb`` (the difference is slack).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional, Tuple

from quatro_nemo.engine.memory_terms import GB, TrainingStateBytes

if TYPE_CHECKING:
    from quatro_nemo.engine.config import ClusterConfig

MIB = 2 ** 20

# nvidia-smi's total memory (MiB) of the cards sold at each nominal size (cluster.gpu_memory_gb),
# the largest where several share one (modal-labs/modal-client#2797 lists the totals it reads:
# H100 81,559, A100 80 GB 81,920, A100 40 GB 40,960, L40S 46,068, A10 23,028, L4 23,034; the
# H200 prints 143,771). torch's own total is ~0.5 GiB lower (what the driver keeps): the planned
# share errs high by at most vllm.gpu_memory_utilization x that.
KNOWN_GPU_TOTAL_MIB = {24: 23_034, 40: 40_960, 48: 46_068, 80: 81_920, 141: 143_771}

# torch's caching host allocator rounds every pinned block up to a power of two (ATen
# CachingHostAllocator: "Round up the allocation to the nearest power of two"): at most twice.
PINNED_ROUNDING = 2.0

PHASES = ("startup", "resume", "rollout", "train", "eval", "save")


def device_total_bytes(cluster: "ClusterConfig") -> Tuple[float, Optional[str]]:
    """(the device's total memory in bytes, a note when it is a guess): ``cluster.gpu_total_mib``
    when set, else :data:`KNOWN_GPU_TOTAL_MIB` of ``cluster.gpu_memory_gb``, else the nominal size."""
    if cluster.gpu_total_mib is not None:
        return cluster.gpu_total_mib * MIB, None
    known = KNOWN_GPU_TOTAL_MIB.get(int(cluster.gpu_memory_gb)) if float(cluster.gpu_memory_gb).is_integer() else None
    if known is not None:
        return known * MIB, None
    return cluster.gpu_memory_gb * GB, (
        f"no known device total for cluster.gpu_memory_gb={cluster.gpu_memory_gb:g}: vLLM's share is planned "
        "from it; set cluster.gpu_total_mib to nvidia-smi's total (vLLM multiplies the device's own total)")


@dataclass
class PhaseInputs:
    """What :func:`phase_bytes` adds up, bytes per GPU (0 where a term does not apply)."""

    state: TrainingStateBytes
    reference: float            # pi_ref
    reserve: float              # cluster.reserve_gb (0 on the CPU)
    engine_asleep: float        # vLLM between its phases: its residual asleep, or all of it without sleep mode
    engine_build: float         # vLLM at construction (its whole share), 0 without vLLM
    train_transient: float      # max(activations + logits, optimizer-step temporaries)
    logprob_forward: float      # a forward-only log-prob micro-batch: logits + one layer's activations
    load_transient: float       # the checkpoint load's transient
    rollout: float              # the rollout phase (memory_plan: kept state + vLLM awake), 0 without vLLM


def phase_bytes(p: PhaseInputs) -> Dict[str, float]:
    """Bytes per GPU of each of :data:`PHASES` (module doc)."""
    between_phases = p.reference + p.engine_asleep + p.reserve   # what every trainer phase shares
    fresh = p.state.before_first_step + between_phases
    if p.engine_build:  # the engine is built before DDP, the optimizer and pi_ref
        fresh = max(fresh, p.state.weights + p.engine_build + p.reserve)
    full = p.state.full + between_phases
    return {
        "startup": fresh,
        "resume": full + p.load_transient,
        "rollout": p.rollout,
        "train": full + p.train_transient,
        "eval": max(p.rollout, full + p.logprob_forward),
        "save": full,
    }


@dataclass
class HostSave:
    """Host bytes per rank while a checkpoint is saved."""

    offload: float        # the optimizer state HostTrainingState keeps on the host
    written: float        # what this rank writes (its optimizer shard, its share of the model)
    staging: float        # the writer's pinned staging of ``written``
    reserve: float        # cluster.host_reserve_gb

    @property
    def per_rank(self) -> float:
        return self.offload + self.staging + self.reserve


def host_save(optimizer_full_bytes: float, weights_bytes: float, largest_tensor_bytes: float, data_parallel: int,
              offload_bytes: float, reserve_bytes: float) -> HostSave:
    """The host during a save (module doc, "save"): a rank writes ``1/d`` of the optimizer state
    of its model shard (its own ``dp_reshardable`` shard, or with a plain optimizer its share of
    the replicas) and ``1/d`` of the model's weights, plus one largest tensor for the fully
    parallel wrapper's whole-tensor balance."""
    written = (optimizer_full_bytes + weights_bytes) / data_parallel + largest_tensor_bytes
    return HostSave(offload=offload_bytes, written=written, staging=PINNED_ROUNDING * written, reserve=reserve_bytes)


__all__ = ["HostSave", "KNOWN_GPU_TOTAL_MIB", "MIB", "PHASES", "PINNED_ROUNDING", "PhaseInputs",
           "device_total_bytes", "host_save", "phase_bytes"]
