"""The side-by-side study (issues 9 and 16; docs/study.md): QUATRO vs the GRPO-family baselines on the CPU
default, over seeds, with the stability sweeps, the log-ratio ablation and QUATRO's diagnostics.

- ``config``:     the typed study config (conf/study/*.yaml)
- ``plan``:       the distinct training runs and their typed values; the SLURM sweep file
- ``adaptive``:   the adaptive-delta study's run list and claims
- ``planner``:    a study's run list by its kind, following its finished runs (searched sweeps)
- ``kept``:       the kept metrics, one file per finished run, led by its identity
- ``results``:    the runs as engine requests; which are done; keeping, committed results, progress
- ``runner``:     runs as independent processes, a few at a time, resumable
- ``forkserver``: the process every run is forked from (imports and task built once)
- ``job``:        one run's process: the engine's front door on its request (train, then evaluate)
- ``stats``:      paired t over seeds, Holm's correction, the verdicts
- ``analysis``:   aggregation over seeds and the claim-by-claim tests
- ``report``:     report.md, report.json and the PNGs (``adaptive_report``: the adaptive study's)
- ``timing``:     the invocation records; a study's cost estimated from a finished study's timings
- ``driver``:     the above end to end (recipes/study.py is its command line)

It sits on top of the engine: it drives runs through quatro_nemo.engine.api (RunRequest in, RunDir
out) and imports quatro_nemo.eval, never the reverse.
"""
