"""The study report: report.md (claim table first, then the evidence), report.json and PNGs."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from quatro_nemo.eval.plots import _pyplot
from quatro_nemo.eval.tables import _markdown_table as _table
from quatro_nemo.eval.tables import to_jsonable
from quatro_nemo.study.config import QUATRO
from quatro_nemo.study.analysis import (Claim, Stat, Study, base_metric, claims_to_json, entropy_retention,
                                        final_metric, identical_methods, ks_of, mean_over_training,
                                        peak_over_training)


def _fmt(s: Optional[Stat], digits: int = 3) -> str:
    if s is None:
        return "-"
    return f"{s.mean:.{digits}f}" if s.n == 1 else f"{s.mean:.{digits}f} ± {s.std:.{digits}f}"


# --------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------


def _band(ax, x, mean, std, label, color):
    """A mean line with a +-1 std band; one colour per method/setting in every panel."""
    ax.plot(x, mean, marker="o", ms=3, label=label, color=color)
    if np.any(std > 0):
        ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.15)


def plot_at_k(study: Study, prefix: str, ylabel: str, path: str) -> bool:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    drawn = False
    for i, (name, setting) in enumerate(study.plan.compare.items()):
        ks = sorted({k for run in study.group(setting, study.plan.seeds) for k in ks_of(run.final, prefix)})
        stats = [study.stat(setting, study.plan.seeds, final_metric(f"{prefix}{k}")) for k in ks]
        pairs = [(k, s) for k, s in zip(ks, stats) if s is not None]
        if pairs:
            _band(ax, [k for k, _ in pairs], np.array([s.mean for _, s in pairs]), np.array([s.std for _, s in pairs]), name, f"C{i}")
            drawn = True
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def plot_curves(study: Study, settings: Dict[str, Any], seeds: Sequence[int], keys: Sequence[str],
                titles: Sequence[str], path: str) -> bool:
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(4.6 * len(keys), 3.5), squeeze=False)
    drawn = False
    for ax, key, title in zip(axes.flat, keys, titles):
        for i, (label, setting) in enumerate(settings.items()):
            curve = study.curve(setting, seeds, key)
            if curve is not None:
                _band(ax, *curve, label=str(label), color=f"C{i}")
                drawn = True
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("rollout step")
        ax.grid(alpha=0.3)
    if drawn:
        axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def plot_sweep(study: Study, sweep: Dict[str, Dict[Any, Any]], axis_label: str, path: str, log_x: bool) -> bool:
    plt = _pyplot()
    panels = [("final held-out reward", final_metric("reward/mean")), ("final held-out entropy", final_metric("entropy")),
              ("clipped fraction (mean over training)", lambda r: mean_over_training(r, "policy/clip_frac"))]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    drawn = False
    for ax, (title, extract) in zip(axes, panels):
        for i, (name, axis) in enumerate(sweep.items()):
            points = [(x, study.stat(s, study.plan.sweep_seeds, extract)) for x, s in sorted(axis.items())]
            points = [(x, s) for x, s in points if s is not None]
            if points:
                _band(ax, [x for x, _ in points], np.array([s.mean for _, s in points]),
                      np.array([s.std for _, s in points]), name, f"C{i}")
                drawn = True
        if log_x:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(axis_label)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    if drawn:
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def plot_advantages(table: Dict[float, Dict[str, List[float]]], path: str) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for delta, t in sorted(table.items()):
        line, = axes[0].plot(t["c"], t["a_correct"], marker="o", ms=3, label=f"delta={delta:g} correct")
        axes[0].plot(t["c"], t["a_wrong"], marker="x", ms=3, ls="--", color=line.get_color(), label=f"delta={delta:g} wrong")
        axes[1].plot(t["c"], t["lambda"], marker="o", ms=3, label=f"delta={delta:g}")
    axes[0].axhline(0, color="k", lw=0.5)
    axes[0].set_title("QUATRO advantage vs number of correct responses (exact)", fontsize=9)
    axes[1].set_title("lambda* vs number of correct responses", fontsize=9)
    for ax in axes:
        ax.set_xlabel("correct responses c (of N)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_figures(study: Study, advantages, out_dir: str) -> Dict[str, str]:
    plan, paths = study.plan, {}

    def keep(name: str, drawn: bool) -> None:
        if drawn:
            paths[name] = f"{name}.png"

    p = lambda name: os.path.join(out_dir, f"{name}.png")  # noqa: E731
    keep("pass_at_k", plot_at_k(study, "pass@", "held-out Pass@k", p("pass_at_k")))
    keep("ucc_at_k", plot_at_k(study, "ucc@", "held-out UCC@k", p("ucc_at_k")))
    keep("training", plot_curves(study, plan.compare, plan.seeds, ["reward/mean", "entropy", "policy/clip_frac"],
                                 ["rollout reward", "policy entropy (rollouts)", "clipped fraction"], p("training")))
    keep("stability_inner_loops", plot_sweep(study, plan.sweep_inner, "inner loops K", p("stability_inner_loops"), True))
    keep("stability_lr", plot_sweep(study, plan.sweep_lr, "learning rate x default", p("stability_lr"), True))
    keep("logratio_ablation", plot_curves(
        study, {f"log_ratio={g}": s for g, s in plan.ablation.items()}, plan.ablation_seeds,
        ["reward/mean", "policy/kl_old"], ["rollout reward", "KL(pi_old || pi_theta) over the inner loops"],
        p("logratio_ablation")))
    keep("lambda", plot_curves(
        study, {f"delta={d:g}": s for d, s in sorted(plan.deltas.items())}, plan.delta_seeds,
        ["quatro/lambda/mean", "quatro/lambda/p50"], ["mean lambda* over prompts", "median lambda*"], p("lambda")))
    plot_advantages(advantages, p("advantage_vs_correct"))
    paths["advantage_vs_correct"] = "advantage_vs_correct.png"
    return paths


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------


def _claim_lines(claims: Sequence[Claim]) -> List[str]:
    rows = [[c.id, c.statement, f"**{c.verdict}**", c.summary or "-"] for c in claims]
    lines = _table(["claim", "statement (as tested here)", "verdict", "numbers"], rows)
    for c in claims:
        if not c.comparisons:
            continue
        lines += [f"### {c.id}: {c.verdict}", "", c.statement + ".", ""]
        if c.note:
            lines += [f"_{c.note}_", ""]
        lines += _table(["vs / effect", "difference (> 0 supports the claim)", "std. error", "outcome", "details"],
                        [[x.label, f"{x.diff:+.4f}", "-" if x.se is None else f"{x.se:.4f}", x.outcome,
                          ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in x.detail.items())]
                         for x in c.comparisons])
    return lines


def _compare_rows(study: Study, kmax: Optional[int]) -> List[List[str]]:
    """One row per method (final held-out numbers), after a row for the base model (step 0, the
    same model and evaluation draw for every method; taken from QUATRO's runs)."""
    quatro = study.plan.compare[QUATRO]
    b = lambda key: _fmt(study.stat(quatro, study.plan.seeds, base_metric(key)))  # noqa: E731
    rows = [["base model (step 0)", "-", b("reward/mean"), "-", b("pass@1")]
            + ([b(f"pass@{kmax}"), b(f"ucc@{kmax}")] if kmax else []) + [b("ucr"), b("entropy"), "-", "-"]]
    for name, setting in study.plan.compare.items():
        s = lambda extract: study.stat(setting, study.plan.seeds, extract)  # noqa: E731
        row = [name, str(len(study.group(setting, study.plan.seeds))), _fmt(s(base_metric("reward/mean"))),
               _fmt(s(final_metric("reward/mean"))), _fmt(s(final_metric("pass@1")))]
        if kmax:
            row += [_fmt(s(final_metric(f"pass@{kmax}"))), _fmt(s(final_metric(f"ucc@{kmax}")))]
        row += [_fmt(s(final_metric("ucr"))), _fmt(s(final_metric("entropy"))), _fmt(s(entropy_retention)),
                _fmt(s(lambda r: mean_over_training(r, "policy/clip_frac")))]
        rows.append(row)
    return rows


def _sweep_rows(study: Study, sweep, axis_name: str) -> List[List[str]]:
    rows = []
    for name, axis in sweep.items():
        for x, setting in sorted(axis.items()):
            s = lambda extract: study.stat(setting, study.plan.sweep_seeds, extract)  # noqa: E731
            rows.append([name, f"{x:g}", _fmt(s(final_metric("reward/mean"))), _fmt(s(final_metric("entropy"))),
                         _fmt(s(lambda r: mean_over_training(r, "policy/clip_frac"))),
                         _fmt(s(lambda r: peak_over_training(r, "policy/kl_old")), 4)])
    return rows


def to_markdown(study: Study, claims: Sequence[Claim], advantages, figures: Dict[str, str],
                info: Dict[str, Any]) -> str:
    cfg, plan = study.cfg, study.plan
    kmax = study.kmax()
    missing = [n for n in plan.runs if n not in study.runs]
    lines = [f"# QUATRO vs baselines at CPU scale: study `{cfg.name}`", "",
             f"{len(study.runs)} of {len(plan.runs)} runs finished"
             + (f" ({len(missing)} missing or failed: {', '.join(missing)})" if missing else "") + ". "
             f"Training config `{cfg.train_config}` with {' '.join(cfg.train_overrides) or 'no study-wide overrides'}; "
             f"default lr {plan.defaults.lr:g}, default K {plan.defaults.inner_loops}. Every method sees the same "
             "prompts, rollout budget (prompts x responses per step, steps) and evaluation.", ""]
    if info.get("wall_minutes") is not None:
        total, count = info.get("total_wall_minutes"), info.get("training_invocations", 1)
        spread = (f"; {total:.1f} min in all, over the {count} invocations that trained runs"
                  if total is not None and count > 1 else "")
        which = "the last invocation that trained runs" if info.get("report_rebuilt") else "this invocation"
        lines += [f"Wall time of {which}: {info['wall_minutes']:.1f} min{spread}, with {cfg.workers} "
                  f"training processes at a time (budget {cfg.time_budget_minutes:g} min).", ""]
    if info.get("scale_note"):
        lines += [f"**Scale.** {info['scale_note']}", ""]
    lines += [f"Seeds: main comparison {plan.seeds}; sweeps {plan.sweep_seeds}; ablation {plan.ablation_seeds}; "
              f"deltas {plan.delta_seeds}. Values are mean ± sample std over seeds. A difference counts when it "
              f"exceeds {cfg.noise_z:g} standard error(s), from the seed-to-seed spread pooled over the main "
              "comparison's methods. Verdicts: REPRODUCED (holds against every baseline), PARTLY (holds against "
              "some, reversed against none), NOT REPRODUCED, NOT TESTED (runs missing).", "",
              "## Claims", ""]
    lines += _claim_lines(claims)
    lines += ["## 1-3. Main comparison (default settings)", ""]
    twins = identical_methods(study)
    if twins:
        lines += ["**Identical results.** " + ", ".join(f"{a} = {b}" for a, b in twins) + ": these methods ended "
                  "with the same held-out numbers for every seed. Likely cause: with K = 1 and one optimizer step per "
                  "rollout batch every update is on-policy (all ratios 1, nothing clipped), where these losses have "
                  "the same gradient; they differ only off-policy (see the sweeps).", ""]
    header = ["method", "seeds", "base reward", "final reward", "pass@1"]
    if kmax:
        header += [f"pass@{kmax}", f"ucc@{kmax}"]
    header += ["UCR", "final entropy", "entropy last/first", "clip frac"]
    lines += _table(header, _compare_rows(study, kmax))
    if kmax:
        ks = ks_of(next(iter(study.runs.values())).final, "pass@") if study.runs else []
        rows = [[name] + [_fmt(study.stat(s, plan.seeds, final_metric(f"pass@{k}"))) for k in ks]
                for name, s in plan.compare.items()]
        lines += ["Held-out Pass@k:", ""] + _table(["method"] + [f"k={k}" for k in ks], rows)
        rows = [[name] + [_fmt(study.stat(s, plan.seeds, final_metric(f"ucc@{k}"))) for k in ks]
                for name, s in plan.compare.items()]
        lines += ["Held-out UCC@k:", ""] + _table(["method"] + [f"k={k}" for k in ks], rows)
    for key in ("pass_at_k", "ucc_at_k", "training"):
        if key in figures:
            lines += [f"![{key}]({figures[key]})", ""]
    lines += ["## 4. Stability sweeps", "",
              "One axis at a time from the default: inner loops K at the default learning rate, and learning-rate "
              "multipliers at K = 1. 'clip frac': mean fraction of clipped ratios over training (methods that clip).",
              ""]
    sweep_header = ["method", "", "final reward", "final entropy", "clip frac", "peak KL-to-old"]
    lines += ["### Inner loops K", ""] + _table([sweep_header[0], "K"] + sweep_header[2:],
                                                 _sweep_rows(study, plan.sweep_inner, "K"))
    if "stability_inner_loops" in figures:
        lines += [f"![inner loops]({figures['stability_inner_loops']})", ""]
    lines += ["### Learning rate", ""] + _table([sweep_header[0], "lr x"] + sweep_header[2:],
                                                _sweep_rows(study, plan.sweep_lr, "lr"))
    if "stability_lr" in figures:
        lines += [f"![learning rate]({figures['stability_lr']})", ""]
    lines += [f"## 5. Log-ratio ablation (delta = {cfg.ablation.delta:g}, K = {cfg.ablation.inner_loops})", ""]
    rows = []
    for g, s in plan.ablation.items():
        st = lambda extract: study.stat(s, plan.ablation_seeds, extract)  # noqa: E731
        rows.append([g, _fmt(st(final_metric("reward/mean"))), _fmt(st(lambda r: mean_over_training(r, "policy/kl_old")), 4),
                     _fmt(st(lambda r: peak_over_training(r, "policy/kl_old")), 4), _fmt(st(final_metric("entropy")))])
    lines += _table(["log_ratio", "final reward", "mean KL-to-old", "peak KL-to-old", "final entropy"], rows)
    if "logratio_ablation" in figures:
        lines += [f"![log-ratio ablation]({figures['logratio_ablation']})", ""]
    lines += ["## 6. QUATRO diagnostics", "", "### lambda over training", ""]
    rows = [[f"{d:g}", _fmt(study.stat(s, plan.delta_seeds, lambda r: mean_over_training(r, "quatro/lambda/mean")), 4),
             _fmt(study.stat(s, plan.delta_seeds, lambda r: mean_over_training(r, "quatro/tr_inactive_frac")))]
            for d, s in sorted(plan.deltas.items())]
    lines += _table(["delta", "mean lambda* (over training)", "inactive TR fraction"], rows)
    if "lambda" in figures:
        lines += [f"![lambda]({figures['lambda']})", ""]
    lines += ["### Advantage vs number of correct responses (exact, binary rewards)", ""]
    deltas = sorted(advantages)
    cs = advantages[deltas[0]]["c"]
    rows = [[c] + [f"{advantages[d]['a_correct'][i]:.3f} / {advantages[d]['a_wrong'][i]:.3f}" for d in deltas]
            for i, c in enumerate(cs)]
    lines += _table(["c correct"] + [f"delta={d:g}: A(correct) / A(wrong)" for d in deltas], rows)
    lines += [f"![advantage vs correct]({figures['advantage_vs_correct']})", ""]
    return "\n".join(lines)


def write_study_report(study: Study, claims: Sequence[Claim], advantages, out_dir: str,
                       info: Dict[str, Any]) -> Dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    figures = write_figures(study, advantages, out_dir)
    markdown = to_markdown(study, claims, advantages, figures, info)
    with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(markdown)
    summary = {"study": study.cfg.name, "info": info, "claims": claims_to_json(claims),
               "runs": {name: {"finished": name in study.runs, "overrides": list(spec.overrides)}
                        for name, spec in study.plan.runs.items()},
               "advantages": {str(d): t for d, t in advantages.items()}}
    with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(to_jsonable(summary), f, indent=1, allow_nan=False)
    return {"markdown": os.path.join(out_dir, "report.md"), "json": os.path.join(out_dir, "report.json"),
            **{k: os.path.join(out_dir, v) for k, v in figures.items()}}
