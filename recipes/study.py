#!/usr/bin/env python
"""QUATRO vs GRPO, GPG, GSPO, GMPO, DAPO and CISPO side by side on the CPU default task (issue 9).

    python recipes/study.py study=quick             # CI scale (<= 10 min on 2 cores): runs/study_quick/
    python recipes/study.py                         # the full study (<= 150 min): runs/study_full/
    python recipes/study.py study=adaptive          # the adaptive-delta study (issue 19): runs/study_adaptive/
    python recipes/study.py 'study.seeds=[1,2,3,4,5,6]' study.workers=2   # study-config overrides
    python recipes/study.py study=quick report_only=true   # rebuild the report from the kept metrics
    python recipes/study.py estimate=runs/study_quick      # the full study's wall time, from quick's timings
    python recipes/study.py study=design estimate=true    # a study's cost from the committed full study's timings
    python recipes/study.py emit_sweep=slurm/sweeps/study_full.txt study.train_config=quatro_1p5b 'study.train_overrides=[]'
    python recipes/study.py collect=runs/sweeps/study_full-<timestamp> study.train_config=quatro_1p5b 'study.train_overrides=[]'
    python recipes/study.py --config-dir my_conf study=mine   # a study config of your own: my_conf/study/mine.yaml

Each run is a request to the engine's front door (quatro_nemo/engine/api.py: trained as
recipes/train.py trains, then its final policy evaluated) in <out>/runs/<name>; a run whose kept
metrics carry its identity is skipped, so an interrupted study continues where it stopped, and so
does a fresh clone from the committed results (``results``, default docs/study_results/<name>;
``publish=true`` copies each run kept here there as it finishes, to be committed;
scripts/study_background.sh runs the pre-registered studies so). Every run's metrics are kept in
<out>/metrics/ (gzip JSON lines, led by the run's identity), from which the report
(<out>/report.md, report.json, PNGs) states claim by claim whether the paper's claim reproduced,
with paired statistics. See docs/study.md.

A Hydra app (hydra-core 1.3) over conf/study_app.yaml: ``study=NAME`` chooses the study config
conf/study/NAME.yaml (typed by quatro_nemo.study.config.StudyConfig; its ``name`` defaults to
NAME), ``study.KEY=VALUE`` overrides one of its keys; the recipe's own keys are
:class:`StudyRecipeConfig`'s (``--cfg job`` prints the composed config). At most one mode key
(report_only, estimate, emit_sweep, collect) is given. Exit codes: 0 done; 1 Hydra rejected an
override (unknown key, ill-typed value: its message names the key) or a run failed; 2 a value
failed validation (the message names the key); 75 the study was interrupted (the same command
continues it).
"""

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import hydra  # noqa: E402
from omegaconf import MISSING, DictConfig, OmegaConf  # noqa: E402

from quatro_nemo.engine.config import CONF_DIR, HYDRA_VERSION_BASE, ConfigError, config_errors_exit, run_hydra_app  # noqa: E402
from quatro_nemo.study.config import StudyConfig, StudyConfigError, study_config_from_dict  # noqa: E402

FAILED_RUNS_EXIT_CODE = 1
INTERRUPTED_EXIT_CODE = 75
PRIMARY = "study_app"   # conf/study_app.yaml
STUDY_GROUP = "study"   # conf/study/<name>.yaml
MODE_KEYS = ("report_only", "estimate", "emit_sweep", "collect")
COMMITTED_RESULTS = "docs/study_results"   # <this>/<study name>: a study's committed results


@dataclass
class StudyRecipeConfig:
    """recipes/study.py's keys (ConfigStore ``schema/study_app``)."""

    # the chosen study config (group conf/study/); name "???" = the chosen option's name
    study: StudyConfig = field(default_factory=lambda: StudyConfig(name=MISSING))
    out: Optional[str] = None          # study directory (default runs/study_<study.name>)
    # committed results: their kept runs with this study's identities count as done (default
    # docs/study_results/<study.name>); publish=true copies every run kept in `out` there as it lands
    results: Optional[str] = None
    publish: bool = False
    # modes (at most one; none: train and evaluate every run, then report)
    report_only: bool = False          # no training: the report from <out>/metrics/
    estimate: Optional[str] = None     # a finished study's directory (or true: the committed full study's): this study's cost
    emit_sweep: Optional[str] = None   # write the run list for slurm/sweep.sh to this file
    collect: Optional[str] = None      # report on this slurm/sweep.sh sweep directory

    def __post_init__(self) -> None:
        modes = [key for key in MODE_KEYS if getattr(self, key)]
        if len(modes) > 1:
            raise ConfigError(f"config keys {' and '.join(modes)} are exclusive modes: give at most one")
        if self.publish and modes:
            raise ConfigError(f"config key publish: only a study that trains publishes its runs, not {modes[0]}")
        for key in ("estimate", "collect"):
            if key == "estimate" and str(self.estimate).lower() == "true":    # the committed full study's timings
                continue
            if getattr(self, key) is not None and not os.path.isdir(getattr(self, key)):
                raise ConfigError(f"config key {key}: directory {getattr(self, key)!r} not found")


def register_study_app_config() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="schema", name=PRIMARY, node=StudyRecipeConfig)


def validate(cfg: DictConfig, study_option: str) -> StudyRecipeConfig:
    """The composed config (typed by Hydra against the schema) as a StudyRecipeConfig whose study
    went through study_config_from_dict; ConfigError naming the key on bad input."""
    values = OmegaConf.to_container(cfg, resolve=True)
    values.pop("hydra", None)
    study = values.pop(STUDY_GROUP)
    if OmegaConf.is_missing(cfg[STUDY_GROUP], "name"):
        study["name"] = study_option
    try:
        study_config = study_config_from_dict(study)
    except StudyConfigError as exc:
        raise ConfigError(f"study '{study_option}' (keys study.*): {exc}") from exc
    return StudyRecipeConfig(study=study_config, **values)


def previous_info(out: str) -> dict:
    """The last full invocation's info (wall time, failed runs) and the wall time of every
    invocation that trained runs, kept when only the report is rebuilt."""
    from quatro_nemo.study.timing import invocation_totals

    path = os.path.join(out, "report.json")
    if not os.path.isfile(path):
        return invocation_totals(out)
    with open(path) as f:
        return dict(json.load(f).get("info") or {}, **invocation_totals(out))


def run(recipe: StudyRecipeConfig) -> int:
    """The chosen mode; its exit code (ConfigError and StudyInterrupted pass on)."""
    from quatro_nemo.study.driver import collect_sweep, emit_sweep, run_study, write_report
    from quatro_nemo.study.planner import build_plan

    cfg = recipe.study
    out = recipe.out or os.path.join("runs", f"study_{cfg.name}")
    results = recipe.results or os.path.join(REPO, COMMITTED_RESULTS, cfg.name)
    if recipe.estimate:
        from quatro_nemo.study.timing import estimate_minutes
        from quatro_nemo.study.timing import COMMITTED_TIMINGS
        timed = os.path.join(REPO, COMMITTED_TIMINGS) if str(recipe.estimate).lower() == "true" else recipe.estimate
        print(json.dumps(estimate_minutes(cfg, timed), indent=1))
        return 0
    if recipe.emit_sweep:
        count = emit_sweep(cfg, recipe.emit_sweep)
        print(f"{count} override sets written to {recipe.emit_sweep}; submit with: bash slurm/sweep.sh {recipe.emit_sweep}")
        return 0
    result: Dict[str, Any]
    if recipe.collect:
        result = collect_sweep(cfg, recipe.collect, recipe.out or os.path.join(recipe.collect, "study_report"))
    elif recipe.report_only:
        result = write_report(cfg, build_plan(cfg, out), out, out, previous_info(out))
    else:
        result = run_study(cfg, out, results_dir=results, publish=recipe.publish)
    for claim in result["claims"]:
        print(f"{claim.verdict:>15}  {claim.id}: {claim.summary}")
    print(f"report: {result['paths']['markdown']}")
    return FAILED_RUNS_EXIT_CODE if result.get("info", {}).get("failed_runs") else 0


register_study_app_config()


@hydra.main(config_path=CONF_DIR, config_name=PRIMARY, version_base=HYDRA_VERSION_BASE)
def study_job(cfg: DictConfig) -> None:
    """One study (each job of a multirun is one; with ``out`` given, job i's is <out>/<i>)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from quatro_nemo.study.runner import StudyInterrupted

    hydra_cfg = HydraConfig.get()
    try:
        with config_errors_exit():
            recipe = validate(cfg, hydra_cfg.runtime.choices[STUDY_GROUP])
            if hydra_cfg.mode == RunMode.MULTIRUN and recipe.out:
                recipe.out = os.path.join(recipe.out, str(hydra_cfg.job.num))
            try:
                code = run(recipe)
            except StudyConfigError as exc:   # found when the plan is built (e.g. an arm's unknown field)
                raise ConfigError(f"study '{recipe.study.name}': {exc}") from exc
    except StudyInterrupted as stop:
        print(f"study stopped: {stop}; the same command continues it", file=sys.stderr)
        raise SystemExit(INTERRUPTED_EXIT_CODE) from stop
    if code:
        raise SystemExit(code)


def main(argv) -> int:
    """Run the Hydra app on ``argv`` (key=value overrides, Hydra flags); the exit code."""
    return run_hydra_app(study_job, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
