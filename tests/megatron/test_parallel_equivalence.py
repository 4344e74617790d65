"""Loss, metrics and EVERY parameter gradient under TP / PP / DP equal a single-process reference.

The reference (one forked process, TP = PP = DP = 1) runs the tiny GPT on the whole global batch
with plain PyTorch: ``torch.log_softmax`` over the full vocabulary, the registry loss with the
full batch's :class:`LossNormalizer`, ``loss.backward()``. No code of ``quatro_nemo.megatron``
besides the model builder is on that path (no schedule, no vocab-parallel function, no
normaliser all-reduce, no gradient finalisation). Log-probs and entropies are also checked
against a float64 full-softmax reference.

Each parallel layout loads the reference weights (``load_full_state_dict``), wraps the model in
megatron's ``DistributedDataParallel`` (the engine's :func:`training.wrap_for_training`), runs
``compute_logprobs`` and ``train_step_forward_backward`` for every loss and two micro-batch
splits (row counts that need not divide the rows), gathers its gradient buffers back to full
tensors and compares on every rank. Then one step of megatron's DISTRIBUTED optimizer (the
engine's :func:`training.build_optimizer`) is compared with a ``torch.optim.AdamW`` step on the
reference gradients. The token-budget test does the same for every algorithm of the registry
with rows sorted by length, binned under a padded-token budget and trimmed (ragged lengths,
empty responses, and a data-parallel rank padded with an empty micro-batch).
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import run_ranks

LOSSES = ("quatro", "gspo", "dapo", "grpo")
EMPTY_RESPONSE_ROWS = (3, 6)
SEED = 1234
NUM_SEQUENCES, SEQ_LEN = 8, 12
REL_TOL = 1e-5
# One Adam step: update = lr * g / (|g| + eps) at step 1. eps well above the gradients' float32
# noise keeps the update a smooth function of the gradient, so it can be compared.
ADAM_LR, ADAM_EPS = 1e-2, 1e-3
UPDATE_REL_TOL = 1e-3


def _model_config():
    from quatro_nemo.megatron.models import ModelConfig

    return ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
                       max_position_embeddings=SEQ_LEN, architecture="gpt", tie_embeddings=True)


def _qwen2_config():
    """Qwen2-style: GQA (4 heads, 2 KV groups), SwiGLU, RMSNorm, QKV bias, RoPE, untied."""
    from quatro_nemo.megatron.models import ModelConfig

    return ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
                       num_query_groups=2, ffn_hidden_size=48, max_position_embeddings=SEQ_LEN,
                       architecture="qwen2", rotary_base=1000, tie_embeddings=False)


def _float64_logprobs_entropy(model, tokens, position_ids):
    """Full-vocabulary softmax in float64: (log p(next token), entropy), both [S, T]."""
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens, position_ids, None)[:, :-1].double(), -1)
    return logp.gather(-1, tokens[:, 1:, None])[..., 0], -(logp.exp() * logp).sum(-1)


def _algo_config(algorithm):
    from quatro_nemo.algos import get_algorithm

    return get_algorithm(algorithm).config_cls(beta=0.01)


def _policy_loss(algorithm):
    from quatro_nemo.algos import get_algorithm

    return get_algorithm(algorithm).policy_loss


def _make_batch(logprobs_now: torch.Tensor) -> dict:
    """A fixed global batch: prompts of 3-5 tokens, responses of varied length (two empty), right
    padding; ``lengths`` = prompt + response tokens (3 to 12)."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, 64, (NUM_SEQUENCES, SEQ_LEN), generator=gen)
    response_mask = torch.zeros(NUM_SEQUENCES, SEQ_LEN - 1)
    lengths = torch.zeros(NUM_SEQUENCES, dtype=torch.long)
    for row in range(NUM_SEQUENCES):
        prompt_len = 3 + row % 3
        response_len = 0 if row in EMPTY_RESPONSE_ROWS else 2 + (row * 5) % (SEQ_LEN - prompt_len - 1)
        end = prompt_len + response_len
        tokens[row, end:] = 0  # pad id
        response_mask[row, prompt_len - 1:end - 1] = 1.0
        lengths[row] = end
    # pi_old off the current policy by per-row amounts: 0 (on-policy), tiny (inside GSPO's
    # clip range), moderate and large (PPO clip active).
    scale = torch.tensor([0.0, 2e-4, 0.1, 0.4]).repeat(NUM_SEQUENCES // 4).unsqueeze(-1)
    old = logprobs_now + scale * torch.randn(logprobs_now.shape, generator=gen)
    ref = logprobs_now + 0.2 * torch.randn(logprobs_now.shape, generator=gen)
    return dict(tokens=tokens, position_ids=torch.arange(SEQ_LEN).expand(NUM_SEQUENCES, SEQ_LEN).clone(),
                response_mask=response_mask, old_logprobs=old, ref_logprobs=ref,
                advantages=torch.randn(NUM_SEQUENCES, generator=gen), lengths=lengths)


def _reference_loss_and_grads(model, batch, algorithm):
    """Plain single-process full-batch loss, metrics and gradients (no quatro_nemo.megatron code):
    every row at the full width, padding included."""
    from quatro_nemo.algos.aggregation import LossNormalizer

    tokens = batch["tokens"]
    model.zero_grad(set_to_none=True)
    log_softmax = torch.log_softmax(model(tokens, batch["position_ids"], None)[:, :-1], -1)
    logprobs = log_softmax.gather(-1, tokens[:, 1:, None])[..., 0]
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    loss, metrics = _policy_loss(algorithm)(
        logprobs, batch["old_logprobs"], batch["advantages"], batch["response_mask"],
        _algo_config(algorithm), LossNormalizer.from_mask(batch["response_mask"]),
        ref_logprobs=batch["ref_logprobs"], entropy=entropy.detach())
    loss.backward()
    # Guard against a vacuous comparison (e.g. every sequence clipped): gradients must flow.
    assert model.embedding.word_embeddings.weight.grad.abs().max() > 1e-6, algorithm
    return dict(loss=loss.item(), metrics={k: v.item() for k, v in metrics.items()},
                grads={name: p.grad.clone() for name, p in model.named_parameters()})


def _reference_adam_update(model, state, grads):
    """Parameters after one plain torch AdamW step on ``grads`` from ``state``, minus ``state``."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name])
            param.grad = grads[name].clone()
    torch.optim.AdamW(list(params.values()), lr=ADAM_LR, eps=ADAM_EPS, weight_decay=0.0).step()
    update = {name: (param.detach() - state[name]).clone() for name, param in params.items()}
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name])
    return update


def _reference_rank(rank, path):
    from quatro_nemo.algos import ALGORITHMS
    from quatro_nemo.megatron.models import build_model
    from quatro_nemo.megatron.parallel import initialize_parallel

    initialize_parallel(seed=SEED)
    model = build_model(_model_config())
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    position_ids = torch.arange(SEQ_LEN).expand(NUM_SEQUENCES, SEQ_LEN)
    probe = torch.randint(1, 64, (NUM_SEQUENCES, SEQ_LEN), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = model(probe, position_ids, None)
        now = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, probe[:, 1:, None])[..., 0]
    batch = _make_batch(now.float())

    tokens = batch["tokens"]
    ref_logprobs64, ref_entropy64 = _float64_logprobs_entropy(model, tokens, position_ids)

    results = {name: _reference_loss_and_grads(model, batch, name) for name in ALGORITHMS}
    adam_update = _reference_adam_update(model, state, results["quatro"]["grads"])
    qwen2 = build_model(_qwen2_config())
    qwen2_logprobs64, qwen2_entropy64 = _float64_logprobs_entropy(qwen2, tokens, position_ids)
    torch.save(dict(state=state, batch=batch, logprobs64=ref_logprobs64, entropy64=ref_entropy64,
                    results=results, adam_update=adam_update,
                    qwen2=dict(state={n: p.detach().clone() for n, p in qwen2.named_parameters()},
                               logprobs64=qwen2_logprobs64, entropy64=qwen2_entropy64,
                               quatro=_reference_loss_and_grads(qwen2, batch, "quatro"))), path)


def _assert_close(name, actual, expected, rel=REL_TOL, scale=0.0):
    """max |actual - expected| <= rel * max(|expected|, scale): ``scale`` is the magnitude of the
    operands when ``expected`` is a difference that cancels (float32 rounding is relative to them)."""
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    scale = torch.maximum(expected.abs().max(), torch.as_tensor(float(scale), dtype=torch.float64)).clamp_min(1e-6)
    err = (actual - expected).abs().max() / scale
    assert err <= rel, f"{name}: relative error {err.item():.3e} > {rel}"


# Metrics that cancel float32 log-probs to a much smaller number: the k1 KL to pi_old, a token mean
# of log pi - log pi_old, and QUATRO's log-ratio statistic l_i = sum_t (log pi - log pi_old)
# (Eq. 17), a difference of two sequence sums. Their rounding, which depends on the CPU's kernels
# (both exceeded 1e-5 of their value under ATEN_CPU_CAPABILITY=default, by 2e-7 absolute), is
# relative to the log-probs, not to the difference: each is compared at REL_TOL of the largest
# |log pi_old| of a token (token means) or of a sequence's summed |log pi_old| (sequence sums), the
# error this test already accepts in the log-probs themselves, summed as the metric sums them.
# A layout bug (a row, token or rank missed, a wrong normaliser) moves them by their own size.
CANCELLING_METRICS = {"policy/kl_old": "token", "quatro/log_ratio_stat/": "sequence"}


def _logprob_scales(batch):
    """{"token": the largest |log pi_old| of a response token, "sequence": the largest sum of
    |log pi_old| over one sequence's response tokens}."""
    magnitudes = batch["old_logprobs"].abs() * batch["response_mask"]
    return {"token": magnitudes.max().item(), "sequence": magnitudes.sum(-1).max().item()}


def _full_gradient(model, name, param):
    """The TP=1 gradient of ``param`` (its DDP buffer ``main_grad``): TP shards all-gathered and
    merged by checkpoint's layout."""
    import torch.distributed as dist
    from quatro_nemo.megatron import parallel
    from quatro_nemo.megatron.checkpoint import merge_shards, partition_layout

    grad = param.main_grad
    partition_dim, stride = partition_layout(model, name, param)
    if partition_dim is None or parallel.tp_size() == 1:
        return grad
    shards = [torch.empty_like(grad) for _ in range(parallel.tp_size())]
    dist.all_gather(shards, grad.contiguous(), group=parallel.tp_group())
    return merge_shards(shards, partition_dim, stride)


def _assert_step_matches(where, model, metrics, expected, covered, batch):
    """Loss, every metric and every gradient (gathered to full tensors) equal the reference
    computed on the global ``batch``."""
    from quatro_nemo.megatron.models import global_parameter_name

    _assert_close(f"{where} loss", metrics["loss"], expected["loss"])
    assert set(metrics) == set(expected["metrics"]) | {"loss"}, where
    scales = _logprob_scales(batch)
    for key, value in expected["metrics"].items():
        kind = next((kind for prefix, kind in CANCELLING_METRICS.items() if key.startswith(prefix)), None)
        _assert_close(f"{where} metric {key}", metrics[key], value, scale=scales[kind] if kind else 0.0)
    for name, param in model.named_parameters():
        full_name = global_parameter_name(model, name)
        covered.add(full_name)
        _assert_close(f"{where} grad {full_name}", _full_gradient(model, name, param),
                      expected["grads"][full_name])


def _assert_every_parameter_compared(covered, full_state):
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, covered)
    assert set().union(*everyone) == set(full_state), "some parameters were never compared"


def _rank_setup(tensor_parallel, pipeline_parallel, path):
    """(reference, layout, model with the reference weights, its DDP wrapper, this DP rank's rows,
    its batch)."""
    from quatro_nemo.megatron import training
    from quatro_nemo.megatron.checkpoint import load_full_state_dict
    from quatro_nemo.megatron.models import build_model
    from quatro_nemo.megatron.parallel import initialize_parallel

    ref = torch.load(path)
    layout = initialize_parallel(tensor_parallel, pipeline_parallel, seed=SEED)
    model = build_model(_model_config())
    load_full_state_dict(model, ref["state"])
    ddp = training.wrap_for_training(model, distributed_optimizer=False)  # full gradients everywhere
    rows = slice(layout.dp_rank * NUM_SEQUENCES // layout.data_parallel,
                 (layout.dp_rank + 1) * NUM_SEQUENCES // layout.data_parallel)
    batch = {key: value[rows] for key, value in ref["batch"].items()}
    return ref, layout, model, ddp, rows, batch


def _parallel_rank(rank, tensor_parallel, pipeline_parallel, micro_batch_sizes, path):
    from quatro_nemo.megatron import training
    from quatro_nemo.megatron.checkpoint import gather_full_state_dict, load_full_state_dict
    from quatro_nemo.megatron.forward import compute_logprobs, train_step_forward_backward
    from quatro_nemo.megatron.loss import global_loss_normalizer
    from quatro_nemo.megatron.models import build_model, global_parameter_name

    ref, layout, model, ddp, rows, batch = _rank_setup(tensor_parallel, pipeline_parallel, path)

    logprobs, entropy = compute_logprobs(model, batch, micro_batch_sizes[0])
    _assert_close("logprobs vs float64", logprobs, ref["logprobs64"][rows])
    _assert_close("entropy vs float64", entropy, ref["entropy64"][rows])

    covered = set()
    for loss_name in LOSSES:
        expected = ref["results"][loss_name]
        for micro_batch_size in micro_batch_sizes:
            ddp.zero_grad_buffer()
            metrics = train_step_forward_backward(ddp, batch, _policy_loss(loss_name), _algo_config(loss_name),
                                                  micro_batch_size)
            where = f"{loss_name} tp={tensor_parallel} pp={pipeline_parallel} mbs={micro_batch_size}"
            _assert_step_matches(where, model, metrics, expected, covered, ref["batch"])
    _assert_every_parameter_compared(covered, ref["state"])

    # One optimizer step over two calls (gradient accumulation across calls): global normaliser
    # passed in, gradients finalised once, after the second call.
    normalizer = global_loss_normalizer(batch["response_mask"])
    half = batch["tokens"].shape[0] // 2
    ddp.zero_grad_buffer()
    losses = []
    for part, finalize in ((slice(0, half), False), (slice(half, None), True)):
        metrics = train_step_forward_backward(
            ddp, {key: value[part] for key, value in batch.items()}, _policy_loss("quatro"), _algo_config("quatro"),
            1, normalizer=normalizer, finalize_grads=finalize)
        losses.append(metrics["loss"])
    expected = ref["results"]["quatro"]
    _assert_close("two calls, summed loss", sum(losses), expected["loss"])
    for name, param in model.named_parameters():
        _assert_close(f"two calls, grad {name}", _full_gradient(model, name, param),
                      expected["grads"][global_parameter_name(model, name)])

    # megatron's distributed optimizer (masters and Adam state sharded over DP): one step equals
    # torch AdamW on the reference gradients.
    fresh = build_model(_model_config())
    load_full_state_dict(fresh, ref["state"])
    fresh_ddp = training.wrap_for_training(fresh, distributed_optimizer=True)
    optimizer = training.build_optimizer(fresh_ddp, training.OptimizerSettings(
        lr=ADAM_LR, adam_eps=ADAM_EPS, weight_decay=0.0, grad_clip=0.0))
    training.zero_gradients(fresh_ddp, optimizer)
    train_step_forward_backward(fresh_ddp, batch, _policy_loss("quatro"), _algo_config("quatro"), micro_batch_sizes[0])
    grad_norm = training.optimizer_step(fresh_ddp, optimizer)
    reference_norm = torch.sqrt(sum(g.double().pow(2).sum() for g in expected["grads"].values()))
    _assert_close("grad norm", grad_norm, reference_norm)
    after = gather_full_state_dict(fresh)
    for name, update in ref["adam_update"].items():
        _assert_close(f"adam update {name}", after[name] - ref["state"][name], update, rel=UPDATE_REL_TOL)


@pytest.fixture(scope="module")
def reference_path(tmp_path_factory):
    path = os.path.join(tmp_path_factory.mktemp("megatron_ref"), "reference.pt")
    run_ranks(1, _reference_rank, path)
    return path


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world_size, tensor_parallel, pipeline_parallel, micro_batch_sizes",
    [
        pytest.param(2, 2, 1, (3, 8), id="tp2"),
        pytest.param(2, 1, 2, (3, 4), id="pp2"),
        pytest.param(2, 1, 1, (1, 3), id="dp2"),
        pytest.param(4, 2, 2, (2, 8), id="tp2xpp2"),
    ],
)
def test_loss_and_gradients_match_single_process(reference_path, world_size, tensor_parallel,
                                                 pipeline_parallel, micro_batch_sizes):
    run_ranks(world_size, _parallel_rank, tensor_parallel, pipeline_parallel, micro_batch_sizes,
              reference_path)


def _token_budget_rank(rank, tensor_parallel, pipeline_parallel, max_tokens, micro_batches, path):
    from quatro_nemo.megatron import parallel

    from quatro_nemo.algos import ALGORITHMS
    from quatro_nemo.megatron.batching import MicroBatching, plan_micro_batches
    from quatro_nemo.megatron.forward import compute_logprobs, train_step_forward_backward
    from quatro_nemo.megatron.models import transformer_engine_available

    ref, layout, model, ddp, rows, batch = _rank_setup(tensor_parallel, pipeline_parallel, path)
    batching = MicroBatching(max_tokens=max_tokens)
    plan = plan_micro_batches(batch, batching)
    # The budget must make this a real test: trimmed micro-batches of several shapes.
    assert len({(micro.rows.numel(), micro.width) for micro in plan}) > 1
    assert any(micro.width < SEQ_LEN for micro in plan)

    if not transformer_engine_available():  # the local layer spec has no THD attention
        with pytest.raises(ValueError, match="parallel.sequence_packing=true needs Transformer Engine"):
            compute_logprobs(model, batch, MicroBatching(max_tokens=max_tokens, pack=True))

    logprobs, entropy = compute_logprobs(model, batch, batching)
    valid = torch.arange(SEQ_LEN - 1).unsqueeze(0) < (batch["lengths"] - 1).unsqueeze(1)
    _assert_close("token budget: logprobs vs float64", logprobs[valid], ref["logprobs64"][rows][valid])
    _assert_close("token budget: entropy vs float64", entropy[valid], ref["entropy64"][rows][valid])

    forward_calls = []
    model.register_forward_pre_hook(lambda module, args: forward_calls.append(1))
    covered = set()
    for algorithm in ALGORITHMS:
        ddp.zero_grad_buffer()
        forward_calls.clear()
        metrics = train_step_forward_backward(ddp, batch, _policy_loss(algorithm), _algo_config(algorithm),
                                              batching)
        where = f"{algorithm} tp={tensor_parallel} pp={pipeline_parallel} max_tokens={max_tokens}"
        _assert_step_matches(where, model, metrics, ref["results"][algorithm], covered,
                             ref["batch"])
        # every DP rank ran the same number of micro-batches (empty ones pad the shorter plan)
        counts = [None] * layout.data_parallel
        torch.distributed.all_gather_object(counts, len(forward_calls), group=parallel.dp_group())
        assert counts == [micro_batches] * layout.data_parallel, counts
    _assert_every_parameter_compared(covered, ref["state"])


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world_size, tensor_parallel, pipeline_parallel, max_tokens, micro_batches",
    [
        # lengths 5, 11, 11, 3, 12, 8, 3, 6 under 22 tokens: [12], [11, 11], [8, 6], [5, 3, 3]
        pytest.param(2, 2, 1, 22, 4, id="tp2"),
        pytest.param(2, 1, 2, 22, 4, id="pp2"),
        # rank 0's rows (5, 11, 11, 3) make 2 micro-batches, rank 1's (12, 8, 3, 6) make 3:
        # rank 0 runs an empty one
        pytest.param(2, 1, 1, 22, 3, id="dp2"),
    ],
)
def test_token_budget_matches_single_process(reference_path, world_size, tensor_parallel, pipeline_parallel,
                                             max_tokens, micro_batches):
    """Every registry algorithm under token-budget micro-batches (sorted, binned, trimmed to each
    micro-batch's longest row) gives the padded single-process loss, metrics and gradients."""
    run_ranks(world_size, _token_budget_rank, tensor_parallel, pipeline_parallel, max_tokens, micro_batches,
              reference_path)


def _qwen2_rank(rank, tensor_parallel, pipeline_parallel, path):
    from quatro_nemo.megatron import training
    from quatro_nemo.megatron.checkpoint import load_full_state_dict
    from quatro_nemo.megatron.forward import compute_logprobs, train_step_forward_backward
    from quatro_nemo.megatron.models import build_model
    from quatro_nemo.megatron.parallel import initialize_parallel

    ref = torch.load(path)
    initialize_parallel(tensor_parallel, pipeline_parallel, seed=SEED + 1)
    model = build_model(_qwen2_config())
    load_full_state_dict(model, ref["qwen2"]["state"])
    logprobs, entropy = compute_logprobs(model, ref["batch"], 4)
    _assert_close("qwen2 logprobs vs float64", logprobs, ref["qwen2"]["logprobs64"])
    _assert_close("qwen2 entropy vs float64", entropy, ref["qwen2"]["entropy64"])

    covered = set()
    ddp = training.wrap_for_training(model, distributed_optimizer=False)
    metrics = train_step_forward_backward(ddp, ref["batch"], _policy_loss("quatro"), _algo_config("quatro"), 4)
    _assert_step_matches("qwen2 quatro tp=2 pp=2", model, metrics, ref["qwen2"]["quatro"], covered,
                         ref["batch"])
    _assert_every_parameter_compared(covered, ref["qwen2"]["state"])


@pytest.mark.distributed
def test_qwen2_under_tp2_pp2_matches_single_process(reference_path):
    """GQA QKV shards, SwiGLU fc1 shards, RoPE and the untied output layer: log-probs and
    entropies vs float64, and the QUATRO loss, metrics and every gradient vs the reference."""
    run_ranks(4, _qwen2_rank, 2, 2, reference_path)
