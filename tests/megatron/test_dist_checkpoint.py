"""Sharded checkpoints of model + distributed optimizer (quatro_nemo.megatron.dist_checkpoint):
save/load round trips resume bit-identically, also for an optimizer saved before its first step.
Each of the three megatron-core fixes of quatro_nemo.megatron.mcore_fixes is needed here:
without fix 1 the save at step 0 fails, without fix 2 every load fails with KeyError 'step',
without fix 3 the resumed steps use a wrong Adam bias correction and the weights differ."""
from __future__ import annotations

import os

import pytest
import torch

from mcore_ranks import run_ranks

STEPS = 3


def _setup(initial=None):
    from quatro_nemo.megatron import training
    from quatro_nemo.megatron.checkpoint import load_full_state_dict
    from quatro_nemo.megatron.models import ModelConfig, build_model

    model = build_model(ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
                                    max_position_embeddings=16))
    if initial is not None:
        load_full_state_dict(model, initial)
    ddp = training.wrap_for_training(model, distributed_optimizer=True)
    optimizer = training.build_optimizer(ddp, training.OptimizerSettings(lr=1e-2, weight_decay=0.1))
    return model, ddp, optimizer


def _step(ddp, optimizer, step):
    from quatro_nemo.algos import get_algorithm
    from quatro_nemo.megatron import parallel, training
    from quatro_nemo.megatron.forward import train_step_forward_backward

    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(1, 64, (8, 16), generator=gen)
    mask = torch.zeros(8, 15)
    mask[:, 4:] = 1.0
    batch = dict(tokens=tokens, position_ids=torch.arange(16).expand(8, 16).contiguous(), response_mask=mask,
                 old_logprobs=torch.full((8, 15), -4.0), advantages=torch.randn(8, generator=gen))
    rows = slice(parallel.dp_rank() * 4, parallel.dp_rank() * 4 + 4)
    training.zero_gradients(ddp, optimizer)
    train_step_forward_backward(ddp, {k: v[rows] for k, v in batch.items()}, "gspo",
                                get_algorithm("gspo").config_cls(beta=0.0), 2)
    training.optimizer_step(ddp, optimizer)


def _round_trip_rank(rank, folder):
    from quatro_nemo.megatron.checkpoint import gather_full_state_dict
    from quatro_nemo.megatron.dist_checkpoint import load_sharded, save_sharded
    from quatro_nemo.megatron.parallel import initialize_parallel

    initialize_parallel(1, 1, seed=3)
    model, ddp, optimizer = _setup()
    initial = gather_full_state_dict(model)
    for step in range(STEPS):
        _step(ddp, optimizer, step)
    uninterrupted = gather_full_state_dict(model)

    # The same run with fresh objects before every step: saved before the first step, reloaded
    # from the previous step's checkpoint, one step, saved.
    model, ddp, optimizer = _setup(initial)
    save_sharded(os.path.join(folder, "step0"), ddp, optimizer, {"next_step": 0})
    for step in range(STEPS):
        model, ddp, optimizer = _setup()
        assert load_sharded(os.path.join(folder, f"step{step}"), ddp, optimizer) == {"next_step": step}
        _step(ddp, optimizer, step)
        save_sharded(os.path.join(folder, f"step{step + 1}"), ddp, optimizer, {"next_step": step + 1})
    resumed = gather_full_state_dict(model)
    torch.save({"uninterrupted": uninterrupted, "resumed": resumed}, os.path.join(folder, f"result{rank}.pt"))


@pytest.mark.distributed
def test_save_and_load_around_every_step_resumes_bit_identically(tmp_path):
    run_ranks(2, _round_trip_rank, str(tmp_path))
    for rank in range(2):
        result = torch.load(tmp_path / f"result{rank}.pt")
        for name, expected in result["uninterrupted"].items():
            assert torch.equal(result["resumed"][name], expected), name
