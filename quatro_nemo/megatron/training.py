"""megatron-core's own training machinery for a policy: DDP, the (distributed) optimizer, offload.

What Megatron-LM's ``pretrain`` sets up, reduced to what the RL loop needs:

- :func:`wrap_for_training`: the model inside megatron's ``DistributedDataParallel`` (contiguous
  float32 gradient buffers ``param.main_grad``, data-parallel reduction in
  ``finish_grad_sync``; with ``use_distributed_optimizer`` a reduce-scatter so that each DP rank
  holds the reduced gradient of its shard only).
- :func:`build_optimizer`: ``get_megatron_optimizer`` with Adam(W). bf16 models get float32
  master weights (Micikevicius et al. 2018, "Mixed Precision Training", Sec. 3.1); with
  ``distributed_optimizer`` the masters and Adam moments are sharded over DP (ZeRO-1, Rajbhandari
  et al. 2020, Sec. 5.1). Gradient clipping (global L2 norm over every model-parallel shard) is the
  optimizer's: ``step()`` returns the norm. Without Transformer Engine or apex (the CPU) megatron
  falls back to ``torch.optim.AdamW``.
- :class:`HostTrainingState`: the optimizer state to reused (pinned) host buffers, parts of flat
  host allocations (:class:`FlatHostBuffer`), and the gradient buffers released while a colocated
  rollout engine samples, and back (NeMo-RL's ``offload_before_refit``, verl's
  ``offload_megatron_*``).

Gradient semantics. Every micro-batch loss is already its additive share of the GLOBAL loss
(:mod:`quatro_nemo.megatron.loss`), so gradients must be SUMMED over data-parallel ranks, not
averaged: models are built with ``calculate_per_token_loss=True`` (:mod:`.models`), which is
megatron's switch for exactly that (DDP's gradient scaling factor 1, no division by the number of
micro-batches in the schedule).
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Dict, Iterator, List, Sequence, Tuple

import torch
import torch.distributed as dist

from quatro_nemo.megatron.compat import current_device


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer's hyper-parameters (``trainer.*``)."""

    lr: float
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0           # global grad-norm clip; 0 disables (the norm is still reported)


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` without megatron's DDP wrapper (a ``GPTModel`` or its ``Float16Module``)."""
    from megatron.core.distributed import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def wrap_for_training(model: torch.nn.Module, distributed_optimizer: bool):
    """``model`` (from :func:`quatro_nemo.megatron.models.build_model`) in megatron's DDP.

    Gradients are reduced in float32 (``grad_reduce_in_fp32``), without overlap (the loop has one
    backward per micro-batch and no compute to hide the reduction behind on CPU; on GPUs the
    reduction of a mini-batch is a small part of an RL step). ``model`` keeps working for
    inference (sampling, log-probs): DDP holds the same parameters.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model,
                                   **precomputed_param_layout(model, ddp_config))


def precomputed_param_layout(model: torch.nn.Module, ddp_config) -> dict:
    """``{"full_param_layout": ...}`` for megatron's DDP where it takes one (megatron-core 0.19+;
    building DDP for the distributed optimizer without it is deprecated there and logs a warning),
    else ``{}`` (0.16.1 computes the same layout inside DDP). The layout is what DDP itself would
    compute: ``DistributedOptimizer.compute_full_param_layout`` over the trainable parameters,
    no bucketing (``overlap_grad_reduce`` is off: one bucket per buffer), padded for the
    data-parallel group."""
    import inspect

    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from quatro_nemo.megatron import parallel

    takes_layout = "full_param_layout" in inspect.signature(DistributedDataParallel.__init__).parameters
    if not (takes_layout and ddp_config.use_distributed_optimizer):
        return {}
    if ddp_config.overlap_grad_reduce or ddp_config.num_distributed_optimizer_instances != 1:
        raise ValueError("precomputed_param_layout covers one bucket per buffer and one optimizer instance")
    params = [param for param in model.parameters() if param.requires_grad]
    # DDP pads for its data-parallel group with context parallelism; the project has none (CP = 1)
    return {"full_param_layout": DistributedOptimizer.compute_full_param_layout(params, None, parallel.dp_size(),
                                                                               ddp_config)}


def build_optimizer(ddp_model, settings: OptimizerSettings):
    """megatron's optimizer over ``ddp_model``'s parameters (see the module docstring); it is
    distributed exactly when the DDP wrapper was built for one."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = ddp_model.config
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=settings.grad_clip,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=ddp_model.ddp_config.use_distributed_optimizer,
    )
    return get_megatron_optimizer(optimizer_config, [ddp_model])


def set_learning_rate(optimizer, lr: float) -> None:
    """Every parameter group's learning rate (megatron keeps per-group ``lr_mult``; ours is 1)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)


def warmup_learning_rate(base_lr: float, warmup_steps: int, optimizer_steps_done: int) -> float:
    """Linear warm-up: ``base_lr * min(1, (s + 1) / warmup)`` for optimizer step ``s`` (0-based)."""
    return base_lr * min(1.0, (optimizer_steps_done + 1) / max(warmup_steps, 1))


def optimizer_step(ddp_model, optimizer) -> float:
    """One optimizer step on the finalised gradients; returns the global gradient norm (before
    clipping). Raises if the step was skipped (inf/nan gradients with a loss scaler)."""
    success, grad_norm, _ = optimizer.step()
    if not success:
        raise FloatingPointError("the optimizer skipped a step: non-finite gradients")
    if not optimizer.config.clip_grad > 0.0:  # megatron computes the norm only when it clips
        grad_norm = optimizer.get_grad_norm()
    return float(grad_norm)


def has_gradient(ddp_model) -> bool:
    """Whether any entry of the DDP gradient buffers (``param.main_grad``) is non-zero on any rank
    (one MAX all-reduce over all ranks), after the step's backward passes. False: the loss had no
    gradient at all, and an optimizer step would move the weights by Adam's momentum and weight
    decay alone. (Under the distributed optimizer a rank's buffer outside its shard keeps its own
    unreduced gradient: still all zero exactly when every rank's gradient is.)"""
    nonzero = torch.zeros((), dtype=torch.float32, device=current_device())
    for param in inner_model(ddp_model).parameters():
        grad = getattr(param, "main_grad", None)
        if grad is not None:
            nonzero += torch.count_nonzero(grad).to(nonzero.device, torch.float32).clamp(max=1.0)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(nonzero, op=dist.ReduceOp.MAX)
    return bool(nonzero > 0)


def zero_gradients(ddp_model, optimizer) -> None:
    """Zero the DDP gradient buffers and the optimizer's main gradients before a new step."""
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()


class HostTrainingState:
    """The training state's device memory given to a colocated rollout engine while it samples,
    and taken back after (NeMo-RL's ``offload_before_refit``, verl's ``offload_megatron_*``).

    :meth:`offload` copies every storage of the optimizer state on the training device (Adam's
    moments and step, the float32 master weights: whatever the torch optimizers inside
    megatron's hold in their state and parameter groups, except storage shared with the model's
    own parameters, which the engine's weight push reads and the memory plan keeps resident) into
    a host buffer, waits for the copies, then releases the device storage (resized to 0, so every
    tensor and view on it stays the same object); DDP's gradient buffers are released without a
    copy (megatron's ``offload_grad_buffers``: between steps their content is dead, they come back
    zeroed). :meth:`reload` resizes each storage back, copies its bytes in and waits for them.

    The host buffers are parts of flat host allocations (:class:`FlatHostBuffer`), one part per
    storage, allocated at the first offload that needs them and reused by every later one (matched
    by byte size in a fixed order; the sizes no held part matches get one new flat allocation
    together: Adam's moments appear after the first step, so a run makes two, the master weights'
    and the moments'; an allocation none of whose parts is in use any more is released). They are
    pinned when CUDA is available (the copies are direct DMA, without a pageable staging copy per
    step), plain on the CPU, where the same round trip runs (it frees nothing there: the buffers
    hold what the storage held). :attr:`pinned_bytes` is what they page-lock. ``seconds`` holds the
    last offload's and reload's wall time (``time/offload``, ``time/reload``).
    """

    def __init__(self, ddp_model, optimizer):
        self.ddp_model, self.optimizer = ddp_model, optimizer
        self.device = torch.device(current_device())
        self.pin_memory = torch.cuda.is_available()
        self.host_buffers: List[torch.Tensor] = []   # in the order of offload_storages()
        self.allocations: List[FlatHostBuffer] = []  # the flat host memory the buffers are parts of
        self.parked: List[torch.UntypedStorage] = []  # released device storages, host_buffers' order
        self.seconds: Dict[str, float] = {}

    def offload_storages(self) -> List[torch.UntypedStorage]:
        """The optimizer's storages on the training device that do not hold model weights, each
        once, in the optimizers' order."""
        weights = {p.untyped_storage()._cdata for p in self.ddp_model.parameters()}
        found: Dict[int, torch.UntypedStorage] = {}
        for inner in torch_optimizers(self.optimizer):
            tensors = [p for group in inner.param_groups for p in group["params"]]
            tensors += [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
            for tensor in tensors:
                storage = tensor.untyped_storage()
                if tensor.device == self.device and storage._cdata not in weights and storage.nbytes() > 0:
                    found.setdefault(storage._cdata, storage)
        return list(found.values())

    def offload(self) -> None:
        if self.parked:
            raise RuntimeError("the training state is already offloaded (offload without a reload)")
        start = time.perf_counter()
        storages = self.offload_storages()
        self.host_buffers = self._buffers_for([storage.nbytes() for storage in storages])
        for storage, host in zip(storages, self.host_buffers):
            host.copy_(_storage_bytes(storage), non_blocking=True)
        self._synchronize()  # the bytes are on the host before their device memory is released
        for storage in storages:
            storage.resize_(0)
        self.parked = storages
        cuda = self.device.type == "cuda"
        self.ddp_model.offload_grad_buffers(synchronize=cuda, empty_cache=False)
        if cuda:
            torch.cuda.empty_cache()
        self.seconds["time/offload"] = time.perf_counter() - start

    def reload(self) -> None:
        start = time.perf_counter()
        self.ddp_model.restore_grad_buffers(synchronize=False)
        for storage, host in zip(self.parked, self.host_buffers):
            storage.resize_(host.numel())
            _storage_bytes(storage).copy_(host, non_blocking=True)
        self._synchronize()  # the state is back before the trainer reads it
        self.parked = []
        self.seconds["time/reload"] = time.perf_counter() - start

    @property
    def pinned_bytes(self) -> int:
        """Host bytes page-locked for the buffers (0 on the CPU): the flat allocations' sizes, where
        torch's caching host allocator would have reserved each buffer's size rounded up to a power
        of two (``torch.cuda.host_memory_stats()["allocated_bytes.current"]``)."""
        return sum(allocation.nbytes for allocation in self.allocations if allocation.pinned)

    def _buffers_for(self, sizes: List[int]) -> List[torch.Tensor]:
        """A host buffer of each byte size: a part of a held allocation where one of that size is
        left (taken in order), else a part of one new flat allocation for all the sizes left over;
        allocations none of whose parts is taken any more are released."""
        spare: Dict[int, List[torch.Tensor]] = {}
        for allocation in self.allocations:
            for part in allocation.parts:
                spare.setdefault(part.numel(), []).append(part)
        buffers = [spare[n].pop(0) if spare.get(n) else None for n in sizes]
        missing = [n for n, buffer in zip(sizes, buffers) if buffer is None]
        if missing:
            self.allocations.append(FlatHostBuffer(missing, pin=self.pin_memory))
            new_parts = iter(self.allocations[-1].parts)
            buffers = [next(new_parts) if buffer is None else buffer for buffer in buffers]
        taken = {buffer.data_ptr() for buffer in buffers}
        self.allocations = [allocation for allocation in self.allocations
                            if any(part.data_ptr() in taken for part in allocation.parts)]
        return buffers

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


HOST_BUFFER_ALIGNMENT = 256
"""Byte alignment of each part of a :class:`FlatHostBuffer` (relative to its start, which the CPU
allocator aligns to 64 bytes): the alignment of every CUDA device allocation, so a part starts as
its device storage does."""


def flat_offsets(sizes: Sequence[int], alignment: int = HOST_BUFFER_ALIGNMENT) -> Tuple[List[int], int]:
    """(byte offset of each size in one flat buffer, the buffer's byte size): the sizes in order,
    each starting at the next multiple of ``alignment``."""
    offsets, end = [], 0
    for size in sizes:
        start = -(-end // alignment) * alignment
        offsets.append(start)
        end = start + size
    return offsets, end


class FlatHostBuffer:
    """One host allocation holding a uint8 part of each byte size (:func:`flat_offsets`).

    ``pin``: page-locked with ``cudaHostRegister`` (``torch.cuda.cudart()``) for exactly its size,
    and unregistered when this object is released. Not ``torch.empty(pin_memory=True)``: that goes
    through torch's caching host allocator, which rounds every allocation up to a power of two
    (ATen ``CachingHostAllocator.h``, ``allocate``: ``c10::llvm::PowerOf2Ceil``, for any size under
    ``pinned_max_round_threshold``, unlimited by default): up to 2x the bytes. torch's own
    ``pinned_use_cuda_host_register`` mode registers CPU-allocator memory the same way
    (``CUDACachingHostAllocator.cpp``). Registered memory is pinned to CUDA (``is_pinned()``,
    asynchronous copies); torch's host-memory statistics do not count it
    (:attr:`HostTrainingState.pinned_bytes` does).
    """

    def __init__(self, sizes: Sequence[int], pin: bool):
        offsets, self.nbytes = flat_offsets(sizes)
        self.memory = torch.empty(self.nbytes, dtype=torch.uint8)
        self.parts = [self.memory[offset:offset + size] for offset, size in zip(offsets, sizes)]
        self.pinned = pin
        if pin:
            cudart = torch.cuda.cudart()
            error = cudart.cudaHostRegister(self.memory.data_ptr(), self.nbytes, 0)  # cudaHostRegisterDefault
            if error != cudart.cudaError.success:
                raise RuntimeError(f"cudaHostRegister of {self.nbytes} host bytes failed: "
                                   f"{cudart.cudaGetErrorString(error)}")
            # before the memory itself is freed (an object's weak references are cleared before
            # its attributes): cudaHostUnregister of freed memory is undefined
            weakref.finalize(self, cudart.cudaHostUnregister, self.memory.data_ptr())


def torch_optimizers(optimizer) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron optimizer (a ``ChainedOptimizer`` or one)."""
    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(megatron_optimizer, "optimizer", None)
        if inner is not None and not getattr(megatron_optimizer, "is_stub_optimizer", False):
            yield inner


def _storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of ``storage`` (the copy source or target)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


__all__: List[str] = [
    "FlatHostBuffer",
    "HOST_BUFFER_ALIGNMENT",
    "HostTrainingState",
    "OptimizerSettings",
    "build_optimizer",
    "flat_offsets",
    "has_gradient",
    "inner_model",
    "optimizer_step",
    "precomputed_param_layout",
    "set_learning_rate",
    "torch_optimizers",
    "warmup_learning_rate",
    "wrap_for_training",
    "zero_gradients",
]
