"""Shares the engine tests' warm-start cache fixture (the tiny base model is trained once)."""
from tests.engine.conftest import warm_cache  # noqa: F401
