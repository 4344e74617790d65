"""What the training loop trains on: prompts, a tokenizer, a verifier and the base model.

`build_task(cfg)` reads the typed `task:` section; the config group option `task=<name>`
(conf/task/<name>.yaml, schema :data:`TASK_SCHEMAS`) picks the kind:

- `countdown`: the embedded CPU task (quatro_nemo.data.countdown). The base model comes from the
  cached supervised warm-start (quatro_nemo.engine.warmstart), the same in every parallel layout.
  `task.reward` picks the verifier's reward: `binary` (default, exact answers) or `graded`
  (partial credit by how close a valid answer gets to the target, `task.partial_credit`;
  quatro_nemo.rewards.countdown).
- `jsonl`: prompts from JSONL files of the project schema (recipes/prepare_data.py writes them),
  a Hugging Face tokenizer, a verifier by name (math, code, countdown) and a base model from a
  Hugging Face checkpoint (quatro_nemo.megatron.hf_conversion): the cluster configs.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from quatro_nemo.data.countdown import CountdownTaskConfig
from quatro_nemo.data.schema import read_problems
from quatro_nemo.data.tokenizer import TokenizerConfig
from quatro_nemo.megatron.parallel import is_rank_zero
from quatro_nemo.rewards import get_verifier
from quatro_nemo.rewards.countdown import CountdownRewardConfig
from quatro_nemo.validation import ConfigError


@dataclass
class Task:
    name: str
    train_problems: List[Dict[str, Any]]
    heldout_problems: List[Dict[str, Any]]
    verifier: Any
    vocab_size: int
    stop_token_ids: Tuple[int, ...]   # every token that ends a response (:func:`checkpoint_end_tokens`)
    pad_id: int
    encode_prompt: Callable[[Dict[str, Any]], List[int]]
    decode_response: Callable[[Sequence[int]], str]
    # ModelConfig -> full state dict, or None: keep the model's own (random) initialisation
    load_base_state: Callable[[Any], Optional[Dict[str, torch.Tensor]]]
    solution_key: Optional[Callable[[Dict[str, Any], str], str]] = None
    properties: Dict[str, Any] = field(default_factory=dict)    # shown in the run report

    def sample(self, backend, problems: Sequence[Dict[str, Any]], prompt_indices: Sequence[int], n: int,
               params) -> Tuple[Any, List[str]]:
        """N responses per problem (grouped rows) and their decoded texts. `prompt_indices` are the
        problems' global positions: the sampling noise of each row depends only on them."""
        rollout = backend.generate([self.encode_prompt(p) for p in problems], n, params,
                                   prompt_indices=list(prompt_indices))
        return rollout, [self.decode_response(ids) for ids in rollout.response_ids()]

    def model_config(self, model_config):
        """The run's ``model`` section (a ModelConfig) with this task's vocabulary size unless the
        section sets one."""
        return dataclasses.replace(model_config, vocab_size=model_config.vocab_size or self.vocab_size)


def _check_task_name(section, expected: str) -> None:
    if section.name != expected:
        raise ValueError(f"task.name={section.name!r} but this is the {expected} task's section: "
                         f"choose the task with task=<name> (conf/task/)")


@dataclass
class CountdownTaskSection(CountdownRewardConfig, CountdownTaskConfig):
    """task=countdown (conf/task/countdown.yaml): the embedded CPU task's problems
    (CountdownTaskConfig's keys), its reward (CountdownRewardConfig's: task.reward,
    task.partial_credit) and its character tokenizer."""

    name: str = "countdown"
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)

    def __post_init__(self) -> None:
        CountdownTaskConfig.__post_init__(self)
        CountdownRewardConfig.__post_init__(self)
        _check_task_name(self, "countdown")

    def problems(self) -> CountdownTaskConfig:
        """The problem generator's config (not the reward: the warm-start's cache key is the problems')."""
        return _part(self, CountdownTaskConfig)

    def reward_config(self) -> CountdownRewardConfig:
        return _part(self, CountdownRewardConfig)


def _part(section, cls: type):
    """The ``cls`` dataclass made of the fields ``section`` shares with it."""
    return cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(cls)})


@dataclass
class JsonlTaskConfig:
    """task=jsonl (conf/task/jsonl.yaml): the cluster setting (MATH and friends in the project's JSONL schema)."""

    name: str = "jsonl"
    train_path: str = ""        # JSONL written by recipes/prepare_data.py
    eval_path: str = ""         # held-out JSONL evaluated during training
    hf_checkpoint: str = ""     # Hugging Face model directory: tokenizer and base weights
    verifier: str = "math"      # a name in quatro_nemo.rewards (math, code, countdown)
    verifier_options: Dict[str, Any] = field(default_factory=dict)  # e.g. code: reward, num_workers

    def __post_init__(self) -> None:
        _check_task_name(self, "jsonl")


# task=<name>: the schema of each option (Hydra ConfigStore schema/task/<name>)
TASK_SCHEMAS = {"countdown": CountdownTaskSection, "jsonl": JsonlTaskConfig}


def register_task_schemas() -> None:
    """Store each task's schema in Hydra's ConfigStore; conf/task/<name>.yaml lists it first."""
    from hydra.core.config_store import ConfigStore

    for name, schema in TASK_SCHEMAS.items():
        ConfigStore.instance().store(group="schema/task", name=name, node=schema)


def build_countdown_task(cfg) -> Task:
    from quatro_nemo.data import countdown
    from quatro_nemo.data.tokenizer import CharTokenizer
    from quatro_nemo.engine.warmstart import load_or_train_base_model

    task_cfg, tokenizer_cfg, warm_cfg = cfg.task.problems(), cfg.task.tokenizer, cfg.warmstart
    tokenizer = CharTokenizer(tokenizer_cfg)
    train = countdown.generate_split(task_cfg, "train")
    heldout = countdown.generate_split(task_cfg, "heldout")
    warm_report: Dict[str, Any] = {}

    def load_base_state(model_cfg) -> Optional[Dict[str, torch.Tensor]]:
        if not warm_cfg.enabled:  # warmstart.enabled=false: a randomly initialised base model
            warm_report.update(enabled=False)
            return None
        state, report = load_or_train_base_model(task_cfg, tokenizer_cfg, model_cfg, warm_cfg)
        warm_report.update(report)
        return state

    properties = {"task": dataclasses.asdict(countdown.measure_task_properties(heldout)),
                  "warmstart": warm_report}
    return Task(
        name="countdown", train_problems=train, heldout_problems=heldout,
        verifier=get_verifier("countdown", **dataclasses.asdict(cfg.task.reward_config())),
        vocab_size=tokenizer.vocab_size, stop_token_ids=(tokenizer.eos_id,), pad_id=tokenizer.pad_id,
        encode_prompt=lambda problem: tokenizer.encode_prompt(problem["prompt"]),
        decode_response=tokenizer.decode,
        load_base_state=load_base_state,
        solution_key=lambda problem, response: countdown.canonical_expression(response) or response,
        properties=properties,
    )


def checkpoint_end_tokens(checkpoint_dir: str, tokenizer_eos_id: Optional[int]) -> Tuple[int, ...]:
    """Every token that ends a response of the Hugging Face checkpoint in ``checkpoint_dir``: the
    tokenizer's EOS first, then the ``eos_token_id`` of ``config.json`` and of
    ``generation_config.json`` (an int or a list; Qwen2.5 base checkpoints end with
    ``<|endoftext|>`` or ``<|im_end|>``), without repeats. Raises ValueError naming the files when
    none of them names one."""
    ids: List[int] = [] if tokenizer_eos_id is None else [int(tokenizer_eos_id)]
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(checkpoint_dir, name)
        if not os.path.exists(path):
            continue
        with open(path) as handle:
            value = json.load(handle).get("eos_token_id")
        for token in (value if isinstance(value, list) else [value]):
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    if not ids:
        raise ValueError(f"{checkpoint_dir}: no end-of-sequence token in the tokenizer, config.json or "
                         "generation_config.json (eos_token_id)")
    return tuple(ids)


def build_jsonl_task(cfg) -> Task:
    """Prompts from JSONL, HF tokenizer and base model (task.train_path, task.eval_path,
    task.hf_checkpoint, task.verifier)."""
    from transformers import AutoTokenizer

    from quatro_nemo.megatron.hf_conversion import load_hf_state_as_megatron

    t = cfg.task
    for key in ("train_path", "eval_path", "hf_checkpoint"):
        if not getattr(t, key):
            raise ValueError(f"task.{key} must be set for task.name=jsonl")
    tokenizer = AutoTokenizer.from_pretrained(t.hf_checkpoint)
    vocab_size = task_vocab_size(t)
    stop_token_ids = checkpoint_end_tokens(t.hf_checkpoint, tokenizer.eos_token_id)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_token_ids[0]
    return Task(
        name="jsonl", train_problems=read_problems(t.train_path), heldout_problems=read_problems(t.eval_path),
        verifier=get_verifier(t.verifier, **t.verifier_options), vocab_size=vocab_size,
        stop_token_ids=stop_token_ids, pad_id=pad_id, solution_key=_SOLUTION_KEYS.get(t.verifier),
        encode_prompt=lambda problem: tokenizer.encode(problem["prompt"]),
        decode_response=lambda ids: tokenizer.decode([i for i in ids if i not in stop_token_ids],
                                                     skip_special_tokens=True),
        load_base_state=lambda model_cfg: load_hf_state_as_megatron(t.hf_checkpoint, model_cfg),
    )


def _code_solution_key(problem: Dict[str, Any], response: str) -> str:
    """Programs equal up to formatting, comments and identifier names are one solution."""
    from quatro_nemo.eval.code_similarity import normalized_program

    return normalized_program(response)


_SOLUTION_KEYS = {"code": _code_solution_key}
_TASKS = {"countdown": build_countdown_task, "jsonl": build_jsonl_task}


def task_vocab_size(section) -> int:
    """The vocabulary size a task's model needs (what a null ``model.vocab_size`` becomes), read
    without building the task: the countdown tokenizer's (padded) size, or a JSONL task's
    checkpoint's ``config.json`` ``vocab_size`` (the model's padded vocabulary, not
    ``len(tokenizer)``). Raises ValueError naming the key or file it could not read."""
    if isinstance(section, CountdownTaskSection):
        from quatro_nemo.data.tokenizer import CharTokenizer

        return CharTokenizer(section.tokenizer).vocab_size
    path = os.path.join(section.hf_checkpoint, "config.json")
    try:
        with open(path) as handle:
            return int(json.load(handle)["vocab_size"])
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"model.vocab_size is null, and the vocabulary size cannot be read from {path} "
                         f"(task.hf_checkpoint): {exc}") from exc


def drop_long_prompts(task: Task, max_prompt_tokens: int) -> Task:
    """``task`` without the training prompts longer than ``max_prompt_tokens`` tokens
    (``scale.max_prompt_tokens``, the prompt length the memory plan assumes; verl's
    ``filter_overlong_prompts``); rank 0 prints how many it dropped, and the run report shows it.
    Held-out problems are kept (evaluation compares every problem)."""
    kept = [problem for problem in task.train_problems if len(task.encode_prompt(problem)) <= max_prompt_tokens]
    dropped = len(task.train_problems) - len(kept)
    if not dropped:
        return task
    if not kept:
        raise ConfigError(f"scale.max_prompt_tokens={max_prompt_tokens} drops all {dropped} training prompts")
    if is_rank_zero():
        print(f"[quatro] scale.max_prompt_tokens={max_prompt_tokens}: dropped {dropped} of "
              f"{len(task.train_problems)} training prompts (longer)", flush=True)
    return dataclasses.replace(task, train_problems=kept,
                               properties=dict(task.properties, dropped_long_prompts=dropped))


def build_task(cfg) -> Task:
    """The task of a validated run config (``cfg.task``: one of :data:`TASK_SCHEMAS`), its training
    prompts at most ``scale.max_prompt_tokens`` long (:func:`drop_long_prompts`)."""
    return drop_long_prompts(_TASKS[cfg.task.name](cfg), cfg.scale.max_prompt_tokens)
