"""PNG figures of an evaluation report: Pass@k curves (log-k axis, paper Fig./Tab. II), UCC@k
bars (Tab. 3), distributions of pairwise similarity among correct responses (App. C.5) and
flip-rate bars by base-difficulty bucket (App. C.7, Fig. IV)."""
from __future__ import annotations

import math
import os
from typing import Any, Dict, List

import numpy as np

from quatro_nemo.eval.flip import bucket_range as _bucket_range
from quatro_nemo.eval.tables import AVERAGE


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (the figures of every report)."""
    import matplotlib

    matplotlib.use("Agg")                       # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_pass_at_k(report: Dict[str, Any], path: str) -> None:
    plt = pyplot()
    runs = report["runs"]
    sections = [AVERAGE] + sorted({b for r in runs.values() for b in r["benchmarks"]})
    cols = min(4, len(sections))
    rows = math.ceil(len(sections) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax, section in zip(axes.flat, sections):
        for name, run in runs.items():
            s = run[AVERAGE] if section == AVERAGE else run["benchmarks"].get(section)
            if not s:
                continue
            ks = [k for k, v in s["pass@k"].items() if not math.isnan(v)]
            ax.plot(ks, [s["pass@k"][k] for k in ks], marker="o", ms=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(section)
        ax.set_xlabel("k")
        ax.set_ylabel("Pass@k")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(sections):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _grouped_bars(ax: Any, groups: List[str], series: Dict[str, List[float]]) -> None:
    width = 0.8 / max(1, len(series))
    x = np.arange(len(groups))
    for i, (name, values) in enumerate(series.items()):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, np.nan_to_num(values), width, label=name)
    ax.set_xticks(x)
    ax.set_xticklabels(groups, fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def plot_ucc_at_k(report: Dict[str, Any], path: str) -> None:
    plt = pyplot()
    runs = report["runs"]
    ks = next(iter(runs.values()))["ucc_ks"]
    fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(ks) * max(1, len(runs)) / 2), 3.5))
    _grouped_bars(ax, [f"k={k}" for k in ks], {name: [run[AVERAGE]["ucc@k"][k] for k in ks]
                                               for name, run in runs.items()})
    ax.set_ylabel(f"UCC@k ({report['config']['ucc_metric']} >= {report['config']['ucc_threshold']})")
    ax.set_title("Unique correct count, average over benchmarks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_similarity(report: Dict[str, Any], path: str) -> bool:
    """Histograms of the per-problem mean pairwise similarity among correct responses."""
    metrics = list(report["config"]["pairwise_metrics"])
    if not metrics:
        return False
    plt = pyplot()
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.6 * len(metrics), 3), squeeze=False)
    for ax, metric in zip(axes.flat, metrics):
        for name, run in report["runs"].items():
            values = [p["similarity"][metric] for p in run["problems"] if metric in p["similarity"]]
            if values:
                ax.hist(values, bins=20, range=(0, 1), alpha=0.5, label=name)
        ax.set_title(metric)
        ax.set_xlabel("mean pairwise similarity (correct)")
    axes.flat[0].set_ylabel("problems")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_flip_rate(report: Dict[str, Any], path: str) -> bool:
    flips = report.get("flip") or {}
    if not flips:
        return False
    plt = pyplot()
    first = next(iter(flips.values()))["buckets"]
    groups = [f"{b['name']}\n{_bucket_range(b)}" for b in first]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5), gridspec_kw={"width_ratios": [1, 3]})
    _grouped_bars(ax1, ["flip rate"], {name: [f["flip_rate"]] for name, f in flips.items()})
    ax1.set_title(f"base-unsolved -> solved (base: {report['config']['base_run']})", fontsize=9)
    _grouped_bars(ax2, groups, {name: [b["improvement_rate"] for b in f["buckets"]] for name, f in flips.items()})
    ax2.set_title("fraction of problems whose pass@1 improved, by base difficulty", fontsize=9)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_plots(report: Dict[str, Any], out_dir: str) -> Dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = {"pass_at_k": os.path.join(out_dir, "pass_at_k.png"), "ucc_at_k": os.path.join(out_dir, "ucc_at_k.png")}
    plot_pass_at_k(report, paths["pass_at_k"])
    plot_ucc_at_k(report, paths["ucc_at_k"])
    if plot_similarity(report, os.path.join(out_dir, "similarity.png")):
        paths["similarity"] = os.path.join(out_dir, "similarity.png")
    if plot_flip_rate(report, os.path.join(out_dir, "flip_rate.png")):
        paths["flip_rate"] = os.path.join(out_dir, "flip_rate.png")
    return paths
