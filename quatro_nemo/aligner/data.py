"""Prompt dataset for the NeMo-Aligner path: this project's JSONL problems, with dataset ids.

NeMo-Aligner's ``RLHFDataset`` returns ``{"text", "length", "loss_multiplier"}`` per prompt and
its collate function (``collate_with_pad_to_max_batch``) keeps only ``text`` and ``length``: the
problem (its reference answer) and the dataset id are lost. :class:`ProblemPromptDataset` returns
the same keys plus ``idx`` (the record's position in the file, plus ``id_offset``), and :func:`collate_with_prompt_ids`
adds ``prompt_ids`` to NeMo-Aligner's collated batch. The QUATRO trainer groups responses by
``prompt_ids`` and the verifier reward client looks problems up by it.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Sequence

import torch



class ProblemPromptDataset(torch.utils.data.Dataset):
    """Tokenized prompts of a problem list, in NeMo-Aligner's ``RLHFDataset`` item format + ``idx``.

    Args:
        problems: records with at least ``prompt`` (see :func:`read_problems`).
        tokenizer: NeMo tokenizer (``text_to_ids``).
        prompt_template: format string with ``{prompt}``, applied before tokenizing.
        max_prompt_length: prompts longer than this (in tokens) raise ValueError naming the id.
        id_offset: added to the position to form ``idx`` (validation ids follow the training ids,
            so one reward client indexed by ``idx`` serves both splits).
    """

    def __init__(self, problems: Sequence[Dict[str, Any]], tokenizer: Any, prompt_template: str = "{prompt}",
                 max_prompt_length: int = 1024, id_offset: int = 0):
        if "{prompt}" not in prompt_template:
            raise ValueError(f"quatro.data.prompt_template must contain '{{prompt}}', got {prompt_template!r}")
        self.problems = problems
        self.tokenizer = tokenizer
        self.prompt_template = prompt_template
        self.max_prompt_length = max_prompt_length
        self.id_offset = id_offset

    def __len__(self) -> int:
        return len(self.problems)

    def __getitem__(self, idx: int) -> Dict[str, Any]:
        problem = self.problems[idx]
        ids = self.tokenizer.text_to_ids(self.prompt_template.format(prompt=problem["prompt"]))
        if len(ids) > self.max_prompt_length:
            raise ValueError(
                f"problem {problem['id']!r} (index {idx}): prompt has {len(ids)} tokens > "
                f"max_prompt_length {self.max_prompt_length}"
            )
        return {"text": torch.tensor(ids, dtype=torch.int64), "length": len(ids), "loss_multiplier": True,
                "idx": idx + self.id_offset}


def _collate_adding_prompt_ids(collate_fn: Callable, items: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    batch = collate_fn(items)
    batch["prompt_ids"] = torch.tensor([item["idx"] for item in items], dtype=torch.int64)
    return batch


def collate_with_prompt_ids(collate_fn: Callable[[List[Dict[str, Any]]], Dict[str, torch.Tensor]]) -> Callable:
    """Wrap NeMo-Aligner's collate function so the batch also carries ``prompt_ids`` [b] int64.

    A ``functools.partial`` of a module-level function, so it pickles (DataLoader workers).
    """
    return functools.partial(_collate_adding_prompt_ids, collate_fn)
