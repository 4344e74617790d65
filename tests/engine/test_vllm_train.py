"""``train()`` with ``rollout.backend=vllm`` on a GPU platform, vLLM replaced only at its import
boundary by the fake engine of ``tests/engine/fake_vllm``: what vLLM's CPU build cannot run here,
sleep mode between phases and the training state's offload around every sampling call (CUDA
memory). The real engine runs through ``recipes/train.py`` in ``tests/vllm/``.

Checked at TP=1 and TP=2 (two engines in one tensor-parallel group, each sampling half the prompts):

- rollouts and held-out evaluations alike sample with the optimizer state and gradient buffers
  offloaded (the memory plan's sampling phase), and reload them after; the offload (run on the
  CPU as on a GPU) reuses host buffers allocated once and returns the state bit for bit;

- each push gives the engine the trainer's weights: the pushed HF tensors, loaded into
  ``transformers``' Qwen2 (an independent implementation of the names and layouts), give the
  logits of the trainer's megatron model at that moment (gathered over TP);
- prompts and sampling parameters arrive as configured (temperature, top-p, max tokens, stop
  token, one seed per sequence, the same requests in both layouts);
- the tokens the engine returns are the rows the loss is computed on (response mask included),
  and the logged response length is theirs.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from quatro_nemo.engine.logging import read_metrics
from quatro_nemo.engine.config import VllmConfig
from tests.distributed import run_ranks
from tests.megatron.test_host_training_state import state_bytes

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

FAKE_VLLM = str(Path(__file__).resolve().parent / "fake_vllm")
STEPS, PROMPTS, N, MAX_NEW, TEMPERATURE, TOP_P, EVAL_TOP_P = 2, 8, 4, 10, 0.9, 0.8, 0.6


def train_args(run_dir: str, tensor: int):
    return [
        "rollout.backend=vllm", f"parallel.tensor={tensor}", "trainer.device=cpu",
        "model.architecture=qwen2", "model.vocab_size=32", "model.hidden_size=32", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.ffn_hidden_size=64", "model.max_position_embeddings=64",
        "model.init_method_std=0.3", "warmstart.enabled=false", "task.num_train=32", "task.num_heldout=4",
        f"trainer.steps={STEPS}", f"trainer.prompts_per_step={PROMPTS}", f"trainer.mini_batch_prompts={PROMPTS}",
        "trainer.checkpoint_every=1",
        "trainer.lr=3e-2", f"rollout.n={N}", f"rollout.max_new_tokens={MAX_NEW}",
        f"rollout.temperature={TEMPERATURE}", f"rollout.top_p={TOP_P}", "parallel.micro_batch_size=2",
        "eval.num_problems=2", "eval.n_samples=2", f"eval.top_p={EVAL_TOP_P}",
        "logging.tensorboard=false", "run.progress_bar=false",
        f"run.dir={run_dir}",
    ]


def hf_logits(hf_config: dict, hf_state: dict, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    config = transformers.Qwen2Config(**{k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")})
    model = transformers.Qwen2ForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict(hf_state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    with torch.no_grad():
        return model(tokens).logits


def _train_rank(rank: int, args, out_dir: str):
    sys.path.insert(0, FAKE_VLLM)
    import vllm

    from quatro_nemo.engine import loop
    from quatro_nemo.engine.config import load_config
    from quatro_nemo.megatron import training
    from tests.conversion.megatron_helpers import forward_logits

    assert vllm.__version__.endswith("quatro-fake")
    models, batches, push_checks = [], [], []
    tokens = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(0))

    def build_model(model_cfg):
        models.append(real_build_model(model_cfg))
        return models[-1]

    def forward_backward(model, mini, *rest, **kwargs):
        batches.append({"tokens": mini["tokens"].clone(), "response_mask": mini["response_mask"].clone()})
        return real_forward_backward(model, mini, *rest, **kwargs)

    real_offload, real_reload = training.HostTrainingState.offload, training.HostTrainingState.reload
    held, before_offload = [], []  # held: every host buffer, so a fresh one cannot reuse a freed address

    def offload(state):  # the product's offload, observed: its host buffers and what it released
        before_offload[:] = [state_bytes(state.optimizer)]
        real_offload(state)
        held.extend(state.host_buffers)
        vllm.LLM.instances[0].events.append({
            "call": "offload", "host_ptrs": [b.data_ptr() for b in state.host_buffers],
            "released": all(s.nbytes() == 0 for s in state.parked),
            "grads_released": all(b.grad_data.untyped_storage().nbytes() == 0 for b in state.ddp_model.buffers)})

    def reload(state):
        real_reload(state)
        after = state_bytes(state.optimizer)
        vllm.LLM.instances[0].events.append({
            "call": "reload", "seconds": dict(state.seconds),
            "identical": len(after) == len(before_offload[0]) and all(
                torch.equal(a, b) for a, b in zip(after, before_offload[0]))})

    training.HostTrainingState.offload, training.HostTrainingState.reload = offload, reload

    def check_push(hf_state):
        trainer = forward_logits(models[0], tokens)  # collective over TP, like the push itself
        engine = hf_logits(vllm.LLM.instances[0].hf_config, hf_state, tokens)
        push_checks.append({"max_diff": float((trainer - engine).abs().max()),
                            "scale": float(engine.abs().max())})

    real_build_model, real_forward_backward = loop.build_model, loop.train_step_forward_backward
    loop.build_model, loop.train_step_forward_backward = build_model, forward_backward
    vllm.PUSH_HOOK = check_push
    loop.train(load_config(args))
    (engine,) = vllm.LLM.instances
    torch.save({"events": engine.events, "batches": batches, "push_checks": push_checks},
               os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two-step runs at TP=1 and TP=2 (DP=1): every rank's engine events, trained batches and push checks."""
    out = {}
    for tensor in (1, 2):
        folder = tmp_path_factory.mktemp(f"tp{tensor}")
        args = train_args(str(folder / "run"), tensor)
        run_ranks(tensor, _train_rank, args, str(folder))
        out[tensor] = {"ranks": [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(tensor)],
                       "metrics": read_metrics(str(folder / "run" / "metrics.jsonl")), "args": args}
    return out


def generate_events(rank_record):
    return [e for e in rank_record["events"] if e["call"] == "generate"]


def step_requests(run, index):
    """All requests of the index-th generate call (eval 0, step 0, step 1, final eval), over the
    engines of the tensor-parallel group, in prompt order."""
    return [r for record in run["ranks"] for r in generate_events(record)[index]["requests"]]


@pytest.mark.parametrize("tensor", [1, 2])
def test_every_push_gives_the_engine_the_trainers_weights(runs, tensor):
    for record in runs[tensor]["ranks"]:
        checks = record["push_checks"]
        # eval at step 0, the rollouts of steps 0 and 1 (sleep level 2 drops the weights), final eval
        assert len(checks) == 2 + STEPS
        for check in checks:
            assert check["scale"] > 1.0  # logits at a scale where a wrong mapping would show
            assert check["max_diff"] < 1e-4, checks


@pytest.mark.parametrize("tensor", [1, 2])
def test_engine_is_built_from_the_config_and_sleeps_between_phases(runs, tensor):
    for record in runs[tensor]["ranks"]:
        start = record["events"][0]
        assert start["call"] == "LLM"
        # conf/config.yaml has no vllm: section: its typed defaults (the 7B test sets one)
        assert start["tensor_parallel_size"] == 1 and start["gpu_memory_utilization"] == VllmConfig().gpu_memory_utilization
        assert start["enable_sleep_mode"] is True and start["max_model_len"] == 64
        assert start["logprobs_mode"] == "raw_logprobs"  # log pi at temperature 1, as the trainer computes it
        assert start["distributed_executor_backend"] == "external_launcher" and start["dtype"] == "float32"
        hf = start["hf_config"]
        assert (hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"],
                hf["intermediate_size"]) == (32, 2, 4, 2, 64)
        calls = [e["call"] if e["call"] not in ("sleep", "wake_up") else (e["call"], e.get("level") or tuple(e["tags"]))
                 for e in record["events"][1:]]
        sample = ["offload", ("wake_up", ("weights",)), "collective_rpc", "load_weights", "reset_prefix_cache",
                  ("wake_up", ("kv_cache",)), "generate", ("sleep", 2), "reload"]
        # asleep from its construction on (before DDP, the optimizer, pi_ref); then the evaluation
        # at step 0, the rollouts of each step, the final evaluation: all offloaded
        assert calls == [("sleep", 2)] + sample * (2 + STEPS)


@pytest.mark.parametrize("tensor", [1, 2])
def test_the_offload_reuses_its_host_buffers_and_returns_the_state_bit_for_bit(runs, tensor):
    """The product's offload (megatron.training.HostTrainingState, run on the CPU as on a GPU):
    host buffers allocated once and reused, device storage and gradient buffers released while
    the engine samples, the optimizer state bit-identical after the reload, seconds logged."""
    for record in runs[tensor]["ranks"]:
        offloads = [e for e in record["events"] if e["call"] == "offload"]
        reloads = [e for e in record["events"] if e["call"] == "reload"]
        assert len(offloads) == len(reloads) == 2 + STEPS
        assert all(e["released"] and e["grads_released"] for e in offloads)
        assert all(e["identical"] and set(e["seconds"]) == {"time/offload", "time/reload"} for e in reloads)
        # evaluation 0 and step 0's rollout come before Adam's first step (no moments yet);
        # step 1's rollout allocates their buffers, the final evaluation reuses every one
        with_state = [e["host_ptrs"] for e in offloads if e["host_ptrs"]]
        assert len(with_state) >= 2 and all(ptrs == with_state[0] for ptrs in with_state)
    train = [m for m in runs[tensor]["metrics"] if m["kind"] == "train"]
    assert train and all(m["time/offload"] >= 0 and m["time/reload"] >= 0 for m in train)


@pytest.mark.parametrize("tensor", [1, 2])
def test_prompts_and_sampling_parameters_arrive_as_configured(runs, tensor):
    from quatro_nemo.engine.config import load_config
    from quatro_nemo.engine.task import build_task

    run = runs[tensor]
    task = build_task(load_config(run["args"]))
    train_prompts = {tuple(task.encode_prompt(p)) for p in task.train_problems}
    heldout_prompts = {tuple(task.encode_prompt(p)) for p in task.heldout_problems}
    for index in range(2 + STEPS):
        requests = step_requests(run, index)
        evaluation = index in (0, 1 + STEPS)
        n = 2 if evaluation else N
        assert len(requests) == (2 if evaluation else PROMPTS) * n
        for group in range(0, len(requests), n):  # N consecutive requests share one prompt
            assert len({tuple(r["prompt"]) for r in requests[group:group + n]}) == 1
        assert {tuple(r["prompt"]) for r in requests} <= (heldout_prompts if evaluation else train_prompts)
        seeds = [r["params"]["seed"] for r in requests]
        assert None not in seeds and len(set(seeds)) == len(seeds)
        for r in requests:
            params = r["params"]
            assert params["temperature"] == (1.0 if evaluation else TEMPERATURE)
            assert params["top_p"] == (EVAL_TOP_P if evaluation else TOP_P)
            assert params["max_tokens"] == MAX_NEW and params["stop_token_ids"] == list(task.stop_token_ids)
            assert params["n"] == 1 and params["logprobs"] == 0 and params["detokenize"] is False
    # The step prompts differ between steps, and the same requests come in both layouts.
    assert {tuple(r["prompt"]) for r in step_requests(run, 1)} != {tuple(r["prompt"]) for r in step_requests(run, 2)}
    if tensor == 2:
        for index in range(2 + STEPS):
            assert step_requests(run, index) == step_requests(runs[1], index)


@pytest.mark.parametrize("tensor", [1, 2])
def test_sampled_tokens_are_what_the_loss_trains_on(runs, tensor):
    run = runs[tensor]
    for step in range(STEPS):
        requests = step_requests(run, 1 + step)
        for record in run["ranks"]:
            assert len(record["batches"]) == STEPS  # one mini-batch (optimizer step) per rollout step
            batch = record["batches"][step]
            assert batch["tokens"].shape[0] == len(requests)
            for row, request in enumerate(requests):
                prompt, response = request["prompt"], request["tokens"]
                end = len(prompt) + len(response)
                assert batch["tokens"][row, :end].tolist() == prompt + response
                mask = batch["response_mask"][row]
                assert mask[len(prompt) - 1:end - 1].eq(1).all() and mask.sum() == len(response)
        record = [m for m in run["metrics"] if m["kind"] == "train" and m["step"] == step + 1][0]
        lengths = [len(r["tokens"]) for r in requests]
        assert record["response_length/mean"] == pytest.approx(sum(lengths) / len(lengths))
