"""The QUATRO subclasses against the real NeMo-Aligner 0.7.0 classes (``.venv-aligner`` only).

Run with ``scripts/test_aligner.sh``; skipped where ``nemo_aligner`` does not import (the main
environment).
"""
import inspect

import pytest

pytest.importorskip("nemo_aligner")

from nemo_aligner.algorithms.reinforce import ReinforceTrainer  # noqa: E402
from nemo_aligner.models.nlp.gpt.megatron_gpt_reinforce_actor import MegatronGPTReinforceActorModel  # noqa: E402

from quatro_nemo.aligner.actor import QuatroReinforceActor  # noqa: E402
from quatro_nemo.aligner.trainer import QuatroReinforceTrainer  # noqa: E402

# (subclass, parent, methods that must override a parent method, methods the subclass adds)
CASES = [
    (
        QuatroReinforceActor,
        MegatronGPTReinforceActorModel,
        {"__init__", "get_actor_forward_output_and_loss_func", "get_loss_and_metrics"},
        {"configure_algorithm", "needs_reference_logprobs", "reduce_step_metrics"},
    ),
    (
        QuatroReinforceTrainer,
        ReinforceTrainer,
        {"__init__", "_run_inference", "generate_reinforce_data", "run_training", "fit"},
        {"compute_reference", "_generate_scored_rollouts", "_gather_globally"},
    ),
]


@pytest.mark.parametrize("subclass,parent,overrides,additions", CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_overrides_exist_on_parent_with_same_signature(subclass, parent, overrides, additions):
    assert issubclass(subclass, parent)
    defined = {name for name, value in vars(subclass).items()
               if callable(value) or isinstance(value, property)} - {"__module__", "__doc__"}
    # Every method the subclass defines is either a listed override or a listed addition: a
    # misspelled override (which would silently never be called) fails here.
    assert defined == overrides | additions
    for name in overrides:
        assert hasattr(parent, name), f"{parent.__name__} has no {name} to override"
        ours = inspect.signature(getattr(subclass, name))
        theirs = inspect.signature(getattr(parent, name))
        assert list(ours.parameters) == list(theirs.parameters), f"{name}: {ours} != {theirs}"
    for name in additions:
        assert not hasattr(parent, name), f"{name} shadows a {parent.__name__} attribute"


def test_actor_mro_keeps_nemo_bases():
    names = [cls.__name__ for cls in QuatroReinforceActor.__mro__]
    assert names.index("MegatronGPTReinforceActorModel") < names.index("NLPAdapterModelMixin") \
        < names.index("MegatronGPTModel")


def test_the_aligner_recipe_imports_and_exits_75_when_preempted(monkeypatch):
    # The recipe runs only in the NeMo-Aligner container on GPUs; here its module must at least
    # import against the real NeMo-Aligner, and its training call sit inside the preemption exit.
    import importlib.util
    from pathlib import Path

    from quatro_nemo.megatron.preemption import PREEMPTED_EXIT_CODE, Preempted

    path = Path(__file__).resolve().parents[2] / "recipes" / "train_quatro_aligner.py"
    spec = importlib.util.spec_from_file_location("train_quatro_aligner", path)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    assert "with preemption_exits():\n            quatro_trainer.fit()" in inspect.getsource(recipe.main)
    with pytest.raises(SystemExit) as stop:
        with recipe.preemption_exits():
            raise Preempted("SIGUSR1")
    assert stop.value.code == PREEMPTED_EXIT_CODE == 75
