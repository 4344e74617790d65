"""The QUATRO actor's loss closure at TP=2 over gloo equals the single-process float64 reference.

The closure gets NeMo-Aligner's own ``from_parallel_logits_to_logprobs`` output from each rank's
vocabulary shard of the logits (as in training); the reference is the QUATRO formula of
quatro-math.md on ``log_softmax`` of the full logits (``aligner_reference.py``), in one process.
Two micro-batches of size 2 (the parent actor is limited to size 1).
"""
import pytest
import torch

pytest.importorskip("nemo_aligner")

from omegaconf import OmegaConf  # noqa: E402

from tests.distributed import run_ranks  # noqa: E402
from aligner_reference import log_softmax_gather, quatro_loss_reference  # noqa: E402
from quatro_nemo.aligner.actor import QuatroReinforceActor, StepLossContext  # noqa: E402
from quatro_nemo.aligner.loss import loss_scale  # noqa: E402
from quatro_nemo.megatron.loss import global_loss_normalizer  # noqa: E402

NUM_SEQUENCES, LENGTH, VOCAB, MICRO_BATCH = 4, 7, 10, 2
BETA = 0.05


def _problem(seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(NUM_SEQUENCES, LENGTH, VOCAB, generator=generator) * 2
    tokens = torch.randint(0, VOCAB, (NUM_SEQUENCES, LENGTH), generator=generator)
    mask = torch.zeros(NUM_SEQUENCES, LENGTH - 1)
    for i, (start, end) in enumerate([(1, 6), (2, 4), (1, 2), (3, 6)]):
        mask[i, start:end] = 1
    with torch.no_grad():
        current = log_softmax_gather(logits, tokens)
    return {
        "logits": logits,
        "response_tokens": tokens,
        "response_mask": mask,
        "old_logprobs": (current + 0.1 * torch.randn(current.shape, generator=generator, dtype=torch.float64)).float(),
        "ref_logprobs": (current + 0.2 * torch.randn(current.shape, generator=generator, dtype=torch.float64)).float(),
        "advantages": torch.randn(NUM_SEQUENCES, generator=generator),
    }


def _actor(log_ratio):
    """The real subclass, without NeMo's model construction (no checkpoint on CPU): only what the
    loss closure uses is set up."""
    actor = QuatroReinforceActor.__new__(QuatroReinforceActor)
    torch.nn.Module.__init__(actor)
    cfg = OmegaConf.create({"quatro": {"algorithm": {"name": "quatro", "beta": BETA, "delta": 0.1,
                                                     "log_ratio": log_ratio}}})
    actor.configure_algorithm(cfg)
    return actor


def _tp_rank(rank, log_ratio):
    from quatro_nemo.megatron.parallel import initialize_parallel

    initialize_parallel(tensor_parallel=2)
    data = _problem()
    shard = VOCAB // 2
    local_logits = data["logits"][..., rank * shard:(rank + 1) * shard].clone().requires_grad_(True)
    actor = _actor(log_ratio)
    num_microbatches = NUM_SEQUENCES // MICRO_BATCH
    actor._step_loss_context = StepLossContext(global_loss_normalizer(data["response_mask"]),
                                               loss_scale(num_microbatches, dp_size=1))
    step = actor.get_actor_forward_output_and_loss_func()
    total = 0.0
    for mb in range(num_microbatches):
        rows = slice(mb * MICRO_BATCH, (mb + 1) * MICRO_BATCH)
        batch = {key: data[key][rows] for key in
                 ("response_tokens", "response_mask", "old_logprobs", "ref_logprobs", "advantages")}
        batch.update(position_ids=torch.arange(LENGTH).expand(MICRO_BATCH, -1), attention_mask=None)

        def model(tokens, position_ids, attention_mask, labels=None, rows=rows):
            assert torch.equal(tokens, data["response_tokens"][rows])
            return local_logits[rows]

        output, loss_func = step(iter([batch]), model)
        loss, _ = loss_func(output)
        total = total + loss / num_microbatches  # what Megatron's schedule does with it
    total.backward()
    return {"loss": total.detach(), "grad": local_logits.grad}


@pytest.mark.distributed
@pytest.mark.parametrize("log_ratio", ["seq_sum", "seq_mean"])
def test_loss_closure_tp2_matches_single_process_reference(tmp_path, log_ratio):
    results = run_ranks(2, _tp_rank, log_ratio)

    data = _problem()
    logits = data["logits"].double().requires_grad_(True)
    logprobs = log_softmax_gather(logits, data["response_tokens"])
    expected = quatro_loss_reference(logprobs, data["old_logprobs"], data["advantages"], data["response_mask"],
                                     beta=BETA, ref_logprobs=data["ref_logprobs"], log_ratio=log_ratio)
    expected.backward()
    shard = VOCAB // 2
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["loss"].double(), expected.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["grad"].double(), logits.grad[..., rank * shard:(rank + 1) * shard],
                                   rtol=1e-4, atol=1e-6)
    assert logits.grad.abs().max() > 1e-3  # the comparison is not between zeros
