"""The vLLM rollout backend: its pure parts on the CPU (hand-built expectations), a clean refusal
without CUDA/vLLM, and (GPU + vLLM only) a weight-push check against megatron's own sampler."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from quatro_nemo.engine.vllm_backend import (
    GeneratedResponse,
    VllmRolloutBackend,
    build_sample_output,
    engine_slices,
    request_seed,
    require_vllm,
)

PAD = 0
FAKE_VLLM = str(Path(__file__).resolve().parents[1] / "engine" / "fake_vllm")


def test_build_sample_output_hand_built():
    rows = [[1, 2], [1, 2], [3]]
    responses = [GeneratedResponse([5, 9], [-0.1, -0.2], True),
                 GeneratedResponse([6], [-0.3], False),
                 GeneratedResponse([7, 8, 9], [-0.4, -0.5, -0.6], True)]
    out = build_sample_output(rows, responses, PAD)
    assert out.tokens.tolist() == [[1, 2, 5, 9], [1, 2, 6, PAD], [3, 7, 8, 9]]
    # entry t describes tokens[t + 1]
    assert out.response_mask.tolist() == [[0, 1, 1], [0, 1, 0], [1, 1, 1]]
    assert torch.allclose(out.logprobs, torch.tensor([[0, -0.1, -0.2], [0, -0.3, 0], [-0.4, -0.5, -0.6]]))
    assert out.prompt_lengths.tolist() == [2, 2, 1] and out.response_lengths.tolist() == [2, 1, 3]
    assert out.finished.tolist() == [True, False, True]


def test_build_sample_output_rejects_mismatched_logprobs():
    with pytest.raises(ValueError, match="response 0: 2 tokens but 1 log-probs"):
        build_sample_output([[1]], [GeneratedResponse([4, 5], [-1.0], False)], PAD)


def test_engine_slices_cover_prompts_in_order():
    assert engine_slices(5, 2) == [(0, 3), (3, 5)]
    assert engine_slices(4, 1) == [(0, 4)]
    assert engine_slices(1, 2) == [(0, 1), (1, 1)]


def test_request_seed_depends_only_on_seed_and_sequence():
    seeds = {request_seed(3, sid) for sid in range(1000)}
    assert len(seeds) == 1000
    assert request_seed(3, 17) == request_seed(3, 17) != request_seed(4, 17)


def test_refuses_cleanly_without_the_vllm_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(RuntimeError, match="needs the vllm package .* or use rollout.backend=megatron"):
        require_vllm()
    with pytest.raises(RuntimeError, match="needs the vllm package"):
        VllmRolloutBackend(model=None, model_config=None, engine=None, eos_id=0, pad_id=0)


def test_refuses_where_vllm_detects_no_cuda(monkeypatch):
    """The device check is vLLM's platform (the fake vLLM reporting a CPU here)."""
    for name in ("vllm", "vllm.platforms"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(FAKE_VLLM)
    monkeypatch.setenv("QUATRO_FAKE_VLLM_PLATFORM", "cpu")
    with pytest.raises(RuntimeError, match="needs CUDA GPUs \\(vLLM detected the CpuPlatform platform\\)"):
        require_vllm()
    for name in ("vllm", "vllm.platforms"):
        sys.modules.pop(name, None)


def _has_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_vllm(), reason="needs CUDA and vllm")
def test_vllm_greedy_follows_pushed_megatron_weights(tmp_path, monkeypatch):
    from quatro_nemo.engine.memory_plan import VllmConfig
    from quatro_nemo.megatron.models import ModelConfig, build_model
    from quatro_nemo.megatron.parallel import destroy_parallel, free_port, initialize_parallel
    from quatro_nemo.megatron.sampling import SamplingParams, generate

    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    initialize_parallel(1, 1, seed=5)
    try:
        cfg = ModelConfig(architecture="qwen2", normalization="RMSNorm", swiglu=True, qkv_bias=True,
                          linear_bias=False, position_embedding="rope", vocab_size=1024, hidden_size=256,
                          num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=512,
                          max_position_embeddings=128, params_dtype="float32", init_method_std=0.2)
        model = build_model(cfg)
        backend = VllmRolloutBackend(model, cfg, engine=VllmConfig(gpu_memory_utilization=0.2, enforce_eager=True),
                                     eos_id=1, pad_id=0)
        with torch.no_grad():  # the trainer moves away from its initial weights ...
            for param in model.parameters():
                param.add_(0.1 * torch.randn_like(param))
        backend.update_weights()  # ... and the backend must follow
        prompts = torch.randint(2, 1024, (4, 8), generator=torch.Generator().manual_seed(0)).tolist()
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
        from_vllm = backend.generate(prompts, 1, greedy).sample.tokens
        model.eval()
        from_megatron = generate(model, prompts, greedy, eos_id=1, pad_id=0).tokens.cpu()
        assert torch.equal(from_vllm[:, 8], from_megatron[:, 8])
    finally:
        destroy_parallel()
