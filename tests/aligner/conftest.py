"""Fixtures of the NeMo-Aligner adapter tests.

Modules that need the real NeMo-Aligner stack call ``pytest.importorskip("nemo_aligner")`` (they
run in ``.venv-aligner`` via ``scripts/test_aligner.sh`` and skip in the main environment); the
pure-function tests run everywhere.
"""
import pytest


@pytest.fixture
def quatro_spec():
    from quatro_nemo.algos import get_algorithm

    spec = get_algorithm("quatro")
    return spec, spec.config_cls
