"""The study report: report.md (claim table first, then the evidence), report.json and PNGs.

Everything is a function of the kept metrics and the study config, so ``report_only=true`` on the
same metrics writes the same report.md and report.json byte for byte.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from quatro_nemo.eval.plots import pyplot
from quatro_nemo.eval.tables import markdown_table as _table
from quatro_nemo.eval.tables import to_jsonable
from quatro_nemo.study.analysis import (Claim, Study, breaking_points, claims_to_json, entropy_retention, final_metric,
                                        identical_methods, ks_of, mean_over_training, peak_over_training, plateau,
                                        trust_region_rows, trust_region_to_json, window_mean)
from quatro_nemo.study.render import (band, claim_lines, finish_frontier_panel, fmt_stat, fmt_value, info_lines,
                                      plot_trust_region, power_lines, save_figure, top_p_label, trust_region_lines)


# --------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------


def plot_at_k(study: Study, prefix: str, ylabel: str, path: str) -> bool:
    """Mean ± std over seeds of a metric against k, one panel per top-p, every method."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(study.top_ps), figsize=(5.2 * len(study.top_ps), 3.8), squeeze=False)
    drawn = False
    for ax, top_p in zip(axes.flat, study.top_ps):
        for i, (name, setting) in enumerate(study.plan.compare.items()):
            ks = sorted({k for run in study.group(setting, study.plan.seeds) for k in ks_of(run.final(top_p) or {}, prefix)})
            pairs = [(k, study.stat(setting, study.plan.seeds, final_metric(f"{prefix}{k}", top_p))) for k in ks]
            pairs = [(k, s) for k, s in pairs if s is not None]
            if pairs:
                band(ax, [k for k, _ in pairs], np.array([s.mean for _, s in pairs]),
                      np.array([s.std for _, s in pairs]), name, f"C{i}")
                drawn = True
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k")
        ax.set_ylabel(ylabel)
        ax.set_title(top_p_label(top_p), fontsize=9)
        ax.grid(alpha=0.3)
    if drawn:
        axes.flat[0].legend(fontsize=7)
    save_figure(fig, plt, path)
    return drawn


def plot_frontier(study: Study, kmax: int, path: str) -> bool:
    """pass@1 against pass@kmax (and against UCC@kmax) for every method and every delta: the
    accuracy / diversity frontier, one point per setting (mean over its seeds)."""
    plt = pyplot()
    panels = [(top_p, f"pass@{kmax}") for top_p in study.top_ps] + [(study.claim_top_p, f"ucc@{kmax}")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 4.0), squeeze=False)
    plan = study.plan
    groups = [(name, s, plan.seeds, "o") for name, s in plan.compare.items()]
    groups += [(f"quatro delta={d:g}", s, plan.delta_seeds, "^") for d, s in sorted(plan.deltas.items())]
    drawn = False
    for ax, (top_p, key) in zip(axes.flat, panels):
        for i, (label, setting, seeds, marker) in enumerate(groups):
            x = study.stat(setting, seeds, final_metric("pass@1", top_p))
            y = study.stat(setting, seeds, final_metric(key, top_p))
            if x is None or y is None:
                continue
            ax.errorbar([x.mean], [y.mean], xerr=[x.std], yerr=[y.std], marker=marker, ms=5, ls="none",
                        color=f"C{i % 10}", label=label)
            drawn = True
        finish_frontier_panel(ax, study, top_p, key, f"{key} vs pass@1, {top_p_label(top_p)}")
    if drawn:
        axes.flat[0].legend(fontsize=6)
    save_figure(fig, plt, path)
    return drawn


def plot_curves(study: Study, settings: Dict[str, Any], seeds: Sequence[int], keys: Sequence[str],
                titles: Sequence[str], path: str) -> bool:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(4.6 * len(keys), 3.5), squeeze=False)
    drawn = False
    for ax, key, title in zip(axes.flat, keys, titles):
        for i, (label, setting) in enumerate(settings.items()):
            curve = study.curve(setting, seeds, key)
            if curve is not None:
                band(ax, *curve, label=str(label), color=f"C{i % 10}")
                drawn = True
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("rollout step")
        ax.grid(alpha=0.3)
    if drawn:
        axes.flat[0].legend(fontsize=7)
    save_figure(fig, plt, path)
    return drawn


def plot_sweep(study: Study, sweep: Dict[str, Dict[Any, Any]], axis_label: str, path: str, log_x: bool) -> bool:
    plt = pyplot()
    p = study.claim_top_p
    panels = [("final held-out reward", final_metric("reward/mean", p)), ("final held-out entropy", final_metric("entropy", p)),
              ("clipped fraction (mean over training)", mean_over_training("policy/clip_frac"))]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    drawn = False
    for ax, (title, extract) in zip(axes, panels):
        for i, (name, axis) in enumerate(sweep.items()):
            points = [(x, study.stat(s, study.plan.sweep_seeds, extract)) for x, s in sorted(axis.items())]
            points = [(x, s) for x, s in points if s is not None]
            if points:
                band(ax, [x for x, _ in points], np.array([s.mean for _, s in points]),
                      np.array([s.std for _, s in points]), name, f"C{i}")
                drawn = True
        if log_x:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(axis_label)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    if drawn:
        axes[0].legend(fontsize=7)
    save_figure(fig, plt, path)
    return drawn


def plot_advantages(table: Dict[float, Dict[str, List[float]]], path: str) -> None:
    plt = pyplot()
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
    save_figure(fig, plt, path)


def write_figures(study: Study, advantages, out_dir: str) -> Dict[str, str]:
    plan, paths = study.plan, {}
    kmax = study.kmax()

    def keep(name: str, drawn: bool) -> None:
        if drawn:
            paths[name] = f"{name}.png"

    p = lambda name: os.path.join(out_dir, f"{name}.png")  # noqa: E731
    keep("pass_at_k", plot_at_k(study, "pass@", "held-out Pass@k", p("pass_at_k")))
    keep("ucc_at_k", plot_at_k(study, "ucc@", "held-out UCC@k", p("ucc_at_k")))
    if kmax:
        keep("frontier", plot_frontier(study, kmax, p("frontier")))
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
        ["quatro/lambda/mean", "entropy"], ["mean lambda* over prompts", "policy entropy (rollouts)"], p("lambda")))
    keep("trust_region", plot_trust_region(study, trust_region_rows(study), p("trust_region")))
    plot_advantages(advantages, p("advantage_vs_correct"))
    paths["advantage_vs_correct"] = "advantage_vs_correct.png"
    return paths


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------


def checkpoint_lines(study: Study) -> List[str]:
    """Held-out checkpoints during training (study config ``checkpoints``): per method and step,
    the rollout reward and KL-to-reference (means over the MATCH_WINDOW steps before it) and the
    held-out UCC@n and pass@n, means over seeds: equal steps, beside the matched-level claims."""
    ck = study.cfg.checkpoints
    if not ck.every:
        return []
    n, rows = ck.n_samples, []
    for name, setting in study.plan.compare.items():
        runs = study.group(setting, study.plan.seeds)
        steps = sorted({r["step"] for run in runs for r in run.checkpoints if r["step"] > 0})
        for step in steps:
            values: Dict[str, List[float]] = {key: [] for key in ("reward", "kl", "ucc", "pass")}
            for run in runs:
                record = next((r for r in run.checkpoints if r["step"] == step), {})
                for key, value in (("reward", window_mean(run, "reward/mean", step)),
                                   ("kl", window_mean(run, "policy/kl_ref", step)),
                                   ("ucc", record.get(f"ucc@{n}")), ("pass", record.get(f"pass@{n}"))):
                    if value is not None:
                        values[key].append(float(value))
            rows.append([name, str(step), str(len(runs))] + [fmt_value(float(np.mean(v)) if v else None, 4)
                                                             for v in values.values()])
    if not rows:
        return []
    return [f"Held-out checkpoints every {ck.every} steps ({study.cfg.evaluation.num_problems} problems x {n} samples, "
            f"{top_p_label(study.claim_top_p)}), means over seeds; the claims `ucc_matched_reward` / `ucc_matched_kl` compare "
            f"methods at the same rollout reward / KL-to-reference instead of the same step:", ""] + _table(
        ["method", "step", "seeds", "rollout reward", "KL-to-reference", f"held-out ucc@{n}", f"held-out pass@{n}"], rows)


def _testbed_lines(study: Study) -> List[str]:
    """The base model's measured properties and the diversity left after training (issue 16)."""
    if not study.base:
        return ["_The base model's evaluation is missing._", ""]
    rows = []
    for top_p in study.top_ps:
        b = study.base.get(top_p)
        if not b:
            continue
        rates = np.array(b["num_correct"], dtype=float) / b["n_samples"]
        deciles = np.histogram(rates, bins=np.linspace(0, 1, 11))[0]
        rows.append([top_p_label(top_p), f"{b['reward/mean']:.3f}", f"{b['solved_fraction']:.3f}",
                     f"{b['distinct_correct_per_solved']:.2f}", f"{np.mean(b['num_distinct']):.2f}",
                     f"{np.min(rates):.3f} / {np.median(rates):.3f} / {np.max(rates):.3f}",
                     " ".join(str(int(c)) for c in deciles)])
    lines = ["## The testbed (base model, measured)", "",
             f"{study.cfg.evaluation.num_problems} held-out problems x {study.cfg.evaluation.n_samples} samples, "
             "temperature 1.0. Distinct correct = distinct expressions modulo commuting (the UCC@k criterion).", ""]
    lines += _table(["sampling", "reward (mean success)", "solved at least once", "distinct correct per solved problem",
                     "distinct correct per problem", "success rate min / median / max",
                     "problems per success decile [0,0.1) .. [0.9,1]"], rows)
    rows = []
    plan = study.plan
    for name, setting in plan.compare.items():
        rows.append([name] + [fmt_stat(study.stat(setting, plan.seeds, final_metric("distinct_correct_per_solved", p)), 2)
                              for p in study.top_ps])
    lines += ["Distinct correct answers per solved problem after training (mean ± std over seeds):", ""]
    base_row = ["base model"] + [fmt_value(study.base.get(p, {}).get("distinct_correct_per_solved"), 2) for p in study.top_ps]
    lines += _table(["method"] + [top_p_label(p) for p in study.top_ps], [base_row] + rows)
    return lines


def _compare_rows(study: Study, kmax: Optional[int], top_p: float) -> List[List[str]]:
    """One row per method (final held-out numbers at `top_p`) after one for the base model."""
    plan = study.plan
    b = study.base.get(top_p, {})
    keys = ["reward/mean", "pass@1"] + ([f"pass@{kmax}", f"ucc@{kmax}"] if kmax else []) + ["ucr", "entropy"]
    rows = [["base model", "-"] + [fmt_value(b.get(k)) for k in keys] + ["-", "-"]]
    for name, setting in plan.compare.items():
        s = lambda extract: fmt_stat(study.stat(setting, plan.seeds, extract))  # noqa: E731
        rows.append([name, str(len(study.group(setting, plan.seeds)))] + [s(final_metric(k, top_p)) for k in keys]
                    + [s(entropy_retention), s(mean_over_training("policy/clip_frac"))])
    return rows


def _at_k_table(study: Study, settings: Dict[str, Any], seeds: Sequence[int], prefix: str, top_p: float) -> List[str]:
    ks = sorted({k for s in settings.values() for run in study.group(s, seeds) for k in ks_of(run.final(top_p) or {}, prefix)})
    if not ks:
        return []
    rows = [[label] + [fmt_stat(study.stat(s, seeds, final_metric(f"{prefix}{k}", top_p))) for k in ks]
            for label, s in settings.items()]
    base = study.base.get(top_p)
    if base:
        rows.insert(0, ["base model"] + [fmt_value(base.get(f"{prefix}{k}")) for k in ks])
    return _table(["setting"] + [f"k={k}" for k in ks], rows)


def _sweep_lines(study: Study, sweep, axis_name: str, default: Any) -> List[str]:
    p = study.claim_top_p
    rows = []
    for name, axis in sweep.items():
        for x, setting in sorted(axis.items()):
            s = lambda extract: study.stat(setting, study.plan.sweep_seeds, extract)  # noqa: E731
            reward = s(final_metric("reward/mean", p))
            rows.append([name, f"{x:g}", fmt_stat(reward),
                         "-" if reward is None or reward.n < 2 else f"[{reward.low:.3f}, {reward.high:.3f}]",
                         fmt_stat(s(final_metric("entropy", p))), fmt_stat(s(mean_over_training("policy/clip_frac"))),
                         fmt_stat(s(peak_over_training("policy/kl_old")), 4)])
    lines = _table(["method", axis_name, "final reward", "95% CI", "final entropy", "clip frac", "peak KL-to-old"], rows)
    points = breaking_points(study, sweep, default)
    tolerance = study.cfg.sweeps.tolerance
    lines += [f"Largest {axis_name} up to which the mean final held-out reward stays within {tolerance:.0%} of its "
              f"{axis_name} = {default:g} reward (every point before it too):", ""]
    lines += _table(["method", f"largest {axis_name} within {tolerance:.0%}"],
                    [[name, "-" if x is None else f"{x:g}"] for name, x in points.items()])
    return lines


def to_markdown(study: Study, claims: Sequence[Claim], advantages, figures: Dict[str, str],
                info: Dict[str, Any]) -> str:
    cfg, plan = study.cfg, study.plan
    kmax = study.kmax()
    ev = cfg.evaluation
    missing = [n for n in plan.runs if n not in study.runs]
    lines = [f"# QUATRO vs baselines at CPU scale: study `{cfg.name}`", "",
             f"{len(study.runs)} of {len(plan.runs)} runs finished"
             + (f" ({len(missing)} missing or failed: {', '.join(missing)})" if missing else "") + ". "
             f"Training config `{cfg.train_config}` with {' '.join(cfg.train_overrides) or 'no study-wide overrides'}; "
             f"default lr {plan.defaults.lr:g}, default K {plan.defaults.inner_loops}. Every method sees the same "
             "prompts, rollout budget (prompts x responses per step, steps), evaluation and seeds; each method's "
             "own hyper-parameters are its config's defaults (conf/algorithm/).", ""]
    lines += info_lines(cfg, info)
    lines += [f"**Evaluation.** Each run's final policy on {ev.num_problems} held-out problems x {ev.n_samples} "
              f"samples at temperature {ev.temperature:g} and top-p {', '.join(f'{p:g}' for p in ev.top_p)} (runs only "
              f"in the sweeps or the ablation: {ev.sweep_n_samples or ev.n_samples} samples at top-p {ev.top_p[0]:g}, "
              "their claims use held-out reward alone); the same sampling noise for every run; the base model "
              f"evaluated once. Claims on held-out metrics are decided at top-p {study.claim_top_p:g}.", "",
              f"**Statistics.** Seeds: main comparison {plan.seeds}; sweeps {plan.sweep_seeds}; ablation "
              f"{plan.ablation_seeds}; deltas {plan.delta_seeds}. Each effect is a per-seed difference between runs with "
              "the same seed (same warm-start, prompt order and evaluation draw), tested with a paired t test over "
              "seeds (95% interval), its two-sided p-value Holm-corrected over the comparisons of its claim; "
              f"significant at Holm p < {cfg.alpha:g}. Verdicts: REPRODUCED (significant for the claim against every "
              "baseline), PARTLY (against some, significantly opposed by none), NOT REPRODUCED (a significant effect "
              "in the opposite direction), EQUIVALENT (for a claim with a stated margin: no significant difference and "
              "every comparison inside the margin by two one-sided tests, Holm-adjusted), INCONCLUSIVE (no significant "
              "difference: the intervals are wide), NOT TESTED (fewer than two paired seeds), NOT RUN (n of N seeds: "
              "a study stopped before every run of the claim finished for every seed its design states; nothing is "
              "decided on fewer). Beside each 95% interval, the family's "
              "simultaneous 95% interval, compatible with Holm (Strassburger & Bretz 2008: a comparison Holm rejects "
              "gets the half-line on its side of 0 unless the whole family is rejected). "
              "Tables show mean ± std over seeds.", ""]
    convergence = plateau(study)
    if convergence:
        lines += [f"**Run length.** {convergence['steps']} rollout steps per run. Plateau criterion: the best method "
                  f"({convergence['method']}, highest final held-out reward) changes its rollout reward by at most "
                  f"{convergence['tolerance']:g} over the last quarter of training (least-squares line through the mean "
                  f"over seeds): {convergence['last_quarter_change']:+.4f}, "
                  + ("plateaued." if convergence["plateaued"] else "NOT plateaued: longer runs may change the picture.")
                  , ""]
    lines += ["## Claims", ""] + claim_lines(claims) + power_lines(cfg, claims)
    lines += _testbed_lines(study)
    lines += ["## 1-3. Main comparison (default settings)", ""]
    twins = identical_methods(study)
    if twins:
        lines += ["**Identical results.** " + ", ".join(f"{a} = {b}" for a, b in twins) + ": these methods ended "
                  "with the same held-out numbers for every seed (same gradient when every update is on-policy).", ""]
    for top_p in study.top_ps:
        header = ["method", "seeds", "final reward", "pass@1"] + ([f"pass@{kmax}", f"ucc@{kmax}"] if kmax else []) \
            + ["UCR", "final entropy", "entropy last/first", "clip frac"]
        lines += [f"Final held-out numbers, {top_p_label(top_p)}:", ""] + _table(header, _compare_rows(study, kmax, top_p))
    for top_p in study.top_ps:
        lines += [f"Held-out Pass@k, {top_p_label(top_p)}:", ""] + _at_k_table(study, plan.compare, plan.seeds, "pass@", top_p)
        lines += [f"Held-out UCC@k, {top_p_label(top_p)}:", ""] + _at_k_table(study, plan.compare, plan.seeds, "ucc@", top_p)
    lines += checkpoint_lines(study)
    for key in ("pass_at_k", "ucc_at_k", "frontier", "training"):
        if key in figures:
            lines += [f"![{key}]({figures[key]})", ""]
    lines += ["## 4. Stability sweeps", "",
              "One axis at a time from the default: inner loops K at the default learning rate, and learning-rate "
              "multipliers at K = 1. Each point uses its own seeds; 95% CI: t interval over them. 'clip frac': mean "
              "fraction of clipped ratios over training (methods that clip).", ""]
    if study.cfg.sweeps.search:
        lines += [f"The sweeps were searched (`sweeps.search`): a method's next K or multiplier ran only once its "
                  f"previous one kept {study.cfg.sweeps.tolerance:.0%} of its default reward, so each method's rows end "
                  "at the first point that did not (or at the grid's end). The claims compare two methods on the "
                  "points both ran.", ""]
    lines += ["### Inner loops K", ""] + _sweep_lines(study, plan.sweep_inner, "K", 1)
    if "stability_inner_loops" in figures:
        lines += [f"![inner loops]({figures['stability_inner_loops']})", ""]
    lines += ["### Learning rate", ""] + _sweep_lines(study, plan.sweep_lr, "lr x", 1.0)
    if "stability_lr" in figures:
        lines += [f"![learning rate]({figures['stability_lr']})", ""]
    lines += [f"## 5. Log-ratio ablation (delta = {cfg.ablation.delta:g}, K = {cfg.ablation.inner_loops})", ""]
    rows = []
    for g, s in plan.ablation.items():
        st = lambda extract: study.stat(s, plan.ablation_seeds, extract)  # noqa: E731
        rows.append([g, fmt_stat(st(final_metric("reward/mean", study.claim_top_p))),
                     fmt_stat(st(mean_over_training("policy/kl_old")), 4), fmt_stat(st(peak_over_training("policy/kl_old")), 4),
                     fmt_stat(st(final_metric("entropy", study.claim_top_p)))])
    lines += _table(["log_ratio", "final reward", "mean KL-to-old", "peak KL-to-old", "final entropy"], rows)
    if "logratio_ablation" in figures:
        lines += [f"![log-ratio ablation]({figures['logratio_ablation']})", ""]
    lines += _delta_lines(study, figures)
    lines += ["### Advantage vs number of correct responses (exact, binary rewards)", ""]
    lines += _advantage_lines(advantages, figures)
    lines += trust_region_lines(trust_region_rows(study), figures)
    lines += ["## Each method's own settings (the same in every part of the study)", ""]
    lines += _table(["method", "fields (conf/algorithm/<name>.yaml)"],
                    [[name, ", ".join(f"{k}={v}" for k, v in sorted(fields.items()) if k != "name")]
                     for name, fields in sorted(plan.defaults.algorithm_fields.items())])
    return "\n".join(lines)


def _advantage_lines(advantages, figures: Dict[str, str]) -> List[str]:
    deltas = sorted(advantages)
    cs = advantages[deltas[0]]["c"]
    rows = [[c] + [f"{advantages[d]['a_correct'][i]:.3f} / {advantages[d]['a_wrong'][i]:.3f}" for d in deltas]
            for i, c in enumerate(cs)]
    return (_table(["c correct"] + [f"delta={d:g}: A(correct) / A(wrong)" for d in deltas], rows)
            + [f"![advantage vs correct]({figures['advantage_vs_correct']})", ""])


def _delta_lines(study: Study, figures: Dict[str, str]) -> List[str]:
    """The delta trade-off: accuracy and diversity per trust-region radius (App. C.1)."""
    plan = study.plan
    seeds = plan.delta_seeds
    settings = {f"delta={d:g}": s for d, s in sorted(plan.deltas.items())}
    lines = ["## 6. QUATRO's trust region: the delta trade-off", "",
             "QUATRO at each delta (other settings at their defaults). With N responses per prompt the trust region "
             "is inactive for a prompt when delta >= log(N / (N - c)) for its c correct answers; "
             "'inactive TR fraction' is the measured share of such prompts over training.", ""]
    p = study.claim_top_p
    rows = [[label, fmt_stat(study.stat(s, seeds, mean_over_training("quatro/lambda/mean")), 4),
             fmt_stat(study.stat(s, seeds, mean_over_training("quatro/tr_inactive_frac"))),
             fmt_stat(study.stat(s, seeds, final_metric("reward/mean", p))),
             fmt_stat(study.stat(s, seeds, final_metric("entropy", p))),
             fmt_stat(study.stat(s, seeds, final_metric("distinct_correct_per_solved", p)), 2)]
            for label, s in settings.items()]
    lines += _table(["delta", "mean lambda* (training)", "inactive TR fraction", f"final reward ({top_p_label(p)})",
                     "final entropy", "distinct correct per solved"], rows)
    for top_p in study.top_ps:
        lines += [f"Pass@k per delta, {top_p_label(top_p)}:", ""] + _at_k_table(study, settings, seeds, "pass@", top_p)
        lines += [f"UCC@k per delta, {top_p_label(top_p)}:", ""] + _at_k_table(study, settings, seeds, "ucc@", top_p)
    if "lambda" in figures:
        lines += [f"![lambda]({figures['lambda']})", ""]
    return lines


def write_study_report(study: Study, claims: Sequence[Claim], advantages, out_dir: str,
                       info: Dict[str, Any]) -> Dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    figures = write_figures(study, advantages, out_dir)
    markdown = to_markdown(study, claims, advantages, figures, info)
    with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(markdown)
    summary = {"study": study.cfg.name, "info": info, "claims": claims_to_json(claims),
               "plateau": plateau(study),
               "breaking_points": {"inner_loops": breaking_points(study, study.plan.sweep_inner, 1),
                                   "lr_multiplier": breaking_points(study, study.plan.sweep_lr, 1.0)},
               "runs": {name: {"finished": name in study.runs, "overrides": list(spec.overrides)}
                        for name, spec in study.plan.runs.items()},
               "advantages": {str(d): t for d, t in advantages.items()}}
    trust_region = trust_region_rows(study)
    if trust_region:          # runs that logged the achieved KL (algorithm.log_achieved_kl)
        summary["trust_region"] = trust_region_to_json(trust_region)
    with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(to_jsonable(summary), f, indent=1, allow_nan=False)
    return {"markdown": os.path.join(out_dir, "report.md"), "json": os.path.join(out_dir, "report.json"),
            **{k: os.path.join(out_dir, v) for k, v in figures.items()}}
