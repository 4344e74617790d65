"""The megatron rollout backend: grouped layout and layout-independent sequence ids."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from quatro_nemo.engine.rollout import (
    MegatronRolloutBackend,
    global_sequence_ids,
    pad_to_length,
)
from quatro_nemo.engine.rollout_backends import build_rollout_backend
from quatro_nemo.megatron.sampling import SamplingParams
from tests.distributed import run_ranks


def test_global_sequence_ids_by_hand():
    assert global_sequence_ids(0, 2, 3) == [0, 1, 2, 3, 4, 5]
    assert global_sequence_ids(2, 1, 3) == [6, 7, 8]


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match=r"rollout\.backend must be one of \['megatron', 'vllm'\], got 'vllm-typo'"):
        build_rollout_backend(SimpleNamespace(rollout=SimpleNamespace(backend="vllm-typo")), model=None,
                              model_config=None, task=None)


def _rollouts(rank, out_dir):
    from quatro_nemo.megatron.models import ModelConfig, build_model
    from quatro_nemo.megatron.parallel import initialize_parallel
    from quatro_nemo.megatron.sampling import generate

    initialize_parallel(1, 1, seed=3)
    model = build_model(ModelConfig(vocab_size=32, hidden_size=32, num_layers=2, num_attention_heads=4,
                                    max_position_embeddings=32, init_method_std=0.3))
    backend = MegatronRolloutBackend(model, stop_token_ids=[2], pad_id=0)
    prompts = [[1, 5, 6], [1, 7], [1, 8, 9, 10], [1, 11]]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6, seed=4)
    whole = backend.generate(prompts, 3, params)
    second_half = backend.generate(prompts[2:], 3, params, first_prompt_index=2)
    rows = [p for p in prompts for _ in range(3)]
    direct = generate(model, rows, params, stop_token_ids=[2], pad_id=0, sequence_ids=list(range(12)))
    torch.save(dict(whole=whole, second_half=second_half, direct=direct, prompts=prompts), f"{out_dir}/r.pt")


@pytest.mark.distributed
def test_grouped_layout_and_prompt_offsets(tmp_path):
    run_ranks(1, _rollouts, str(tmp_path))
    r = torch.load(tmp_path / "r.pt", weights_only=False)
    whole, half, direct = r["whole"], r["second_half"], r["direct"]
    assert (whole.num_prompts, whole.num_samples) == (4, 3)
    assert whole.tokens.shape[0] == 12
    for g, prompt in enumerate(r["prompts"]):
        for j in range(3):
            assert whole.tokens[g * 3 + j, : len(prompt)].tolist() == prompt
    assert torch.equal(whole.tokens, direct.tokens)
    # the second half generated alone equals rows 6..11 of the whole batch
    length = half.tokens.shape[1]
    assert torch.equal(half.tokens, whole.tokens[6:, :length])
    assert len(set(map(tuple, whole.response_ids()))) > 3  # samples differ
    assert torch.equal(whole.position_ids[5], torch.arange(whole.tokens.shape[1]))
    padded = pad_to_length(half.sample, length + 3, pad_id=0)
    assert padded.tokens.shape[1] == length + 3 and padded.response_mask.shape[1] == length + 2
    assert (padded.tokens[:, length:] == 0).all()


def test_the_engine_gap_compares_the_engines_log_probs_else_the_samplers_own_at_temperature_one():
    from quatro_nemo.engine.rollout import RolloutBatch
    from quatro_nemo.megatron.sampling import SampleOutput

    sampler = torch.tensor([[0.0, -1.5, -0.25]])
    sample = SampleOutput(tokens=torch.tensor([[1, 5, 6, 2]]), response_mask=torch.tensor([[0.0, 1.0, 1.0]]),
                          logprobs=sampler, prompt_lengths=torch.tensor([2]), response_lengths=torch.tensor([2]),
                          finished=torch.tensor([True]))
    megatron = RolloutBatch(sample=sample, num_prompts=1, num_samples=1)
    # the sampler's log-probs are of softmax(logits / T): pi's only at T = 1
    assert megatron.gap_logprobs(1.0) is sampler and megatron.gap_logprobs(0.7) is None
    engine = torch.tensor([[0.0, -1.4, -0.3]])
    vllm = RolloutBatch(sample=sample, num_prompts=1, num_samples=1, engine_logprobs=engine)
    assert vllm.gap_logprobs(1.0) is engine and vllm.gap_logprobs(0.7) is engine   # raw log-probs: any T
