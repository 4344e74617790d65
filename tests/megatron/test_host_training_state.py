"""The training state's offload around sampling (quatro_nemo.megatron.training.HostTrainingState)
on megatron's own DDP and optimizer: bf16 weights with the distributed optimizer, so float32
master weights and Adam's moments exist and are offloaded, while the model's weights stay.

Checked against copies taken before each offload (the reference), over three offload cycles with
optimizer steps between them:

- the host buffers are allocated once per storage and reused by every later cycle (same
  ``data_ptr``; the first cycle, before any step, has only the master weights: the moments'
  buffers are added by the second and reused by the third);
- they are parts of flat allocations, one per cycle that adds buffers (the master weights', the
  moments'), each exactly its parts' bytes at the layout's alignment (no power-of-two rounding),
  page-locked and released in pairs where pinning applies (the CUDA runtime's
  ``cudaHostRegister``/``cudaHostUnregister`` replaced by a recorder on the CPU);
- while offloaded, every optimizer storage on the device holds 0 bytes and DDP's gradient
  buffers are released; the model's weights are untouched;
- after the reload the optimizer state is bit-identical to the copy (bytes compared), and the
  gradient buffers are back, zeroed;
- on a GPU (skipped without one): the host buffers are pinned, the device memory the state held
  is freed while offloaded, and the round trip is bit-identical on the device too.
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks

CYCLES = 3


def state_bytes(optimizer):
    """A byte copy of each tensor in the torch optimizers' state and parameter groups."""
    from quatro_nemo.megatron.training import torch_optimizers

    tensors = []
    for inner in torch_optimizers(optimizer):
        tensors += [p for group in inner.param_groups for p in group["params"]]
        tensors += [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return [t.detach().contiguous().view(-1).view(torch.uint8).cpu().clone() for t in tensors]


class _RecordingCudart:
    """The CUDA runtime calls FlatHostBuffer makes, recorded (on the CPU; the GPU-only part of the
    pinned path, replaced at ``torch.cuda.cudart``)."""

    class cudaError:  # noqa: N801  (the runtime's name)
        success = 0

    def __init__(self):
        self.registered, self.unregistered = [], []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802
        self.registered.append((ptr, size, flags))
        return self.cudaError.success

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append(ptr)
        return self.cudaError.success


def _offload_cycles_rank(rank, device_type, record_pinning=False):
    from quatro_nemo.algos import get_algorithm
    from quatro_nemo.megatron import training
    from quatro_nemo.megatron.forward import train_step_forward_backward
    from quatro_nemo.megatron.models import ModelConfig, build_model
    from quatro_nemo.megatron.parallel import initialize_parallel

    initialize_parallel(1, 1, seed=5)
    model = build_model(ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
                                    max_position_embeddings=16, params_dtype="bfloat16"))
    ddp = training.wrap_for_training(model, distributed_optimizer=True)
    optimizer = training.build_optimizer(ddp, training.OptimizerSettings(lr=1e-3))
    state = training.HostTrainingState(ddp, optimizer)
    device = state.device
    cudart = _RecordingCudart()
    if record_pinning:
        torch.cuda.cudart, state.pin_memory = lambda: cudart, True
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 64, (4, 16), generator=gen)
    mask = torch.zeros(4, 15)
    mask[:, 5:] = 1.0
    batch = {k: v.to(device) for k, v in dict(
        tokens=tokens, position_ids=torch.arange(16).expand(4, 16).contiguous(), response_mask=mask,
        old_logprobs=torch.full((4, 15), -4.0), advantages=torch.randn(4, generator=gen)).items()}
    loss_config = get_algorithm("gspo").config_cls(beta=0.0)
    grad_buffers = [buffer.grad_data for buffer in ddp.buffers]
    cycles, held = [], []  # held: every host buffer seen, so a fresh one cannot reuse a freed address
    for _ in range(CYCLES):
        before = state_bytes(optimizer)
        weights = [p.detach().clone() for p in model.parameters()]
        allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        state.offload()
        held += state.host_buffers
        offloaded = {
            "host_ptrs": [b.data_ptr() for b in state.host_buffers],
            "host_pinned": [b.is_pinned() for b in state.host_buffers],
            "host_bytes": sum(b.numel() for b in state.host_buffers),
            "parked_nbytes": [s.nbytes() for s in state.parked],
            "grad_buffer_nbytes": [g.untyped_storage().nbytes() for g in grad_buffers],
            "weights_same": all(torch.equal(a, p) for a, p in zip(weights, model.parameters())),
            "freed": allocated - torch.cuda.memory_allocated(device) if device.type == "cuda" else 0,
            "allocations": [(a.memory.data_ptr(), a.nbytes, [(p.data_ptr() - a.memory.data_ptr(), p.numel())
                                                              for p in a.parts]) for a in state.allocations],
            "pinned_bytes": state.pinned_bytes,
        }
        state.reload()
        after = state_bytes(optimizer)
        offloaded["identical"] = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
        offloaded["grads_zero"] = all(g.untyped_storage().nbytes() > 0 and not g.any() for g in grad_buffers)
        offloaded["seconds"] = dict(state.seconds)
        cycles.append(offloaded)
        training.zero_gradients(ddp, optimizer)
        train_step_forward_backward(ddp, batch, get_algorithm("gspo").policy_loss, loss_config, 2)
        training.optimizer_step(ddp, optimizer)
    registered = list(cudart.registered)
    del state
    return {"cycles": cycles, "device": device.type, "registered": registered, "unregistered": cudart.unregistered}


def _check_cycles(result):
    first, second, third = result["cycles"]
    # before any step: the master weights only; after one: the moments (and step) too
    assert 0 < len(first["host_ptrs"]) < len(second["host_ptrs"]) == len(third["host_ptrs"])
    assert second["host_ptrs"][:len(first["host_ptrs"])] == first["host_ptrs"]
    assert third["host_ptrs"] == second["host_ptrs"]
    # one flat allocation for the master weights, one more for the moments, exactly their parts
    assert [len(cycle["allocations"]) for cycle in result["cycles"]] == [1, 2, 2]
    assert second["allocations"][0] == first["allocations"][0] and third["allocations"] == second["allocations"]
    for _start, nbytes, parts in third["allocations"]:
        ends = [offset + size for offset, size in parts]
        assert parts[0][0] == 0 and nbytes == ends[-1]
        # each part at the first multiple of 256 at or after the previous part's end
        assert all(offset % 256 == 0 and end <= offset < end + 256 for (offset, _), end in zip(parts[1:], ends))
    assert sorted(third["host_ptrs"]) == sorted(start + offset for start, _, parts in third["allocations"]
                                                for offset, _ in parts)
    for cycle in result["cycles"]:
        assert cycle["parked_nbytes"] and all(n == 0 for n in cycle["parked_nbytes"])
        assert cycle["grad_buffer_nbytes"] and all(n == 0 for n in cycle["grad_buffer_nbytes"])
        assert cycle["weights_same"] and cycle["identical"] and cycle["grads_zero"]
        assert set(cycle["seconds"]) == {"time/offload", "time/reload"}


@pytest.mark.distributed
def test_offload_reuses_its_host_buffers_and_round_trips_the_state_bit_for_bit():
    (result,) = run_ranks(1, _offload_cycles_rank, "cpu")
    _check_cycles(result)
    assert not any(p for cycle in result["cycles"] for p in cycle["host_pinned"])  # plain on the CPU
    assert not result["registered"] and all(cycle["pinned_bytes"] == 0 for cycle in result["cycles"])


@pytest.mark.distributed
def test_pinned_offload_registers_each_flat_allocation_once_and_unregisters_it_when_released():
    (result,) = run_ranks(1, _offload_cycles_rank, "cpu", True)
    _check_cycles(result)
    allocations = result["cycles"][-1]["allocations"]
    # cudaHostRegister(start, exactly its bytes, cudaHostRegisterDefault) once per flat allocation
    assert result["registered"] == [(start, nbytes, 0) for start, nbytes, _ in allocations]
    assert [cycle["pinned_bytes"] for cycle in result["cycles"]] == [
        sum(nbytes for _, nbytes, _ in cycle["allocations"]) for cycle in result["cycles"]]
    assert sorted(result["unregistered"]) == sorted(start for start, _, _ in allocations)  # the state released


def test_flat_offsets_align_every_part():
    from quatro_nemo.megatron.training import flat_offsets

    assert flat_offsets([5, 300, 1, 256], alignment=256) == ([0, 256, 768, 1024], 1280)
    assert flat_offsets([512, 4], alignment=256) == ([0, 512], 516)
    assert flat_offsets([], alignment=256) == ([], 0)


def test_a_flat_host_buffer_holds_disjoint_aligned_parts_that_round_trip_bytes():
    from quatro_nemo.megatron.training import FlatHostBuffer

    sizes = [1000, 3, 4096, 257]
    buffer = FlatHostBuffer(sizes, pin=False)
    assert buffer.nbytes == 256 * 4 + 256 + 4096 + 257 and not buffer.pinned
    assert [part.numel() for part in buffer.parts] == sizes
    starts = [part.data_ptr() - buffer.memory.data_ptr() for part in buffer.parts]
    assert starts == [0, 1024, 1280, 5376]
    assert all(part.untyped_storage().data_ptr() == buffer.memory.data_ptr() for part in buffer.parts)
    gen = torch.Generator().manual_seed(0)
    payloads = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in sizes]
    for part, payload in zip(buffer.parts, payloads):
        part.copy_(payload)
    assert all(torch.equal(part, payload) for part, payload in zip(buffer.parts, payloads))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned host buffers")
def test_offload_on_a_gpu_uses_pinned_buffers_and_frees_the_device_memory():
    # in-process (a forked rank cannot use CUDA initialised by the parent); the CUDA device is
    # the run device wherever CUDA is available (compat.current_device)
    import os

    from quatro_nemo.megatron.parallel import destroy_parallel, free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        result = _offload_cycles_rank(0, "cuda")
    finally:
        destroy_parallel()
    assert result["device"] == "cuda"
    _check_cycles(result)
    for cycle in result["cycles"]:
        assert cycle["host_pinned"] and all(cycle["host_pinned"])
        assert cycle["freed"] >= cycle["host_bytes"]


def test_buffers_are_rematched_by_size_and_unused_allocations_released(monkeypatch):
    """What a resume does when megatron replaces the state's tensors (same sizes: the same host
    parts) or the sizes change (new parts; an allocation no part of which is needed is released,
    its pages unlocked)."""
    from quatro_nemo.megatron.training import HostTrainingState

    cudart = _RecordingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    state = HostTrainingState(ddp_model=None, optimizer=None)
    state.pin_memory = True
    first = state._buffers_for([100, 200])
    grown = state._buffers_for([100, 300, 200])
    assert [grown[0].data_ptr(), grown[2].data_ptr()] == [b.data_ptr() for b in first]
    assert len(state.allocations) == 2 and state.pinned_bytes == 456 + 300
    kept = state._buffers_for([300])  # the first allocation's parts are no longer needed
    assert kept[0].data_ptr() == grown[1].data_ptr() and len(state.allocations) == 1
    assert cudart.unregistered == [cudart.registered[0][0]] and state.pinned_bytes == 300
    state._buffers_for([50])
    assert cudart.unregistered == [cudart.registered[0][0], cudart.registered[1][0]]
    assert [size for _, size, _ in cudart.registered] == [456, 300, 50]
