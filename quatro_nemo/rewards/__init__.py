"""Verifiers: turn (problem, response) pairs into rewards in [0, 1].

Verifiers are looked up by name and imported lazily, so that e.g. the CPU task never imports
math-verify and the math path never imports the code sandbox.
"""
from __future__ import annotations

import importlib
from typing import Any, Dict, List, Protocol, Sequence

from quatro_nemo.validation import choices

# name -> "module:attribute" of a zero-argument factory (usually the class itself); a task's own
# verifier lives with its task (countdown: quatro_nemo.tasks.countdown) and is found here by name
_VERIFIERS: Dict[str, str] = {
    "countdown": "quatro_nemo.tasks.countdown.verifier:CountdownVerifier",
    "math": "quatro_nemo.rewards.math_verifier:MathVerifier",
    "code": "quatro_nemo.rewards.code:CodeVerifier",
}
VerifierName = choices("VerifierName", tuple(_VERIFIERS), __name__)   # a config's choice of verifier


class Verifier(Protocol):
    def score_batch(self, problems: Sequence[Dict[str, Any]], responses: Sequence[str]) -> List[float]:
        """One reward in [0, 1] per (problem, response) pair."""


def available_verifiers() -> List[str]:
    return sorted(_VERIFIERS)


def get_verifier(name: str, **kwargs: Any) -> Verifier:
    """Build the verifier registered under `name` (kwargs go to its constructor)."""
    if name not in _VERIFIERS:
        raise ValueError(f"unknown verifier {name!r}; choose one of {available_verifiers()}")
    module_name, attr = _VERIFIERS[name].split(":")
    factory = getattr(importlib.import_module(module_name), attr)
    return factory(**kwargs)
