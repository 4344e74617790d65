"""NeMo-Aligner 0.7.0 adapter: a QUATRO actor and trainer (docs/aligner.md).

Import lazily: ``quatro_nemo.aligner.actor`` and ``quatro_nemo.aligner.trainer`` import NeMo and
NeMo-Aligner (the NeMo-Aligner container or ``.venv-aligner``); ``rollouts``, ``loss``,
``rewards``, ``data`` and ``config`` do not. This package imports nothing by itself.
"""
