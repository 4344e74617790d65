"""task=jsonl: prompts from JSONL files of the project schema (recipes/prepare_data.py writes them),
a Hugging Face tokenizer, a verifier by name (math, code, countdown) and a base model from a
Hugging Face checkpoint (quatro_nemo.megatron.hf_conversion): the cluster configs.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from quatro_nemo.data.schema import read_problems
from quatro_nemo.rewards import VerifierName, get_verifier
from quatro_nemo.tasks.base import Task, check_task_name
from quatro_nemo.validation import coerce_choices


@dataclass
class JsonlTaskConfig:
    """task=jsonl (conf/task/jsonl.yaml): the cluster setting (MATH and friends in the project's JSONL schema)."""

    name: str = "jsonl"
    train_path: str = ""        # JSONL written by recipes/prepare_data.py
    eval_path: str = ""         # held-out JSONL evaluated during training
    hf_checkpoint: str = ""     # Hugging Face model directory: tokenizer and base weights
    verifier: VerifierName = VerifierName.math   # a verifier of quatro_nemo.rewards
    verifier_options: Dict[str, Any] = field(default_factory=dict)  # e.g. code: reward, num_workers

    def __post_init__(self) -> None:
        check_task_name(self, "jsonl")
        coerce_choices(self, "task")


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
    vocab_size = jsonl_vocab_size(cfg.task)
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


def jsonl_vocab_size(section: JsonlTaskConfig) -> int:
    """The checkpoint's ``config.json`` ``vocab_size`` (the model's padded vocabulary, not
    ``len(tokenizer)``). Raises ValueError naming the file it could not read."""
    path = os.path.join(section.hf_checkpoint, "config.json")
    try:
        with open(path) as handle:
            return int(json.load(handle)["vocab_size"])
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"model.vocab_size is null, and the vocabulary size cannot be read from {path} "
                         f"(task.hf_checkpoint): {exc}") from exc
