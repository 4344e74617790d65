"""Config validation shared by every package: one error type and each rule stated once.

Every typed config section (``quatro_nemo.algos.config``, ``quatro_nemo.engine.config``, the
memory planner, the study, the warm-start) checks its values with these helpers; each raises
:class:`ConfigError` whose message names the full dotted key, the value and why it is refused.

Choices are :class:`Choice` enums: Hydra/OmegaConf check an enum-typed field while composing (a
bad value fails naming the key and listing the options), and a :class:`Choice` member is a
``str`` that compares, hashes and formats as its value, so code and saved configs see the plain
string. :func:`coerce_choices` turns the strings a section built by hand was given into members
(and refuses unknown ones) in its ``__post_init__``.

This module sits below every package (pyproject.toml's layers): it imports nothing of ours.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import math
import typing
from typing import Any, Dict, Optional, Sequence, Type


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key (or file), value and rule."""


class Choice(str, enum.Enum):
    """A config choice: the member's name is its value (what OmegaConf matches while composing),
    and it behaves as that string (``==``, hashing, ``str``, f-strings, JSON)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def choices(name: str, values: Sequence[str], module: str) -> Type[Choice]:
    """A :class:`Choice` enum named ``name`` whose members are ``values`` (any strings, e.g.
    ``token-mean``); ``module``: the defining module's ``__name__`` (for pickling)."""
    return Choice(name, [(value, value) for value in values], module=module)


def choice_values(choice: Type[Choice]) -> list:
    return [member.value for member in choice]


def check_choice(key: str, value: Any, choice: Type[Choice]) -> Choice:
    """``value`` as a member of ``choice``; ConfigError naming ``key`` and the options otherwise."""
    try:
        return choice(value)
    except ValueError:
        raise ConfigError(f"{key} must be one of {choice_values(choice)}, got {value!r}") from None


@functools.lru_cache(maxsize=None)
def _choice_fields(cls: type) -> Dict[str, Type[Choice]]:
    hints = typing.get_type_hints(cls)
    found = {}
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        if typing.get_origin(hint) is typing.Union:  # Optional[SomeChoice]
            hint = next((arg for arg in typing.get_args(hint) if arg is not type(None)), None)
        if isinstance(hint, type) and issubclass(hint, Choice):
            found[f.name] = hint
    return found


def coerce_choices(section: Any, prefix: str) -> None:
    """Turn every :class:`Choice`-typed field of the dataclass ``section`` into its member (a field
    may hold the plain string when the section is built by hand); ConfigError naming
    ``<prefix>.<field>`` for a value that is not one of the choices. None stays None."""
    for name, choice in _choice_fields(type(section)).items():
        value = getattr(section, name)
        if value is not None:
            object.__setattr__(section, name, check_choice(f"{prefix}.{name}", value, choice))


def check_number(key: str, value: Any, *, positive: bool = False, non_negative: bool = False,
                 optional: bool = False, integer: bool = False) -> None:
    """``value`` must be a finite real number (an integer with ``integer``), > 0 with ``positive``,
    >= 0 with ``non_negative``; None passes with ``optional``."""
    if value is None and optional:
        return
    kind = "an integer" if integer else "a finite number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) \
            or not math.isfinite(value):
        raise ConfigError(f"{key} must be {kind}, got {value!r}")
    if positive and value <= 0:
        raise ConfigError(f"{key} must be > 0, got {value!r}")
    if non_negative and value < 0:
        raise ConfigError(f"{key} must be >= 0, got {value!r}")


def check_positive(key: str, value: Any) -> None:
    """``value`` > 0 (None is refused)."""
    if value is None or value <= 0:
        raise ConfigError(f"{key} must be > 0, got {value!r}")


def check_at_least(key: str, value: Any, minimum: float, why: str = "") -> None:
    if value is None or value < minimum:
        raise ConfigError(f"{key} must be >= {minimum:g}{f' ({why})' if why else ''}, got {value!r}")


def check_in_unit_interval(key: str, value: float, *, closed_low: bool = False, closed_high: bool = True) -> None:
    """``value`` in (0, 1] by default; the bounds' closedness as given."""
    low_ok = value >= 0.0 if closed_low else value > 0.0
    high_ok = value <= 1.0 if closed_high else value < 1.0
    if not (low_ok and high_ok):
        interval = f"{'[' if closed_low else '('}0, 1{']' if closed_high else ')'}"
        raise ConfigError(f"{key} must be in {interval}, got {value}")


def check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")


# ---------------------------------------------------------------------------------------------
# Rules that more than one section (or the loop) needs: each stated here once
# ---------------------------------------------------------------------------------------------


MIN_MICRO_BATCH_TOKENS = 2  # a micro-batch must hold one next-token prediction (T = width - 1 >= 1)


def check_token_budget(max_tokens: Optional[int], pack: bool = False) -> None:
    """``parallel.max_tokens_per_micro_batch``: 0/None (off) or >= 2 tokens; packing
    (``parallel.sequence_packing``) needs a budget."""
    if max_tokens is not None and max_tokens != 0 and max_tokens < MIN_MICRO_BATCH_TOKENS:
        raise ConfigError(f"parallel.max_tokens_per_micro_batch={max_tokens} must be >= {MIN_MICRO_BATCH_TOKENS} "
                          "tokens (or 0/null: off)")
    if pack and not max_tokens:
        raise ConfigError("parallel.sequence_packing=true needs parallel.max_tokens_per_micro_batch > 0 "
                          "(packing fills token-budget micro-batches)")


def check_mini_batches(prompts_per_step: int, mini_batch_prompts: Optional[int],
                       data_parallel: Optional[int] = None) -> int:
    """The prompts per optimizer step (``trainer.mini_batch_prompts``, null: the whole
    ``trainer.prompts_per_step``): they must divide the step's prompts and, given the
    data-parallel size, split evenly over its ranks. Returns the mini-batch size."""
    mini = mini_batch_prompts or prompts_per_step
    if prompts_per_step % mini:
        raise ConfigError(f"trainer.mini_batch_prompts={mini} does not divide trainer.prompts_per_step="
                          f"{prompts_per_step}")
    if data_parallel is not None and mini % data_parallel:
        raise ConfigError(f"trainer.mini_batch_prompts={mini} is not divisible by data_parallel={data_parallel} "
                          "(each data-parallel rank trains an equal share of a mini-batch)")
    return mini


__all__ = [
    "Choice", "ConfigError", "MIN_MICRO_BATCH_TOKENS", "check_at_least", "check_bool", "check_choice",
    "check_in_unit_interval", "check_mini_batches", "check_number", "check_positive", "check_token_budget",
    "choice_values", "choices", "coerce_choices",
]
