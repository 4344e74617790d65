"""The embedded CPU task (``task=countdown``): Countdown with step-by-step answers.

- :mod:`.problems`: problem generation, the rules, brute-force solutions, the task's properties;
- :mod:`.verifier`: the reward (binary or graded);
- :mod:`.warmstart`: the supervised warm-start that makes the base model, its SFT loop and cache;
- :mod:`.measure`: what a policy does on held-out problems (success spread, distinct solutions);
- :mod:`.task`: the ``task:`` config section and :func:`~.task.build_countdown_task`.
"""
