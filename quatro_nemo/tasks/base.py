"""The interface between a task and the engine: :class:`Task`, and what every task section shares."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch


@dataclass
class Task:
    name: str
    train_problems: List[Dict[str, Any]]
    heldout_problems: List[Dict[str, Any]]
    verifier: Any
    vocab_size: int
    stop_token_ids: Tuple[int, ...]   # every token that ends a response (a JSONL task: :func:`quatro_nemo.tasks.jsonl.checkpoint_end_tokens`)
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
        rollout = self.generate(backend, problems, prompt_indices, n, params)
        return rollout, self.decode(rollout)

    def generate(self, backend, problems: Sequence[Dict[str, Any]], prompt_indices: Sequence[int], n: int, params):
        """The rollout of :meth:`sample`, without decoding it."""
        return backend.generate([self.encode_prompt(p) for p in problems], n, params, prompt_indices=list(prompt_indices))

    def decode(self, rollout) -> List[str]:
        """Each row's response text."""
        return [self.decode_response(ids) for ids in rollout.response_ids()]

    def model_config(self, model_config):
        """The run's ``model`` section (a ModelConfig) with this task's vocabulary size unless the
        section sets one."""
        return dataclasses.replace(model_config, vocab_size=model_config.vocab_size or self.vocab_size)


def check_task_name(section, expected: str) -> None:
    if section.name != expected:
        raise ValueError(f"task.name={section.name!r} but this is the {expected} task's section: "
                         f"choose the task with task=<name> (conf/task/)")


def section_part(section, cls: type):
    """The ``cls`` dataclass made of the fields ``section`` shares with it."""
    return cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(cls)})
