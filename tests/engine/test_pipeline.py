"""The rollout pipeline's schedule (quatro_nemo/engine/pipeline.py; docs/quatro-math.md Sec. 9.1)
with executors that sample nothing, and the checkpoint form of rollouts in flight
(quatro_nemo/engine/rollout_store.py) against hand-built rollouts."""
from __future__ import annotations

import pytest
import torch

from quatro_nemo.engine import rollout_store
from quatro_nemo.engine.executors import InlineExecutor
from quatro_nemo.engine.pipeline import RolloutPipeline, RolloutRequest, ScheduleError, rollout_version
from quatro_nemo.engine.rollout import RolloutBatch, pad_to_length
from quatro_nemo.megatron.sampling import SampleOutput
from quatro_nemo.validation import ConfigError

STEPS = 8


class Trainer:
    """The trainer's position as the loop advances it: version = next step; optimizer steps 3 per step."""

    def __init__(self, step=0):
        self.step = step

    def position(self):
        return self.step, 3 * self.step


class RecordingExecutor(InlineExecutor):
    """The inline executor on a sampler that returns an empty marker batch, with a log of every
    push and submit; ``lose_push_at``: the weights of that version never reach the sampler (it
    keeps sampling with the previous ones), as when a push is lost."""

    def __init__(self, trainer, lose_push_at=None):
        super().__init__(sample=lambda step: None, weights_position=self.sampler_position)
        self.trainer, self.lose_push_at, self.loaded, self.log = trainer, lose_push_at, 0, []

    def sampler_position(self):
        return self.loaded, 3 * self.loaded

    def push(self, version):
        self.log.append(("push", version))
        if version != self.lose_push_at:
            self.loaded = version

    def submit(self, request):
        self.log.append(("submit", request.step, request.version))
        super().submit(request)


def run_schedule(k, steps=STEPS, lose_push_at=None):
    trainer = Trainer()
    executor = RecordingExecutor(trainer, lose_push_at)
    pipeline = RolloutPipeline(k, executor)
    taken = []
    for step in range(steps):
        trainer.step = step
        pipeline.advance(step)
        assert pipeline.outstanding(step) == k + 1
        taken.append(pipeline.take(step, optimizer_steps=3 * step))
    return executor.log, taken, pipeline


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_each_step_is_sampled_by_version_max_0_s_minus_k_after_its_push(k):
    log, taken, _ = run_schedule(k)
    submits = [(event[1], event[2]) for event in log if event[0] == "submit"]
    assert submits == [(s, max(0, s - k)) for s in range(STEPS + k)]
    for position, event in enumerate(log):          # every submit follows the push of its version
        if event[0] == "submit":
            assert ("push", event[2]) in log[:position]
    assert [t.result.version for t in taken] == [rollout_version(s, k) for s in range(STEPS)]
    assert [t.metrics["async/staleness"] for t in taken] == [min(s, k) for s in range(STEPS)]
    assert [t.metrics["async/staleness_optimizer_steps"] for t in taken] == [3 * min(s, k) for s in range(STEPS)]
    assert [t.metrics["async/outstanding"] for t in taken] == [k + 1] * STEPS
    assert all(t.result.step == s for s, t in enumerate(taken))


def test_a_lost_push_fails_the_step_sampled_by_the_stale_weights():
    with pytest.raises(ScheduleError, match=r"step 5 is step 5's, sampled by version 2; the schedule says version 3"):
        run_schedule(k=2, lose_push_at=3)


def test_taking_a_step_never_submitted_or_submitting_past_the_bound_fails():
    trainer = Trainer()
    pipeline = RolloutPipeline(1, RecordingExecutor(trainer))
    with pytest.raises(ScheduleError, match="step 0 was never submitted"):
        pipeline.take(0, 0)
    resumed = RolloutPipeline(1, RecordingExecutor(Trainer(4)), submitted_through=2)   # steps 3 lost
    with pytest.raises(ScheduleError, match=r"steps 3..3 were never submitted"):
        resumed.advance(4)


def test_the_inline_executor_stamps_the_trainers_position_and_refuses_a_push_it_is_not_at():
    trainer = Trainer(step=2)
    executor = InlineExecutor(sample=lambda step: f"rollout {step}", weights_position=trainer.position)
    executor.push(2)
    with pytest.raises(ScheduleError, match="version 3 pushed, but the trainer is at step 2"):
        executor.push(3)
    executor.submit(RolloutRequest(4, 2))
    result = executor.collect(4)
    assert (result.step, result.version, result.optimizer_steps, result.batch) == (4, 2, 6, "rollout 4")


def test_a_pipeline_resumed_from_its_drained_state_continues_the_same_schedule():
    k, stop = 2, 3
    log, taken, _ = run_schedule(k)
    trainer = Trainer()
    first = RolloutPipeline(k, RecordingExecutor(trainer))
    for step in range(stop):
        trainer.step = step
        first.advance(step)
        first.take(step, 3 * step)
    in_flight = first.drain(stop)
    assert sorted(in_flight) == list(range(stop, stop + k))
    resumed_executor = RecordingExecutor(Trainer(stop))
    resumed_executor.loaded = stop
    resumed = RolloutPipeline(k, resumed_executor, finished=in_flight, submitted_through=first.submitted_through)
    for step in range(stop, STEPS):
        resumed_executor.trainer.step = step
        resumed.advance(step)
        again = resumed.take(step, 3 * step)
        assert (again.result.step, again.result.version) == (taken[step].result.step, taken[step].result.version)
    assert [e for e in resumed_executor.log if e[0] == "submit"] == [e for e in log if e[0] == "submit"][stop + k:]


# ------------------------------------------------------------------ rollouts in the checkpoint

N, PAD = 3, 7


def hand_rollout(slots, seed, engine=True):
    """A rollout of len(slots) prompts x N rows, rows of different prompt and response lengths,
    right-padded with PAD to the longest row as the backends pad them."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(slots) * N
    prompt_lengths = torch.randint(2, 5, (rows,), generator=gen)
    response_lengths = torch.randint(1, 6, (rows,), generator=gen)
    width = int((prompt_lengths + response_lengths).max())
    tokens = torch.full((rows, width), PAD, dtype=torch.long)
    mask = torch.zeros(rows, width - 1)
    for row in range(rows):
        end = int(prompt_lengths[row] + response_lengths[row])
        tokens[row, :end] = torch.randint(10, 50, (end,), generator=gen)
        mask[row, int(prompt_lengths[row]) - 1:end - 1] = 1.0
    logprobs = -torch.rand(rows, width - 1, generator=gen) * mask
    sample = SampleOutput(tokens=tokens, response_mask=mask, logprobs=logprobs, prompt_lengths=prompt_lengths,
                          response_lengths=response_lengths, finished=torch.rand(rows, generator=gen) < 0.5)
    engine_logprobs = (logprobs - 0.01 * torch.rand(rows, width - 1, generator=gen)) * mask if engine else None
    return RolloutBatch(sample, len(slots), N, engine_logprobs=engine_logprobs, timings={"time/offload": 0.5})


def assert_same_batch(got: RolloutBatch, expected: RolloutBatch):
    for name in ("tokens", "response_mask", "logprobs", "prompt_lengths", "response_lengths", "finished"):
        assert torch.equal(getattr(got.sample, name), getattr(expected.sample, name)), name
    assert (got.engine_logprobs is None) == (expected.engine_logprobs is None)
    if expected.engine_logprobs is not None:
        assert torch.equal(got.engine_logprobs, expected.engine_logprobs)
    assert (got.num_prompts, got.num_samples) == (expected.num_prompts, expected.num_samples)


@pytest.mark.parametrize("engine", [True, False])
def test_slot_records_give_back_the_rollout_bit_for_bit(engine):
    slots = [4, 5, 0, 1]
    batch = hand_rollout(slots, seed=3, engine=engine)
    records = rollout_store.slot_records(batch, slots)
    assert sorted(records) == sorted(slots)
    assert_same_batch(rollout_store.batch_from_slots(records, slots, N, PAD), batch)


def test_rollouts_saved_by_two_data_parallel_ranks_load_at_one_and_the_other_way_round():
    """Rank r of DP=2 holds slots [2r, 2r+1] of a 4-prompt step: one rank at DP=1 takes all four,
    rows in slot order, padded to the longest (the rollout a DP=1 run would have sampled)."""
    parts = {0: hand_rollout([0, 1], seed=1), 1: hand_rollout([2, 3], seed=2)}
    records = {**rollout_store.slot_records(parts[0], [0, 1]), **rollout_store.slot_records(parts[1], [2, 3])}
    whole = rollout_store.batch_from_slots(records, [0, 1, 2, 3], N, PAD)
    width = max(parts[r].tokens.shape[1] for r in parts)
    padded = [pad_to_length(parts[r].sample, width, PAD) for r in (0, 1)]
    assert torch.equal(whole.tokens, torch.cat([p.tokens for p in padded]))
    assert torch.equal(whole.response_mask, torch.cat([p.response_mask for p in padded]))
    # and back: each DP rank of a resumed DP=2 run gets its own rollout bit for bit
    back = rollout_store.slot_records(whole, [0, 1, 2, 3])
    for rank, slots in ((0, [0, 1]), (1, [2, 3])):
        assert_same_batch(rollout_store.batch_from_slots(back, slots, N, PAD), parts[rank])


def test_the_saved_state_restores_the_rollouts_in_flight_and_refuses_another_staleness():
    slots = [0, 1]
    trainer = Trainer()
    batches = {step: hand_rollout(slots, seed=10 + step) for step in range(6)}
    executor = InlineExecutor(sample=batches.__getitem__, weights_position=trainer.position)
    pipeline = RolloutPipeline(2, executor)
    for step in range(2):
        trainer.step = step
        pipeline.advance(step)
        pipeline.take(step, 3 * step)
    state = rollout_store.pipeline_state(pipeline, next_step=2, slots=slots)
    assert (state["max_staleness"], state["submitted_through"], sorted(state["results"])) == (2, 3, [2, 3])
    finished, submitted_through = rollout_store.restore(state, 2, 2, slots, PAD, where="step_000002")
    assert submitted_through == 3
    for step in (2, 3):
        version = rollout_version(step, 2)
        assert (finished[step].version, finished[step].optimizer_steps) == (version, 3 * version)
        assert_same_batch(finished[step].batch, batches[step])
    with pytest.raises(ConfigError, match=r"rollout.pipeline.max_staleness=1, but .* step_000002 was written with "
                                          r"rollout.pipeline.max_staleness=2"):
        rollout_store.restore(state, 2, 1, slots, PAD, where="step_000002")
    with pytest.raises(ConfigError, match=r"rollout.pipeline.max_staleness=2, .* written with rollout.pipeline.max_staleness=0"):
        rollout_store.restore(None, 2, 2, slots, PAD, where="step_000002")
    assert rollout_store.restore(None, 2, 0, slots, PAD, where="step_000002") == ({}, 1)
