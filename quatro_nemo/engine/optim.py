"""The optimizer: AdamW, with float32 master weights when the model is bf16/fp16.

With bf16 parameters an update of lr 1e-6 (the paper's) is far below bf16's resolution
(~8e-3 relative) and would be lost. Mixed-precision training therefore keeps a float32 master
copy of every parameter, steps AdamW on it, and copies the result back to the model
(Micikevicius et al. 2018, "Mixed Precision Training", Sec. 3.1). float32 models use
torch.optim.AdamW directly.

Not (yet) here: megatron's DistributedOptimizer, which shards the float32 state across
data-parallel ranks (memory_plan.py's `scale.distributed_optimizer`); it needs CUDA.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch


class MasterWeightAdamW:
    """AdamW over float32 masters of low-precision parameters (the torch.optim.Optimizer API the
    loop uses: zero_grad, step, state_dict, load_state_dict; a LR scheduler drives the inner
    ``optimizer``, see build_optimizer)."""

    def __init__(self, params, **adamw_kwargs: Any):
        self.model_params: List[torch.nn.Parameter] = [p for p in params if p.requires_grad]
        self.masters = [p.detach().to(torch.float32, copy=True) for p in self.model_params]
        self.optimizer = torch.optim.AdamW(self.masters, **adamw_kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for p, master in zip(self.model_params, self.masters):
            master.grad = None if p.grad is None else p.grad.float()
        self.optimizer.step()
        for p, master in zip(self.model_params, self.masters):
            p.copy_(master)
            master.grad = None   # the float32 gradient copy is not kept between steps

    def state_dict(self) -> Dict[str, Any]:
        return {"adamw": self.optimizer.state_dict(), "masters": [m.clone() for m in self.masters]}

    @torch.no_grad()
    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["adamw"])
        for master, saved in zip(self.masters, state["masters"]):
            master.copy_(saved)


def build_optimizer(model: torch.nn.Module, lr: float, betas, eps: float, weight_decay: float):
    """torch AdamW for float32 models; MasterWeightAdamW when any parameter is low precision.
    Returns (optimizer, the torch.optim.Optimizer a LR scheduler should drive)."""
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if all(p.dtype == torch.float32 for p in params):
        optimizer = torch.optim.AdamW(params, **kwargs)
        return optimizer, optimizer
    optimizer = MasterWeightAdamW(params, **kwargs)
    return optimizer, optimizer.optimizer
