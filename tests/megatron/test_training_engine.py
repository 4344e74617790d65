"""megatron-core's training machinery as the engine builds it (quatro_nemo.megatron.training):
bf16 models keep float32 master weights, and the learning-rate warm-up."""
from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks

STEPS, LR = 40, 2e-6


def _bf16_master_weights_rank(rank, result_path):
    from quatro_nemo.algos import get_algorithm
    from quatro_nemo.megatron import training
    from quatro_nemo.megatron.checkpoint import gather_full_state_dict
    from quatro_nemo.megatron.forward import train_step_forward_backward
    from quatro_nemo.megatron.models import ModelConfig, build_model
    from quatro_nemo.megatron.parallel import initialize_parallel

    initialize_parallel(1, 1, seed=5)
    model = build_model(ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
                                    max_position_embeddings=16, params_dtype="bfloat16"))
    before = gather_full_state_dict(model)
    ddp = training.wrap_for_training(model, distributed_optimizer=True)
    optimizer = training.build_optimizer(ddp, training.OptimizerSettings(lr=LR, grad_clip=0.0))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 64, (8, 16), generator=gen)
    mask = torch.zeros(8, 15)
    mask[:, 5:] = 1.0
    batch = dict(tokens=tokens, position_ids=torch.arange(16).expand(8, 16).contiguous(), response_mask=mask,
                 old_logprobs=torch.full((8, 15), -4.0), advantages=torch.randn(8, generator=gen))
    config = get_algorithm("gspo").config_cls(beta=0.0)
    for _ in range(STEPS):
        training.zero_gradients(ddp, optimizer)
        train_step_forward_backward(ddp, batch, get_algorithm("gspo").policy_loss, config, 4)
        training.optimizer_step(ddp, optimizer)
    after = gather_full_state_dict(model)
    torch.save({"before": before, "after": after}, result_path)


@pytest.mark.distributed
def test_bf16_parameters_accumulate_updates_below_their_resolution(tmp_path):
    """Adam moves each weight by about lr per step; at lr 2e-6 one step is far below bf16's
    resolution (~4e-3 relative), so without float32 masters (Micikevicius et al. 2018, Sec. 3.1)
    no bf16 weight would ever change. With them, 40 steps add up to ~8e-5 and most weights of
    magnitude ~0.02 move by whole bf16 steps, never by more than the accumulated updates."""
    path = str(tmp_path / "result.pt")
    run_ranks(1, _bf16_master_weights_rank, path)
    result = torch.load(path)
    matrices = [k for k, v in result["before"].items() if v.dim() == 2]
    before = torch.cat([result["before"][k].float().flatten() for k in matrices])
    after = torch.cat([result["after"][k].float().flatten() for k in matrices])
    assert result["after"][matrices[0]].dtype == torch.bfloat16
    moved = (after != before).float().mean().item()
    assert moved > 0.3, f"only {moved:.1%} of bf16 weights moved: updates were lost"
    # A weight moves by at most the accumulated updates plus one bf16 rounding step (Adam's
    # bias-corrected step can exceed lr a little when the gradient changes between steps:
    # 1.06 lr measured here, hence 1.5).
    ulp = before.abs().clamp_min(1e-3) * 2.0 ** -7
    assert ((after - before).abs() <= STEPS * LR * 1.5 + ulp).all()


def test_warmup_learning_rate_is_linear_then_constant():
    from quatro_nemo.megatron.training import warmup_learning_rate

    assert [warmup_learning_rate(1.0, 4, s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_learning_rate(3e-4, 0, 0) == 3e-4


def _buffer_layouts(ddp):
    """Each DDP buffer's parameter offsets (by parameter name), bucket bounds and size."""
    names = {param: name for name, param in ddp.module.named_parameters()}
    return [({names[p]: span for p, span in buffer.param_index_map.items()}, list(buffer.bucket_indices), buffer.numel)
            for buffer in ddp.buffers]


def _param_layout_rank(rank):
    import logging

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from quatro_nemo.megatron import training
    from quatro_nemo.megatron.models import ModelConfig, build_model
    from quatro_nemo.megatron.parallel import initialize_parallel

    initialize_parallel(1, 1, seed=5)
    config = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
                         max_position_embeddings=16, params_dtype="bfloat16")
    warnings = []

    class Collect(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    ddp_logger = logging.getLogger(DistributedDataParallel.__module__)
    ddp_logger.addHandler(Collect(level=logging.WARNING))
    ours = training.wrap_for_training(build_model(config), distributed_optimizer=True)
    ours_warnings = list(warnings)
    # megatron's own path: DDP computes the layout itself (0.19: deprecated, with a warning)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=True)
    model = build_model(config)
    reference = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    passed = training.precomputed_param_layout(build_model(config), ddp_config)
    return {"ours": _buffer_layouts(ours), "reference": _buffer_layouts(reference),
            "ours_warned": [w for w in ours_warnings if "full_param_layout" in w], "passes_layout": bool(passed)}


@pytest.mark.distributed
def test_ddp_gets_the_layout_it_would_compute_itself():
    """megatron-core 0.19 deprecates building DDP for the distributed optimizer without a
    precomputed ``full_param_layout``; wrap_for_training passes one there (none on 0.16.1, whose
    DDP takes none). Either way the buffers are laid out as DDP lays them out by itself (checked
    at DP = 2, where the buffers are padded for the group), and 0.19 logs no deprecation."""
    import inspect

    from megatron.core.distributed import DistributedDataParallel

    takes_layout = "full_param_layout" in inspect.signature(DistributedDataParallel.__init__).parameters
    for result in run_ranks(2, _param_layout_rank):
        assert result["ours"] == result["reference"] and result["ours"]
        assert result["passes_layout"] is takes_layout
        assert result["ours_warned"] == []
