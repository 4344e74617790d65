"""A study's run list by its kind, following its finished runs: the paper's comparison
(``plan.build_paper_plan``, whose searched sweeps add points as runs finish) or the adaptive-delta
study (``adaptive.build_adaptive_plan``)."""
from __future__ import annotations

import os
from typing import Dict, Optional

from quatro_nemo.study.adaptive import build_adaptive_plan
from quatro_nemo.study.analysis import run_from_records
from quatro_nemo.study.config import QUATRO, StudyConfig
from quatro_nemo.study.kept import archive_path, read_archive
from quatro_nemo.study.plan import Defaults, RewardOf, RunSpec, StudyPlan, build_paper_plan, read_defaults


def finished_rewards(cfg: StudyConfig, study_dir: str) -> RewardOf:
    """A run's final held-out reward at the claims' top-p (``evaluation.top_p[0]``) from its kept
    metrics (``<study_dir>/metrics``); None while there are none. What the sweeps' search
    (``plan.searched_points``) judges by."""
    top_p = float(cfg.evaluation.top_p[0])
    known: Dict[str, float] = {}

    def reward_of(spec: RunSpec) -> Optional[float]:
        if spec.name not in known:
            path = archive_path(study_dir, spec.name)
            run = run_from_records(spec.name, read_archive(path)) if os.path.isfile(path) else None
            final = None if run is None else run.final(top_p)
            if final is None:
                return None
            known[spec.name] = final["reward/mean"]
        return known[spec.name]
    return reward_of


def build_plan(cfg: StudyConfig, results_dir: Optional[str] = None, defaults: Optional[Defaults] = None,
               unknown_holds: bool = False) -> StudyPlan:
    """The study's runs, by its kind. ``results_dir``: the study directory whose finished runs a
    search follows (none: the whole grid); ``defaults``: ``plan.read_defaults``' result, when
    known; ``unknown_holds``: ``plan.searched_points``."""
    if cfg.kind == "adaptive":
        return build_adaptive_plan(cfg, defaults or read_defaults(cfg, [QUATRO]))
    rewards = None if results_dir is None else finished_rewards(cfg, results_dir)
    return build_paper_plan(cfg, rewards, defaults, unknown_holds)
