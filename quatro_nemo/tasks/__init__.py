"""Tasks: what a run trains on. Each task is a package or module beside the others:

- :mod:`quatro_nemo.tasks.countdown`: the embedded CPU task (problems, verifier, the supervised
  warm-start that makes its base model, and the measurement of a policy on it);
- :mod:`quatro_nemo.tasks.jsonl`: prompts from JSONL files of the project schema with a Hugging
  Face tokenizer and base model (MATH, code: the cluster configs).

Each builds a :class:`quatro_nemo.tasks.base.Task`, the interface the engine trains on; the engine
looks a task up by its config name (:mod:`quatro_nemo.engine.task`), as it looks up algorithms in
:mod:`quatro_nemo.algos.registry`. Tasks sit below the engine (pyproject.toml's layers): they
use the megatron layer (the warm-start's SFT loop, Hugging Face weights), never the engine.
"""
