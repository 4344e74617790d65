#!/usr/bin/env python
"""Evaluate sampled responses: Pass@k, UCC@k, diversity, entropy and flip rate (paper Sec. 4, App. C).

From samples files (one or several runs side by side)::

    python recipes/evaluate.py +runs.grpo=out/grpo.jsonl +runs.quatro=out/quatro.jsonl \\
        +runs.base=out/base.jsonl base_run=base out=eval_report/
    python recipes/evaluate.py '++runs={grpo: out/grpo.jsonl, base: out/base.jsonl}' out=eval_report/

From a checkpoint (samples generated first, then evaluated; the generator is the engine's)::

    python recipes/evaluate.py checkpoint=runs/a/checkpoints/step_100 data='[data/math500.jsonl]' \\
        num_samples=256 name=quatro out=eval_report/

A Hydra app (hydra-core 1.3) over conf/evaluate.yaml; its keys are :class:`EvaluateRecipeConfig`'s
(``--cfg job`` prints them, ``-m`` sweeps, e.g. ``-m ucc_metric=exact,rouge_l``: job i reports
in <out>/<i>). Exit codes: 0 done; 1 Hydra rejected an override (unknown key, ill-typed value:
its message names the key) or evaluation failed; 2 a value failed validation (the message names
the key). Samples format: quatro_nemo/eval/samples.py. Outputs in ``out``: report.md, metrics.csv,
report.json, pass_at_k.png, ucc_at_k.png, similarity.png, flip_rate.png (with ``base``), and
samples_<name>.jsonl (with ``checkpoint``).
"""

import dataclasses
import importlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hydra  # noqa: E402
from omegaconf import MISSING, DictConfig, OmegaConf  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from quatro_nemo.data.schema import read_problems  # noqa: E402
from quatro_nemo.engine.config import (CONF_DIR, HYDRA_VERSION_BASE, ConfigError, config_errors_exit,  # noqa: E402
                                       omegaconf_error_message, run_hydra_app)
from quatro_nemo.eval.report import (DEFAULT_PAIRWISE_METRICS, MetricsConfig, UccMetric, evaluate_runs,  # noqa: E402
                                     write_report)
from quatro_nemo.eval.samples import load_samples, write_samples  # noqa: E402
from quatro_nemo.rewards import VerifierName  # noqa: E402

PRIMARY = "evaluate"   # conf/evaluate.yaml

# The sampler that turns a checkpoint + problems into sample records; provided by the engine.
# Contract: generate_samples(checkpoint: str, problems: list[dict], num_samples: int,
#   temperature: float, top_p: float, max_new_tokens: int, seed: int) -> list[dict] (samples
#   format: the problem's id/benchmark/answer plus "responses", optionally "logprobs"/"entropies").
DEFAULT_GENERATOR = "quatro_nemo.engine.generate:generate_samples"


@dataclass
class EvaluateRecipeConfig:
    """recipes/evaluate.py's keys (ConfigStore ``schema/evaluate``). The metric keys are
    quatro_nemo.eval.report.MetricsConfig's fields, which checks their values."""

    # inputs
    runs: Dict[str, str] = field(default_factory=dict)  # run name -> samples JSONL file
    base_run: Optional[str] = None           # run name of the base model (flip-rate buckets)
    checkpoint: Optional[str] = None         # generate samples from this checkpoint first
    data: List[str] = field(default_factory=list)  # problem JSONL file(s) for checkpoint
    name: str = "checkpoint"                 # run name of the checkpoint's samples
    generator: str = DEFAULT_GENERATOR       # module:function generating samples
    num_samples: int = 256                   # responses per problem (the paper's n)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 1024
    # metrics
    verifier: VerifierName = VerifierName.math  # grader name for quatro_nemo.rewards.get_verifier
    grading_workers: int = 2
    grading_timeout: float = 5.0             # seconds per answer check
    regrade: bool = False                    # ignore precomputed rewards in the samples
    ks: Optional[List[int]] = None           # Pass@k grid (default 1, 2, 4, .., n)
    ucc_ks: Optional[List[int]] = None       # UCC@k grid (default: ks)
    ucc_metric: UccMetric = UccMetric("rouge_l")  # near-duplicate criterion; 'precomputed': records' cluster_sizes
    ucc_threshold: Optional[float] = None
    pairwise_metrics: List[str] = field(default_factory=lambda: list(DEFAULT_PAIRWISE_METRICS))
    max_pairwise_responses: int = 32
    workers: int = 1                         # threads for similarity matrices
    seed: int = 0
    # outputs
    out: str = MISSING                       # output directory (required)
    plots: bool = True

    def __post_init__(self) -> None:
        for key in ("num_samples", "max_new_tokens", "grading_workers", "grading_timeout"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"config key {key} must be > 0, got {getattr(self, key)!r}")
        for run_name, path in self.runs.items():
            if not os.path.isfile(path):
                raise ConfigError(f"config key runs.{run_name}: samples file {path!r} not found")
        if self.checkpoint is not None and not self.data:
            raise ConfigError("config key data: checkpoint needs problem files, e.g. data='[data/math500.jsonl]'")
        if self.checkpoint is not None and self.name in self.runs:
            raise ConfigError(f"config key name: {self.name!r} is also a key of runs; choose another name")
        if not self.runs and self.checkpoint is None:
            raise ConfigError("config key runs: nothing to evaluate; give +runs.NAME=samples.jsonl "
                              "and/or checkpoint=DIR")
        try:
            self.metrics_config()
        except ValueError as exc:  # MetricsConfig names its field, which is the same key here
            raise ConfigError(f"config key {str(exc).replace('MetricsConfig.', '')}") from exc

    def metrics_config(self) -> MetricsConfig:
        metric_keys = {f.name for f in dataclasses.fields(MetricsConfig)} & {f.name for f in dataclasses.fields(self)}
        return MetricsConfig(pairwise_metrics=tuple(self.pairwise_metrics),
                          **{key: getattr(self, key) for key in metric_keys - {"pairwise_metrics"}})


def register_evaluate_config() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="schema", name="evaluate", node=EvaluateRecipeConfig)


def validate(cfg: DictConfig) -> EvaluateRecipeConfig:
    """The composed config as an EvaluateRecipeConfig; ConfigError naming the key on bad input."""
    try:
        plain = OmegaConf.to_container(cfg, resolve=True)
        plain.pop("hydra", None)
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EvaluateRecipeConfig), plain))
    except OmegaConfBaseException as exc:
        raise ConfigError(omegaconf_error_message(exc)) from exc


def load_generator(spec: str):
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"config key generator: checkpoint needs the sample generator {spec!r}, which cannot "
                          f"be imported ({err}); set generator=module:function or evaluate samples files with runs=") from err
    if not hasattr(module, attr):
        raise ConfigError(f"config key generator: module {module_name!r} has no function {attr!r}")
    return getattr(module, attr)


def evaluate(config: EvaluateRecipeConfig) -> Dict[str, str]:
    """Generate the checkpoint's samples (if any), evaluate every run, write the report; its files."""
    runs: Dict[str, List[Dict[str, Any]]] = {name: load_samples(path) for name, path in config.runs.items()}
    if config.checkpoint is not None:
        generate_samples = load_generator(config.generator)
        problems = [p for path in config.data for p in read_problems(path)]
        samples = generate_samples(checkpoint=config.checkpoint, problems=problems, num_samples=config.num_samples,
                                   temperature=config.temperature, top_p=config.top_p,
                                   max_new_tokens=config.max_new_tokens, seed=config.seed)
        os.makedirs(config.out, exist_ok=True)
        write_samples(os.path.join(config.out, f"samples_{config.name}.jsonl"), samples)
        runs[config.name] = samples
    verifier_kwargs = ({"num_workers": config.grading_workers, "timeout_s": config.grading_timeout}
                       if config.verifier == "math" else {})
    start = time.perf_counter()
    report = evaluate_runs(runs, config.metrics_config(), verifier=config.verifier, verifier_kwargs=verifier_kwargs)
    paths = write_report(report, config.out, plots=config.plots)
    print(f"evaluated {len(runs)} run(s) in {time.perf_counter() - start:.1f} s")
    for kind, path in paths.items():
        print(f"  {kind}: {path}")
    return paths


register_evaluate_config()


@hydra.main(config_path=CONF_DIR, config_name=PRIMARY, version_base=HYDRA_VERSION_BASE)
def evaluate_job(cfg: DictConfig) -> None:
    """One evaluation (each job of a multirun is one, reporting in Hydra's <out>/<job number>)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        cfg = OmegaConf.merge(cfg, {"out": hydra_cfg.runtime.output_dir})
    with config_errors_exit():
        evaluate(validate(cfg))


def main(argv) -> int:
    """Run the Hydra app on ``argv`` (key=value overrides, Hydra flags); the exit code."""
    return run_hydra_app(evaluate_job, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
