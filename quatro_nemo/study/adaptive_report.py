"""The adaptive-delta study's report.md and figures (:mod:`quatro_nemo.study.adaptive`).

A function of the kept metrics and the study config only, so ``report_only=true`` rewrites it.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Sequence

from quatro_nemo.eval.plots import pyplot
from quatro_nemo.eval.tables import markdown_table as _table
from quatro_nemo.eval.tables import to_jsonable
from quatro_nemo.study.adaptive import (FULL_EVALUATION_NOTE, AdaptivePlan, adaptive_kmax, evaluate_adaptive_claims,
                                        retention)
from quatro_nemo.study.analysis import (Study, claims_to_json, final_metric, load_base, load_runs, mean_over_training,
                                        peak_over_training, trust_region_rows, trust_region_to_json)
from quatro_nemo.study.config import DEFAULT_CONDITION, StudyConfig, flat_fields
from quatro_nemo.study.plan import StudyPlan
from quatro_nemo.study.render import (band, claim_lines, finish_frontier_panel, fmt_stat, fmt_value, info_lines,
                                      plot_trust_region, power_lines, save_figure, top_p_label, trust_region_lines)


def _frontier_points(study: Study, task: str, kmax: int, key: str, top_p: float):
    """(fixed-delta points sorted by delta, strategy points): (label, pass@1 stat, key stat)."""
    plan: AdaptivePlan = study.plan.adaptive
    points = {}
    for arm in plan.arms():
        setting = plan.settings[(task, DEFAULT_CONDITION, arm)]
        x = study.stat(setting, plan.seeds, final_metric("pass@1", top_p))
        y = study.stat(setting, plan.seeds, final_metric(key, top_p))
        if x is not None and y is not None:
            points[arm] = (x, y)
    fixed = [(arm, *points[arm]) for arm, _ in sorted(plan.fixed.items(), key=lambda item: item[1]) if arm in points]
    strategies = [(arm, *points[arm]) for arm in plan.strategies if arm in points]
    return fixed, strategies


def plot_frontier(study: Study, kmax: int, path: str) -> bool:
    """Per task: pass@1 against pass@kmax and against UCC@kmax at the default condition; the
    fixed-delta sweep as a line (each point labelled), every strategy as a marker, the base model
    as a star; error bars are the std over seeds."""
    plt = pyplot()
    plan: AdaptivePlan = study.plan.adaptive
    p = study.claim_top_p
    keys = [f"pass@{kmax}", f"ucc@{kmax}"]
    fig, axes = plt.subplots(len(plan.tasks), len(keys), figsize=(5.0 * len(keys), 4.0 * len(plan.tasks)),
                             squeeze=False)
    drawn = False
    for row, task in enumerate(plan.tasks):
        for col, key in enumerate(keys):
            ax = axes[row, col]
            fixed, strategies = _frontier_points(study, task, kmax, key, p)
            if fixed:
                ax.errorbar([x.mean for _, x, _ in fixed], [y.mean for _, _, y in fixed],
                            xerr=[x.std for _, x, _ in fixed], yerr=[y.std for _, _, y in fixed],
                            marker="o", ms=4, color="C0", label="fixed delta")
                for arm, x, y in fixed:
                    ax.annotate(arm.split("=")[1], (x.mean, y.mean), fontsize=7, xytext=(3, 3),
                                textcoords="offset points")
                drawn = True
            for i, (arm, x, y) in enumerate(strategies):
                ax.errorbar([x.mean], [y.mean], xerr=[x.std], yerr=[y.std], marker="D^sv"[i % 4], ms=7, ls="none",
                            color=f"C{i + 1}", label=arm)
                drawn = True
            finish_frontier_panel(ax, study, p, key, f"{task} reward: {key} vs pass@1, {top_p_label(p)}")
    if drawn:
        axes[0, 0].legend(fontsize=7)
    save_figure(fig, plt, path)
    return drawn


def plot_radius(study: Study, path: str) -> bool:
    """The radius over training of every strategy (mean over seeds), one panel per task, one line
    per condition: the controller's delta, or the per-query rule's mean delta_q."""
    plt = pyplot()
    plan: AdaptivePlan = study.plan.adaptive
    fig, axes = plt.subplots(1, len(plan.tasks), figsize=(5.0 * len(plan.tasks), 3.6), squeeze=False)
    drawn = False
    for ax, task in zip(axes.flat, plan.tasks):
        color = 0
        for strategy in plan.strategies:
            for condition in plan.conditions:
                curve = study.curve(plan.settings[(task, condition, strategy)], plan.seeds, "quatro/delta/mean")
                if curve is not None:
                    band(ax, *curve, label=f"{strategy}, {condition}", color=f"C{color % 10}")
                    drawn = True
                color += 1
        ax.set_yscale("log")
        ax.set_xlabel("rollout step")
        ax.set_ylabel("mean delta over non-constant groups")
        ax.set_title(f"{task} reward: the adaptive radius", fontsize=9)
        ax.grid(alpha=0.3)
    if drawn:
        axes.flat[0].legend(fontsize=6)
    save_figure(fig, plt, path)
    return drawn


def write_figures(study: Study, out_dir: str) -> Dict[str, str]:
    paths = {}
    kmax = adaptive_kmax(study)
    if kmax and plot_frontier(study, kmax, os.path.join(out_dir, "frontier.png")):
        paths["frontier"] = "frontier.png"
    if plot_radius(study, os.path.join(out_dir, "radius.png")):
        paths["radius"] = "radius.png"
    if plot_trust_region(study, trust_region_rows(study), os.path.join(out_dir, "trust_region.png")):
        paths["trust_region"] = "trust_region.png"
    return paths


def _arm_rows(study: Study, task: str, condition: str, kmax) -> List[List[str]]:
    plan: AdaptivePlan = study.plan.adaptive
    p = study.claim_top_p
    keys = ["reward/mean", "pass@1"] + ([f"pass@{kmax}", f"ucc@{kmax}"] if kmax and condition == DEFAULT_CONDITION
                                        else [])
    rows = []
    for arm in plan.arms():
        setting = plan.settings[(task, condition, arm)]
        s = lambda extract, digits=3: fmt_stat(study.stat(setting, plan.seeds, extract), digits)  # noqa: E731
        radius = f"{plan.fixed[arm]:g}" if arm in plan.fixed else s(mean_over_training("quatro/delta/mean"), 4)
        rows.append([arm, str(len(study.group(setting, plan.seeds)))] + [s(final_metric(k, p)) for k in keys]
                    + [s(final_metric("entropy", p)), radius,
                       s(mean_over_training("quatro/tr_inactive_frac")), s(peak_over_training("policy/kl_old"), 4)])
    header = ["arm", "seeds", "final reward"] + keys[1:] + ["final entropy", "mean radius (training)",
                                                            "inactive TR fraction", "peak KL-to-old"]
    return [header] + rows


def _retention_lines(study: Study, task: str) -> List[str]:
    plan: AdaptivePlan = study.plan.adaptive
    tolerance = study.cfg.adaptive.tolerance
    rows = []
    for arm in plan.arms():
        row = [arm]
        for condition in plan.conditions[1:]:
            kept = retention(study, task, condition, arm)
            row.append("-" if kept is None else f"{kept:.3f}" + (" BREAKS" if kept < tolerance else ""))
        rows.append(row)
    return (["Final held-out reward under stress / at the default condition (mean over seeds; "
             f"BREAKS below {tolerance:g}):", ""]
            + _table(["arm"] + list(plan.conditions[1:]), rows))


def to_markdown(study: Study, claims: Sequence[Any], figures: Dict[str, str], info: Dict[str, Any]) -> str:
    cfg, plan = study.cfg, study.plan
    ad: AdaptivePlan = plan.adaptive
    kmax = adaptive_kmax(study)
    missing = [n for n in plan.runs if n not in study.runs]
    strategies = ", ".join(f"`{name}` ({', '.join(f'{k}={v}' for k, v in flat_fields(fields).items())})"
                           for name, fields in cfg.adaptive.strategies.items())
    stress = ", ".join(f"`{name}` ({', '.join(f'{k}={v:g}' for k, v in values.items())})"
                       for name, values in cfg.adaptive.stress.items())
    lines = [f"# QUATRO with an adaptive trust-region radius: study `{cfg.name}` (issue 19)", "",
             f"{len(study.runs)} of {len(plan.runs)} runs finished"
             + (f" ({len(missing)} missing or failed: {', '.join(missing)})" if missing else "") + ". "
             f"Training config `{cfg.train_config}` with {' '.join(cfg.train_overrides) or 'no study-wide overrides'}; "
             f"default lr {plan.defaults.lr:g}, default K {plan.defaults.inner_loops}.", ""]
    lines += info_lines(cfg, info)
    lines += [f"**Arms.** Fixed delta in {sorted(ad.fixed.values())}; strategies {strategies}, each one setting for "
              f"every task and condition. **Tasks** (`task.reward`): {', '.join(ad.tasks)}. **Conditions**: the default, "
              f"and the stress settings {stress}. **Seeds** {ad.seeds}, paired across arms (same warm-start, prompt "
              f"order and evaluation draw).", "",
              f"**Evaluation.** {cfg.evaluation.num_problems} held-out problems; {FULL_EVALUATION_NOTE} "
              f"({cfg.evaluation.n_samples} / {cfg.evaluation.sweep_n_samples or cfg.evaluation.n_samples} samples). "
              f"A response is correct when its reward is 1 (exact), on both tasks, so pass@k and UCC@k mean the same "
              f"on both; the final reward of the graded task includes partial credit. Claims at {top_p_label(study.claim_top_p)}.",
              "", "**Statistics.** Paired t test over seeds of per-seed differences (95% interval), Holm-corrected "
              f"within each claim, significant at Holm p < {cfg.alpha:g} (docs/study.md).", ""]
    lines += ["## Claims", ""] + claim_lines(claims) + power_lines(cfg, claims)
    for task in ad.tasks:
        lines += [f"## Task `{task}`", ""]
        for condition in ad.conditions:
            header, *rows = _arm_rows(study, task, condition, kmax)
            lines += [f"### {condition} ({top_p_label(study.claim_top_p)})", ""] + _table(header, rows)
        if len(ad.conditions) > 1:
            lines += _retention_lines(study, task)
    for key, title in (("frontier", "The accuracy / diversity frontier"), ("radius", "The adaptive radius over training")):
        if key in figures:
            lines += [f"## {title}", "", f"![{key}]({figures[key]})", ""]
    base = study.base.get(study.claim_top_p)
    if base and kmax:
        lines += [f"Base model ({top_p_label(study.claim_top_p)}): pass@1 {fmt_value(base.get('pass@1'))}, pass@{kmax} "
                  f"{fmt_value(base.get(f'pass@{kmax}'))}, UCC@{kmax} {fmt_value(base.get(f'ucc@{kmax}'))}.", ""]
    lines += trust_region_lines(trust_region_rows(study), figures)
    return "\n".join(lines)


def write_adaptive_report(cfg: StudyConfig, plan: StudyPlan, study_dir: str, out_dir: str,
                          info: Dict[str, Any]) -> Dict[str, Any]:
    """Load the kept metrics of ``study_dir``, test the claims, write report.md / report.json / PNGs."""
    study = Study(cfg, plan, load_runs(study_dir, list(plan.runs)), load_base(study_dir))
    claims = evaluate_adaptive_claims(study)
    info = dict(info, scale_note=cfg.description or None)
    os.makedirs(out_dir, exist_ok=True)
    figures = write_figures(study, out_dir)
    with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(to_markdown(study, claims, figures, info))
    ad: AdaptivePlan = plan.adaptive
    summary = {"study": cfg.name, "kind": cfg.kind, "info": info, "claims": claims_to_json(claims),
               "retention": {task: {c: {arm: retention(study, task, c, arm) for arm in ad.arms()}
                                    for c in ad.conditions[1:]} for task in ad.tasks},
               "runs": {name: {"finished": name in study.runs, "overrides": list(spec.overrides)}
                        for name, spec in plan.runs.items()}}
    trust_region = trust_region_rows(study)
    if trust_region:          # runs that logged the achieved KL (algorithm.log_achieved_kl)
        summary["trust_region"] = trust_region_to_json(trust_region)
    with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(to_jsonable(summary), f, indent=1, allow_nan=False)
    paths = {"markdown": os.path.join(out_dir, "report.md"), "json": os.path.join(out_dir, "report.json"),
             **{k: os.path.join(out_dir, v) for k, v in figures.items()}}
    return {"paths": paths, "claims": claims, "study": study}
