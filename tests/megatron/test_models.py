"""ModelConfig validation (errors name the field) and the CPU compatibility layer's contract."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quatro_nemo.megatron.models import ModelConfig


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
    from tests.distributed import run_ranks

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
