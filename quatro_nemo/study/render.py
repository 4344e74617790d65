"""What the study reports share (report.py, adaptive_report.py): number formats, figure helpers,
the claim tables, the power table and the wall-time lines."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from quatro_nemo.algos.step_state import ACHIEVED_KL
from quatro_nemo.eval.tables import markdown_table
from quatro_nemo.eval.plots import pyplot
from quatro_nemo.study.analysis import (TRUST_REGION_COLUMNS, Claim, Stat, Study, TrustRegionRow,
                                        trust_region_groups)
from quatro_nemo.study.stats import NOT_TESTED, PairedTest, is_not_run, paired_power, seeds_for_power


def fmt_stat(s: Optional[Stat], digits: int = 3) -> str:
    """mean ± std over seeds (the report's tables; the claims carry the 95% intervals)."""
    if s is None:
        return "-"
    return f"{s.mean:.{digits}f}" if s.n == 1 else f"{s.mean:.{digits}f} ± {s.std:.{digits}f}"


def fmt_value(x: Any, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def fmt_interval(bounds: Optional[Tuple[float, float]]) -> str:
    """A simultaneous interval (stats.simultaneous_intervals); an infinite end as -inf / +inf."""
    if bounds is None:
        return "-"
    return "[" + ", ".join(f"{b:+.4f}" if math.isfinite(b) else ("+inf" if b > 0 else "-inf") for b in bounds) + "]"


def top_p_label(top_p: float) -> str:
    return f"top-p {top_p:g}"


def band(ax, x, mean, std, label, color):
    """A mean line with a +-1 std band; one colour per method/setting in every panel."""
    ax.plot(x, mean, marker="o", ms=3, label=label, color=color)
    if np.any(std > 0):
        ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.15)


def save_figure(fig, plt, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def finish_frontier_panel(ax, study: Study, top_p: float, key: str, title: str) -> None:
    """A (pass@1, ``key``) frontier panel's base-model star, axis labels, title and grid."""
    base = study.base.get(top_p)
    if base and key in base:
        ax.plot([base["pass@1"]], [base[key]], marker="*", ms=10, color="k", ls="none", label="base model")
    ax.set_xlabel("pass@1")
    ax.set_ylabel(key)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)


def claim_lines(claims: Sequence[Claim]) -> List[str]:
    """The claim table, a partial study's decidable / not-run split, and each claim's comparisons."""
    rows = [[c.id, c.statement, f"**{c.verdict}**", c.summary or "-"] for c in claims]
    lines = partial_study_lines(claims)
    lines += markdown_table(["claim", "statement (as tested here)", "verdict", "numbers"], rows)
    for c in claims:
        if not c.comparisons:
            continue
        lines += [f"### {c.id}: {c.verdict}", "", c.statement + ".", ""]
        if c.note:
            lines += [f"_{c.note}_", ""]
        rows = []
        for x in c.comparisons:
            t = x.test
            detail = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in x.detail.items())
            if isinstance(t, PairedTest):
                rows.append([x.label, f"{t.mean:+.4f}", f"[{t.low:+.4f}, {t.high:+.4f}]", fmt_interval(x.simultaneous),
                             f"{t.p_value:.3g}", f"{x.p_adjusted:.3g}", fmt_value(x.tost_p_adjusted, 3), x.outcome, detail])
            else:
                rows.append([x.label, "-", "-", "-", "-", "-", "-", x.outcome, detail])
        header = ["vs / effect", "mean difference (> 0 supports)", "95% CI (paired t)",
                  "simultaneous 95% CI (Holm-compatible)", "p", "Holm p"]
        lines += markdown_table(header + [f"TOST Holm p (margin ±{c.margin:g})" if c.margin else "TOST", "outcome",
                                          "details"], rows)
    return lines


def partial_study_lines(claims: Sequence[Claim]) -> List[str]:
    """Of a study stopped before its end (some claim NOT RUN): which claims its finished runs
    decide (every run of the claim finished for every seed of its design) and which not; nothing
    for a complete study."""
    missing = [c for c in claims if is_not_run(c.verdict)]
    if not missing:
        return []
    decided = [c.id for c in claims if not is_not_run(c.verdict) and c.verdict != NOT_TESTED]
    untested = [c.id for c in claims if c.verdict == NOT_TESTED]
    return [f"**Partial study.** Decided from the runs present (every run of the claim finished for every seed its "
            f"design states): {', '.join(decided) or 'none'}. NOT RUN (fewer complete paired seeds than designed; "
            "not decided on fewer): " + ", ".join(f"{c.id} ({c.verdict[len('NOT RUN ('):-1]})" for c in missing)
            + "." + (f" NOT TESTED (nothing to test in this design): {', '.join(untested)}." if untested else ""), ""]


def power_lines(cfg, claims: Sequence[Claim]) -> List[str]:
    """The design's power, claim by claim (stats.paired_power): each family's size m and the paired
    seeds n its design states (a claim without a stated design: its fewest paired seeds), the
    power of Holm's first step against a ``power_effect_sd`` effect, and the seeds
    ``power_target`` needs (stats.seeds_for_power). A claim NOT RUN is listed at its design."""
    rows = []
    for c in claims:
        tests = [x.test for x in c.comparisons if isinstance(x.test, PairedTest)]
        n = c.design_seeds if c.design_seeds is not None else min((t.n for t in tests), default=None)
        if not c.family_size or n is None or (c.design_seeds is None and not tests):
            continue
        m = c.family_size
        rows.append([c.id, str(m), str(n), f"{paired_power(cfg.power_effect_sd, n, m, cfg.alpha):.2f}",
                     str(seeds_for_power(cfg.power_effect_sd, m, cfg.alpha, cfg.power_target)),
                     "-" if c.margin is None else f"±{c.margin:g}"])
    if not rows:
        return []
    return [f"**Power.** A paired t test over n seeds, Holm over a family of m, first step at alpha / m = "
            f"{cfg.alpha:g} / m, against a true effect of {cfg.power_effect_sd:g} standard deviations of the per-seed "
            f"difference (noncentral t; a lower bound for the family's other steps); the seeds it needs for power "
            f"{cfg.power_target:g}; and the claim's equivalence margin (TOST), stated before the runs.", ""] + markdown_table(
        ["claim", "family m", "paired seeds n", f"power at {cfg.power_effect_sd:g} sd",
         f"seeds for power {cfg.power_target:g}", "TOST margin"], rows)


def info_lines(cfg, info: Dict[str, Any]) -> List[str]:
    lines = []
    total = info.get("total_wall_minutes")
    if total is not None:
        count = info.get("training_invocations", 1)
        lines += [f"Wall time: {total:.1f} min over the {count} invocation(s) that trained runs, with {cfg.workers} "
                  f"training processes at a time (budget {cfg.time_budget_minutes:g} min"
                  + (", EXCEEDED" if total > cfg.time_budget_minutes else "") + ").", ""]
    if info.get("collected_from"):
        lines += [f"Runs collected from the sweep directory `{info['collected_from']}`.", ""]
    if info.get("scale_note"):
        lines += [f"**Scale.** {info['scale_note']}", ""]
    return lines


def plot_trust_region(study: Study, rows: Sequence[TrustRegionRow], path: str) -> bool:
    """The achieved trust-region KL over training (mean ± std over seeds), one panel per part of
    :func:`~quatro_nemo.study.analysis.trust_region_rows` (the delta sweep, each stress point),
    one line per setting with its delta dashed in the same colour; log scale."""
    parts = list(dict.fromkeys(row.part for row in rows))
    if not parts:
        return False
    plt = pyplot()
    fig, axes = plt.subplots(1, len(parts), figsize=(5.0 * len(parts), 3.8), squeeze=False)
    groups = {(part, label): (setting, seeds) for part, label, setting, seeds in trust_region_groups(study)}
    for ax, part in zip(axes.flat, parts):
        for i, row in enumerate(r for r in rows if r.part == part):
            setting, seeds = groups[(part, row.label)]
            curve = study.curve(setting, seeds, ACHIEVED_KL)
            if curve is not None:
                band(ax, *curve, label=f"{row.label} (delta {row.delta:g})", color=f"C{i % 10}")
            ax.axhline(row.delta, color=f"C{i % 10}", ls="--", lw=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("rollout step")
        ax.set_ylabel("achieved trust-region KL (dashed: delta)")
        ax.set_title("delta sweep" if part == "deltas" else f"stress point {part}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    save_figure(fig, plt, path)
    return True


def trust_region_lines(rows: Sequence[TrustRegionRow], figures: Dict[str, str]) -> List[str]:
    """Issue 29: does QUATRO's radius bound the step? The achieved KL against delta per setting;
    nothing when no run logged it (runs before ``algorithm.log_achieved_kl``)."""
    if not rows:
        return []
    columns = list(TRUST_REGION_COLUMNS)
    table = [[row.part, row.label, f"{row.delta:g}", str(row.runs)]
             + [fmt_stat(row.stats[c], 3 if "/" in c or "multiplier" in c else 5) for c in columns] for row in rows]
    lines = ["## The trust region where the step is taken", "",
             "QUATRO's delta is the KL of each prompt's target pi* (Eq. 11); the step the optimizer takes towards it "
             "is set by the learning rate. Per training step the loop measures the achieved trust-region KL of the "
             "update (mean over the prompts whose rewards are not all equal; `trust_region/achieved_kl`), its largest "
             "prompt's (`_max`) and achieved / delta. Per run: the median and the max over its training steps; each "
             "cell mean ± std over seeds. With `lr_control.kind=kl_adaptive` the learning rate is scaled so that the "
             "achieved KL stays within [delta / 2, 2 delta] (algos/lr_control.py).", ""]
    lines += markdown_table(["part", "setting", "delta", "runs"] + columns, table)
    if "trust_region" in figures:
        lines += [f"![trust region]({figures['trust_region']})", ""]
    return lines
