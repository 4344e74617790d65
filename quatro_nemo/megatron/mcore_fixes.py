"""Work-arounds for megatron-core bugs on the optimizer paths this project uses.

Fixes 1-3 apply only to the megatron-core releases from the first to the last of
:data:`AFFECTED_VERSIONS` and only on the ``torch.optim.AdamW`` fallback megatron takes without Transformer Engine or apex
(``USING_PYTORCH_OPTIMIZER``: the CPU machines; GPU clusters with TE use FusedAdam, which keeps
'step' per parameter group and is not affected); fix 4 always (a no-op where it is not needed).
Each is covered by a test that fails without it, on both releases
(``tests/megatron/test_dist_checkpoint.py``).

1. Saving or loading before the first step: the distributed optimizer's ``state_dict()`` reads
   each parameter's 'step', which torch AdamW creates lazily at its first step
   (``distrib_optimizer.py``, ``assert len(steps) == 1``). Fix: give the optimizer the state of a
   fresh AdamW (zero moments, step 0) with megatron's own ``_init_optimizer_states_with_dummy_
   values`` (a step on zero gradients) run at learning rate 0, so that decoupled weight decay
   cannot move the parameters, and the steps reset to 0.
2. The per-parameter 'step' of a load: ``_set_main_param_and_optimizer_states`` copies every key
   of the live state, 'step' included, from the loaded per-parameter tensors
   (``distrib_optimizer.py``), while 'step' itself comes back through the optimizer's param
   groups (``load_state_dict``, which runs first). A ``fully_reshardable`` checkpoint holds no
   'step' there: the load fails with ``KeyError: 'step'``. A ``dp_reshardable`` one hands back
   the load template's own 'step' (a ``LocalNonpersistentObject`` taken before the load, i.e.
   the fresh optimizer's): the copy resets every restored step to it, and the resumed steps use
   a wrong Adam bias correction. Fix: hand that method the live 'step' as the source of its own
   copy (a no-op copy), per optimizer instance.
3. One 'step' tensor for all parameters: loading gives every parameter state the *same* 'step'
   tensor object, which torch AdamW then increments once per parameter on the next step (wrong
   bias correction after a resume). Fix: give each parameter its own copy after loading.

4. A ``dp_reshardable`` load fails with "a view of a leaf Variable that requires grad is being
   used in an in-place operation": ``load_parameter_state_from_dp_reshardable`` lacks the
   ``@torch.no_grad()`` of its ``fully_reshardable`` twin, and for float32 parameters the
   distributed optimizer's master shard is a view of the parameter itself
   (``distrib_optimizer.py``, ``_build_model_and_main_param_groups``). bf16 models (the GPU
   configs) keep separate float32 masters and are not affected. Fix: load under
   ``torch.no_grad()``, which is what the load means anyway.
"""
from __future__ import annotations

import re
from typing import Any, Dict, Tuple

import torch

# The megatron-core releases the fixes apply to: checked at both ends (0.16.1, the newest for
# Python 3.11, and 0.19.2, the newest): there each test fails without its fix. A newer release is
# re-checked when the lock moves to it (tests/megatron in .venv-cluster).
AFFECTED_VERSIONS = ("0.16.1", "0.19.2")


def release(version: str) -> Tuple[int, int, int]:
    """(major, minor, patch) of a version string such as "0.19.2" or "0.19.2rc1+abc"."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a megatron-core version: {version!r}")
    return (int(match.group(1)), int(match.group(2)), int(match.group(3)))


def megatron_core_release() -> Tuple[int, int, int]:
    """The installed megatron-core release. (``megatron.core.__version__`` of 0.19 appends the
    git commit of the current directory when that is a git checkout.)"""
    from importlib.metadata import version

    return release(version("megatron-core"))


def _affected(optimizer) -> bool:
    first, last = (release(v) for v in AFFECTED_VERSIONS)
    return first <= megatron_core_release() <= last and _uses_torch_adam(optimizer)


def _uses_torch_adam(optimizer) -> bool:
    return any(isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))
               for inner in _inner_optimizers(optimizer))


def _megatron_optimizers(optimizer):
    """The megatron optimizers inside a ``ChainedOptimizer`` (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _inner_optimizers(optimizer):
    return [opt.optimizer for opt in _megatron_optimizers(optimizer) if getattr(opt, "optimizer", None) is not None]


def ensure_optimizer_state(optimizer) -> None:
    """Fix 1, before a checkpoint of ``optimizer`` is saved or loaded."""
    if not _affected(optimizer):
        return
    for opt in _distributed_optimizers(optimizer):
        if len(opt.optimizer.state) == 0:
            _init_fresh_adam_state(opt)


def before_optimizer_load(optimizer) -> None:
    """Fixes 1 and 2, before a checkpoint is loaded into ``optimizer``."""
    ensure_optimizer_state(optimizer)
    if not _affected(optimizer):
        return
    for opt in _distributed_optimizers(optimizer):
        if not getattr(opt, "_quatro_step_fix", False):
            opt._set_main_param_and_optimizer_states = _with_live_step(opt)
            opt._quatro_step_fix = True


def _distributed_optimizers(optimizer):
    return [opt for opt in _megatron_optimizers(optimizer) if hasattr(opt, "_init_optimizer_states_with_dummy_values")]


def _init_fresh_adam_state(opt) -> None:
    groups = opt.optimizer.param_groups
    learning_rates = [group["lr"] for group in groups]
    for group in groups:
        group["lr"] = 0.0
    opt._init_optimizer_states_with_dummy_values()
    for group, lr in zip(groups, learning_rates):
        group["lr"] = lr
    for param_state in opt.optimizer.state.values():
        if isinstance(param_state.get("step"), torch.Tensor):
            param_state["step"] = torch.zeros_like(param_state["step"])


def _with_live_step(opt):
    original = opt._set_main_param_and_optimizer_states

    def set_states(model_param, tensors):
        group_index, group_order = opt.model_param_group_index_map[model_param]
        main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
        live_step = opt.optimizer.state[main_param].get("step")
        if live_step is not None:
            tensors = dict(tensors, step=live_step)
        original(model_param, tensors)

    return set_states


def load_optimizer_state(optimizer, state: Dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)`` without autograd (fix 4), then fix 3 (one 'step'
    tensor per parameter)."""
    with torch.no_grad():
        optimizer.load_state_dict(state)
    if not _affected(optimizer):
        return
    for inner in _inner_optimizers(optimizer):
        for param_state in inner.state.values():
            step = param_state.get("step")
            if isinstance(step, torch.Tensor):
                param_state["step"] = step.clone()
