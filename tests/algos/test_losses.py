"""Policy losses: analytic QUATRO gradients, GSPO reduction, hand-computed baselines, and exact
micro-batch additivity with global normalisers (docs/interfaces.md)."""
import math

import pytest
import torch

from quatro_nemo.algos import (
    ALGORITHMS,
    CISPOConfig,
    DAPOConfig,
    GMPOConfig,
    GPGConfig,
    GRPOConfig,
    GSPOConfig,
    LossNormalizer,
    QuatroConfig,
    get_advantage_estimator,
    get_algorithm,
    get_policy_loss,
)

D = torch.float64


def make_batch(num_seqs=6, length=5, seed=0, spread=0.3, empty_row=None):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(num_seqs, length, generator=gen, dtype=D) * 2.0 - 0.1
    logprobs = (old + spread * torch.randn(num_seqs, length, generator=gen, dtype=D)).requires_grad_(True)
    ref = old + 0.2 * torch.randn(num_seqs, length, generator=gen, dtype=D)
    mask = torch.ones(num_seqs, length, dtype=D)
    for i in range(num_seqs):  # varying lengths 1..length
        mask[i, 1 + (i * 3) % length:] = 0.0
    if empty_row is not None:
        mask[empty_row] = 0.0
    advantages = torch.randn(num_seqs, generator=gen, dtype=D)
    entropy = torch.rand(num_seqs, length, generator=gen, dtype=D)
    return logprobs, old, ref, mask, advantages, entropy


def lengths_of(mask):
    return [int(m) for m in mask.sum(dim=1).tolist()]


# ---------------------------------------------------------------- QUATRO (Eq. 17)

@pytest.mark.parametrize("log_ratio", ["seq_sum", "seq_mean"])
def test_quatro_gradient_matches_analytic(log_ratio):
    logprobs, old, _, mask, adv, _ = make_batch()
    config = QuatroConfig(log_ratio=log_ratio, beta=0.0)
    num_seqs = logprobs.shape[0]
    loss, _ = get_policy_loss("quatro")(logprobs, old, adv, mask, config, LossNormalizer(num_seqs, float(mask.sum())))
    loss.backward()
    expected_grad = torch.zeros_like(old)
    expected_loss = 0.0
    for i, n_tok in enumerate(lengths_of(mask)):
        l_i = sum(logprobs[i, t].item() - old[i, t].item() for t in range(n_tok))
        log_s = l_i / n_tok
        s_i = math.exp(log_s)
        g_i = l_i if log_ratio == "seq_sum" else log_s
        expected_loss += -s_i * (adv[i].item() - g_i) / num_seqs
        # -(1/S) s_i (A_i - g_i) d log s_i / d logprob_t, d log s_i / d logprob_t = 1 / |o_i|
        for t in range(n_tok):
            expected_grad[i, t] = -s_i * (adv[i].item() - g_i) / n_tok / num_seqs
    assert loss.item() == pytest.approx(expected_loss, rel=1e-12, abs=1e-14)
    torch.testing.assert_close(logprobs.grad, expected_grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("log_ratio", ["seq_sum", "seq_mean"])
def test_quatro_gradient_vanishes_at_trust_region_optimum(log_ratio):
    _, old, _, mask, adv, _ = make_batch(seed=3)
    lengths = mask.sum(dim=1, keepdim=True)
    # g_i = A_i: spread A_i over the tokens (seq_sum) or put A_i on every token (seq_mean).
    per_token = adv.unsqueeze(1) / lengths if log_ratio == "seq_sum" else adv.unsqueeze(1).expand_as(old)
    logprobs = (old + per_token * mask).requires_grad_(True)
    loss, _ = get_policy_loss("quatro")(logprobs, old, adv, mask, QuatroConfig(log_ratio=log_ratio, beta=0.0),
                                        LossNormalizer(6, float(mask.sum())))
    loss.backward()
    assert abs(loss.item()) < 1e-14
    assert logprobs.grad.abs().max().item() < 1e-14
    # The same point is NOT stationary without the log-ratio term: the test can fail.
    logprobs.grad = None
    loss, _ = get_policy_loss("quatro")(logprobs, old, adv, mask, QuatroConfig(log_ratio="none", beta=0.0),
                                        LossNormalizer(6, float(mask.sum())))
    loss.backward()
    assert logprobs.grad.abs().max().item() > 1e-3


def test_quatro_on_policy_first_step():
    _, old, _, mask, adv, _ = make_batch(seed=4)
    logprobs = old.clone().requires_grad_(True)
    loss, metrics = get_policy_loss("quatro")(logprobs, old, adv, mask, QuatroConfig(beta=0.0), LossNormalizer(6, float(mask.sum())))
    loss.backward()
    # s_i = 1, g_i = 0: loss -(1/S) sum A_i, gradient -(1/S) A_i / |o_i| on response tokens.
    assert loss.item() == pytest.approx(-adv.sum().item() / 6, rel=1e-12)
    expected = -(adv.unsqueeze(1) / mask.sum(dim=1, keepdim=True)) * mask / 6
    torch.testing.assert_close(logprobs.grad, expected, rtol=1e-12, atol=1e-15)
    assert metrics["policy/seq_ratio/max"].item() == 1.0 == metrics["policy/seq_ratio/min"].item()


def test_quatro_reduces_to_gspo():
    """Paper Sec. 3.2: drop sg[g_i], use GRPO's advantage, add GSPO's clip -> GSPO exactly."""
    gen = torch.Generator().manual_seed(11)
    rewards = (torch.rand(3, 4, generator=gen) < 0.5).to(D)
    rewards[:, 0] = 1.0
    rewards[:, 1] = 0.0
    gspo_config = GSPOConfig(beta=0.01)
    adv = get_advantage_estimator("grpo")(rewards, gspo_config).advantages.flatten()
    _, old, ref, mask, _, _ = make_batch(num_seqs=12, length=6, seed=5)
    # Tiny perturbation so some sequences sit inside and some outside (1 - 3e-4, 1 + 4e-4).
    base = old + 4e-4 * torch.randn(12, 6, generator=gen, dtype=D)
    quatro_config = QuatroConfig(log_ratio="none", clip_low=3e-4, clip_high=4e-4, log_ratio_clamp=10.0, beta=0.01)
    normalizer = LossNormalizer(12, float(mask.sum()))
    grads, losses = [], []
    for name, config in (("gspo", gspo_config), ("quatro", quatro_config)):
        logprobs = base.clone().requires_grad_(True)
        loss, metrics = get_policy_loss(name)(logprobs, old, adv, mask, config, normalizer, ref_logprobs=ref)
        loss.backward()
        losses.append(loss.item())
        grads.append(logprobs.grad)
        assert 0.0 < metrics["policy/clip_frac"].item() < 1.0  # clipping is exercised
    assert losses[0] == losses[1]
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_quatro_optional_clamp_reports_and_bounds():
    _, old, _, mask, adv, _ = make_batch(seed=6)
    logprobs = (old + 3.0 * mask).requires_grad_(True)  # log s_i = 3 on every sequence
    loss, metrics = get_policy_loss("quatro")(logprobs, old, adv, mask, QuatroConfig(log_ratio_clamp=2.0, beta=0.0),
                                              LossNormalizer(6, float(mask.sum())))
    assert metrics["policy/clamp_frac"].item() == pytest.approx(1.0)
    assert metrics["policy/seq_ratio/max"].item() == pytest.approx(math.exp(2.0))


# ---------------------------------------------------------------- baselines vs hand values

def _ppo_token(ratio, a, lo, hi, dual_c=None):
    """PPO clip (Schulman et al. 2017, Eq. 7); with dual_c, Ye et al. 2020's cap for a < 0 (Eq. 5)."""
    loss = max(-a * ratio, -a * min(max(ratio, 1 - lo), 1 + hi))
    return min(loss, -a * dual_c) if dual_c is not None and a < 0 else loss


def reference_loss(name, config, logprobs, old, ref, mask, adv):
    """Plain-Python scalar loops of each baseline's published formula (independent of the code)."""
    lp, ol, rf = logprobs.tolist(), old.tolist(), ref.tolist()
    lengths = lengths_of(mask)
    seqs = [i for i, n in enumerate(lengths) if n > 0]
    num_seqs, num_toks = len(seqs), sum(lengths)

    def aggregate(token_values, mode):
        if mode == "token-mean":
            return sum(sum(token_values[i][:lengths[i]]) for i in seqs) / num_toks
        if mode == "seq-mean-token-mean":
            return sum(sum(token_values[i][:lengths[i]]) / lengths[i] for i in seqs) / num_seqs
        return sum(sum(token_values[i][:lengths[i]]) for i in seqs) / num_seqs

    r = [[lp[i][t] - ol[i][t] for t in range(len(lp[i]))] for i in range(len(lp))]
    a = adv.tolist()
    if name in ("grpo", "dapo"):
        tok = [[_ppo_token(math.exp(x), a[i], config.clip_low, config.clip_high, config.clip_ratio_c) for x in r[i]]
               for i in range(len(r))]
        pg = aggregate(tok, config.loss_agg_mode)
    elif name == "gspo":
        pg = 0.0
        for i in seqs:
            log_s = min(sum(r[i][:lengths[i]]) / lengths[i], config.log_ratio_clamp)
            pg += _ppo_token(math.exp(log_s), a[i], config.clip_low, config.clip_high) / num_seqs
    elif name == "gmpo":
        pg = 0.0
        for i in seqs:
            sgn = (a[i] > 0) - (a[i] < 0)
            clipped = [sgn * min(sgn * x, sgn * min(max(x, -config.clip_low), config.clip_high)) for x in r[i][:lengths[i]]]
            pg += -a[i] * math.exp(sum(clipped) / lengths[i]) / num_seqs
    elif name == "cispo":
        tok = [[-min(max(math.exp(r[i][t]), 1 - config.clip_low), 1 + config.clip_high) * a[i] * lp[i][t]
                for t in range(len(r[i]))] for i in range(len(r))]
        pg = aggregate(tok, config.loss_agg_mode)
    elif name == "gpg":
        pg = aggregate([[-a[i] * lp[i][t] for t in range(len(r[i]))] for i in range(len(r))], config.loss_agg_mode)
    else:
        raise AssertionError(name)
    k3 = [[math.exp(rf[i][t] - lp[i][t]) - (rf[i][t] - lp[i][t]) - 1 for t in range(len(r[i]))] for i in range(len(r))]
    if config.kl_clamp > 0:
        k3 = [[min(value, config.kl_clamp) for value in row] for row in k3]
    return pg + config.beta * aggregate(k3, config.loss_agg_mode)


BASELINES = [
    ("grpo", GRPOConfig(beta=0.02)),
    ("grpo", GRPOConfig(beta=0.0, loss_agg_mode="seq-mean-token-mean")),
    ("dapo", DAPOConfig(beta=0.02)),
    ("dapo", DAPOConfig(beta=0.02, loss_agg_mode="seq-mean-token-sum")),
    ("dapo", DAPOConfig(beta=0.02, clip_ratio_c=1.3, kl_clamp=0.05)),   # both caps fire on this batch
    ("gspo", GSPOConfig(beta=0.02)),
    ("gmpo", GMPOConfig(beta=0.02)),
    ("cispo", CISPOConfig(beta=0.02)),
    ("gpg", GPGConfig(beta=0.02)),
]


@pytest.mark.parametrize("name,config", BASELINES, ids=[f"{n}-{c.loss_agg_mode}-{i}" for i, (n, c) in enumerate(BASELINES)])
def test_baseline_matches_reference(name, config):
    logprobs, old, ref, mask, adv, _ = make_batch(seed=8, spread=0.4, empty_row=2)
    normalizer = LossNormalizer(5, float(mask.sum()))  # row 2 is empty: 5 sequences
    loss, _ = get_policy_loss(name)(logprobs, old, adv, mask, config, normalizer, ref_logprobs=ref)
    assert loss.item() == pytest.approx(reference_loss(name, config, logprobs.detach(), old, ref, mask, adv), rel=1e-12)


def test_ppo_clip_hand_values():
    """One token each, hand-derived, clip (0.8, 1.2)."""
    logprobs = torch.tensor([[0.5], [-0.5], [0.1]], dtype=D, requires_grad=True)
    old = torch.zeros(3, 1, dtype=D)
    adv = torch.tensor([1.0, -2.0, -1.0], dtype=D)
    mask = torch.ones(3, 1, dtype=D)
    loss, metrics = get_policy_loss("grpo")(logprobs, old, adv, mask, GRPOConfig(beta=0.0), LossNormalizer(3, 3))
    # token 1 (A = 1, r = e^.5 = 1.65): max(-1.65, -1.2) = -1.2, clipped, no gradient;
    # token 2 (A = -2, r = e^-.5 = 0.61): max(1.21, 2 * 0.8) = 1.6, clipped, no gradient;
    # token 3 (A = -1, r = e^.1 = 1.105, inside the range): 1.105, gradient -A r = e^.1.  Mean over 3.
    expected = (-1.2 + 1.6 + math.exp(0.1)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-14)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0], [0.0], [math.exp(0.1) / 3]], dtype=D))
    assert metrics["policy/clip_frac"].item() == pytest.approx(2 / 3)


def test_dual_clip_hand_values():
    """Ye et al. 2020 (arXiv:1912.09729, Eq. 5), c = 3, clip (0.8, 1.2), one token each, hand-derived:
    A < 0 tokens whose PPO loss -A r exceeds -A c are capped there (constant, no gradient)."""
    logprobs = torch.tensor([[math.log(5.0)], [0.5], [math.log(5.0)], [2.0]], dtype=D, requires_grad=True)
    old = torch.zeros(4, 1, dtype=D)
    adv = torch.tensor([-1.0, -2.0, 1.0, -0.5], dtype=D)
    mask = torch.ones(4, 1, dtype=D)
    # PPO alone: token 1 max(5, 1.2) = 5 (grad -A r = 5); token 2 max(2 e^.5, 2.4) = 2 e^.5 (grad 2 e^.5);
    # token 3 (A > 0) max(-5, -1.2) = -1.2 (clipped, no grad); token 4 max(.5 e^2, .6) = .5 e^2 (grad .5 e^2).
    # Dual clip c = 3 caps token 1 at 1 * 3 = 3 and token 4 at .5 * 3 = 1.5; token 2 (2 e^.5 = 3.30 < 6) stays.
    cases = {
        None: ((5.0 + 2 * math.exp(0.5) - 1.2 + 0.5 * math.exp(2.0)) / 4,
               [5.0 / 4, 2 * math.exp(0.5) / 4, 0.0, 0.5 * math.exp(2.0) / 4]),
        3.0: ((3.0 + 2 * math.exp(0.5) - 1.2 + 1.5) / 4, [0.0, 2 * math.exp(0.5) / 4, 0.0, 0.0]),
    }
    for dual_c, (expected_loss, expected_grad) in cases.items():
        logprobs.grad = None
        loss, metrics = get_policy_loss("grpo")(logprobs, old, adv, mask, GRPOConfig(beta=0.0, clip_ratio_c=dual_c),
                                                LossNormalizer(4, 4))
        loss.backward()
        assert loss.item() == pytest.approx(expected_loss, rel=1e-14)
        torch.testing.assert_close(logprobs.grad, torch.tensor(expected_grad, dtype=D).unsqueeze(1), rtol=1e-14, atol=0)
        assert metrics["policy/clip_frac"].item() == pytest.approx(1 / 4)
        assert ("policy/dual_clip_frac" in metrics) == (dual_c is not None)
    assert metrics["policy/dual_clip_frac"].item() == pytest.approx(2 / 4)


def test_dual_clip_is_off_by_default_and_validated():
    assert GRPOConfig().clip_ratio_c is None and DAPOConfig().clip_ratio_c is None
    for bad in (1.0, 0.5, float("nan"), "3"):
        with pytest.raises(ValueError, match=r"GRPOConfig\.clip_ratio_c"):
            GRPOConfig(clip_ratio_c=bad)


def test_cispo_keeps_gradient_of_clipped_tokens():
    logprobs = torch.tensor([[1.0, -0.2]], dtype=D, requires_grad=True)  # ratio e^1 > 1.28: clipped
    old = torch.tensor([[0.0, -0.2]], dtype=D)
    loss, _ = get_policy_loss("cispo")(logprobs, old, torch.tensor([2.0], dtype=D), torch.ones(1, 2, dtype=D),
                                       CISPOConfig(beta=0.0), LossNormalizer(1, 2))
    loss.backward()
    # d/dlogp of -sg(w) A log p / 2 = -w A / 2 with w = 1.28 and 1.0.
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.28, -1.0]], dtype=D))


def test_k3_requires_reference_when_beta_positive():
    logprobs, old, _, mask, adv, _ = make_batch()
    with pytest.raises(ValueError, match="ref_logprobs"):
        get_policy_loss("grpo")(logprobs, old, adv, mask, GRPOConfig(beta=0.1), LossNormalizer(6, 10))


def test_k3_hand_value():
    # r = ref - logp = ln 2: k3 = 2 - ln 2 - 1 on the single token; on-policy so pg term = -A.
    logprobs = torch.tensor([[-1.0]], dtype=D)
    ref = logprobs + math.log(2.0)
    loss, metrics = get_policy_loss("gpg")(logprobs, logprobs, torch.tensor([0.0], dtype=D), torch.ones(1, 1, dtype=D),
                                           GPGConfig(beta=0.5), LossNormalizer(1, 1), ref_logprobs=ref)
    assert metrics["policy/kl_ref"].item() == pytest.approx(1.0 - math.log(2.0), rel=1e-14)
    assert loss.item() == pytest.approx(0.5 * (1.0 - math.log(2.0)), rel=1e-14)


def test_k3_clamp_caps_the_value_and_stops_the_gradient_of_wild_tokens():
    """Reference-KL gradient of one token per row, beta = 1, token-mean over 3 tokens, A = 0 (GPG's
    -A log pi adds nothing). d/d log pi of k3 = exp(r) - r - 1, r = ref - log pi, is 1 - exp(r):
    -3.27e6 at r = 15 with the clamp off; 0 with the default cap 10 (k3(15) > 10 is replaced by the
    constant 10); rows with k3 below the cap (r = 2: 4.39, r = -0.5: 0.107) are unchanged."""
    logprobs = torch.tensor([[-20.0], [-3.0], [-1.0]], dtype=D, requires_grad=True)
    r = torch.tensor([15.0, 2.0, -0.5], dtype=D)
    ref = logprobs.detach() + r.unsqueeze(1)
    zero_adv = torch.zeros(3, dtype=D)
    bare_k3 = [math.exp(x) - x - 1 for x in r.tolist()]
    bare_grad = [(1 - math.exp(x)) / 3 for x in r.tolist()]
    cases = {
        0.0: (sum(bare_k3) / 3, bare_grad),
        10.0: ((10.0 + bare_k3[1] + bare_k3[2]) / 3, [0.0, bare_grad[1], bare_grad[2]]),
    }
    assert GPGConfig().kl_clamp == 10.0
    for clamp, (expected_kl, expected_grad) in cases.items():
        logprobs.grad = None
        loss, metrics = get_policy_loss("gpg")(logprobs, logprobs.detach(), zero_adv, torch.ones(3, 1, dtype=D),
                                               GPGConfig(beta=1.0, kl_clamp=clamp), LossNormalizer(3, 3), ref_logprobs=ref)
        loss.backward()
        assert metrics["policy/kl_ref"].item() == pytest.approx(expected_kl, rel=1e-14)
        torch.testing.assert_close(logprobs.grad, torch.tensor(expected_grad, dtype=D).unsqueeze(1), rtol=1e-14, atol=0)
    assert bare_grad[0] * 3 == pytest.approx(-3.269e6, rel=1e-3)  # the figure
    with pytest.raises(ValueError, match=r"GPGConfig\.kl_clamp"):
        GPGConfig(kl_clamp=-1.0)


def test_k3_without_cap_still_guards_the_log_ratio():
    """``kl_clamp = 0`` removes the value cap, not the +-20 guard on r = ref - log pi: at r = 25
    (and -25) k3 is exp(20) - 20 - 1 (exp(-20) + 20 - 1) by hand, with no gradient; at r = 15,
    inside the guard, the bare formula and its gradient 1 - exp(15)."""
    from quatro_nemo.algos.kl import k3_kl

    logprobs = torch.tensor([-30.0, -1.0, -30.0], dtype=D, requires_grad=True)
    r = torch.tensor([25.0, -25.0, 15.0], dtype=D)
    kl = k3_kl(logprobs, logprobs.detach() + r, clamp=0.0)
    kl.sum().backward()
    expected = [math.exp(20) - 21, math.exp(-20) + 19, math.exp(15) - 16]
    assert kl.tolist() == pytest.approx(expected, rel=1e-14)
    assert logprobs.grad.tolist() == pytest.approx([0.0, 0.0, 1 - math.exp(15)], rel=1e-14, abs=0)


def test_shape_and_config_errors():
    logprobs, old, _, mask, adv, _ = make_batch()
    with pytest.raises(ValueError, match="QuatroConfig"):
        get_policy_loss("quatro")(logprobs, old, adv, mask, GRPOConfig(), LossNormalizer(6, 10))
    with pytest.raises(ValueError, match="advantages"):
        get_policy_loss("grpo")(logprobs, old, adv[:3], mask, GRPOConfig(beta=0.0), LossNormalizer(6, 10))


# ---------------------------------------------------------------- micro-batch additivity

def _merge(parts):
    merged = {}
    for metrics in parts:
        for key, value in metrics.items():
            if key not in merged:
                merged[key] = value.clone()
            elif key.endswith("/max"):
                merged[key] = torch.maximum(merged[key], value)
            elif key.endswith("/min"):
                merged[key] = torch.minimum(merged[key], value)
            else:
                merged[key] = merged[key] + value
    return merged


LOSS_CASES = [(name, {}) for name in ALGORITHMS] + [
    ("grpo", {"loss_agg_mode": "seq-mean-token-mean"}),
    ("grpo", {"loss_agg_mode": "seq-mean-token-sum"}),
    ("quatro", {"log_ratio": "seq_mean", "clip_low": 0.1, "clip_high": 0.1, "log_ratio_clamp": 0.5}),
    ("quatro", {"loss_agg_mode": "token-mean"}),
    ("dapo", {"clip_ratio_c": 1.3, "kl_clamp": 0.05}),
]


@pytest.mark.parametrize("name,overrides", LOSS_CASES, ids=[f"{n}-{sorted(o)}" for n, o in LOSS_CASES])
def test_micro_batch_split_is_exact(name, overrides):
    spec = get_algorithm(name)
    config = spec.config_cls(**{"beta": 0.05, **overrides})
    logprobs, old, ref, mask, adv, entropy = make_batch(num_seqs=10, length=7, seed=9, spread=0.5, empty_row=4)
    from quatro_nemo.algos import count_sequences, count_tokens
    normalizer = LossNormalizer(count_sequences(mask), count_tokens(mask))  # 0-dim tensors, as after an all-reduce
    whole_loss, whole_metrics = spec.policy_loss(logprobs, old, adv, mask, config, normalizer, ref_logprobs=ref, entropy=entropy)
    whole_grad, = torch.autograd.grad(whole_loss, logprobs)
    split_loss = torch.zeros((), dtype=D)
    parts = []
    for rows in (slice(0, 3), slice(3, 5), slice(5, 10)):
        part_loss, part_metrics = spec.policy_loss(logprobs[rows], old[rows], adv[rows], mask[rows], config, normalizer,
                                                   ref_logprobs=ref[rows], entropy=entropy[rows])
        split_loss = split_loss + part_loss
        parts.append(part_metrics)
    split_grad, = torch.autograd.grad(split_loss, logprobs)
    assert split_loss.item() == pytest.approx(whole_loss.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(split_grad, whole_grad, rtol=1e-12, atol=1e-15)
    merged = _merge(parts)
    assert merged.keys() == whole_metrics.keys()
    for key, value in whole_metrics.items():
        assert value.dim() == 0 and not value.requires_grad, key
        torch.testing.assert_close(merged[key], value, rtol=1e-12, atol=1e-14, msg=key)
    assert abs(whole_loss.item()) > 1e-6 and whole_grad.abs().sum().item() > 1e-6  # not trivially zero


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_all_padding_micro_batch_is_neutral(name):
    """A micro-batch of padding rows adds 0 to the loss and every additive metric, and the
    identities of max/min (-inf/+inf) to the extremal ones, so merging it changes nothing."""
    spec = get_algorithm(name)
    logprobs, old, ref, _, adv, entropy = make_batch(num_seqs=3, length=4, seed=12)
    empty = torch.zeros(3, 4, dtype=D)
    loss, metrics = spec.policy_loss(logprobs, old, adv, empty, spec.config_cls(), LossNormalizer(5, 17),
                                     ref_logprobs=ref, entropy=entropy)
    loss.backward()
    assert loss.item() == 0.0 and logprobs.grad.abs().max().item() == 0.0
    for key, value in metrics.items():
        if key.endswith("/max"):
            assert value.item() == float("-inf"), key
        elif key.endswith("/min"):
            assert value.item() == float("inf"), key
        else:
            assert value.item() == 0.0, key


def _poison_masked(values, mask):
    """``values`` with NaN, -inf and +inf in turn at the masked positions (a row's padding)."""
    poison = torch.tensor([float("nan"), float("-inf"), float("inf")], dtype=values.dtype)
    fill = poison[torch.arange(values.numel()) % 3].view(values.shape)
    return torch.where(mask.bool(), values.detach(), fill)


def test_aggregation_ignores_nan_and_inf_at_masked_positions():
    """Masked entries contribute exactly 0 in every mode, as the clean values' sums by hand show;
    ``v * 0`` would be NaN."""
    from quatro_nemo.algos.aggregation import aggregate_sequences, aggregate_tokens

    values = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=D)
    poisoned = _poison_masked(values, mask).requires_grad_(True)
    normalizer = LossNormalizer(num_sequences=4, num_tokens=5.0)   # global counts: other ranks' rows too
    expected = {"token-mean": (1 + 2 + 8) / 5, "seq-mean-token-mean": ((1 + 2) / 2 + 8 / 1) / 4,
                "seq-mean-token-sum": (1 + 2 + 8) / 4}
    for mode, value in expected.items():
        poisoned.grad = None
        result = aggregate_tokens(poisoned, mask, mode, normalizer)
        result.backward()
        assert result.item() == pytest.approx(value, rel=1e-15), mode
        assert torch.isfinite(poisoned.grad).all() and (poisoned.grad[mask == 0] == 0).all(), mode
    sequences = torch.tensor([3.0, float("nan"), float("-inf")], dtype=D)   # rows 1 and 2 have no tokens
    row_mask = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]], dtype=D)
    assert aggregate_sequences(sequences, row_mask, normalizer).item() == pytest.approx(3.0 / 4, rel=1e-15)


@pytest.mark.parametrize("name,overrides", LOSS_CASES, ids=[f"{n}-{sorted(o)}" for n, o in LOSS_CASES])
def test_nan_and_inf_at_masked_positions_leave_every_loss_unchanged(name, overrides):
    """NaN/-inf/+inf in the log-probs, old and reference log-probs and entropies wherever the mask
    is 0 (an empty row included): the loss, its gradient and every metric equal the clean
    batch's, and no gradient reaches a masked position."""
    spec = get_algorithm(name)
    config = spec.config_cls(**{"beta": 0.05, **overrides})
    logprobs, old, ref, mask, adv, entropy = make_batch(num_seqs=10, length=7, seed=9, spread=0.5, empty_row=4)
    normalizer = LossNormalizer.from_mask(mask)
    clean_loss, clean_metrics = spec.policy_loss(logprobs, old, adv, mask, config, normalizer,
                                                 ref_logprobs=ref, entropy=entropy)
    clean_grad, = torch.autograd.grad(clean_loss, logprobs)
    poisoned = _poison_masked(logprobs, mask).requires_grad_(True)
    loss, metrics = spec.policy_loss(poisoned, _poison_masked(old, mask), adv, mask, config, normalizer,
                                     ref_logprobs=_poison_masked(ref, mask), entropy=_poison_masked(entropy, mask))
    grad, = torch.autograd.grad(loss, poisoned)
    assert loss.item() == pytest.approx(clean_loss.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad, clean_grad, rtol=1e-12, atol=1e-15)
    assert (grad[mask == 0] == 0).all()
    assert metrics.keys() == clean_metrics.keys()
    for key, value in clean_metrics.items():
        torch.testing.assert_close(metrics[key], value, rtol=1e-12, atol=1e-15, msg=key)


def test_normalizer_rejects_non_positive_counts():
    with pytest.raises(ValueError, match="num_sequences"):
        LossNormalizer(0, 5)
    with pytest.raises(ValueError, match="num_tokens"):
        LossNormalizer(2, -1.0)
