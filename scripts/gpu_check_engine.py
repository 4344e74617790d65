#!/usr/bin/env python
"""The GPU check's engine probe: the 7B run's vLLM engine, alone, with dummy weights.

    python scripts/gpu_check_engine.py --json-file F [--sequences 256,512] [--new-tokens 256]
        [--emulate-gpu-gb 80] [config=quatro_7b key=value ...]

Builds the engine exactly as the training run does (the model's ``config.json`` from
:func:`~quatro_nemo.engine.vllm_backend.write_engine_model_dir`, the arguments of
:func:`~quatro_nemo.engine.vllm_backend.engine_arguments`, vLLM's ``external_launcher`` inside
megatron's process group) for the config's model (default ``config=quatro_7b``) at vLLM tensor
parallel 1, then measures, in this order:

- ``construction_s``: ``vllm.LLM(...)`` (torch.compile and CUDA-graph capture included);
- with sleep mode (GPUs): ``sleep(level=2)``'s seconds and vLLM's own report of it, the log line
  ``Sleep mode freed X GiB memory, Y GiB memory is still in use.`` (``Worker.sleep`` in
  ``vllm/v1/worker/gpu_worker.py``, 0.32.0): ``sleep_freed_gib`` and ``sleep_still_in_use_gib``,
  the device's use with the engine asleep (this process's CUDA context included); then
  ``wake_weights_s`` (``wake_up(tags=["weights"])``);
- ``push_s``: a random full state (the HF Qwen2 names and shapes of ``transformers``'
  ``Qwen2ForCausalLM`` on the meta device) streamed through vLLM's in-place ``reload_weights``, as
  the backend pushes (:func:`~quatro_nemo.engine.vllm_backend.engine_weights`), and what vLLM logged
  meanwhile (``push_log``: scripts/gpu_check_report.py looks for its weight-load warnings there);
- ``wake_kv_s`` (``wake_up(tags=["kv_cache"])``);
- ``decode``: per number of sequences, ``--new-tokens`` sampled tokens each (``ignore_eos``) after
  64-token prompts (shorter where the model's context needs it): seconds and generated tokens/s.

``--emulate-gpu-gb G`` scales ``vllm.gpu_memory_utilization`` by ``G / this GPU's GB`` (an H100's
share on an H200). Writes the figures to ``--json-file`` (also with ``"error"`` when a stage
raised); exit code 0 when every stage ran.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, Iterator, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT_TOKENS = 64
SLEEP_LINE = re.compile(r"Sleep mode freed ([\d.]+) GiB memory, ([\d.]+) GiB memory is still in use")


class CapturedLog(logging.Handler):
    """Every message of the ``vllm`` loggers (the engine runs in this process) from :meth:`mark` on.
    vLLM configures its ``vllm`` logger again while it builds an engine (``logging.config``
    replaces its handlers), so each mark attaches this handler anew."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: List[str] = []

    def mark(self) -> int:
        """Capture from now on; the position of the next message."""
        vllm_logger = logging.getLogger("vllm")
        if self not in vllm_logger.handlers:
            vllm_logger.addHandler(self)
        return len(self.messages)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def since(self, start: int) -> List[str]:
        return self.messages[start:]


def random_hf_state(model_config, device, dtype) -> Iterator[Tuple[str, Any]]:
    """``(HF name, random tensor)`` of the engine's untied Qwen2, one tensor at a time on ``device``."""
    import torch
    import transformers

    from quatro_nemo.megatron.hf_conversion import hf_config_from_model_config

    hf_config = dict(hf_config_from_model_config(model_config), tie_word_embeddings=False)
    with torch.device("meta"):
        skeleton = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**hf_config))
    for name, param in skeleton.named_parameters():
        yield name, torch.randn(param.shape, device=device, dtype=dtype) * 0.02


def emulated_utilization(utilization: float, emulate_gb: float) -> float:
    """``utilization`` of an ``emulate_gb`` GPU as a fraction of this one (CUDA only)."""
    import torch

    if not emulate_gb or not torch.cuda.is_available():
        return utilization
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 1e9
    return min(utilization * emulate_gb / total, 0.95)


def probe(args, overrides: List[str], figures: Dict[str, Any]) -> None:
    import torch
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.platforms import current_platform

    from quatro_nemo.engine.config import load_config
    from quatro_nemo.engine.loop import select_device
    from quatro_nemo.engine.vllm_backend import (engine_arguments, engine_weights, launcher_environment,
                                                 require_vllm, write_engine_model_dir)
    from quatro_nemo.megatron import parallel

    cfg = load_config(["config=quatro_7b", *overrides, "vllm.tensor_parallel=1",
                       f"vllm.max_num_seqs={max(args.sequences)}"])
    select_device(cfg.trainer.device)
    parallel.initialize_parallel(1, 1, seed=cfg.run.seed)
    vllm = require_vllm()
    log = CapturedLog()
    sleep_mode = cfg.vllm.sleep_between_phases and current_platform.is_sleep_mode_available()
    engine = dataclasses.replace(cfg.vllm, gpu_memory_utilization=emulated_utilization(
        cfg.vllm.gpu_memory_utilization, args.emulate_gpu_gb))
    model = cfg.model
    figures.update(model=dict(hidden_size=model.hidden_size, num_layers=model.num_layers,
                              vocab_size=model.vocab_size, params_dtype=str(model.params_dtype)),
                   gpu_memory_utilization=engine.gpu_memory_utilization, sleep_mode=sleep_mode)

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.update(launcher_environment())
    with tempfile.TemporaryDirectory(prefix="gpu-check-engine-") as model_dir:
        start = time.perf_counter()
        llm = vllm.LLM(**engine_arguments(model, engine, write_engine_model_dir(model, model_dir), sleep_mode))
        figures["construction_s"] = time.perf_counter() - start
        print(f"[gpu_check] engine: built in {figures['construction_s']:.1f} s", flush=True)
        if sleep_mode:
            mark, start = log.mark(), time.perf_counter()
            llm.sleep(level=2)
            figures["sleep_s"] = time.perf_counter() - start
            found = [SLEEP_LINE.search(m) for m in log.since(mark)]
            found = [m for m in found if m]
            if found:
                figures["sleep_freed_gib"], figures["sleep_still_in_use_gib"] = map(float, found[-1].groups())
            start = time.perf_counter()
            llm.wake_up(tags=["weights"])
            figures["wake_weights_s"] = time.perf_counter() - start
        mark, start = log.mark(), time.perf_counter()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        weights = engine_weights(random_hf_state(model, device, model.torch_dtype), tied=False)
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        figures["push_s"] = time.perf_counter() - start
        figures["push_log"] = log.since(mark)
        if sleep_mode:
            start = time.perf_counter()
            llm.wake_up(tags=["kv_cache"])
            figures["wake_kv_s"] = time.perf_counter() - start
        print(f"[gpu_check] engine: push {figures['push_s']:.1f} s"
              + (f", sleep {figures['sleep_s']:.1f} s (vLLM: {figures.get('sleep_still_in_use_gib')} GiB still in "
                 f"use), wake {figures['wake_weights_s'] + figures['wake_kv_s']:.1f} s" if sleep_mode else
                 ", no sleep mode on this platform"), flush=True)
        figures["decode"] = {}
        generator = torch.Generator().manual_seed(0)
        prompt_tokens = max(1, min(PROMPT_TOKENS, model.max_position_embeddings - args.new_tokens))
        for count in args.sequences:
            prompts = [{"prompt_token_ids": torch.randint(0, model.vocab_size, (prompt_tokens,),
                                                          generator=generator).tolist()} for _ in range(count)]
            params = VllmSamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=count,
                                        detokenize=False)
            start = time.perf_counter()
            outputs = llm.generate(prompts, sampling_params=params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            figures["decode"][str(count)] = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
            print(f"[gpu_check] engine: {count} sequences x {args.new_tokens} new tokens: {seconds:.1f} s, "
                  f"{tokens / seconds:,.0f} tokens/s", flush=True)
    figures["vllm_log_messages"] = len(log.messages)  # > 0: vLLM's log reached the capture


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-file", required=True)
    parser.add_argument("--sequences", default="256,512",
                        type=lambda text: [int(n) for n in text.replace(",", " ").split()])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--emulate-gpu-gb", type=float, default=80.0)
    args, overrides = parser.parse_known_args(argv)
    figures: Dict[str, Any] = {}
    code = 0
    try:
        probe(args, overrides, figures)
    except Exception as exc:  # reported in the summary, as a failure of this part
        traceback.print_exc()
        figures["error"] = f"{type(exc).__name__}: {exc}"
        code = 1
    with open(args.json_file, "w") as handle:
        json.dump(figures, handle, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
