"""KV-cache sampling on megatron-core: against full recomputation, the model's own distribution,
and the single-process run under TP=2 / PP=2 / DP=2 (fork-started gloo ranks).

Every rank function runs in a forked process (also the single-process reference), so the pytest
process never initialises torch.distributed.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from tests.distributed import run_ranks
from quatro_nemo.megatron.sampling import SamplingParams, draw_tokens, top_p_filtered_probs

EOS, PAD, VOCAB = 2, 0, 32


def _model_config():
    from quatro_nemo.megatron.models import ModelConfig

    return ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4,
                       max_position_embeddings=40, init_method_std=0.3)


def _prompts(count: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 7, (count,), generator=gen)
    return [[1] + torch.randint(3, VOCAB, (int(n) - 1,), generator=gen).tolist() for n in lengths]


def _build(tp: int, pp: int, full_state=None):
    from quatro_nemo.megatron.checkpoint import load_full_state_dict
    from quatro_nemo.megatron.models import build_model
    from quatro_nemo.megatron.parallel import initialize_parallel

    initialize_parallel(tp, pp, seed=11)
    model = build_model(_model_config())
    if full_state is not None:
        load_full_state_dict(model, full_state)
    return model


def _full_logits(model, tokens):
    """``[B, L, V]`` logits by a plain full forward (TP=1, PP=1), no KV cache."""
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, None).float()


def _eos_prone_state(model):
    """The full state with the EOS embedding row scaled up, so that EOS is often sampled (tied
    output layer): exercises stopping, padding after EOS and the masks."""
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    state["embedding.word_embeddings.weight"][EOS] *= 2.0
    return state


# ---------------------------------------------------------------------------------------------
# Pure sampling pieces against independent references


def test_top_p_filter_matches_a_numpy_reference():
    rng = np.random.default_rng(0)
    logits = torch.from_numpy(rng.normal(size=(50, 9)))
    for top_p in (0.3, 0.75, 1.0):
        got = top_p_filtered_probs(logits, 0.8, top_p).numpy()
        for row, expected_logits in zip(got, logits.numpy() / 0.8):
            p = np.exp(expected_logits - expected_logits.max())
            p /= p.sum()
            order = np.argsort(-p, kind="stable")
            kept, mass = [], 0.0
            for k in order:  # smallest prefix of the sorted tokens whose mass reaches top_p
                kept.append(k)
                mass += p[k]
                if mass >= top_p:
                    break
            ref = np.zeros_like(p)
            ref[kept] = p[kept] / p[kept].sum()
            np.testing.assert_allclose(row, ref, atol=1e-12)


def test_inverse_cdf_frequencies_match_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]], dtype=torch.float64)
    draws = 40000
    uniforms = torch.from_numpy(np.random.default_rng(1).random(draws))
    tokens, logprobs = draw_tokens(logits.expand(draws, -1), uniforms, temperature=0.9, top_p=0.8)
    p = np.exp(logits[0].numpy() / 0.9)
    p /= p.sum()  # by hand: sorted masses 0.57, 0.19, 0.11 (cum 0.88 >= 0.8): keep 3 tokens
    expected = np.r_[p[:3] / p[:3].sum(), 0, 0, 0]
    counts = np.bincount(tokens.numpy(), minlength=6)
    assert counts[3:].sum() == 0
    assert stats.chisquare(counts[:3], expected[:3] / expected[:3].sum() * draws).pvalue > 1e-3
    np.testing.assert_allclose(logprobs.numpy(), np.log(p)[tokens.numpy()], rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# One process: KV cache vs recomputation, and the model's distribution


def _single_process_checks(rank, out_dir):
    from quatro_nemo.megatron.sampling import generate

    model = _build(1, 1)
    model.load_state_dict(
        {**model.state_dict(), **_eos_prone_state(model)}, strict=False
    )
    model.eval()
    prompts = _prompts(6)
    greedy = generate(model, prompts, SamplingParams(temperature=0.0, max_new_tokens=10), stop_token_ids=[EOS], pad_id=PAD)
    # Full recomputation, one token at a time, no cache.
    recomputed = []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(10):
            next_token = int(_full_logits(model, torch.tensor([seq]))[0, -1].argmax())
            seq.append(next_token)
            if next_token == EOS:
                break
        recomputed.append(seq)

    # Sampled first tokens of one prompt vs the model's filtered distribution.
    prompt = prompts[0]
    params = SamplingParams(temperature=3.0, top_p=0.8, max_new_tokens=1, seed=3)
    first = generate(model, [prompt] * 3000, params, stop_token_ids=[EOS], pad_id=PAD)
    filtered = top_p_filtered_probs(_full_logits(model, torch.tensor([prompt]))[:, -1], 3.0, 0.8)[0]

    # Sampled sequences: the sampler's log-probs vs a full forward of what it generated.
    sampled = generate(model, prompts * 4, SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=12, seed=5),
                       stop_token_ids=[EOS], pad_id=PAD)
    full = torch.log_softmax(_full_logits(model, sampled.tokens)[:, :-1], dim=-1)
    recomputed_logprobs = full.gather(-1, sampled.tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    torch.save(dict(greedy=greedy, recomputed=recomputed, first=first, filtered=filtered, sampled=sampled,
                    recomputed_logprobs=recomputed_logprobs), f"{out_dir}/single.pt")


@pytest.mark.distributed
def test_single_process_sampling(tmp_path):
    run_ranks(1, _single_process_checks, str(tmp_path))
    r = torch.load(tmp_path / "single.pt", weights_only=False)
    greedy = r["greedy"]
    for row, expected in enumerate(r["recomputed"]):
        n = int(greedy.prompt_lengths[row] + greedy.response_lengths[row])
        assert greedy.tokens[row, :n].tolist() == expected  # token for token
        assert bool(greedy.finished[row]) == (expected[-1] == EOS)

    counts = np.bincount(r["first"].tokens[:, -1].numpy(), minlength=VOCAB)
    probs = r["filtered"].numpy()
    assert counts[probs == 0].sum() == 0
    keep = probs > 0
    assert 3 <= keep.sum() < VOCAB  # a real top-p cut with several tokens left
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    assert stats.chisquare(counts[keep], expected).pvalue > 1e-3

    s = r["sampled"]
    mask = s.response_mask.bool()
    assert s.finished.any() and (~s.finished).any()  # both stop reasons occur
    assert torch.equal(s.response_mask.sum(1).long(), s.response_lengths)
    for row in range(s.tokens.shape[0]):
        p, n = int(s.prompt_lengths[row]), int(s.response_lengths[row])
        response = s.tokens[row, p:p + n].tolist()
        assert (EOS in response) == bool(s.finished[row])
        assert EOS not in response[:-1] and (not s.finished[row] or response[-1] == EOS)
        assert n == 12 or s.finished[row]
        assert (s.tokens[row, p + n:] == PAD).all()
    torch.testing.assert_close(s.logprobs[mask], r["recomputed_logprobs"][mask], atol=1e-5, rtol=1e-5)
    assert (s.logprobs[~mask] == 0).all()


# ---------------------------------------------------------------------------------------------
# Parallel layouts give the same samples as one process

PARAMS = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=7)


def _sample_in_layout(rank, tp, pp, dp_split, out_dir, full_state):
    from quatro_nemo.megatron.parallel import dp_rank, dp_size
    from quatro_nemo.megatron.sampling import generate

    model = _build(tp, pp, full_state)
    if full_state is None:  # the reference run defines the weights the others load
        full_state = _eos_prone_state(model)
        model.load_state_dict({**model.state_dict(), **full_state}, strict=False)
        torch.save(full_state, f"{out_dir}/full_state.pt")
    prompts = _prompts(8, seed=1)
    ids = list(range(len(prompts)))
    if dp_split:
        share = len(prompts) // dp_size()
        ids = ids[dp_rank() * share:(dp_rank() + 1) * share]
    out = generate(model, [prompts[i] for i in ids], PARAMS, stop_token_ids=[EOS], pad_id=PAD, sequence_ids=ids)
    torch.save(dict(out=out, ids=ids), f"{out_dir}/rank{rank}.pt")


@pytest.mark.distributed
def test_tp2_pp2_dp2_sample_the_same_tokens_as_one_process(tmp_path):
    """TP2, PP2 and DP2 alone (two ranks each), then all three at once (eight ranks)."""
    run_ranks(1, _sample_in_layout, 1, 1, False, str(tmp_path), None)
    reference = torch.load(tmp_path / "rank0.pt", weights_only=False)["out"]
    full_state = torch.load(tmp_path / "full_state.pt")
    assert reference.finished.any()
    for tp, pp, dp in ((2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)):
        layout_dir = tmp_path / f"tp{tp}pp{pp}dp{dp}"
        layout_dir.mkdir()
        world_size = tp * pp * dp
        run_ranks(world_size, _sample_in_layout, tp, pp, dp > 1, str(layout_dir), full_state)
        for rank in range(world_size):
            result = torch.load(layout_dir / f"rank{rank}.pt", weights_only=False)
            out, ids = result["out"], result["ids"]
            length = out.tokens.shape[1]
            assert torch.equal(out.tokens, reference.tokens[ids, :length]), (tp, pp, dp, rank)
            assert (reference.tokens[ids, length:] == PAD).all()
            assert torch.equal(out.response_lengths, reference.response_lengths[ids])
            torch.testing.assert_close(out.logprobs, reference.logprobs[ids, : length - 1], atol=1e-5, rtol=1e-5)


def _stop_checks(rank, out_dir, stops):
    from quatro_nemo.megatron.sampling import generate

    model = _build(1, 1)
    model.eval()
    out = generate(model, _prompts(6, seed=4), SamplingParams(temperature=0.0, max_new_tokens=12),
                   stop_token_ids=stops, pad_id=PAD)
    torch.save(out, f"{out_dir}/stops-{'-'.join(map(str, stops))}.pt")


@pytest.mark.distributed
def test_a_response_ends_at_the_first_of_any_end_token(tmp_path):
    """Qwen2.5 base models end a response with either of two tokens: the sampler stops at whichever
    comes first. Expected lengths are read off the greedy responses of a run that never stops."""
    never = VOCAB + 7  # outside the vocabulary: never sampled
    run_ranks(1, _stop_checks, str(tmp_path), [never])
    free = torch.load(tmp_path / f"stops-{never}.pt", weights_only=False)
    responses = [free.tokens[row, int(free.prompt_lengths[row]):int(free.prompt_lengths[row] + free.response_lengths[row])].tolist()
                 for row in range(len(free.prompt_lengths))]
    assert all(len(r) == 12 for r in responses)
    first, second = responses[0][2], responses[1][4]   # two tokens the greedy model does emit
    run_ranks(1, _stop_checks, str(tmp_path), [first, second])
    stopped = torch.load(tmp_path / f"stops-{first}-{second}.pt", weights_only=False)
    for row, response in enumerate(responses):
        ends = [i for i, token in enumerate(response) if token in (first, second)]
        expected = ends[0] + 1 if ends else 12
        assert int(stopped.response_lengths[row]) == expected
        assert bool(stopped.finished[row]) == bool(ends)
        n = int(stopped.prompt_lengths[row]) + expected
        assert stopped.tokens[row, int(stopped.prompt_lengths[row]):n].tolist() == response[:expected]
