"""Autoregressive sampling with a KV cache on a megatron-core ``GPTModel``, under TP and PP.

The loop is megatron's static-batching text generation (``megatron/inference/text_generation``
in Megatron-LM, and ``StaticInferenceContext`` of megatron-core): prefill the prompts up to the
shortest prompt length, then one position per step for the whole batch; a sequence whose prompt
is longer is fed its own prompt token at that position instead of a sample. The KV cache is
megatron-core's ``StaticInferenceContext`` (``sequence_len_offset`` advanced by the tokens
consumed, ``attention_mask=None``, ``runtime_gather_output=True``; ``docs/stack-facts.md``).

Pipeline parallel: every step runs stage by stage; a stage receives the previous stage's hidden
states ``[n, S, H]`` (``set_input_tensor``) and sends its own on; the last stage samples and
broadcasts the new tokens to all stages of its pipeline. Tensor parallel: the logits are gathered
over TP, so every TP rank samples the same token from the same uniforms.

Layout-independent randomness: one uniform per (global sequence id, absolute position) comes
from ``numpy.random.default_rng([seed, sequence_id])`` and a token is drawn by inverse-CDF over
the top-p-filtered distribution **in vocabulary order** (a ~1e-7 change of the logits between
layouts moves a draw only if the uniform lies within ~1e-7 of a bucket edge). So one process,
TP=2, PP=2 and any split of the prompts across data-parallel ranks generate the same tokens.
Top-p (nucleus) filtering follows Holtzman et al. 2020 (https://arxiv.org/abs/1904.09751): keep
the smallest set of most probable tokens whose mass reaches ``top_p``; the token that crosses the
threshold is kept.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from quatro_nemo.megatron import parallel


@dataclass
class SamplingParams:
    """How to sample. Validated in ``__post_init__`` (ValueError naming the key).

    ``temperature = 0`` is greedy decoding (argmax; ``top_p`` and the seed are then unused).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p={self.top_p} must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens={self.max_new_tokens} must be >= 1")

    def to_dict(self) -> Dict[str, object]:
        return asdict(self)


@dataclass
class SampleOutput:
    """Generated sequences in the rollout layout of ``docs/interfaces.md`` (this rank's rows).

    ``L`` is the longest ``prompt + response`` of these rows (rows are right-padded with
    ``pad_id``); callers that concatenate outputs of several ranks pad to a common ``L``.

    Attributes:
        tokens: ``[S, L]`` int64, prompt followed by response (EOS included when emitted).
        response_mask: ``[S, L-1]`` float32, 1 where ``tokens[:, t+1]`` is a response token.
        logprobs: ``[S, L-1]`` float32, the sampler's ``log p(tokens[t+1])`` under
            ``softmax(logits / temperature)`` before top-p (``temperature = 0``: 1), 0 outside
            the response. For diagnostics (mismatch with the trainer's recomputation).
        prompt_lengths, response_lengths: ``[S]`` int64.
        finished: ``[S]`` bool, True when the response ended with EOS (else it was truncated).
    """

    tokens: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    finished: torch.Tensor


# --------------------------------------------------------------------------------------------
# Pure pieces (no Megatron): uniforms and the draw from logits


def sequence_uniforms(seed: int, sequence_ids: Sequence[int], length: int) -> torch.Tensor:
    """``[S, length]`` float64 uniforms in [0, 1): row ``i`` depends only on (seed, sequence_ids[i])."""
    rows = [np.random.default_rng([int(seed), int(sid)]).random(length) for sid in sequence_ids]
    return torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, length, dtype=torch.float64)


def top_p_filtered_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """``softmax(logits / temperature)`` with the tail beyond nucleus ``top_p`` zeroed, renormalised.

    ``logits``: ``[S, V]``; returns float64 ``[S, V]``. Token k is kept when the mass of the tokens
    strictly more probable than it (ties broken by index) is below ``top_p``.
    """
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def draw_tokens(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_p: float):
    """One token per row by inverse CDF (in vocabulary order) of the top-p-filtered distribution.

    Returns ``(tokens [S] int64, logprobs [S] float32)`` with ``logprobs`` under
    ``softmax(logits / temperature)`` before top-p (temperature 0: argmax and ``log_softmax``).
    """
    if temperature == 0:
        tokens = torch.argmax(logits, dim=-1)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
    else:
        probs = top_p_filtered_probs(logits, temperature, top_p)
        cdf = torch.cumsum(probs, dim=-1)
        # first k with cdf[k] > u; clamp guards u >= cdf[-1] from rounding (cdf[-1] ~ 1 - 1e-16)
        tokens = torch.searchsorted(cdf, uniforms.unsqueeze(-1).to(cdf.dtype), right=True).squeeze(-1)
        tokens = torch.clamp(tokens, max=logits.shape[-1] - 1)
        # never land on a filtered-out token (only possible through the clamp above)
        last_kept = probs.shape[-1] - 1 - torch.argmax(torch.flip(probs > 0, dims=[-1]).int(), dim=-1)
        tokens = torch.where(probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) > 0, tokens, last_kept)
        logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


# --------------------------------------------------------------------------------------------
# One forward step through the pipeline


def _stage_forward(model, input_ids: torch.Tensor, position_ids: torch.Tensor, context) -> Optional[torch.Tensor]:
    """Run this stage on ``input_ids [S, n]``; the last stage returns last-position logits ``[S, V]``.

    Non-first stages receive ``[n, S, H]`` hidden states from the previous stage; non-last stages
    send theirs to the next. Logits are full-vocabulary (gathered over TP).
    """
    first = parallel.is_first_stage()
    last = parallel.is_last_stage()
    if not first:
        config = model.config
        hidden = torch.empty(
            (input_ids.shape[1], input_ids.shape[0], config.hidden_size),
            dtype=config.pipeline_dtype, device=input_ids.device,
        )
        dist.recv(hidden, src=parallel.previous_stage_global_rank())
        model.set_input_tensor(hidden)
    output = model(
        input_ids=input_ids, position_ids=position_ids, attention_mask=None,
        inference_context=context, runtime_gather_output=True,
    )
    if not last:
        dist.send(output.contiguous(), dst=parallel.next_stage_global_rank())
        return None
    return output[:, -1, :]  # [S, 1, V] (only the last position is materialised) -> [S, V]


def _broadcast_from_last_stage(values: torch.Tensor) -> torch.Tensor:
    """The last pipeline stage's ``values`` on every stage of this pipeline (in place)."""
    if parallel.pp_size() > 1:
        dist.broadcast(values, src=parallel.last_stage_global_rank(), group=parallel.pp_group())
    return values


# --------------------------------------------------------------------------------------------
# The generation loop


@torch.no_grad()
def generate(
    model,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    stop_token_ids: Sequence[int],
    pad_id: int,
    sequence_ids: Optional[Sequence[int]] = None,
) -> SampleOutput:
    """Sample one response per prompt with a KV cache. Call on every rank of the model's pipeline.

    Args:
        model: this rank's ``GPTModel`` stage (``build_model``); put in eval mode for the call.
        prompts: this rank's prompts as token ids (with BOS), one row per sequence to generate.
            Repeat a prompt N times for N responses.
        params: temperature, top-p, max new tokens, seed.
        stop_token_ids: the tokens that end a response (every end token of the checkpoint: a
            Qwen2.5 base model ends with ``<|endoftext|>`` or ``<|im_end|>``); ``pad_id``: the
            right-padding token.
        sequence_ids: the global index of each row (e.g. ``dp_rank * S + i``); the randomness of
            row i depends only on ``(params.seed, sequence_ids[i])``. Default ``0 .. S-1``.

    Returns the :class:`SampleOutput` of these rows (same on every TP and PP rank).
    """
    from megatron.core.inference.contexts import StaticInferenceContext

    from quatro_nemo.megatron.compat import current_device

    num_rows = len(prompts)
    if num_rows == 0:
        raise ValueError("generate() needs at least one prompt")
    if sequence_ids is None:
        sequence_ids = range(num_rows)
    if len(sequence_ids) != num_rows:
        raise ValueError(f"generate(): {len(sequence_ids)} sequence_ids for {num_rows} prompts")
    prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    if int(prompt_lengths.min()) < 1:
        raise ValueError("generate(): every prompt needs at least one token (BOS)")
    total_length = int(prompt_lengths.max()) + params.max_new_tokens
    max_positions = getattr(model, "max_sequence_length", None)
    if max_positions is not None and total_length > max_positions:
        raise ValueError(
            f"longest prompt ({int(prompt_lengths.max())}) + sampling.max_new_tokens "
            f"({params.max_new_tokens}) = {total_length} exceeds the model's "
            f"max_position_embeddings={max_positions}"
        )

    if not stop_token_ids:
        raise ValueError("generate(): stop_token_ids is empty (a response needs an end token)")
    stops = torch.tensor(sorted(set(int(t) for t in stop_token_ids)), dtype=torch.long)
    device = current_device()
    tokens = torch.full((num_rows, total_length), pad_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.as_tensor(list(prompt), dtype=torch.long)
    logprobs = torch.zeros(num_rows, total_length - 1, dtype=torch.float32)
    uniforms = sequence_uniforms(params.seed, sequence_ids, total_length)
    finished = torch.zeros(num_rows, dtype=torch.bool)
    end = prompt_lengths + params.max_new_tokens  # exclusive end of each row's response

    was_training = model.training
    model.eval()
    context = StaticInferenceContext(num_rows, total_length)
    positions = torch.arange(total_length, dtype=torch.long).unsqueeze(0).expand(num_rows, -1)
    start = int(prompt_lengths.min())
    step_input = slice(0, start)  # the prefill
    try:
        for position in range(start, total_length):
            logits = _stage_forward(
                model, tokens[:, step_input].to(device), positions[:, step_input].to(device), context
            )
            context.sequence_len_offset += step_input.stop - step_input.start
            in_prompt = position < prompt_lengths
            generating = ~in_prompt & (position < end) & ~finished
            new_tokens = torch.empty(num_rows, dtype=torch.long)
            if logits is not None:  # the last pipeline stage samples
                # The draw runs where the logits are: on a GPU, copying [S, V] logits to the host
                # and drawing there took ~1 s per decode step at S=256, V=152k (the first GPU check
                # logged no training step in 5 min); the uniforms are the same on any device.
                sampled, sampled_logprobs = draw_tokens(
                    logits, uniforms[:, position].to(logits.device), params.temperature, params.top_p
                )
                sampled, sampled_logprobs = sampled.cpu(), sampled_logprobs.cpu()
                new_tokens = torch.where(in_prompt, tokens[:, position], torch.where(generating, sampled, pad_id))
                logprobs[:, position - 1] = torch.where(generating, sampled_logprobs, 0.0)
            tokens[:, position] = _broadcast_from_last_stage(new_tokens.to(device)).cpu()
            finished |= generating & torch.isin(tokens[:, position], stops)
            if bool(((position + 1 >= end) | finished).all()):
                break
            step_input = slice(position, position + 1)
            if hasattr(context, "enable_decode_mode"):
                context.enable_decode_mode()
    finally:
        model.train(was_training)

    response_lengths = torch.zeros(num_rows, dtype=torch.long)
    for row in range(num_rows):
        response = tokens[row, int(prompt_lengths[row]): int(end[row])]
        stop = torch.isin(response, stops).nonzero()
        response_lengths[row] = int(stop[0]) + 1 if len(stop) else len(response)
    length = int((prompt_lengths + response_lengths).max())
    index = torch.arange(length - 1).unsqueeze(0)
    response_mask = (index + 1 >= prompt_lengths.unsqueeze(1)) & (
        index + 1 < (prompt_lengths + response_lengths).unsqueeze(1)
    )
    logprobs = _broadcast_from_last_stage(logprobs.to(device)).cpu()
    return SampleOutput(
        tokens=tokens[:, :length].contiguous(),
        response_mask=response_mask.float(),
        logprobs=logprobs[:, : length - 1] * response_mask,
        prompt_lengths=prompt_lengths,
        response_lengths=response_lengths,
        finished=finished,
    )


def decode_responses(output: SampleOutput, decode) -> List[str]:
    """The response text of each row, ``decode(ids)`` applied to its response tokens."""
    return [
        decode(output.tokens[row, int(output.prompt_lengths[row]):
                             int(output.prompt_lengths[row] + output.response_lengths[row])].tolist())
        for row in range(output.tokens.shape[0])
    ]
