"""The fake vLLM of ``tests/engine/fake_vllm`` (what the main suite's tests of the GPU-only paths,
sleep mode among them, run against) checked against the real vLLM 0.32.0 installed here: the
calls the backend makes have the real signatures, the fake sleeps exactly the real executor's
tags, and each call the fake refuses is one the real engine ignores with a warning (its text is in
the real source), so a backend that relied on it would believe a state the engine is not in."""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import sys

import pytest

from tests.vllm.conftest import REPO

FAKE = REPO / "tests" / "engine" / "fake_vllm" / "vllm" / "__init__.py"


@pytest.fixture(scope="module")
def fake():
    spec = importlib.util.spec_from_file_location("quatro_fake_vllm", FAKE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _parameters(function):
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]


def test_sleep_and_wake_up_have_the_real_signatures(fake):
    import vllm

    assert _parameters(fake.LLM.sleep) == _parameters(vllm.LLM.sleep)
    assert _parameters(fake.LLM.wake_up) == _parameters(vllm.LLM.wake_up)


def test_every_engine_argument_the_fake_takes_is_a_real_one(fake):
    import vllm

    real = {field.name for field in dataclasses.fields(vllm.EngineArgs)}
    taken = [name for name, _ in _parameters(fake.LLM.__init__) if name != "self"]
    assert set(taken) <= real, sorted(set(taken) - real)


def test_the_fake_sleeps_the_real_executors_tags_and_refuses_what_it_ignores(fake, tmp_path):
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.abstract import SLEEP_TAGS, Executor

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 8}))
    engine = fake.LLM(model=str(tmp_path), load_format="dummy", tensor_parallel_size=1,
                      distributed_executor_backend="uni", dtype="float32", gpu_memory_utilization=0.5,
                      enable_sleep_mode=True, max_model_len=16, max_num_seqs=4, enforce_eager=True, seed=0,
                      skip_tokenizer_init=True, logprobs_mode="raw_logprobs")
    sleep_source, wake_source = inspect.getsource(Executor.sleep), inspect.getsource(Executor.wake_up)
    with pytest.raises(RuntimeError, match="Executor is not sleeping"):
        engine.wake_up(tags=["weights"])
    assert "Executor is not sleeping." in wake_source
    engine.sleep(level=2)
    assert engine.asleep_tags == set(SLEEP_TAGS)
    with pytest.raises(RuntimeError, match="Executor is already sleeping"):
        engine.sleep(level=2)
    assert "Executor is already sleeping." in sleep_source
    with pytest.raises(RuntimeError, match="vLLM logs a warning and wakes none of the tags"):
        engine.wake_up(tags=["weights", "cudagraph"])   # not a sleeping tag: the real one wakes nothing
    assert "is not in sleeping tags" in wake_source and engine.asleep_tags == set(SLEEP_TAGS)
    with pytest.raises(RuntimeError, match="reload_weights\\(\\) while the weights sleep"):
        engine.collective_rpc("reload_weights", kwargs={"weights_iterator": iter([])})
    assert engine.wake_up(tags=["weights", "scheduling"]) is False   # "scheduling" is the scheduler's, dropped
    assert '"scheduling"' in inspect.getsource(EngineCore.wake_up)
    with pytest.raises(RuntimeError, match="scheduler stays paused until every tag is awake"):
        engine.generate([], sampling_params=[], use_tqdm=False)
    assert engine.wake_up(tags=["kv_cache"]) is True and engine.asleep_tags == set()
