"""Hydra schemas of the algorithm configs (conf/algorithm/<name>.yaml).

The schema of option ``<name>`` is that algorithm's config dataclass (``quatro_nemo.algos.config``)
plus the ``name`` key the YAML files and saved run configs carry. Registered in Hydra's
ConfigStore as ``schema/algorithm/<name>``; each conf/algorithm/<name>.yaml lists it first in its
defaults, so an unknown ``algorithm.*`` key or an ill-typed value fails while Hydra composes.
Hydra is imported only by :func:`register_algorithm_schemas` (this layer stays importable without it).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Type

from quatro_nemo.algos.config import AlgorithmConfig
from quatro_nemo.algos.registry import ALGORITHMS, get_algorithm

SCHEMA_GROUP = "schema/algorithm"


@functools.lru_cache(maxsize=None)
def algorithm_schema(name: str) -> Type[AlgorithmConfig]:
    """The config dataclass of algorithm ``name`` plus a ``name`` field defaulting to it."""
    config_cls = get_algorithm(name).config_cls
    schema = dataclasses.make_dataclass(
        config_cls.__name__, [("name", str, dataclasses.field(default=name))], bases=(config_cls,),
        namespace={"__doc__": f"Hydra schema of algorithm={name}: {config_cls.__name__} plus its name."})
    schema.__module__ = __name__
    schema.__qualname__ = f"algorithm_schema({name!r})"
    return schema


def register_algorithm_schemas() -> None:
    """Store every registered algorithm's schema in Hydra's ConfigStore (``schema/algorithm/<name>``)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for name in ALGORITHMS:
        store.store(group=SCHEMA_GROUP, name=name, node=algorithm_schema(name))
