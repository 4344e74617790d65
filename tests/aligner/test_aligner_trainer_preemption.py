"""SIGUSR1 / SIGTERM during a CPU run of the QUATRO REINFORCE trainer (DP=2 over gloo): the run
checkpoints at the step boundary and stops with ``Preempted`` (the recipe's exit 75), and a rerun
from that checkpoint continues exactly where an uninterrupted run would be.

Real: NeMo-Aligner's ``ReinforceTrainer.fit`` (its ``check_progress`` time-limit path saves),
``Timer``, ``save`` / ``state_dict`` / ``load_state_dict``, its Megatron sampler, and
``retrieve_custom_trainer_state_dict`` (how the recipe recovers the trainer state from the
checkpoint's file name); PTL's ``ModelCheckpoint`` names the file from NeMo-Aligner's template.
Stand-ins (``aligner_standins.py``): the actor and the callback that writes the file (NeMo's
saves the PTL model, which needs a ``.nemo`` checkpoint). The signal reaches rank 1 only.
"""
import os
import signal
from types import SimpleNamespace

import pytest

pytest.importorskip("nemo_aligner")

from tests.distributed import run_ranks  # noqa: E402
from aligner_standins import (  # noqa: E402
    GLOBAL_BATCH_SIZE,
    INNER_LOOPS,
    NUM_RESPONSES,
    PROMPTS_PER_STEP,
    Actor,
    build_trainer,
)

STEPS = 4
OPTIMIZER_STEPS_PER_STEP = INNER_LOOPS * PROMPTS_PER_STEP * NUM_RESPONSES // GLOBAL_BATCH_SIZE  # 4
# NeMo-Aligner's checkpoint name (examples/nlp/gpt/conf/gpt_reinforce_actor.yaml)
FILENAME = "megatron_gpt-{step}-{consumed_samples}-{reinforce_optimization_step}-{epoch}-{val_rewards:.3f}"
TRAINER_OPTIONS = {"max_steps": STEPS, "val_check_interval": 10, "save_interval": 10}


class FileCheckpoint:
    """Writes one file per save, named as NeMo's callback names it (PTL's ``ModelCheckpoint``
    over the monitor candidates ``ReinforceTrainer.save`` passes)."""

    def __init__(self, dirpath):
        from lightning.pytorch.callbacks import ModelCheckpoint

        self.naming = ModelCheckpoint(dirpath=dirpath, filename=FILENAME)
        self.saved = []

    def custom_save(self, monitor_candidates, is_train_end):
        path = self.naming.format_checkpoint_name(monitor_candidates)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("model state would be here\n")
        self.saved.append(path)


def _run_rank(rank, ckpt_root, signal_number=None, signal_at_call=None, resume_from=None):
    """One rank: fit (optionally resuming from ``resume_from[rank]``), with ``signal_number`` sent
    to rank 1 itself at its ``signal_at_call``-th training micro-step."""
    from nemo_aligner.utils.train_script_utils import retrieve_custom_trainer_state_dict

    from quatro_nemo.megatron.parallel import initialize_parallel
    from quatro_nemo.megatron.preemption import Preempted

    initialize_parallel(tensor_parallel=1)  # world 2 -> DP 2

    def maybe_signal(call_number):
        if rank == 1 and call_number == signal_at_call:
            os.kill(os.getpid(), signal_number)

    actor = Actor(rank, on_training_call=maybe_signal)
    checkpoint = FileCheckpoint(os.path.join(ckpt_root, f"rank{rank}"))
    trainer = build_trainer(actor, checkpoint, **TRAINER_OPTIONS)
    if resume_from is not None:  # as the recipe: the trainer state parsed from the checkpoint path
        path = resume_from[rank]
        ptl_trainer = SimpleNamespace(ckpt_path=path, state=SimpleNamespace(fn=None),
                                      _checkpoint_connector=SimpleNamespace(_select_ckpt_path=lambda *_: path))
        trainer.load_state_dict(retrieve_custom_trainer_state_dict(ptl_trainer))
    preempted = None
    try:
        trainer.fit()
    except Preempted as exc:
        preempted = str(exc)
    return {"preempted": preempted, "step": trainer.step, "consumed_samples": trainer.consumed_samples,
            "optimizer_steps": trainer.reinforce_optimization_step, "saved": checkpoint.saved,
            "prompt_ids_asked": actor.prompt_ids_asked, "trained_calls": len(actor.trained_on)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    results = run_ranks(2, _run_rank, str(tmp_path_factory.mktemp("reference-ckpt")))
    for result in results:
        assert result["preempted"] is None and result["step"] == STEPS
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("signal_number", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_signal_checkpoints_at_the_step_boundary_and_a_rerun_resumes(tmp_path, uninterrupted, signal_number):
    ckpt_root = str(tmp_path / "ckpt")
    # The signal reaches rank 1 during its 2nd optimizer step of training step 2 (of 4).
    stopped = run_ranks(2, _run_rank, ckpt_root, signal_number, OPTIMIZER_STEPS_PER_STEP + 2)
    name = signal.Signals(signal_number).name
    for rank, result in enumerate(stopped):
        # Both ranks (rank 0 learns of it through the collective) finish step 2, save, and stop.
        assert result["preempted"] == (f"{name} at step 2" if rank == 1 else "signal on another rank at step 2")
        assert (result["step"], result["consumed_samples"]) == (2, 2 * PROMPTS_PER_STEP)
        assert result["trained_calls"] == result["optimizer_steps"] == 2 * OPTIMIZER_STEPS_PER_STEP
        (path,) = result["saved"]  # save_interval 10: only the signal saved
        assert os.path.basename(path).startswith(
            f"megatron_gpt-step=2-consumed_samples={2 * PROMPTS_PER_STEP}-"
            f"reinforce_optimization_step={2 * OPTIMIZER_STEPS_PER_STEP}-")

    resumed = run_ranks(2, _run_rank, str(tmp_path / "ckpt-resumed"), None, None,
                        [result["saved"][0] for result in stopped])
    generation_calls_per_step = len(uninterrupted[0]["prompt_ids_asked"][:-1]) // STEPS  # the last is validation
    for rank in range(2):
        reference, first, second = uninterrupted[rank], stopped[rank], resumed[rank]
        assert second["preempted"] is None
        for key in ("step", "consumed_samples", "optimizer_steps"):
            assert second[key] == reference[key], key
        # Same prompts in the same order as without the interruption: steps 1-2, then 3-4 and the
        # final validation (the stopped run's own validation, before its save, is not training).
        assert first["prompt_ids_asked"][:2 * generation_calls_per_step] + second["prompt_ids_asked"] \
            == reference["prompt_ids_asked"]
        assert second["trained_calls"] == 2 * OPTIMIZER_STEPS_PER_STEP
