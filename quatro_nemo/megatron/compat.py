"""Run megatron-core on CPU over gloo: the six workarounds, and one start-up saving, in one place.

megatron-core assumes CUDA in a few spots that have nothing to do with the maths. On a machine
without CUDA (the CPU tests and the embedded CPU default), :func:`apply_cpu_compat` patches
exactly these six, each shown necessary by switching it off (``docs/stack-facts.md``):

1. **Device of new tensors.** Megatron allocates with ``device=torch.cuda.current_device()``
   (attention buffers, RoPE, p2p shape tensors, TP gather outputs). ``torch.cuda.current_device``
   is made to return ``"cpu"``.
2. **Model-parallel RNG tracker.** ``DotProductAttention`` always forks the tracker's CUDA RNG
   state, even with dropout 0, and ``model_parallel_cuda_manual_seed`` seeds CUDA. The tracker's
   get/set state helpers and ``torch.cuda.{get,set}_rng_state`` / ``torch.cuda.manual_seed`` are
   backed by the CPU generator.
3. **Hard-coded CUDA tensors.** The pipeline schedules create a token counter with
   ``device="cuda"`` (even at PP=1); the default causal mask (``attention_mask=None``) is built
   with ``device="cuda"``; tied embeddings under PP call ``weight.data.cuda()``. A
   ``TorchFunctionMode`` (:class:`CudaToCpuDeviceMode`) that maps CUDA devices (``device=``
   keywords and ``Tensor.cuda()``) to the CPU is entered once for the process (forked ranks
   inherit it). Its cost is one Python call per torch call, 1-2 us (``benchmarks/bench_compat.py``): a
   few percent of a training step of the CPU default (~25k torch calls).
4. **p2p synchronisation.** ``p2p_communication`` calls ``torch.cuda.synchronize()``: a no-op.
5. **Legacy type strings.** megatron's optimizers and gradient clipping classify parameters by
   ``param.type() == "torch.cuda.FloatTensor"`` (``optimizer.py``, ``distrib_optimizer.py``,
   ``clip_grads.py``). The same mode makes the no-argument ``Tensor.type()`` of a CPU tensor
   report the ``torch.cuda.*`` name (``torch.FloatTensor`` -> ``torch.cuda.FloatTensor``);
   ``Tensor.type(dtype)`` conversions are untouched.
6. **CUDA streams.** megatron-core 0.19's gradient sync (``param_and_grad_buffer.py``,
   ``start_grad_sync``) asks ``torch.cuda.current_stream()`` unconditionally, to wait for CUDA-graph
   events. ``torch.cuda.current_stream`` is made to return torch's own CPU stream
   (``torch.cpu.current_stream()``, whose ``wait_event``/``wait_stream``/``record_event`` do
   nothing): CPU work is synchronous. (0.16.1 never asks for a stream without overlap.)

And one that saves time rather than being needed:

7. **Eager fusions.** megatron-core wraps its fused element-wise kernels (bias+GeLU, SwiGLU,
   ...) in ``torch.compile`` as it imports them (``megatron.core.jit.jit_fuser``, ~38 functions);
   the first such call imports TorchDynamo and Inductor, 2.7-3 s of every CPU process's start-up
   (4.9 s -> 1.9 s for importing megatron-core, measured on the 2-core CI machine), for kernels a
   run never calls (``megatron/models.py`` builds every model without CUDA with the fusions off) and
   that on a CPU would go through Inductor's C++ compiler. :func:`apply_cpu_compat` imports
   megatron-core with ``torch.compile`` as the identity for that import. ``megatron.core.jit``
   binds ``jit_fuser = torch.compile`` as it is imported, so the identity stays its fuser for the
   modules imported later too: the functions run eagerly, with the same results. It takes effect
   only if megatron-core was not imported before.

Nothing is patched when CUDA is available, and applying twice changes nothing. No other module
of ``quatro_nemo`` may special-case the CPU: call :func:`apply_cpu_compat` (``initialize_parallel``
does) and write device-agnostic code with :func:`current_device`.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False

_DEVICE_MODE: Optional["CudaToCpuDeviceMode"] = None


def cpu_compat_needed() -> bool:
    """True when the workarounds apply: CUDA is not available in this process."""
    return not torch.cuda.is_available()


def current_device() -> torch.device:
    """The device new tensors of this rank belong on: the current CUDA device, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare integer means a CUDA ordinal to torch's factory functions.
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpuDeviceMode(TorchFunctionMode):
    """Maps every CUDA device a torch function is asked for to the CPU (workaround 3), and
    reports CPU tensors' legacy type names as CUDA ones (workaround 5)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every torch call of the process passes here (~25k per training step of the CPU default):
        # the common case (no device keyword, not .cuda()/.type()) returns after two identity
        # checks and one dict lookup, with no copy of ``kwargs``.
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if not kwargs:
            return func(*args)
        if _is_cuda_device(kwargs.get("device")):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def _cpu_get_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *_args, **_kwargs) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all itself.
    torch.default_generator.manual_seed(int(seed))


def _eager_compile(model=None, **_options):
    """``torch.compile``'s signature, compiling nothing: the function itself (or, used as
    ``@torch.compile(...)``, a decorator returning it)."""
    return model if model is not None else (lambda function: function)


def _import_megatron_core_with_eager_fusions() -> None:
    """Workaround 7: import megatron-core without TorchDynamo (see the module docstring)."""
    if "megatron.core" in sys.modules:
        return
    compile_ = torch.compile
    torch.compile = _eager_compile
    try:
        import megatron.core  # noqa: F401  (megatron.core.jit keeps the identity as its jit_fuser)
    finally:
        torch.compile = compile_


def apply_cpu_compat() -> bool:
    """Apply the six CPU workarounds (and the eager fusions, 7) when CUDA is unavailable. Idempotent.

    Returns True when the workarounds are (now or already) in effect, False when CUDA is
    available and nothing was patched.
    """
    global _APPLIED
    if not cpu_compat_needed():
        return False
    if _APPLIED:
        return True

    # 7. megatron-core's fusions stay eager: no TorchDynamo import at start-up.
    _import_megatron_core_with_eager_fusions()
    import megatron.core.tensor_parallel.random as mcore_random

    # 1. device=torch.cuda.current_device() -> "cpu".
    torch.cuda.current_device = lambda: "cpu"

    # 2. The RNG tracker and CUDA seeding use the CPU generator.
    mcore_random._get_cuda_rng_state = _cpu_get_rng_state
    mcore_random._set_cuda_rng_state = _cpu_set_rng_state
    torch.cuda.get_rng_state = _cpu_get_rng_state
    torch.cuda.set_rng_state = _cpu_set_rng_state
    torch.cuda.random.get_rng_state = _cpu_get_rng_state
    torch.cuda.random.set_rng_state = _cpu_set_rng_state
    torch.cuda.manual_seed = _cpu_manual_seed

    # 3. CUDA devices asked of torch functions are mapped to the CPU, for the whole process.
    global _DEVICE_MODE
    _DEVICE_MODE = CudaToCpuDeviceMode()
    _DEVICE_MODE.__enter__()

    # 4. p2p's torch.cuda.synchronize() does nothing on the CPU.
    torch.cuda.synchronize = lambda *args, **kwargs: None

    # 6. The current CUDA stream is torch's no-op CPU stream.
    torch.cuda.current_stream = lambda *args, **kwargs: torch.cpu.current_stream()

    _APPLIED = True
    return True


def cpu_compat_applied() -> bool:
    """Whether :func:`apply_cpu_compat` has patched this process."""
    return _APPLIED


__all__ = [
    "CudaToCpuDeviceMode",
    "apply_cpu_compat",
    "cpu_compat_applied",
    "cpu_compat_needed",
    "current_device",
]
