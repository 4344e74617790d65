"""vocab_parallel_logprobs_and_entropy at TP=1 against a float64 full-softmax autograd reference.

(The TP=2 path, with its all-reduces, is checked in test_parallel_equivalence.py.)

When the entropy is a metric only (detached, as the loss does) its gradient is never materialised
and the backward computes the log-prob term alone, in place: the gradient must equal, bit for bit
at TP=1 and TP=2 (gloo), the one computed with the entropy's gradient an explicit tensor of zeros
(the full branch, which every backward ran before), and both must equal float64 autograd.
"""
import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from quatro_nemo.megatron.logprobs import token_logprobs_and_entropy, vocab_parallel_logprobs_and_entropy
from tests.distributed import run_ranks


def _float64_reference(logits, target):
    logp = torch.log_softmax(logits.double(), -1)
    return logp.gather(-1, target[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


def test_values_and_gradients_match_float64_full_softmax():
    gen = torch.Generator().manual_seed(0)
    logits = (3.0 * torch.randn(3, 5, 17, generator=gen)).requires_grad_()
    target = torch.randint(0, 17, (3, 5), generator=gen)
    w_lp, w_ent = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)

    logprobs, entropy = vocab_parallel_logprobs_and_entropy(logits, target, group=None, vocab_start=0)
    (w_lp * logprobs + w_ent * entropy).sum().backward()

    logits64 = logits.detach().double().requires_grad_()
    ref_lp, ref_ent = _float64_reference(logits64, target)
    (w_lp.double() * ref_lp + w_ent.double() * ref_ent).sum().backward()

    torch.testing.assert_close(logprobs.double(), ref_lp.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy.double(), ref_ent.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad.double(), logits64.grad, rtol=1e-5, atol=1e-6)
    assert logits.grad.abs().max() > 0.01


def test_only_logprobs_used_gives_the_cross_entropy_gradient():
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0]], requires_grad=True)
    target = torch.tensor([2])
    logprobs, _ = vocab_parallel_logprobs_and_entropy(logits, target, group=None, vocab_start=0)
    logprobs.sum().backward()
    p = torch.softmax(logits.detach().double(), -1)
    expected = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=torch.float64) - p  # onehot - p
    torch.testing.assert_close(logits.grad.double(), expected, rtol=1e-6, atol=1e-7)


def test_input_logits_are_not_modified_and_uniform_entropy_is_log_v():
    logits = torch.zeros(2, 4, 8)
    tokens = torch.randint(0, 8, (2, 4))
    before = logits.clone()
    logprobs, entropy = token_logprobs_and_entropy(logits, tokens)
    assert logprobs.shape == entropy.shape == (2, 3)
    torch.testing.assert_close(entropy, torch.full((2, 3), float(torch.log(torch.tensor(8.0)))))
    torch.testing.assert_close(logprobs, torch.full((2, 3), -float(torch.log(torch.tensor(8.0)))))
    assert torch.equal(logits, before)


def test_packed_micro_batch_logprobs_and_gradients_equal_the_row_layout():
    """micro_batch_logprobs_and_entropy on THD-packed logits (rows concatenated, slots padded to
    4) gives each row's float64 log-probs and entropies, and the same gradient to each row's
    logits, as the row layout; 0 past each row's length. Row independence of the logits is what
    THD attention provides on the GPU (not run here)."""
    from quatro_nemo.megatron.batching import pack_micro_batch
    from quatro_nemo.megatron.logprobs import micro_batch_logprobs_and_entropy

    gen = torch.Generator().manual_seed(3)
    lengths, width, vocab = torch.tensor([5, 2, 7]), 7, 11
    tokens = torch.randint(1, vocab, (3, width), generator=gen)
    tokens[torch.arange(width).unsqueeze(0) >= lengths.unsqueeze(1)] = 0
    row_logits = [(2.0 * torch.randn(int(n), vocab, generator=gen)).requires_grad_() for n in lengths]
    micro = pack_micro_batch({"tokens": tokens, "lengths": lengths}, pad_to_multiple=4)
    slots = micro["packed_layout"].cu_seqlens_padded.diff().tolist()
    packed_logits = torch.cat([torch.cat([logits, torch.randn(slot - logits.shape[0], vocab, generator=gen)])
                               for logits, slot in zip(row_logits, slots)]).unsqueeze(0)
    logprobs, entropy = micro_batch_logprobs_and_entropy(packed_logits, micro)
    assert logprobs.shape == entropy.shape == (3, width - 1)
    weights = torch.randn(3, width - 1, generator=gen)
    (weights * (logprobs + 0.5 * entropy)).sum().backward()

    for row, logits in enumerate(row_logits):
        n = int(lengths[row])
        ref_lp, ref_ent = _float64_reference(logits.detach()[:-1], tokens[row, 1:n])
        torch.testing.assert_close(logprobs[row, :n - 1].double(), ref_lp, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(entropy[row, :n - 1].double(), ref_ent, rtol=1e-6, atol=1e-6)
        assert logprobs[row, n - 1:].abs().sum() == 0 and entropy[row, n - 1:].abs().sum() == 0
        logits64 = logits.detach().double().requires_grad_()
        lp64, ent64 = _float64_reference(logits64[:-1], tokens[row, 1:n])
        (weights[row, :n - 1].double() * (lp64 + 0.5 * ent64)).sum().backward()
        torch.testing.assert_close(logits.grad.double(), logits64.grad, rtol=1e-5, atol=1e-6)


def _gradients_with_and_without_the_entropy_term(logits, target, weights, group, vocab_start):
    """The gradient to ``logits`` of ``sum(weights * log p)``: with the entropy detached (its
    gradient None, the lean branch) and with the entropy in the graph at weight 0 (an explicit zero
    gradient: the full branch, as every backward computed it before)."""
    grads = []
    for entropy_weight in (None, 0.0):
        leaf = logits.detach().clone().requires_grad_()
        logprobs, entropy = vocab_parallel_logprobs_and_entropy(leaf, target, group=group, vocab_start=vocab_start)
        loss = (weights * logprobs).sum()
        if entropy_weight is not None:
            loss = loss + (entropy_weight * entropy).sum()
        loss.backward()
        grads.append(leaf.grad)
    return grads


def _logits_case(vocab=40):
    gen = torch.Generator().manual_seed(7)
    logits = 4.0 * torch.randn(3, 6, vocab, generator=gen)
    target = torch.randint(0, vocab, (3, 6), generator=gen)
    return logits, target, torch.randn(3, 6, generator=gen)


def _float64_logprob_gradient(logits, target, weights):
    logits64 = logits.double().requires_grad_()
    (weights.double() * _float64_reference(logits64, target)[0]).sum().backward()
    return logits64.grad


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs CUDA")])])
def test_a_detached_entropy_leaves_the_gradient_bitwise_unchanged_at_tp1(device):
    logits, target, weights = _logits_case()
    lean, full = _gradients_with_and_without_the_entropy_term(logits.to(device), target.to(device),
                                                              weights.to(device), None, 0)
    assert torch.equal(lean, full)
    torch.testing.assert_close(lean.double().cpu(), _float64_logprob_gradient(logits, target, weights),
                               rtol=1e-5, atol=1e-6)


def _tp2_gradients_rank(rank):
    dist.init_process_group("gloo")
    logits, target, weights = _logits_case()
    local = logits.chunk(2, dim=-1)[rank]  # this rank's vocabulary slice
    return _gradients_with_and_without_the_entropy_term(local, target, weights, dist.group.WORLD,
                                                        rank * local.shape[-1])


@pytest.mark.distributed
def test_a_detached_entropy_leaves_the_gradient_bitwise_unchanged_at_tp2():
    logits, target, weights = _logits_case()
    results = run_ranks(2, _tp2_gradients_rank)
    for lean, full in results:
        assert torch.equal(lean, full)
    assert not all(torch.equal(r[0], torch.zeros_like(r[0])) for r in results)
    torch.testing.assert_close(torch.cat([lean for lean, _ in results], dim=-1).double(),
                               _float64_logprob_gradient(logits, target, weights), rtol=1e-5, atol=1e-6)


class _NewTensorsOfSize(TorchDispatchMode):
    """Counts the tensors of ``numel`` elements on new memory that the ops run under it return
    (an in-place op or a view returns an input's memory)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.created = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.created += sum(isinstance(t, torch.Tensor) and t.numel() == self.numel
                            and t.untyped_storage().data_ptr() not in inputs for t in tree_leaves(out))
        return out


@pytest.mark.parametrize("entropy_in_loss, created", [(False, 1), (True, 8)])
def test_the_backward_of_a_detached_entropy_creates_one_logits_sized_buffer(entropy_in_loss, created):
    """The memory of the loss's backward (module docstring): with the entropy detached, one float32
    buffer of the logits' size (shifted, then p, then the gradient, in place); with its gradient
    in the graph, the full branch's shifted, probs, grad and five temporaries (shifted - log Z,
    and the four products and differences of its two terms)."""
    logits, target, weights = _logits_case()
    logits.requires_grad_()
    logprobs, entropy = vocab_parallel_logprobs_and_entropy(logits, target, group=None, vocab_start=0)
    loss = (weights * logprobs).sum() + ((0.0 * entropy).sum() if entropy_in_loss else 0.0)
    with _NewTensorsOfSize(logits.numel()) as counter:
        loss.backward()
    assert counter.created == created
