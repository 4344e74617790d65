"""Flip rate and per-difficulty improvement (paper App. C.7, "Flip Rate Analysis").

Problems are bucketed by the base model's number of correct samples out of 256 with bin edges
[0, 8, 32, 128, 256] ("very hard", "hard", "medium", "easy"): bucket b holds counts in
[edge_b, edge_{b+1}), the last bucket also holds 256. When a problem has n != 256 samples its
count is rescaled to c * 256 / n before bucketing, so the buckets keep their meaning as success
rates.

- A problem *flips* when the base model has no correct sample and the trained model at least
  one. flip rate = flipped / base-unsolved problems (per bucket; only the first bucket can hold
  base-unsolved problems, and the overall figure is reported too).
- improvement rate (per bucket) = fraction of problems whose trained success rate c'/n' exceeds
  the base rate c/n; mean delta = mean of (c'/n' - c/n), i.e. the change in pass@1.
"""
from __future__ import annotations

import dataclasses
from typing import List, Sequence

import numpy as np

DEFAULT_BUCKET_EDGES = (0, 8, 32, 128, 256)
BUCKET_NAMES = ("very hard", "hard", "medium", "easy")


@dataclasses.dataclass
class FlipBucket:
    name: str
    low: int                      # inclusive, in counts out of 256
    high: int                     # exclusive (inclusive for the last bucket)
    num_problems: int
    num_base_unsolved: int
    num_flipped: int
    flip_rate: float              # NaN when no base-unsolved problem
    improvement_rate: float       # NaN when the bucket is empty
    mean_pass1_delta: float       # NaN when the bucket is empty


def bucket_index(base_correct: np.ndarray, base_n: np.ndarray,
                 edges: Sequence[int] = DEFAULT_BUCKET_EDGES) -> np.ndarray:
    """Bucket of each problem from its base correct count, on the 256-sample scale."""
    edges = np.asarray(edges, dtype=np.float64)
    if edges.ndim != 1 or edges.size < 2 or np.any(np.diff(edges) <= 0):
        raise ValueError(f"bucket edges must be strictly increasing, got {edges.tolist()}")
    scaled = np.asarray(base_correct, dtype=np.float64) * edges[-1] / np.asarray(base_n, dtype=np.float64)
    idx = np.searchsorted(edges, scaled, side="right") - 1
    return np.clip(idx, 0, edges.size - 2)


def flip_rate_by_bucket(base_correct: Sequence[int], base_n: Sequence[int],
                        trained_correct: Sequence[int], trained_n: Sequence[int],
                        edges: Sequence[int] = DEFAULT_BUCKET_EDGES) -> List[FlipBucket]:
    """Per-bucket flip and improvement rates for problems aligned by index (App. C.7).

    Args:
        base_correct, base_n: [P] correct counts and sample counts of the base model.
        trained_correct, trained_n: [P] the same for the trained model, same problem order.
    """
    base_c = np.asarray(base_correct, dtype=np.int64)
    base_n_arr = np.asarray(base_n, dtype=np.int64)
    tr_c = np.asarray(trained_correct, dtype=np.int64)
    tr_n = np.asarray(trained_n, dtype=np.int64)
    if not (base_c.shape == base_n_arr.shape == tr_c.shape == tr_n.shape):
        raise ValueError("base and trained arrays must have the same length (one entry per problem)")
    buckets = bucket_index(base_c, base_n_arr, edges)
    unsolved = base_c == 0
    flipped = unsolved & (tr_c > 0)
    delta = tr_c / tr_n - base_c / base_n_arr
    names = BUCKET_NAMES if len(edges) == 5 else tuple(f"bucket {b}" for b in range(len(edges) - 1))
    out = []
    for b in range(len(edges) - 1):
        sel = buckets == b
        num, num_unsolved = int(sel.sum()), int((sel & unsolved).sum())
        num_flipped = int((sel & flipped).sum())
        out.append(FlipBucket(
            name=names[b], low=int(edges[b]), high=int(edges[b + 1]),
            num_problems=num, num_base_unsolved=num_unsolved, num_flipped=num_flipped,
            flip_rate=num_flipped / num_unsolved if num_unsolved else float("nan"),
            improvement_rate=float((delta[sel] > 0).mean()) if num else float("nan"),
            mean_pass1_delta=float(delta[sel].mean()) if num else float("nan"),
        ))
    return out


def bucket_range(bucket: dict) -> str:
    """'[8,32)' for a bucket dict; the last bucket (high = 256) is closed: '[128,256]'."""
    closing = "]" if bucket["high"] == DEFAULT_BUCKET_EDGES[-1] else ")"
    return f"[{bucket['low']},{bucket['high']}{closing}"


def overall_flip_rate(base_correct: Sequence[int], trained_correct: Sequence[int]) -> float:
    """Flipped / base-unsolved over all problems; NaN when the base model solves every problem."""
    base_c = np.asarray(base_correct)
    unsolved = base_c == 0
    if not unsolved.any():
        return float("nan")
    return float((np.asarray(trained_correct)[unsolved] > 0).mean())
