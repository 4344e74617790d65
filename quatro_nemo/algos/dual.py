"""Exact per-query dual solve of QUATRO's trust-region problem, vectorised over all queries.

quatro-math.md Sec. 1-3 (paper Eq. 11, 13, 15, 19). For one query with rewards R_1..R_N the
dual ``f(lam) = lam * delta + lam * log mean_j exp(R_j / lam)`` is convex with
``f'(lam) = delta - KL(softmax(R / lam) || uniform_N)``, so ``lam*`` is the root of

    KL(softmax(R / lam) || uniform_N) = delta.                                        (Sec. 2)

We work with the range-normalised rewards ``z = (R - max R) / (max R - min R)`` in [-1, 0] and
the inverse temperature ``b = range / lam``. With ``s_m(b) = mean_j exp(b z_j) z_j^m``,

    KL(b) = b s_1 / s_0 - log s_0,   dKL/db = b Var_w(z) > 0   (w = softmax(b z)),

and ``KL(b) <= b^2 / 8`` (Var of a variable in [-1, 0] is at most 1/4) gives a guaranteed lower
bracket ``b_lo = sqrt(2 delta)``; the floor ``lambda_min`` gives the upper one.

Each pass over the [B, N] rewards computes the power sums s_0 .. s_{M-1} at one point b0. Since
``s_m(b0 + eps) = sum_j eps^j / j! s_{m+j}(b0)`` and |z| <= 1, the truncated series is exact to
``|eps|^(M-m) / (M-m)! e^|eps|`` relative to s_0, so Newton's method runs on it ([B]-sized
arithmetic) instead of on further passes; a pass is an exp and a few multiply-sums, the cost of
GRPO's mean and std. Large batches take a float32 phase (7 sums, radius 0.2 in b: the small-KL
start is usually that close) and then one float64 pass (4 sums, radius 2e-5) from its root, which
is exact in float64; small batches, where Python's overhead dominates, one float64 phase with a
long expansion (18 sums, radius 1). A row whose root lies beyond the radius is moved by a
bracketed Newton step and expanded again; the test of the floor (lambda_min) is done in float64
for the rows whose root may lie beyond it.
The advantage is then (Eq. 15)

    A_i = R_i / lam - log mean_j exp(R_j / lam) = log(N * w_i),

so ``mean_i exp(A_i) = 1`` and ``KL = sum_i w_i A_i``.

With a sampler k steps behind (quatro-math.md Sec. 9.3) the samples carry importance weights and
every ``mean_j`` above becomes ``sum_j w̄_j`` under their per-prompt normalisation w̄ (``weights``):
the same solve on another base measure (the bracket holds under any measure; binary rewards keep
their two atoms, with the weighted frequencies).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

# Relative tolerance under which a group's reward range counts as zero (all rewards equal).
CONSTANT_RTOL = 1e-12


@dataclass(frozen=True)
class _Expansion:
    """How a phase of the solve expands the power sums (see the module docstring)."""

    dtype: torch.dtype
    sums: int             # M: power sums s_0 .. s_{M-1} per pass; s_m is expanded to order M-1-m
    radius: float         # |eps| = |b - b0| within which the truncation error is negligible
    newton_rtol: float    # Newton on the expansion stops once every step is below this times b
    #                       (quadratic convergence: the iterate is then within ~(rtol b)^2 of the root)
    kl_rtol: float        # a row is solved when its iterate is inside the radius with
    #                       |KL - delta| <= kl_rtol delta on the expansion


# The KL's accuracy on an expansion is that of s_1's, order M - 2: its remainder is below
# radius^(M-1) / (M-1)! e^radius of s_0 (s_2 only enters the slope, i.e. Newton's speed).
# Large batches: a float32 pass (exp and sums several times cheaper), remainder 0.2^6 / 6! e^0.2
# < 1.2e-7, about float32's own precision (the small-KL start is usually within 0.2 of the root,
# b ~ 0.1 .. 10), then one float64 pass from its root (within ~1e-5), remainder (2e-5)^3 / 3!
# < 1.4e-15.
FLOAT32_EXPANSION = _Expansion(torch.float32, sums=7, radius=0.2, newton_rtol=1e-5, kl_rtol=1e-7)
FLOAT64_EXPANSION = _Expansion(torch.float64, sums=4, radius=2e-5, newton_rtol=1e-9, kl_rtol=1e-12)
# Small batches, where a pass costs less than Python's overhead: float64 passes of a long
# expansion, remainder 1 / 17! e < 8e-15 over a radius 1 (usually one pass).
WIDE_FLOAT64_EXPANSION = _Expansion(torch.float64, sums=18, radius=1.0, newton_rtol=1e-9, kl_rtol=1e-12)
# Batches with at least this many atoms (B x K) take the float32 + float64 phases.
FLOAT32_MIN_ATOMS = 1 << 16
# Newton on each expansion takes at most this many steps (quadratic convergence: a start within
# the radius needs about five).
NEWTON_STEPS_PER_EXPANSION = 8
# Rows whose first-phase root lies above (1 - FLOOR_DOUBT) b_hi may have their true root beyond
# the floor (float32 roots are accurate to ~1e-5): the floor test is done for them in float64.
FLOOR_DOUBT = 1e-3
# [choice] floor on lambda relative to the reward range: |A| stays below about 1 / 0.1 = 10
# (GRPO's |A| for 1 wrong of 8 is 2.5), and queries clamped here are counted as inactive.
DEFAULT_LAMBDA_MIN = 0.1


@dataclass
class DualSolution:
    """Result of :func:`solve_dual` (all float64 except the masks).

    lam:        [B] lambda*; lambda_min * range for inactive queries; 0 for constant groups.
    mu:         [B] mu* from Eq. 19 (lam + mu = lam * log mean exp(R / lam)); R for constant groups.
    advantages: [B, N] A = (R - (lam + mu)) / lam (Eq. 15); 0 for constant groups.
    kl:         [B] KL(softmax(R / lam) || uniform) achieved (= delta when the constraint binds);
                with weights KL(softmax(R / lam + log w̄) || w̄).
    constant:   [B] bool, all N rewards equal (no information, A = 0).
    inactive:   [B] bool, the constraint cannot bind above the floor: lambda clamped.
    iterations: passes over the rewards, float32 + float64 phases (the slowest query's).
    """

    lam: torch.Tensor
    mu: torch.Tensor
    advantages: torch.Tensor
    kl: torch.Tensor
    constant: torch.Tensor
    inactive: torch.Tensor
    iterations: int


def check_rewards(rewards: torch.Tensor):
    """Raise ValueError unless ``rewards`` is a finite ``[B, N]`` tensor with N >= 2.

    Returns the row minima and maxima ([B] each), which decide finiteness: amin/amax propagate
    NaN and show +-inf, so a row is finite exactly when both are (two reductions, no [B, N] mask).
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 2:
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a [B, N] tensor (B prompts, N responses), got {shape}")
    if rewards.shape[1] < 2:
        raise ValueError(f"rewards needs N >= 2 responses per prompt, got N = {rewards.shape[1]}")
    r_min, r_max = rewards.amin(dim=1), rewards.amax(dim=1)
    finite_rows = torch.isfinite(r_min) & torch.isfinite(r_max)
    if not bool(finite_rows.all()):
        bad = torch.nonzero(~finite_rows).flatten().tolist()
        raise ValueError(f"rewards contain non-finite values in prompt row(s) {bad}")
    return r_min, r_max


@dataclass
class _RewardDistribution:
    """Each row's range-normalised rewards z in [-1, 0] (max exactly 0) as atoms z_k with
    probabilities q_k: either every sample (q = 1/N, ``probs`` a float) or, when every row takes
    only two values, the two atoms {-1, 0} with their frequencies (the dual depends on the rewards
    only through their empirical distribution)."""

    atoms: torch.Tensor                   # [B, K]
    probs: Union[float, torch.Tensor]     # [B, K], or the float 1/N for every sample

    def rows(self, index: torch.Tensor) -> "_RewardDistribution":
        probs = self.probs if isinstance(self.probs, float) else self.probs[index]
        return _RewardDistribution(self.atoms[index], probs)

    def to(self, dtype: torch.dtype) -> "_RewardDistribution":
        probs = self.probs if isinstance(self.probs, float) else self.probs.to(dtype)
        return _RewardDistribution(self.atoms.to(dtype), probs)


def _every_row_two_valued(z: torch.Tensor) -> bool:
    """True if every z is 0 or -1 (each reward is its row's max or min; the min maps to -1
    exactly, as (min - max) / (max - min) rounds symmetrically). z (z + 1) <= 0 on [-1, 0], zero
    only there. Continuous rewards show a third value in the first rows, tested first."""
    for rows in (slice(0, 32), slice(None)):
        block = z[rows]
        if bool(torch.addcmul(block, block, block).any()):
            return False
    return True


def _reward_distribution(z: torch.Tensor, weights: Optional[torch.Tensor] = None) -> _RewardDistribution:
    """Two atoms {-1, 0} when every row is two-valued (binary verifier rewards; K = 2 makes the
    solve O(B)), else the N samples; each sample's probability 1/N, or its normalised weight
    ``weights`` [B, N] (rows summing to 1: Sec. 9.3's base measure w̄)."""
    if _every_row_two_valued(z):
        if weights is None:
            frac_min = z.sum(dim=1).neg_().div_(z.shape[1])  # exact counts of -1
        else:
            frac_min = (z * weights).sum(dim=1).neg_()        # the weight on the -1 atom
        atoms = torch.tensor([-1.0, 0.0], dtype=z.dtype, device=z.device).expand(z.shape[0], 2)
        return _RewardDistribution(atoms.contiguous(), torch.stack([frac_min, 1.0 - frac_min], dim=1))
    return _RewardDistribution(z, 1.0 / z.shape[1] if weights is None else weights)


def _power_sums(distribution: _RewardDistribution, b: torch.Tensor, count: int) -> torch.Tensor:
    """s_m(b) = sum_k q_k exp(b z_k) z_k^m for m = 0 .. count - 1: one pass over [B, K] in the
    distribution's precision; returned as [B, count] float64."""
    terms = torch.mul(distribution.atoms, b.to(distribution.atoms.dtype).unsqueeze(1)).exp_()
    uniform = isinstance(distribution.probs, float)
    if not uniform:
        terms.mul_(distribution.probs)
    sums = [terms.sum(dim=1)]
    for _ in range(1, count):
        sums.append(terms.mul_(distribution.atoms).sum(dim=1))
    sums = torch.stack(sums, dim=1).to(torch.float64)
    return sums * distribution.probs if uniform else sums


def _kl(b: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor):
    """(KL(w || uniform), log mean_j exp(b z_j), E_w[z]) = (b s_1 / s_0 - log s_0, log s_0, s_1 / s_0)
    (Sec. 2)."""
    mean_z = s1 / s0
    log_mean_exp = torch.log(s0)
    return b * mean_z - log_mean_exp, log_mean_exp, mean_z


def _kl_terms(b: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor):
    """(KL, dKL/db = b Var_w(z), log mean_j exp(b z_j)) from the power sums at b."""
    kl, log_mean_exp, mean_z = _kl(b, s0, s1)
    return kl, b * (s2 / s0 - mean_z * mean_z).clamp_min(0.0), log_mean_exp


def _variance(distribution: _RewardDistribution) -> torch.Tensor:
    """Var of z under q ([B], float64): the b -> 0 limit of Var_w(z)."""
    if isinstance(distribution.probs, float):
        mean = distribution.atoms.sum(dim=1) * distribution.probs
        mean_square = (distribution.atoms * distribution.atoms).sum(dim=1) * distribution.probs
    else:
        weighted = distribution.atoms * distribution.probs
        mean, mean_square = weighted.sum(dim=1), (weighted * distribution.atoms).sum(dim=1)
    return (mean_square - mean * mean).to(torch.float64)


class _TaylorModel:
    """:func:`_kl_terms` at b0 + eps from the power sums s_0 .. s_{M-1} at b0 ([B, M] float64),
    by the truncated series s_m(b0 + eps) = sum_{j < M - m} eps^j / j! s_{m+j}(b0), m = 0, 1, 2."""

    def __init__(self, power_sums: torch.Tensor, b0: torch.Tensor) -> None:
        num_sums = power_sums.shape[1]
        self.b0 = b0
        # H[m, j] = s_{m+j}, 0 for m + j >= M: [B, 3, M].
        self.hankel = torch.nn.functional.pad(power_sums, (0, 2)).unfold(1, num_sums, 1).contiguous()
        self.inverse_j = 1.0 / torch.arange(1, num_sums, dtype=b0.dtype, device=b0.device)
        self.ones = torch.ones_like(b0).unsqueeze(1)

    def __call__(self, eps: torch.Tensor):
        coefficients = torch.cat([self.ones, eps.unsqueeze(1) * self.inverse_j], dim=1).cumprod_(dim=1)  # eps^j / j!
        s = torch.bmm(self.hankel, coefficients.unsqueeze(2)).squeeze(2)
        return _kl_terms(self.b0 + eps, s[:, 0], s[:, 1], s[:, 2])


@dataclass
class _Roots:
    """Per-row state of the solve, float64 [B]: b and, from the last expansion, KL and log s_0."""

    b: torch.Tensor
    kl: torch.Tensor
    log_mean_exp: torch.Tensor


def _solve_on_expansions(distribution: _RewardDistribution, delta: torch.Tensor, b_lo: torch.Tensor,
                         b_hi: torch.Tensor, expansion: _Expansion, roots: _Roots, rows: torch.Tensor,
                         max_iter: int):
    """Root of KL(b) = delta in [b_lo, b_hi] for the row indices ``rows``, from ``roots.b``
    (updated in place); ``distribution`` is in the expansion's precision.

    Each iteration is one pass over the pending rows: their power sums at b0. Newton's method
    runs on the Taylor expansion, each iterate clamped to the radius and the bracket; a row whose
    iterate ends strictly inside the radius with |KL - delta| <= kl_rtol delta is solved. For
    the others the expansion (accurate up to the radius) and the value at b0 narrow the bracket
    (KL is increasing in b), and b0 moves by a Newton step from the values at b0, or to the
    bracket's midpoint if that step leaves it. Returns (iterations, rows still pending).
    """
    lo, hi = b_lo.clone(), b_hi.clone()
    pending = rows
    iterations = 0
    while pending.numel() and iterations < max_iter:
        iterations += 1
        full = pending.numel() == roots.b.shape[0]
        b0, target = roots.b[pending], delta[pending]
        row_lo, row_hi = lo[pending], hi[pending]
        model = _TaylorModel(_power_sums(distribution if full else distribution.rows(pending), b0, expansion.sums), b0)
        eps = torch.zeros_like(b0)
        kl0, slope0, _ = model(eps)
        kl, slope = kl0, slope0
        row_lo = torch.where(kl0 < target, b0, row_lo)
        row_hi = torch.where(kl0 > target, b0, row_hi)
        lower = (row_lo - b0).clamp(min=-expansion.radius)
        upper = (row_hi - b0).clamp(max=expansion.radius)
        for step in range(NEWTON_STEPS_PER_EXPANSION):
            newton = (eps - (kl - target) / slope.clamp_min(torch.finfo(torch.float64).tiny)).nan_to_num_(0.0)
            newton = torch.clamp(newton, min=lower, max=upper)
            converged = bool(((newton - eps).abs() <= expansion.newton_rtol * b0).all())
            eps = newton
            if converged or step == NEWTON_STEPS_PER_EXPANSION - 1:
                break
            kl, slope, _ = model(eps)
        kl, _, log_mean_exp = model(eps)
        roots.b[pending], roots.kl[pending], roots.log_mean_exp[pending] = b0 + eps, kl, log_mean_exp
        solved = (eps.abs() < expansion.radius) & ((kl - target).abs() <= expansion.kl_rtol * target)
        # Unsolved: b0 + eps is where the expansion stopped (KL there is accurate) - a bracket end.
        row_lo = torch.where(~solved & (kl < target), torch.maximum(row_lo, b0 + eps), row_lo)
        row_hi = torch.where(~solved & (kl > target), torch.minimum(row_hi, b0 + eps), row_hi)
        pending = pending[~solved]
        if iterations < max_iter and pending.numel():  # else b, KL and log s_0 stay consistent
            newton = b0 - (kl0 - target) / slope0.clamp_min(torch.finfo(torch.float64).tiny)
            next_b0 = torch.where((newton > row_lo) & (newton < row_hi), newton, 0.5 * (row_lo + row_hi))
            roots.b[pending] = next_b0[~solved]
            lo[pending], hi[pending] = row_lo[~solved], row_hi[~solved]
    return iterations, pending


def _kl_at(distribution: _RewardDistribution, b: torch.Tensor, rows: torch.Tensor):
    """(KL, log mean_j exp(b z_j)) at ``b`` [len(rows)] for the row indices ``rows``, in the
    distribution's precision (float64 arithmetic on its power sums)."""
    sums = _power_sums(distribution.rows(rows), b, 2)
    return _kl(b, sums[:, 0], sums[:, 1])[:2]


def normalised_weights(weights: torch.Tensor, num_prompts: int, num_samples: int) -> Optional[torch.Tensor]:
    """Sec. 9.3's per-prompt base measure ``w̄ = w / sum_j w_j`` ([B, N] float64) of non-negative
    sample weights, or None when every row's weights are equal (the uniform measure 1/N: the
    unweighted solve, bit for bit). ValueError for a wrong shape, a negative or non-finite weight
    or a row without weight."""
    if not isinstance(weights, torch.Tensor) or weights.shape != (num_prompts, num_samples):
        shape = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
        raise ValueError(f"weights must be a [B={num_prompts}, N={num_samples}] tensor like the rewards, got {shape}")
    w = weights.detach().to(torch.float64)
    if not bool((torch.isfinite(w) & (w >= 0)).all()):
        raise ValueError("weights must be finite and >= 0")
    total = w.sum(dim=1, keepdim=True)
    if not bool((total > 0).all()):
        bad = torch.nonzero(total.squeeze(1) <= 0).flatten().tolist()
        raise ValueError(f"weights of prompt row(s) {bad} sum to 0")
    if bool((w == w[:, :1]).all()):
        return None
    return w / total


def solve_dual(
    rewards: torch.Tensor,
    delta: Union[float, torch.Tensor],
    lambda_min: float = DEFAULT_LAMBDA_MIN,
    max_iter: int = 100,
    weights: Optional[torch.Tensor] = None,
) -> DualSolution:
    """Solve ``lam*_q = argmin_{lam >= 0} f_q(lam)`` (Eq. 11) for every query q at once.

    Args:
        rewards:    [B, N] rewards, N >= 2, finite (ValueError naming the bad rows otherwise).
        delta:      trust-region radius, float or [B] tensor, > 0.
        lambda_min: floor on lambda relative to each group's reward range (max - min) [choice];
                    a query whose KL at the floor is still <= delta is clamped there (``inactive``).
        max_iter:   cap on the passes of each phase (typically 1-3 in float32, 1 in float64).
        weights:    optional [B, N] non-negative sample weights (a stale sampler's importance
                    weights pi_prox / mu, quatro-math.md Sec. 9.3): the dual's expectation is then
                    under the per-prompt normalised weights w̄ instead of 1/N,
                    ``f(lam) = lam delta + lam log sum_j w̄_j exp(R_j / lam)``, and
                    ``A_i = R_i / lam - log sum_j w̄_j exp(R_j / lam)``, ``kl = KL(q || w̄)`` with
                    ``q = softmax(R / lam + log w̄)``. None, or equal weights in every row, is the
                    unweighted solve bit for bit.

    Returns a :class:`DualSolution` in float64, finite everywhere.
    """
    r_min, r_max = check_rewards(rewards)
    if weights is not None:
        weights = normalised_weights(weights, *rewards.shape)
    if not (isinstance(lambda_min, (int, float)) and math.isfinite(lambda_min) and lambda_min > 0):
        raise ValueError(f"lambda_min must be a finite number > 0, got {lambda_min!r}")
    num_prompts = rewards.shape[0]
    delta_t = torch.as_tensor(delta, dtype=torch.float64, device=rewards.device)
    if delta_t.dim() == 0:
        delta_t = delta_t.expand(num_prompts)
    if delta_t.shape != (num_prompts,) or not bool((torch.isfinite(delta_t) & (delta_t > 0)).all()):
        raise ValueError(f"delta must be a finite float > 0 or a [B={num_prompts}] tensor of them")

    r = rewards.detach()
    r_min, r_max = r_min.to(torch.float64), r_max.to(torch.float64)
    r_range = r_max - r_min
    scale = torch.maximum(r_max.abs(), r_min.abs()).clamp_min(torch.finfo(torch.float64).tiny)
    constant = r_range <= CONSTANT_RTOL * scale
    # z in [-1, 0] with max exactly 0; constant rows divide by inf so their z is exactly 0.
    z_divisor = torch.where(constant, torch.full_like(r_range, math.inf), r_range)
    z = (r.to(torch.float64) - r_max.unsqueeze(1)).div_(z_divisor.unsqueeze(1))
    distribution = _reward_distribution(z, weights)
    large = distribution.atoms.numel() >= FLOAT32_MIN_ATOMS
    phases = (FLOAT32_EXPANSION, FLOAT64_EXPANSION) if large else (WIDE_FLOAT64_EXPANSION,)
    first = distribution.to(phases[0].dtype)

    # Bracket (b = range / lam): KL(b) <= b^2 / 8, so KL(sqrt(2 delta)) <= delta / 4; the floor.
    b_hi = torch.full_like(delta_t, 1.0 / lambda_min)
    b_lo = torch.minimum(torch.sqrt(2.0 * delta_t), b_hi)
    # Start from the small-KL expansion KL ~ b^2 Var_uniform(z) / 2.
    var_u = _variance(first).clamp_min(torch.finfo(torch.float64).tiny)
    start = torch.minimum(torch.maximum(torch.sqrt(2.0 * delta_t / var_u), b_lo), b_hi)
    roots = _Roots(start, torch.zeros_like(start), torch.zeros_like(start))

    # One pass of the first phase over every row solves most of them. Rows left pending, or
    # solved near the floor b_hi, may have their root beyond it: if KL(b_hi) <= delta (float64)
    # the constraint cannot bind there and the row is inactive; the others go on.
    iterations, pending = _solve_on_expansions(first, delta_t, b_lo, b_hi, phases[0], roots,
                                               torch.nonzero(~constant).flatten(), 1)
    near_floor = roots.b >= (1.0 - FLOOR_DOUBT) * b_hi
    near_floor[pending] = True
    candidates = torch.nonzero(near_floor & ~constant).flatten()
    inactive = torch.zeros_like(constant)
    if candidates.numel():
        inactive[candidates] = _kl_at(distribution, b_hi[candidates], candidates)[0] <= delta_t[candidates]
        more, _ = _solve_on_expansions(first, delta_t, b_lo, b_hi, phases[0], roots,
                                       pending[~inactive[pending]], max_iter - 1)
        iterations += more
    active_rows = torch.nonzero(~constant & ~inactive).flatten()
    for expansion in phases[1:]:
        more, _ = _solve_on_expansions(distribution, delta_t, b_lo, b_hi, expansion, roots, active_rows, max_iter)
        iterations += more
    b, kl, log_mean_exp = roots.b, roots.kl, roots.log_mean_exp
    inactive_rows = torch.nonzero(inactive).flatten()
    if inactive_rows.numel():
        b[inactive_rows] = b_hi[inactive_rows]
        kl[inactive_rows], log_mean_exp[inactive_rows] = _kl_at(distribution, b_hi[inactive_rows], inactive_rows)

    # Eq. 15: A_i = R_i / lam - log mean_j exp(R_j / lam) = b z_i - log mean_j exp(b z_j);
    # constant rows have z = 0 and offset 0, hence A = 0 exactly.
    advantages = torch.addcmul(-log_mean_exp.unsqueeze(1), z, b.unsqueeze(1))
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
