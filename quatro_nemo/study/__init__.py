"""The side-by-side study (issue 9; docs/study.md): QUATRO vs the GRPO-family baselines on the CPU
default, over seeds, with the stability sweeps, the log-ratio ablation and QUATRO's diagnostics.

- ``config``:   the typed study config (conf/study/*.yaml)
- ``plan``:     the distinct training runs and their overrides; the SLURM sweep file
- ``runner``:   runs as independent recipes/train.py processes, a few at a time, resumable
- ``analysis``: aggregation over seeds and the claim-by-claim verdicts
- ``report``:   report.md, report.json and the PNGs
- ``driver``:   the above end to end (recipes/study.py is its command line)

It sits at the engine level: it imports quatro_nemo.engine and quatro_nemo.eval, never the reverse.
"""
