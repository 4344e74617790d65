"""megatron-core glue (imports megatron lazily; nothing here is imported by ``quatro_nemo.algos``).

- :mod:`.compat`   the CPU/gloo workarounds, applied only without CUDA (``apply_cpu_compat``).
- :mod:`.parallel` ``initialize_parallel`` / ``destroy_parallel`` and rank helpers.
- :mod:`.models`   ``ModelConfig`` and ``build_model`` (tiny GPT, Qwen2-style decoder).
- :mod:`.logprobs` TP-complete per-token log-probs and full-vocabulary entropy.
- :mod:`.loss`     the loss closure for ``forward_backward_func``, global normalisers, metrics.
- :mod:`.batching` micro-batch plans (rows, or a token budget: sorted, binned, trimmed) and the
  THD packing layout; pure torch.
- :mod:`.forward`  ``compute_logprobs`` and ``train_step_forward_backward`` for the engine.
- :mod:`.checkpoint`, :mod:`.hf_conversion`, :mod:`.sampling`: full state dicts, HF weights,
  generation.
"""
