"""The vLLM rollout backend: its pure parts on the CPU (hand-built expectations), a clean refusal
without CUDA/vLLM, and (GPU + vLLM only) a weight-push check against megatron's own sampler."""
from __future__ import annotations

import os
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
        VllmRolloutBackend(model=None, model_config=None, engine=None, stop_token_ids=[0], pad_id=0)


@pytest.mark.parametrize("platform, accepted", [("cuda", True), ("cpu", True), ("tpu", False)])
def test_accepts_cuda_and_the_cpu_build_and_refuses_other_platforms(monkeypatch, platform, accepted):
    """The device check is vLLM's platform (the fake vLLM reporting each here)."""
    for name in ("vllm", "vllm.platforms"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(FAKE_VLLM)
    monkeypatch.setenv("QUATRO_FAKE_VLLM_PLATFORM", platform)
    try:
        if accepted:
            assert require_vllm().__version__.endswith("quatro-fake")
        else:
            with pytest.raises(RuntimeError, match="runs on CUDA GPUs or vLLM's CPU build \\(vLLM detected the "
                                                   "TpuPlatform platform\\)"):
                require_vllm()
    finally:
        for name in ("vllm", "vllm.platforms"):
            sys.modules.pop(name, None)


def _single_process_launcher_environment(rank):
    from quatro_nemo.engine.vllm_backend import launcher_environment
    from quatro_nemo.megatron.parallel import initialize_parallel

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key)  # a plain process: megatron makes its own group
    initialize_parallel(1, 1)
    return launcher_environment()


def test_launcher_environment_of_a_single_process_started_without_a_launcher():
    """scripts/gpu_check.sh starts recipes/train.py as one plain process: megatron makes its own
    group and nothing exports RANK / LOCAL_RANK, which vLLM's external_launcher reads."""
    from tests.distributed import run_ranks

    env = run_ranks(1, _single_process_launcher_environment)[0]
    assert env["RANK"] == "0" and env["LOCAL_RANK"] == "0"
    assert env["MASTER_ADDR"] == "127.0.0.1" and 0 < int(env["MASTER_PORT"]) < 65536


@pytest.mark.parametrize("visible, local_rank, device", [(8, "3", "3"), (1, "3", "0"), (2, "3", "1")])
def test_launcher_environment_tells_vllm_the_trainers_gpu(monkeypatch, visible, local_rank, device):
    """vLLM takes LOCAL_RANK as its CUDA device index and asserts it is below the visible count; with
    one GPU per task (SLURM binding: one visible device) the trainer's device is 0, not SLURM's local id."""
    from quatro_nemo.engine import vllm_backend

    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setattr(vllm_backend.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm_backend.torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(vllm_backend.parallel, "global_rank", lambda: 11)
    env = vllm_backend.launcher_environment()
    assert env["LOCAL_RANK"] == device and int(env["LOCAL_RANK"]) < visible and env["RANK"] == "11"


def test_engine_weights_give_a_tied_policys_embedding_to_the_engines_own_output_layer():
    """vLLM's in-place reload puts a tied output layer's old tensor back, so the engine is built untied
    and the embedding is pushed twice; an untied policy's stream is unchanged."""
    from quatro_nemo.engine.vllm_backend import engine_weights

    embed, norm = torch.randn(5, 3), torch.randn(3)
    stream = [("model.embed_tokens.weight", embed), ("model.norm.weight", norm)]
    tied = list(engine_weights(iter(stream), tied=True))
    assert [name for name, _ in tied] == ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    assert tied[1][1] is embed
    assert list(engine_weights(iter(stream), tied=False)) == stream


def test_engine_config_is_untied_and_names_the_models_shape(tmp_path):
    import json

    from quatro_nemo.engine.vllm_backend import write_engine_model_dir
    from quatro_nemo.megatron.models import ModelConfig

    cfg = ModelConfig(architecture="qwen2", vocab_size=96, hidden_size=128, num_layers=2, num_attention_heads=2,
                      num_query_groups=2, ffn_hidden_size=256, max_position_embeddings=64, tie_embeddings=True)
    config = json.loads((Path(write_engine_model_dir(cfg, str(tmp_path))) / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert (config["hidden_size"], config["num_attention_heads"], config["vocab_size"]) == (128, 2, 96)
