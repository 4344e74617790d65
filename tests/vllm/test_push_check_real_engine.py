"""``vllm.check_push`` with the real engine (vLLM's CPU build, whose linear weights are packed out of
reach): after each push, the engine's layers on fixed inputs equal megatron's weights, and a
deliberately wrong HF mapping (gate/up swapped, then k/v swapped) is caught by the layer it breaks.

One engine in a forked rank (``tests/distributed.run_ranks``): built by the product's ``build_run``,
then pushed three times through ``VllmRolloutBackend.generate``, the mapping replaced at its
import boundary (``hf_conversion.megatron_tensor_to_hf``) for the last two pushes."""
from __future__ import annotations

import pytest

from tests.distributed import run_ranks
from tests.vllm.conftest import SMALL

pytestmark = pytest.mark.slow


def _swapped(original, first: str, second: str):
    """``megatron_tensor_to_hf`` with the tensors of two HF names exchanged (a wrong mapping)."""

    def mapping(name, tensor, cfg, vocab_size=None):
        pairs = original(name, tensor, cfg, vocab_size)
        names = [n for n, _ in pairs]
        tensors = {n: t for n, t in pairs}
        for a, b in ((first, second), (second, first)):
            for index, n in enumerate(names):
                if n.endswith(a) and n[: -len(a)] + b in tensors:
                    pairs[index] = (n, tensors[n[: -len(a)] + b])
        return pairs

    return mapping


def _push_three_times(rank, args):
    from quatro_nemo.engine.config import load_config
    from quatro_nemo.engine.loop import build_run
    from quatro_nemo.megatron import hf_conversion
    from quatro_nemo.megatron.sampling import SamplingParams

    run = build_run(load_config(args))
    prompts = [run.task.encode_prompt(problem) for problem in run.task.train_problems[:2]]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4, seed=1)
    original, measured = hf_conversion.megatron_tensor_to_hf, {}
    for case, mapping in (("right", original), ("gate_up", _swapped(original, "gate_proj.weight", "up_proj.weight")),
                          ("kv", _swapped(original, "k_proj.weight", "v_proj.weight"))):
        hf_conversion.megatron_tensor_to_hf = mapping
        run.backend.update_weights()   # stale: the next generate pushes
        measured[case] = {k: v for k, v in run.backend.generate(prompts, 2, params).timings.items()
                          if k.startswith("engine_push/")}
    hf_conversion.megatron_tensor_to_hf = original
    return measured


def test_the_push_check_passes_the_real_push_and_catches_a_wrong_mapping(tmp_path):
    args = SMALL + ["vllm.check_push=true", "trainer.steps=1", f"run.dir={tmp_path / 'run'}"]
    measured = run_ranks(1, _push_three_times, args)[0]
    right, gate_up, kv = measured["right"], measured["gate_up"], measured["kv"]
    assert set(right) == {"engine_push/qkv_rel_err", "engine_push/gate_up_rel_err", "engine_push/logits_rel_err"}
    # float32 on both sides: the engine computes with exactly the pushed weights
    assert all(value < 1e-5 for value in right.values()), right
    assert gate_up["engine_push/gate_up_rel_err"] > 0.5 and gate_up["engine_push/qkv_rel_err"] < 1e-5, gate_up
    assert kv["engine_push/qkv_rel_err"] > 0.5 and kv["engine_push/gate_up_rel_err"] < 1e-5, kv
    assert all(case["engine_push/logits_rel_err"] < 1e-5 for case in (gate_up, kv))
