"""Exact per-query dual solve of QUATRO's trust-region problem, vectorised over all queries.

quatro-math.md Sec. 1-3 (paper Eq. 11, 13, 15, 19). For one query with rewards R_1..R_N the
dual ``f(lam) = lam * delta + lam * log mean_j exp(R_j / lam)`` is convex with
``f'(lam) = delta - KL(softmax(R / lam) || uniform_N)``, so ``lam*`` is the root of

    KL(softmax(R / lam) || uniform_N) = delta.                                        (Sec. 2)

We work with the range-normalised rewards ``z = (R - max R) / (max R - min R)`` in [-1, 0] and
the inverse temperature ``b = range / lam``: ``KL(b)`` is increasing in ``b`` with
``dKL / d log b = b^2 Var_w(z)`` (w = softmax(b z)) and ``KL(b) <= b^2 / 8`` (Var of a
variable in [-1, 0] is at most 1/4), which gives a guaranteed lower bracket. The root is found by
Newton's method on ``log b`` safeguarded by bisection, one batched tensor op per iteration and no
loop over queries. The advantage is then (Eq. 15)

    A_i = R_i / lam - log mean_j exp(R_j / lam) = log(N * w_i),

so ``mean_i exp(A_i) = 1`` and ``KL = sum_i w_i A_i``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

import torch

# Relative tolerance under which a group's reward range counts as zero (all rewards equal).
CONSTANT_RTOL = 1e-12
# Newton/bisection stops once every active query's step in log b is below this (a Newton step
# of 1e-9 leaves an error of order 1e-18; bisection steps shrink the bracket to that width).
LOG_B_TOL = 1e-9
# [choice] floor on lambda relative to the reward range: |A| stays below about 1 / 0.1 = 10
# (GRPO's |A| for 1 wrong of 8 is 2.5), and queries clamped here are counted as inactive.
DEFAULT_LAMBDA_MIN = 0.1


@dataclass
class DualSolution:
    """Result of :func:`solve_dual` (all float64 except the masks).

    lam:        [B] lambda*; lambda_min * range for inactive queries; 0 for constant groups.
    mu:         [B] mu* from Eq. 19 (lam + mu = lam * log mean exp(R / lam)); R for constant groups.
    advantages: [B, N] A = (R - (lam + mu)) / lam (Eq. 15); 0 for constant groups.
    kl:         [B] KL(softmax(R / lam) || uniform) achieved (= delta when the constraint binds).
    constant:   [B] bool, all N rewards equal (no information, A = 0).
    inactive:   [B] bool, the constraint cannot bind above the floor: lambda clamped.
    iterations: safeguarded-Newton iterations used (the slowest query's).
    """

    lam: torch.Tensor
    mu: torch.Tensor
    advantages: torch.Tensor
    kl: torch.Tensor
    constant: torch.Tensor
    inactive: torch.Tensor
    iterations: int


def check_rewards(rewards: torch.Tensor) -> None:
    """Raise ValueError unless ``rewards`` is a finite ``[B, N]`` tensor with N >= 2."""
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 2:
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a [B, N] tensor (B prompts, N responses), got {shape}")
    if rewards.shape[1] < 2:
        raise ValueError(f"rewards needs N >= 2 responses per prompt, got N = {rewards.shape[1]}")
    finite_rows = torch.isfinite(rewards).all(dim=1)
    if not bool(finite_rows.all()):
        bad = torch.nonzero(~finite_rows).flatten().tolist()
        raise ValueError(f"rewards contain non-finite values in prompt row(s) {bad}")


class _Moments:
    """KL(w || uniform) and its slope, for all rows at once, from each row's reward distribution.

    A row is given as atoms z_k <= 0 (max exactly 0) with probabilities q_k: either every sample
    (q = 1/N) or, when every row takes only two values, the two atoms {-1, 0} with their
    frequencies (the dual depends on the rewards only through their empirical distribution).
    With e_k = exp(b z_k) <= 1 and s_m = sum_k q_k e_k z_k^m (one batched GEMV):

        log mean_j exp(b z_j) = log s_0,   KL = b s_1 / s_0 - log s_0,   dKL/dlog b = b^2 Var_w(z).
    """

    def __init__(self, atoms: torch.Tensor, probs: torch.Tensor) -> None:
        self.atoms = atoms
        self.weighted_powers = torch.stack([probs, probs * atoms, probs * atoms * atoms], dim=2)  # [B, K, 3]
        self.exp_buffer = torch.empty_like(atoms)

    def variance_at_zero(self) -> torch.Tensor:
        """Var of z under q (the b -> 0 limit of Var_w(z)), [B]."""
        s = self.weighted_powers.sum(dim=1)
        return (s[:, 2] - s[:, 1] ** 2).clamp_min(0.0)

    def __call__(self, log_b: torch.Tensor):
        """Return (KL, dKL/dlog b, log mean_j exp(b z_j)), each [B]."""
        b = torch.exp(log_b)
        torch.mul(self.atoms, b.unsqueeze(1), out=self.exp_buffer)
        self.exp_buffer.exp_()
        s = torch.bmm(self.exp_buffer.unsqueeze(1), self.weighted_powers).squeeze(1)  # [B, 3]
        mean_z = s[:, 1] / s[:, 0]
        var_z = (s[:, 2] / s[:, 0] - mean_z ** 2).clamp_min(0.0)
        log_mean_exp = torch.log(s[:, 0])
        return b * mean_z - log_mean_exp, b ** 2 * var_z, log_mean_exp


def _reward_distribution(r: torch.Tensor, r_min: torch.Tensor, r_max: torch.Tensor, z: torch.Tensor):
    """(atoms [B, K], probs [B, K]) of each row's z: two atoms {-1, 0} when every row is
    two-valued (binary verifier rewards; K = 2 makes the solve O(B)), else the N samples."""
    at_max = r == r_max.unsqueeze(1)
    if bool((at_max | (r == r_min.unsqueeze(1))).all()):
        frac_max = at_max.sum(dim=1).to(r.dtype) / r.shape[1]
        atoms = torch.tensor([-1.0, 0.0], dtype=r.dtype, device=r.device).expand(r.shape[0], 2)
        return atoms.contiguous(), torch.stack([1.0 - frac_max, frac_max], dim=1)
    return z, torch.full_like(z, 1.0 / r.shape[1])


def solve_dual(
    rewards: torch.Tensor,
    delta: Union[float, torch.Tensor],
    lambda_min: float = DEFAULT_LAMBDA_MIN,
    max_iter: int = 100,
) -> DualSolution:
    """Solve ``lam*_q = argmin_{lam >= 0} f_q(lam)`` (Eq. 11) for every query q at once.

    Args:
        rewards:    [B, N] rewards, N >= 2, finite (ValueError naming the bad rows otherwise).
        delta:      trust-region radius, float or [B] tensor, > 0.
        lambda_min: floor on lambda relative to each group's reward range (max - min) [choice];
                    a query whose KL at the floor is still <= delta is clamped there (``inactive``).
        max_iter:   cap on safeguarded-Newton iterations (typically 5-10 are used).

    Returns a :class:`DualSolution` in float64, finite everywhere.
    """
    check_rewards(rewards)
    if not (isinstance(lambda_min, (int, float)) and math.isfinite(lambda_min) and lambda_min > 0):
        raise ValueError(f"lambda_min must be a finite number > 0, got {lambda_min!r}")
    r = rewards.detach().to(torch.float64)
    num_prompts, n = r.shape
    delta_t = torch.as_tensor(delta, dtype=torch.float64, device=r.device)
    if delta_t.dim() == 0:
        delta_t = delta_t.expand(num_prompts)
    if delta_t.shape != (num_prompts,) or not bool((torch.isfinite(delta_t) & (delta_t > 0)).all()):
        raise ValueError(f"delta must be a finite float > 0 or a [B={num_prompts}] tensor of them")

    r_min, r_max = torch.aminmax(r, dim=1)
    r_range = r_max - r_min
    scale = torch.maximum(r_max.abs(), r_min.abs()).clamp_min(torch.finfo(r.dtype).tiny)
    constant = r_range <= CONSTANT_RTOL * scale
    # z in [-1, 0] with max exactly 0; constant rows divide by inf so their z is exactly 0.
    z_divisor = torch.where(constant, torch.full_like(r_range, math.inf), r_range)
    z = (r - r_max.unsqueeze(1)).div_(z_divisor.unsqueeze(1))

    kl_stats = _Moments(*_reward_distribution(r, r_min, r_max, z))
    # Bracket in log b (b = range / lam): KL(b) <= b^2 / 8 so b_lo = sqrt(2 delta) has KL <= delta / 4.
    log_lo = 0.5 * torch.log(2.0 * delta_t)
    log_hi = torch.full_like(log_lo, -math.log(lambda_min))
    kl_hi, _, _ = kl_stats(log_hi)
    inactive = (~constant) & (kl_hi <= delta_t)
    active = (~constant) & (~inactive)
    log_lo = torch.minimum(log_lo, log_hi)

    # Start from the small-KL expansion KL ~ b^2 Var_uniform(z) / 2.
    var_u = kl_stats.variance_at_zero().clamp_min(torch.finfo(r.dtype).tiny)
    log_b = (0.5 * torch.log(2.0 * delta_t / var_u)).clamp(min=log_lo, max=log_hi)
    iterations = 0
    for iterations in range(1, max_iter + 1):
        kl, slope, _ = kl_stats(log_b)
        excess = kl - delta_t
        # Keep the bracket: KL increasing in log b.
        log_lo = torch.where(excess < 0, log_b, log_lo)
        log_hi = torch.where(excess > 0, log_b, log_hi)
        newton = log_b - excess / slope.clamp_min(torch.finfo(r.dtype).tiny)
        midpoint = 0.5 * (log_lo + log_hi)
        inside = (newton >= log_lo) & (newton <= log_hi) & torch.isfinite(newton)
        next_log_b = torch.where(inside, newton, midpoint)
        step = (next_log_b - log_b).abs()
        log_b = next_log_b
        if not bool(((step > LOG_B_TOL) & active).any()):
            break

    log_b = torch.where(inactive, torch.full_like(log_b, -math.log(lambda_min)), log_b)
    kl, _, log_mean_exp = kl_stats(log_b)
    b = torch.exp(log_b)
    # Eq. 15: A_i = R_i / lam - log mean_j exp(R_j / lam) = b z_i - log mean_j exp(b z_j);
    # constant rows have z = 0 and offset 0, hence A = 0 exactly.
    offset = torch.where(constant, torch.zeros_like(log_mean_exp), log_mean_exp)
    advantages = torch.addcmul(-offset.unsqueeze(1), z, b.unsqueeze(1))
    lam = r_range / b
    # Eq. 19: lam + mu = lam * log mean_j exp(R_j / lam) = R_max + lam * log mean_j exp(b z_j).
    mu = r_max + lam * log_mean_exp - lam

    zero = torch.zeros_like(lam)
    return DualSolution(
        lam=torch.where(constant, zero, lam),
        mu=torch.where(constant, r_max, mu),
        advantages=advantages,
        kl=torch.where(constant, zero, kl),
        constant=constant,
        inactive=inactive,
        iterations=iterations,
    )
