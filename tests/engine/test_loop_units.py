"""Pure pieces of the training loop: data position, data-parallel slots."""

from quatro_nemo.engine.loop import local_prompt_slots
from quatro_nemo.engine.step_rollout import step_prompt_indices


def test_prompt_stream_is_a_pure_function_of_the_step_and_covers_each_epoch_once():
    dataset, batch = 10, 4
    steps = [step_prompt_indices(s, batch, dataset, seed=3) for s in range(5)]   # 20 draws = 2 epochs
    flat = [i for s in steps for i in s]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != list(range(10))                                        # shuffled
    assert flat[:10] != flat[10:]                                              # reshuffled each epoch
    assert steps == [step_prompt_indices(s, batch, dataset, seed=3) for s in range(5)]  # no hidden state
    assert steps != [step_prompt_indices(s, batch, dataset, seed=4) for s in range(5)]


def test_data_parallel_slots_partition_every_mini_batch_evenly():
    batch, mini, dp = 12, 6, 3
    per_rank = [local_prompt_slots(batch, mini, r, dp) for r in range(dp)]
    assert sorted(s for slots in per_rank for s in slots) == list(range(batch))
    for start in range(0, batch, mini):                      # each optimizer step: 2 prompts per rank
        for slots in per_rank:
            assert sum(start <= s < start + mini for s in slots) == mini // dp
    assert local_prompt_slots(batch, batch, 0, 1) == list(range(batch))


def test_train_state_reads_checkpoints_written_before_it_existed():
    """A checkpoint's ``common`` from before issue 30 (a position dict with QUATRO's controller at
    the top level) resumes as the same position and controller state."""
    import io

    import torch

    from quatro_nemo.algos import QuatroConfig, get_algorithm
    from quatro_nemo.engine.checkpoint import TrainState

    controller = {"delta": 0.0625, "updates": 3, "last_kl": 0.02}
    buffer = io.BytesIO()
    torch.save({"next_step": 4, "optimizer_steps": 16, "delta_controller": controller}, buffer)
    buffer.seek(0)
    state = TrainState.from_common(torch.load(buffer, weights_only=False))
    assert (state.next_step, state.optimizer_steps) == (4, 16)
    quatro = get_algorithm("quatro").make_state(QuatroConfig.from_dict({"delta_controller": {"kind": "kl"}}))
    quatro.load_state_dict(state.algorithm_state)
    assert quatro.delta_controller.state_dict() == controller
    # and the new form round-trips
    assert TrainState.from_common(state.to_common()) == state
    assert TrainState.from_common({"next_step": 2, "optimizer_steps": 8}) == TrainState(2, 8, {})
