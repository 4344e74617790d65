"""One run device: no tensor the project leaves on the host reaches the model or a collective.

On a GPU cluster the run device is the rank's GPU, and a host tensor fed to the model or to an
NCCL collective is an error there (NCCL rejects CPU tensors). Without a GPU every tensor is on the
CPU, so the mistake cannot surface by running. This test finds it by *taint tracking* during a
real two-step training run (megatron backend, data parallel over 2 ranks on gloo):

- sources: tensors our code (``quatro_nemo``, not torch or megatron) creates without an explicit
  ``device=``, and tensors it moves to the host with ``.cpu()`` / ``.to("cpu")`` (``tensor``,
  ``zeros``, ``arange``, ``from_numpy``, ...: on a GPU machine these are host tensors);
- propagation: every torch operation with a tainted input taints its outputs, except a move to
  the run device (``.to(current_device())``), which is exactly the fix;
- sinks: the inputs of every ``torch.distributed`` collective, of the model's forward and of the
  sampler's per-token draw (the logits stay on the device where the model made them).

A tainted tensor at a sink is a tensor that would be on the wrong device on a GPU.
"""
from __future__ import annotations

import sys
import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.distributed import run_ranks

from .conftest import TINY

FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full,
             torch.arange, torch.rand, torch.randn, torch.randint, torch.from_numpy, torch.linspace}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter",
               "reduce_scatter_tensor", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
               "send", "recv", "isend", "irecv")


def _caller_is_ours() -> bool:
    """Whether the innermost frame outside torch and this test belongs to quatro_nemo."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module.startswith("torch") or module == __name__):
            return module.startswith("quatro_nemo")
        frame = frame.f_back
    return False


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class HostTaint(TorchFunctionMode):
    """Marks host tensors made by our code and everything computed from them (module docstring)."""

    def __init__(self, run_device: torch.device):
        super().__init__()
        self.run_device = run_device
        self.tainted = {}   # id(tensor) -> weak reference (tensors compare elementwise, so no WeakSet)
        self.violations = []

    def is_tainted(self, tensor) -> bool:
        ref = self.tainted.get(id(tensor))
        return ref is not None and ref() is tensor

    def _mark(self, tensor) -> None:
        key = id(tensor)
        self.tainted[key] = weakref.ref(tensor, lambda _ref, key=key: self.tainted.pop(key, None))

    def _moves_to_run_device(self, func, args, kwargs) -> bool:
        if func is torch.Tensor.cuda:
            return True
        if func is not torch.Tensor.to:
            return False
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        if isinstance(target, torch.Tensor):
            return not self.is_tainted(target)
        return isinstance(target, torch.device) and target == self.run_device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        if func in FACTORIES and "device" not in kwargs and _caller_is_ours():
            taint = True
        elif func is torch.Tensor.cpu or (func is torch.Tensor.to and args[1:2] == ("cpu",)):
            taint = _caller_is_ours()
        elif self._moves_to_run_device(func, args, kwargs):
            taint = False
        else:
            taint = any(self.is_tainted(t) for t in inputs)
        for tensor in _tensors(result):
            if taint:
                self._mark(tensor)
            else:  # a move to the run device of a tensor already there returns the tensor itself
                self.tainted.pop(id(tensor), None)
        return result

    def check(self, where: str, values) -> None:
        for tensor in _tensors(values):
            if self.is_tainted(tensor):
                self.violations.append(f"{where}: {tuple(tensor.shape)} {tensor.dtype}")


def _install_sinks(monkey, taint: HostTaint) -> None:
    import torch.distributed as dist

    for name in COLLECTIVES:
        original = getattr(dist, name)

        def checked(*args, _original=original, _name=name, **kwargs):
            taint.check(f"torch.distributed.{_name}", (args, kwargs))
            return _original(*args, **kwargs)

        monkey.setattr(dist, name, checked)

    from megatron.core.models.gpt import GPTModel

    original_forward = GPTModel.forward

    def checked_forward(self, *args, **kwargs):
        taint.check("GPTModel.forward", (args, kwargs))
        return original_forward(self, *args, **kwargs)

    monkey.setattr(GPTModel, "forward", checked_forward)

    # The sampler's per-token draw: [S, V] logits copied to the host there cost ~1 s per decode
    # step on a GPU at S=256, V=152k (quatro_nemo/megatron/sampling.py generate).
    from quatro_nemo.megatron import sampling

    original_draw = sampling.draw_tokens

    def checked_draw(logits, uniforms, *args, **kwargs):
        taint.check("sampling.draw_tokens", (logits, uniforms))
        return original_draw(logits, uniforms, *args, **kwargs)

    monkey.setattr(sampling, "draw_tokens", checked_draw)


def _train_rank(rank, args, result_path, break_device):
    from quatro_nemo.engine import loop
    from quatro_nemo.engine.config import load_config
    from quatro_nemo.megatron.compat import current_device

    monkey = pytest.MonkeyPatch()
    if break_device:  # the check must see a host tensor handed to a collective
        monkey.setattr(loop, "current_device", lambda: "cpu")
    taint = HostTaint(torch.device("cpu"))
    assert current_device() == torch.device("cpu")
    _install_sinks(monkey, taint)
    with taint:
        loop.train(load_config(args))
    monkey.undo()
    torch.save(taint.violations, f"{result_path}.{rank}")


def _violations(tmp_path, warm_cache, break_device):
    run_dir = tmp_path / ("broken" if break_device else "run")
    args = TINY + [f"warmstart.cache_dir={warm_cache}", f"run.dir={run_dir}", "trainer.steps=2",
                   "trainer.mini_batch_prompts=4", "eval.num_problems=2", "trainer.checkpoint_every=2"]
    path = str(tmp_path / "violations")
    run_ranks(2, _train_rank, args, path, break_device)
    return torch.load(f"{path}.0") + torch.load(f"{path}.1")


@pytest.mark.distributed
@pytest.mark.slow
def test_no_host_tensor_reaches_the_model_or_a_collective(tmp_path, warm_cache):
    assert _violations(tmp_path, warm_cache, break_device=False) == []


@pytest.mark.distributed
@pytest.mark.slow
def test_the_check_sees_a_host_tensor_given_to_a_collective(tmp_path, warm_cache):
    """The loop's ``.to(current_device())`` replaced by ``.to("cpu")``: the checker must object."""
    violations = _violations(tmp_path, warm_cache, break_device=True)
    assert any("torch.distributed" in v for v in violations), violations
