"""Evaluation suite (paper Sec. 4, App. C; quatro-math.md Sec. 6).

- ``passk``: unbiased Pass@k, UCC@k, UCR
- ``similarity``: pairwise similarity metrics and near-duplicate clustering
- ``entropy``: token entropy; ``flip``: flip rate by base-difficulty bucket
- ``samples``: the samples JSONL format; ``report``: ``evaluate_runs`` / ``write_report``
- ``tables`` / ``plots``: Markdown, CSV, JSON and PNG output

Submodules are imported on use, so ``import quatro_nemo.eval`` stays cheap.
"""
