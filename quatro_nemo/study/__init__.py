"""The side-by-side study (issues 9 and 16; docs/study.md): QUATRO vs the GRPO-family baselines on the CPU
default, over seeds, with the stability sweeps, the log-ratio ablation and QUATRO's diagnostics.

- ``config``:   the typed study config (conf/study/*.yaml)
- ``plan``:     the distinct training runs and their overrides; the SLURM sweep file
- ``runner``:     runs as independent processes, a few at a time, resumable
- ``job``:        one run's process: training (as recipes/train.py), then its evaluation
- ``evaluation``: held-out evaluation of a final policy or of the base model, at each top-p
- ``stats``:      paired t over seeds, Holm's correction, the verdicts
- ``analysis``:   the kept metrics, aggregation over seeds and the claim-by-claim tests
- ``report``:     report.md, report.json and the PNGs
- ``timing``:     a study's wall time estimated from a finished study's per-run timings
- ``driver``:     the above end to end (recipes/study.py is its command line)

It sits at the engine level: it imports quatro_nemo.engine and quatro_nemo.eval, never the reverse.
"""
