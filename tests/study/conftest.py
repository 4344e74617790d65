"""Shares the engine tests' warm-start cache and tiny-run fixtures (the tiny base model is trained once)."""
from tests.engine.conftest import tiny_args, warm_cache  # noqa: F401
