"""Sharded checkpoints of model + distributed optimizer (quatro_nemo.megatron.dist_checkpoint):
save/load round trips resume bit-identically, also for an optimizer saved before its first step.
Each of the three megatron-core fixes of quatro_nemo.megatron.mcore_fixes is needed here (on 0.16.1
and on 0.19.2 alike):
without fix 1 the save at step 0 fails, without fix 2 every load fails with KeyError 'step',
without fix 3 the resumed steps use a wrong Adam bias correction and the weights differ."""
from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import run_ranks

STEPS = 3


def _setup(initial=None, tie_embeddings=True, adam_eps=1e-8):
    from quatro_nemo.megatron import training
    from quatro_nemo.megatron.checkpoint import load_full_state_dict
    from quatro_nemo.megatron.models import ModelConfig, build_model

    model = build_model(ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
                                    ffn_hidden_size=64, max_position_embeddings=16, tie_embeddings=tie_embeddings))
    if initial is not None:
        load_full_state_dict(model, initial)
    ddp = training.wrap_for_training(model, distributed_optimizer=True)
    optimizer = training.build_optimizer(ddp, training.OptimizerSettings(lr=1e-2, weight_decay=0.1, adam_eps=adam_eps))
    return model, ddp, optimizer


def _step(ddp, optimizer, step):
    """One optimizer step on a fixed 8-row batch (this DP rank's share of it)."""
    from quatro_nemo.algos import get_algorithm
    from quatro_nemo.megatron import parallel, training
    from quatro_nemo.megatron.forward import train_step_forward_backward

    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(1, 64, (8, 16), generator=gen)
    mask = torch.zeros(8, 15)
    mask[:, 4:] = 1.0
    batch = dict(tokens=tokens, position_ids=torch.arange(16).expand(8, 16).contiguous(), response_mask=mask,
                 old_logprobs=torch.full((8, 15), -4.0), advantages=torch.randn(8, generator=gen))
    share = 8 // parallel.dp_size()
    rows = slice(parallel.dp_rank() * share, (parallel.dp_rank() + 1) * share)
    training.zero_gradients(ddp, optimizer)
    train_step_forward_backward(ddp, {k: v[rows] for k, v in batch.items()}, get_algorithm("gspo").policy_loss,
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


# --- Resharding: a run that changes layout between steps ---------------------------------------

LAYOUTS = [(1, 1, 1), (2, 2, 1), (2, 1, 2), (1, 1, 1)]   # (world size, TP, PP): TP1 -> TP2 -> PP2 -> TP1


def _untied_setup(initial=None):
    # eps above the gradients' float32 noise: Adam's update is then a smooth function of the
    # gradient, so layouts that sum in another order still agree closely.
    return _setup(initial, tie_embeddings=False, adam_eps=1e-3)


def _layout_rank(rank, folder, index, tensor_parallel, pipeline_parallel):
    from quatro_nemo.megatron.checkpoint import gather_full_state_dict
    from quatro_nemo.megatron.dist_checkpoint import load_sharded, save_sharded
    from quatro_nemo.megatron.parallel import initialize_parallel

    initialize_parallel(tensor_parallel, pipeline_parallel, seed=9)
    if index == 0:
        model, ddp, optimizer = _untied_setup()
        if rank == 0:
            torch.save(gather_full_state_dict(model), os.path.join(folder, "initial.pt"))
    else:
        model, ddp, optimizer = _untied_setup()
        load_sharded(os.path.join(folder, f"after{index - 1}"), ddp, optimizer)
        loaded = gather_full_state_dict(model)
        saved = torch.load(os.path.join(folder, f"after{index - 1}.pt"))
        for name, tensor in saved.items():
            assert torch.equal(loaded[name], tensor), f"layout {index}: {name} changed across save/load"
    _step(ddp, optimizer, index)
    full = gather_full_state_dict(model)
    if rank == 0:
        torch.save(full, os.path.join(folder, f"after{index}.pt"))
    save_sharded(os.path.join(folder, f"after{index}"), ddp, optimizer, {})


def _uninterrupted_rank(rank, folder):
    from quatro_nemo.megatron.checkpoint import gather_full_state_dict
    from quatro_nemo.megatron.parallel import initialize_parallel

    initialize_parallel(1, 1, seed=9)
    model, ddp, optimizer = _untied_setup(torch.load(os.path.join(folder, "initial.pt")))
    for index in range(len(LAYOUTS)):
        _step(ddp, optimizer, index)
    torch.save(gather_full_state_dict(model), os.path.join(folder, "uninterrupted.pt"))


@pytest.mark.distributed
def test_a_run_resharded_at_every_step_follows_the_uninterrupted_run(tmp_path):
    """Model and distributed-optimizer state saved at one layout load exactly at the next
    (TP1 -> TP2 -> PP2 -> TP1, so TP2->PP2 and PP2->TP1 reshard both TP and PP), and the weights
    after four steps equal a single-process run's without checkpoints (Adam moments and step
    counts carried across every reshard; float32 reduction order aside)."""
    for index, (world, tensor_parallel, pipeline_parallel) in enumerate(LAYOUTS):
        run_ranks(world, _layout_rank, str(tmp_path), index, tensor_parallel, pipeline_parallel)
    run_ranks(1, _uninterrupted_rank, str(tmp_path))
    resumed = torch.load(tmp_path / f"after{len(LAYOUTS) - 1}.pt")
    expected = torch.load(tmp_path / "uninterrupted.pt")
    for name, tensor in expected.items():
        scale = tensor.abs().max().clamp_min(1e-6)
        assert (resumed[name] - tensor).abs().max() / scale < 1e-4, name


WRITER_MANAGER_CHECK = """
import multiprocessing, signal
from quatro_nemo.megatron.compat import apply_cpu_compat
from quatro_nemo.megatron.dist_checkpoint import _start_writer_manager_deaf_to_preemption
apply_cpu_compat()
_start_writer_manager_deaf_to_preemption()
(manager,) = multiprocessing.active_children()
blocked = open(f"/proc/{manager.pid}/status").read().split("SigBlk:")[1].split()[0]
print(type(manager).__name__, int(blocked, 16) & (1 << (signal.SIGTERM - 1)) != 0,
      int(blocked, 16) & (1 << (signal.SIGUSR1 - 1)) != 0, signal.pthread_sigmask(signal.SIG_BLOCK, []) == set())
"""


def test_on_the_cpu_the_checkpoint_writers_manager_is_forked_and_deaf_to_preemption():
    # A spawned Manager costs ~2 s of CPU per process (a new interpreter that imports torch at the
    # first write); on the CPU it is forked. Either way it must never receive SIGTERM/SIGUSR1
    # (SLURM's checkpoint request would kill it mid-save), and this process's mask is restored.
    import subprocess
    import sys

    # (megatron-core 0.19's import alone takes ~45 s on a loaded 2-core machine)
    result = subprocess.run([sys.executable, "-c", WRITER_MANAGER_CHECK], capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["ForkProcess", "True", "True", "True"]
