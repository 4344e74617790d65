"""ModelConfig validation (errors name the field), the CPU compatibility layer's contract, and which
of megatron's fusions each device gets (on the CPU: none; a fused model runs on the CPU with the
GPU-only kernels stood in)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quatro_nemo.megatron.models import ModelConfig
from tests.distributed import run_ranks


def test_architecture_defaults_fill_the_flavour():
    qwen2 = ModelConfig(architecture="qwen2", num_attention_heads=4, num_query_groups=2)
    assert (qwen2.normalization, qwen2.swiglu, qwen2.qkv_bias, qwen2.linear_bias, qwen2.position_embedding) == (
        "RMSNorm", True, True, False, "rope")
    gpt = ModelConfig(architecture="gpt")
    assert (gpt.normalization, gpt.swiglu, gpt.position_embedding) == ("LayerNorm", False, "learned_absolute")
    assert gpt.num_query_groups == gpt.num_attention_heads and gpt.ffn_hidden_size == 4 * gpt.hidden_size


@pytest.mark.parametrize("overrides, field", [
    (dict(architecture="llama"), "architecture"),
    (dict(hidden_size=30, num_attention_heads=4), "hidden_size"),
    (dict(num_attention_heads=4, num_query_groups=3), "num_attention_heads"),
    (dict(normalization="BatchNorm"), "normalization"),
    (dict(params_dtype="float8"), "params_dtype"),
    (dict(num_layers=0), "num_layers"),
])
def test_bad_values_raise_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"model.{field}"):
        ModelConfig(**overrides)


def _check_cpu_compat(rank):
    from quatro_nemo.megatron import compat

    assert compat.apply_cpu_compat() is True
    mode = compat._DEVICE_MODE
    assert compat.apply_cpu_compat() is True and compat._DEVICE_MODE is mode  # nothing re-applied
    assert torch.zeros(2, device="cuda").device.type == "cpu"  # as megatron's schedules allocate
    assert torch.ones(1).cuda().device.type == "cpu"
    assert torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"
    torch.cuda.manual_seed(5)  # the RNG tracker's CUDA seeding drives the CPU generator
    first = torch.rand(3)
    torch.cuda.manual_seed(5)
    assert torch.equal(first, torch.rand(3))
    stream = torch.cuda.current_stream()  # megatron-core 0.19's gradient sync waits on it
    stream.wait_stream(stream)
    stream.wait_event(stream.record_event())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU workarounds apply only without CUDA")
def test_cpu_compat_is_idempotent_and_maps_cuda_to_cpu():
    # In a forked process, so the pytest process itself stays unpatched.
    run_ranks(1, _check_cpu_compat)


EAGER_FUSIONS_PROBE = """
import json, sys, torch
from quatro_nemo.megatron import compat
compat.apply_cpu_compat()
from megatron.core.fusions.fused_bias_gelu import bias_gelu
from megatron.core.models.gpt import GPTModel, gpt_layer_specs
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core import dist_checkpointing
bias, y = torch.linspace(-3, 3, 7, dtype=torch.float64), torch.linspace(-1, 2, 7, dtype=torch.float64)
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "bias_gelu": bias_gelu(bias, y).tolist()}))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU workarounds apply only without CUDA")
def test_cpu_compat_imports_megatron_without_torchdynamo_and_fusions_run_eagerly():
    # Workaround 7, in a fresh interpreter (this one may have imported megatron-core already):
    # what a training process imports brings in no TorchDynamo, and a fusion gives torch's own
    # tanh-GeLU of bias + y (float64, 1e-7 relative: megatron rounds sqrt(2/pi) to 0.79788456).
    probe = subprocess.run([sys.executable, "-c", EAGER_FUSIONS_PROBE], capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    result = json.loads(probe.stdout.splitlines()[-1])
    assert result["dynamo"] is False
    x = torch.linspace(-3, 3, 7, dtype=torch.float64) + torch.linspace(-1, 2, 7, dtype=torch.float64)
    expected = torch.nn.functional.gelu(x, approximate="tanh")
    torch.testing.assert_close(torch.tensor(result["bias_gelu"], dtype=torch.float64), expected, rtol=1e-7, atol=1e-9)


# --------------------------------------------------------------------------------------------
# megatron's fusions: which device gets which (models.fusions_for), and the fused model on the CPU
# --------------------------------------------------------------------------------------------

QWEN2 = dict(architecture="qwen2", vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=2,
             num_attention_heads=4, num_query_groups=2, max_position_embeddings=16)
FLAGS = ("gradient_accumulation_fusion", "apply_rope_fusion", "bias_activation_fusion")


@pytest.mark.parametrize("cuda, te, apex, architecture, megatron_ddp, expected", [
    # the CPU: nothing, whatever imports
    (False, False, False, "qwen2", True, (False, False, False)),
    (False, True, True, "qwen2", True, (False, False, False)),
    # a GPU without TE or apex (PyPI wheels): megatron's own compiled SwiGLU only
    (True, False, False, "qwen2", True, (False, False, True)),
    # TE without apex: the output layer (megatron's ColumnParallelLinear) has no fused wgrad kernel
    (True, True, False, "qwen2", True, (False, True, True)),
    # apex without TE (local spec): megatron's linears accumulate through apex's kernel
    (True, False, True, "qwen2", True, (True, False, True)),
    # the image (TE and apex)
    (True, True, True, "qwen2", True, (True, True, True)),
    # a model trained by a plain torch optimizer has no main_grad to accumulate into
    (True, True, True, "qwen2", False, (False, True, True)),
    # GELU MLP (fused: tanh approximation, another function), learned positions (no RoPE)
    (True, True, True, "gpt", True, (True, False, False)),
])
def test_each_device_gets_the_fusions_it_can_run(cuda, te, apex, architecture, megatron_ddp, expected):
    from quatro_nemo.megatron.models import FusionCapability, fusions_for

    capability = FusionCapability(cuda=cuda, transformer_engine=te, apex_fused_wgrad=apex)
    fusions = fusions_for(capability, ModelConfig(architecture=architecture), megatron_ddp=megatron_ddp)
    assert tuple(getattr(fusions, flag) for flag in FLAGS) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's capability")
def test_this_cpu_detects_no_fusion_capability():
    from quatro_nemo.megatron.models import FusionCapability

    assert FusionCapability.detect() == FusionCapability(cuda=False, transformer_engine=False, apex_fused_wgrad=False)


def _fusions_rank(rank, fused, params_dtype="float32"):
    """A qwen2 model (SwiGLU, RoPE, tied embeddings) built by build_model inside megatron's DDP:
    pi_old's log-probs (compute_logprobs), one training forward/backward
    (train_step_forward_backward) and its gradients. ``fused``: the GPU-only parts replaced at
    their import boundary by CPU stand-ins (the detected capability; apex's
    fused_weight_gradient_mlp_cuda as megatron's tensor_parallel.layers imports it; TE's fused RoPE
    as megatron's rope_utils imports it, standing in with megatron's own unfused RoPE); megatron's
    SwiGLU fusion runs as it is (eager on the CPU)."""
    import megatron.core.tensor_parallel.layers as layers
    import megatron.core.transformer.mlp as mlp
    from megatron.core.models.common.embeddings import rope_utils

    from quatro_nemo.algos import get_algorithm
    from quatro_nemo.megatron import models
    from quatro_nemo.megatron.forward import compute_logprobs, train_step_forward_backward
    from quatro_nemo.megatron.compat import current_device
    from quatro_nemo.megatron.parallel import initialize_parallel
    from quatro_nemo.megatron.training import wrap_for_training

    calls = {"wgrad": 0, "rope": 0, "swiglu": 0}

    def counted(name, function):
        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return call

    class FusedWeightGradient:  # apex's kernel: main_grad += grad_output^T @ input, float32
        @staticmethod
        def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
            calls["wgrad"] += 1
            main_grad.add_(grad_output.t() @ total_input)

    if fused:
        models.FusionCapability.detect = classmethod(lambda cls: cls(True, True, True))
        layers.fused_weight_gradient_mlp_cuda, layers._grad_accum_fusion_available = FusedWeightGradient, True
        rope_utils.fused_apply_rotary_pos_emb = counted("rope", lambda t, freqs, interleaved=False:
                                                        rope_utils._apply_rotary_pos_emb_bshd(
                                                            t, freqs, rotary_interleaved=interleaved))
        mlp.bias_swiglu_impl = counted("swiglu", mlp.bias_swiglu_impl)
    initialize_parallel(1, 1, seed=5)
    model = models.build_model(ModelConfig(**QWEN2, params_dtype=params_dtype))
    ddp = wrap_for_training(model, distributed_optimizer=False)
    gen = torch.Generator().manual_seed(0)
    rows, width = 6, 12
    batch = {"tokens": torch.randint(1, 64, (rows, width), generator=gen),
             "position_ids": torch.arange(width).expand(rows, width).contiguous(),
             "response_mask": (torch.arange(width - 1) >= 4).float().expand(rows, -1).contiguous(),
             "advantages": torch.randn(rows, generator=gen)}
    batch = {key: value.to(current_device()) for key, value in batch.items()}
    with torch.no_grad():
        batch["old_logprobs"], _ = compute_logprobs(model, batch, 4)  # pi_old's pass
    spec, seen = get_algorithm("grpo"), []

    def spy(logprobs, old_logprobs, *args, **kwargs):
        seen.append(torch.equal(logprobs.detach(), old_logprobs))
        return spec.policy_loss(logprobs, old_logprobs, *args, **kwargs)

    train_step_forward_backward(ddp, batch, spy, spec.config_cls(beta=0.0), 4)
    return {"flags": tuple(getattr(model.config, flag) for flag in FLAGS), "calls": calls, "same_as_pi_old": seen,
            "grads": {name: p.main_grad.cpu() for name, p in model.named_parameters()}}


@pytest.mark.distributed
def test_the_model_built_on_the_cpu_has_every_fusion_off_and_a_fused_one_trains_alike():
    """The CPU build has every fusion off. With the GPU-only parts stood in, the fused model
    builds (megatron's TransformerConfig accepts the flags), its training forward's log-probs equal
    pi_old's bit for bit (the same kernels in both passes), the fused kernels run, and its gradients
    equal the unfused model's (1e-5 relative: megatron's hand-written SwiGLU backward rounds
    differently from autograd's; the stand-ins compute what the unfused paths do)."""
    (unfused,), (fused,) = run_ranks(1, _fusions_rank, False), run_ranks(1, _fusions_rank, True)
    assert unfused["flags"] == (False, False, False) and not any(unfused["calls"].values())
    assert fused["flags"] == (True, True, True) and all(fused["calls"].values()), fused["calls"]
    assert fused["same_as_pi_old"] and all(fused["same_as_pi_old"]) and all(unfused["same_as_pi_old"])
    assert fused["grads"].keys() == unfused["grads"].keys()
    for name, grad in unfused["grads"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(fused["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the fusions this GPU can run")
def test_on_a_gpu_the_detected_fusions_keep_pi_old_equal_to_the_training_forward():
    """bf16, the fusions this GPU's process detects (megatron's compiled SwiGLU at least), micro-
    batches of two shapes (torch.compile specialises the first, then compiles a dynamic-shape
    kernel): the training forward's log-probs equal pi_old's bit for bit. In-process (a forked rank
    cannot use CUDA initialised by the parent)."""
    import os

    from quatro_nemo.megatron.models import FusionCapability, fusions_for
    from quatro_nemo.megatron.parallel import destroy_parallel, free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        result = _fusions_rank(0, False, "bfloat16")
    finally:
        destroy_parallel()
    detected = fusions_for(FusionCapability.detect(), ModelConfig(**QWEN2), megatron_ddp=True)
    assert result["flags"] == tuple(getattr(detected, flag) for flag in FLAGS) and detected.bias_activation_fusion
    assert len(result["same_as_pi_old"]) == 2 and all(result["same_as_pi_old"])
