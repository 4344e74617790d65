"""``QuatroReinforceActor.get_loss_and_metrics`` at DP=2 over gloo, micro-batch size 2, through
megatron-core 0.10's real ``forward_backward_no_pipelining`` and NeMo's microbatch calculator.

The model is a stand-in with one shared weight (``logits = E[tokens] @ W``, same W on both ranks);
after the step the W gradients of the two ranks are averaged (what NeMo's DP gradient reduction
does). That average, and the loss the actor reports, must equal the single-process float64
QUATRO formula (quatro-math.md Sec. 4) on the whole global batch.
"""
import pytest
import torch

pytest.importorskip("nemo_aligner")

from omegaconf import OmegaConf  # noqa: E402

from tests.distributed import run_ranks  # noqa: E402
from aligner_reference import log_softmax_gather, quatro_loss_reference  # noqa: E402
from quatro_nemo.aligner.actor import QuatroReinforceActor  # noqa: E402

GLOBAL_BATCH, DP, MICRO_BATCH, LENGTH, VOCAB, HIDDEN, BETA = 8, 2, 2, 6, 9, 5, 0.05


def _data(seed=0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (GLOBAL_BATCH, LENGTH), generator=generator)
    mask = torch.zeros(GLOBAL_BATCH, LENGTH - 1)
    for i in range(GLOBAL_BATCH):
        start = 1 + i % 2
        mask[i, start:start + 1 + i % (LENGTH - 1 - start)] = 1
    return {
        "embedding": torch.randn(VOCAB, HIDDEN, generator=generator),
        "weight": torch.randn(HIDDEN, VOCAB, generator=generator) * 0.5,
        "response_tokens": tokens,
        "response_mask": mask,
        "old_logprobs": -torch.rand(GLOBAL_BATCH, LENGTH - 1, generator=generator) * 3,
        "ref_logprobs": -torch.rand(GLOBAL_BATCH, LENGTH - 1, generator=generator) * 3,
        "advantages": torch.randn(GLOBAL_BATCH, generator=generator),
    }


class Model(torch.nn.Module):
    def __init__(self, data, config):
        from megatron.core.enums import ModelType

        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.register_buffer("embedding", data["embedding"].clone())
        self.weight = torch.nn.Parameter(data["weight"].clone())

    def set_input_tensor(self, tensor):  # the schedule's pipeline hook (unused at PP=1)
        pass

    def forward(self, tokens, position_ids, attention_mask, labels=None):
        return self.embedding[tokens] @ self.weight


def _dp_rank(rank):
    from megatron.core.transformer import TransformerConfig
    from nemo_aligner.utils.utils import configure_batch_sizes

    from quatro_nemo.megatron.parallel import initialize_parallel

    initialize_parallel(tensor_parallel=1)  # world 2 -> DP 2
    data = _data()
    actor = QuatroReinforceActor.__new__(QuatroReinforceActor)  # no checkpoint on CPU: set up by hand
    torch.nn.Module.__init__(actor)
    cfg = OmegaConf.create({
        "micro_batch_size": MICRO_BATCH, "global_batch_size": GLOBAL_BATCH, "data": {},
        "optim": {"name": "adam"},
        "quatro": {"algorithm": {"name": "quatro", "beta": BETA, "delta": 0.1}},
    })
    actor._cfg = cfg
    actor.with_distributed_adam = False
    actor.use_mcore_dist_optim = False
    actor.tokenizer = type("Tokenizer", (), {"eos_id": 0})()
    actor.model = Model(data, TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1,
                                                use_cpu_initialization=True))
    actor.configure_algorithm(cfg)
    configure_batch_sizes(mbs=MICRO_BATCH, gbs=GLOBAL_BATCH, dp=DP)

    rows = slice(rank * GLOBAL_BATCH // DP, (rank + 1) * GLOBAL_BATCH // DP)
    batch = {key: data[key][rows].clone() for key in
             ("response_tokens", "response_mask", "old_logprobs", "ref_logprobs", "advantages")}
    loss, metrics = actor.get_loss_and_metrics(batch=batch, forward_only=False)
    return {"loss": loss, "metrics": metrics, "grad": actor.model.weight.grad.clone()}


@pytest.mark.distributed
def test_get_loss_and_metrics_dp2_equals_global_reference(tmp_path):
    results = run_ranks(DP, _dp_rank)

    data = _data()
    weight = data["weight"].double().requires_grad_(True)
    logits = data["embedding"].double()[data["response_tokens"]] @ weight
    logprobs = log_softmax_gather(logits, data["response_tokens"])
    expected = quatro_loss_reference(logprobs, data["old_logprobs"], data["advantages"], data["response_mask"],
                                     beta=BETA, ref_logprobs=data["ref_logprobs"])
    expected.backward()

    averaged_grad = sum(result["grad"].double() for result in results) / DP  # NeMo's DP averaging
    torch.testing.assert_close(averaged_grad, weight.grad, rtol=1e-4, atol=1e-6)
    assert weight.grad.abs().max() > 1e-3
    for result in results:  # the reported step loss is the global one, on every rank
        assert result["loss"] == pytest.approx(expected.item(), rel=1e-5)
        assert result["metrics"]["policy/loss"] == result["loss"]
        assert result["metrics"]["policy/kl_ref"] > 0
