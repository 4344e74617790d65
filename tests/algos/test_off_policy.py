"""Decoupled (``proximal``) correction of every algorithm's loss (docs/quatro-math.md Sec. 9.5):
with each sample's gradient scaled by omega_i = N w̄_i, the gradient equals the importance-weighted
on-policy gradient, written out by hand below in float64 for each loss, and the loss's value is
unchanged."""
import math

import pytest
import torch

from quatro_nemo.algos import ALGORITHMS, LossNormalizer, QuatroConfig, get_algorithm, get_policy_loss
from quatro_nemo.algos.importance import importance_weighted_logprobs
from quatro_nemo.algos.off_policy import SampleWeights

D = torch.float64
NUM_PROMPTS, N, LENGTH = 3, 4, 6

# How each loss reduces its per-token or per-sequence term (quatro-math.md Sec. 4-5): at
# pi_theta = pi_prox every ratio is 1 (inside every clip) and d(term)/d(log pi_theta(o_{i,t})) is
# -A_i on every token of o_i for the token losses (PPO clip, CISPO, GPG) and -A_i / |o_i| for the
# sequence losses (GSPO's and GMPO's exp(mean_t r_t), QUATRO's s_i), each mean over the batch.
SEQUENCE_LOSSES = {"gspo", "gmpo", "quatro"}


def rollout(seed=0):
    """Log-probs (leaf, = pi_prox: the first inner step), masks of 1..LENGTH tokens, advantages,
    and per-sample gradient weights N w̄ from random log weights."""
    gen = torch.Generator().manual_seed(seed)
    rows = NUM_PROMPTS * N
    prox = -torch.rand(rows, LENGTH, generator=gen, dtype=D) * 2.0 - 0.1
    mask = torch.zeros(rows, LENGTH, dtype=D)
    for i in range(rows):
        mask[i, :1 + (i * 5) % LENGTH] = 1.0
    advantages = torch.randn(rows, generator=gen, dtype=D)
    weights = SampleWeights.from_log_weights(torch.randn(NUM_PROMPTS, N, generator=gen, dtype=D) * 1.5)
    omega = weights.loss_weights.reshape(-1)
    return prox, mask, advantages, omega


def hand_gradient(name, config, mask, advantages, omega):
    """sum_i omega_i x (sample i's on-policy gradient) w.r.t. log pi_theta [S, T], by hand."""
    lengths = mask.sum(dim=1)
    num_sequences, num_tokens = int((lengths > 0).sum()), float(mask.sum())
    if name in SEQUENCE_LOSSES:
        per_token = -advantages / lengths / num_sequences
    else:
        per_token = -advantages / {"token-mean": num_tokens,
                                   "seq-mean-token-mean": None,
                                   "seq-mean-token-sum": num_sequences}[config.loss_agg_mode]
    return (omega * per_token).unsqueeze(1) * mask


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_proximal_gradient_is_the_importance_weighted_on_policy_gradient(name):
    prox, mask, advantages, omega = rollout()
    spec = get_algorithm(name)
    config = spec.config_cls(beta=0.0)
    assert config.loss_agg_mode != "seq-mean-token-mean" or name in SEQUENCE_LOSSES
    normalizer = LossNormalizer.from_mask(mask)
    logprobs = prox.clone().requires_grad_(True)
    weighted = importance_weighted_logprobs(logprobs, omega.unsqueeze(1).expand_as(prox))
    loss, _ = get_policy_loss(name)(weighted, prox, advantages, mask, config, normalizer)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, hand_gradient(name, config, mask, advantages, omega),
                               rtol=1e-12, atol=1e-15)
    unweighted, _ = get_policy_loss(name)(prox.clone(), prox, advantages, mask, config, normalizer)
    assert loss.item() == unweighted.item()   # the weights scale gradients, never the value


@pytest.mark.parametrize("log_ratio", ["seq_sum", "seq_mean"])
def test_quatro_off_the_proximal_point_with_the_reference_term(log_ratio):
    """Later inner steps (pi_theta != pi_prox): -(1/S) sum_i omega_i [s_i (A_i - g_i) / |o_i| +
    beta (1 - exp(log pi_ref - log pi_theta)) / |o_i|] on each token, s_i = exp(mean_t r_t),
    g_i = sum_t r_t (seq_sum) or mean_t r_t (seq_mean); the reference term's gradient is weighted too."""
    prox, mask, advantages, omega = rollout(seed=1)
    gen = torch.Generator().manual_seed(5)
    logprobs = (prox + 0.1 * torch.randn(prox.shape, generator=gen, dtype=D)).requires_grad_(True)
    ref = prox + 0.1 * torch.randn(prox.shape, generator=gen, dtype=D)
    beta = 0.05
    config = QuatroConfig(beta=beta, log_ratio=log_ratio)
    weighted = importance_weighted_logprobs(logprobs, omega.unsqueeze(1).expand_as(prox))
    loss, _ = get_policy_loss("quatro")(weighted, prox, advantages, mask, config, LossNormalizer.from_mask(mask),
                                        ref_logprobs=ref)
    loss.backward()
    expected = torch.zeros_like(prox)
    num_sequences = NUM_PROMPTS * N
    for i in range(num_sequences):
        tokens = int(mask[i].sum())
        l_i = sum(logprobs[i, t].item() - prox[i, t].item() for t in range(tokens))
        s_i = math.exp(l_i / tokens)
        g_i = l_i if log_ratio == "seq_sum" else l_i / tokens
        for t in range(tokens):
            pg = -s_i * (advantages[i].item() - g_i)
            k3 = beta * (1.0 - math.exp(ref[i, t].item() - logprobs[i, t].item()))
            expected[i, t] = omega[i].item() * (pg + k3) / tokens / num_sequences
    torch.testing.assert_close(logprobs.grad, expected, rtol=1e-10, atol=1e-14)


def test_uniform_loss_weights_are_one_and_leave_the_gradient_bit_for_bit():
    prox, mask, advantages, _ = rollout(seed=2)
    ones = SampleWeights.from_log_weights(torch.zeros(NUM_PROMPTS, N, dtype=D)).loss_weights.reshape(-1)
    assert torch.equal(ones, torch.ones_like(ones))
    grads = []
    for weights in (None, ones):
        logprobs = prox.clone().requires_grad_(True)
        lp = logprobs if weights is None else importance_weighted_logprobs(logprobs, weights.unsqueeze(1).expand_as(prox))
        loss, _ = get_policy_loss("quatro")(lp, prox, advantages, mask, QuatroConfig(beta=0.0),
                                            LossNormalizer.from_mask(mask))
        loss.backward()
        grads.append(logprobs.grad)
    assert torch.equal(grads[0], grads[1])
