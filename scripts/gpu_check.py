#!/usr/bin/env python
"""Prepared GPU check (one GPU, < 10 minutes): run with ``bash scripts/gpu_check.sh``.

1. Environment: torch / CUDA / GPU, Transformer Engine and vLLM availability.
2. HF Qwen2 <-> megatron-core on the GPU (float32, TE spec when TE imports): logits of a tiny
   random ``transformers`` Qwen2 against the converted megatron model, and the export round trip.
3. A Qwen2-architecture model at small scale (bf16, ~0.12 B parameters, TE spec if present): a few
   QUATRO steps (megatron sampling -> synthetic verifiable reward -> QUATRO advantages -> old
   log-probs -> policy loss forward/backward -> AdamW), printing step time and tokens/s per phase.
4. Padded rows vs token-budget micro-batches vs THD packing (Transformer Engine only) on the same
   long-tailed batch: old log-probs + one training forward/backward, tokens/s each way, and the
   budget and packed log-probs and losses against the padded ones.
5. If vLLM is installed: the colocated vLLM backend on the same model (export -> engine -> weight
   push after an optimizer step -> rollout), printing tokens/s and greedy agreement with megatron.

Prints one ``GPU_CHECK_RESULT {json}`` line at the end (and writes it to $OUT/gpu_check.json when
$OUT is set). Exit code 0 when every attempted check passed.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

RESULT = {"checks": {}, "failures": []}
# --cpu-smoke: the same code paths at toy sizes on the CPU (a dry run of this script, no timings).
CPU_SMOKE = "--cpu-smoke" in sys.argv
DEVICE = torch.device("cpu") if CPU_SMOKE else torch.device("cuda")


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def record(name, **values):
    RESULT["checks"][name] = values
    print(f"[gpu_check] {name}: " + ", ".join(f"{k}={v}" for k, v in values.items()), flush=True)


def environment():
    from quatro_nemo.megatron.models import transformer_engine_available

    try:
        import vllm
        vllm_version = vllm.__version__
    except Exception as exc:  # ImportError or a broken install
        vllm_version = f"unavailable ({type(exc).__name__})"
    import megatron.core

    record("environment", torch=torch.__version__, cuda=torch.version.cuda,
           gpu=torch.cuda.get_device_name(0) if DEVICE.type == "cuda" else "none (cpu smoke)", megatron_core=megatron.core.__version__,
           transformer_engine=transformer_engine_available(), vllm=vllm_version)


def conversion_check():
    import transformers

    from quatro_nemo.megatron.hf_conversion import (export_megatron_to_hf, load_hf_into_megatron,
                                                    model_config_from_hf, read_hf_checkpoint)
    from quatro_nemo.megatron.models import build_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    config = transformers.Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.1)
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(config).eval().to(DEVICE)
    tokens = torch.randint(0, 512, (2, 64), device=DEVICE)
    with torch.no_grad():
        hf_logits = hf(tokens).logits.float()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(f"{tmp}/hf")
        hf_config, state = read_hf_checkpoint(f"{tmp}/hf", lazy=True)
        cfg = model_config_from_hf(hf_config, params_dtype="float32")
        model = build_model(cfg).eval()
        load_hf_into_megatron(model, state, cfg)
        positions = torch.arange(64, device=DEVICE).unsqueeze(0).expand(2, 64)
        with torch.no_grad():
            logits = model(tokens, positions, None).float()
        diff = (logits - hf_logits).abs().max().item()
        export_megatron_to_hf(model, cfg, f"{tmp}/export", base_config=hf_config)
        _, exported = read_hf_checkpoint(f"{tmp}/export")
        reference = {k: v.cpu() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
        identical = all(torch.equal(exported[k].cpu(), v) for k, v in reference.items())
    ok = diff <= 2e-3 and identical
    record("hf_conversion", max_logit_diff=f"{diff:.2e}", export_identical=identical, ok=ok)
    if not ok:
        RESULT["failures"].append("hf_conversion")


def small_qwen2_config():
    from quatro_nemo.megatron.models import ModelConfig

    if CPU_SMOKE:
        return ModelConfig(architecture="qwen2", normalization="RMSNorm", swiglu=True, qkv_bias=True,
                           linear_bias=False, position_embedding="rope", vocab_size=128, hidden_size=32,
                           num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                           max_position_embeddings=64, params_dtype="float32")
    return ModelConfig(architecture="qwen2", normalization="RMSNorm", swiglu=True, qkv_bias=True,
                       linear_bias=False, position_embedding="rope", vocab_size=32768, hidden_size=1024,
                       num_layers=8, num_attention_heads=16, num_query_groups=4, ffn_hidden_size=2816,
                       max_position_embeddings=1024, rotary_base=10000, tie_embeddings=True, norm_eps=1e-6,
                       params_dtype="bfloat16")


def synthetic_rewards(sample, num_prompts, n):
    """A verifiable reward: the fraction of even token ids in the response (thresholded)."""
    rewards = []
    for row in range(sample.tokens.shape[0]):
        start = int(sample.prompt_lengths[row])
        response = sample.tokens[row, start:start + int(sample.response_lengths[row])]
        rewards.append(float((response % 2 == 0).float().mean() > 0.5) if len(response) else 0.0)
    return torch.tensor(rewards, dtype=torch.float32).view(num_prompts, n)


def quatro_steps(model, cfg, steps=4, num_prompts=16, n=8, prompt_len=64, new_tokens=128, micro_batch=16):
    from quatro_nemo.algos import get_algorithm
    from quatro_nemo.megatron import training
    from quatro_nemo.megatron.forward import compute_logprobs, train_step_forward_backward
    from quatro_nemo.megatron.sampling import SamplingParams, generate

    spec = get_algorithm("quatro")
    algo_cfg = spec.config_cls()
    model_ddp = training.wrap_for_training(model, distributed_optimizer=False)  # as the engine trains
    optimizer = training.build_optimizer(model_ddp, training.OptimizerSettings(lr=1e-6))
    generator = torch.Generator().manual_seed(0)
    timings = []
    for step in range(steps):
        prompts = torch.randint(1, cfg.vocab_size, (num_prompts, prompt_len), generator=generator).tolist()
        rows = [p for p in prompts for _ in range(n)]
        sync(); t0 = time.perf_counter()
        model.eval()
        sample = generate(model, rows, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens,
                                                      seed=step), eos_id=0, pad_id=0)
        sync(); t1 = time.perf_counter()
        rewards = synthetic_rewards(sample, num_prompts, n)
        advantages = spec.advantage_estimator(rewards.double(), algo_cfg).advantages.float().flatten()
        tokens = sample.tokens.to(DEVICE)
        batch = {"tokens": tokens,
                 "position_ids": torch.arange(tokens.shape[1], device=DEVICE).expand_as(tokens).contiguous(),
                 "response_mask": sample.response_mask.to(DEVICE), "advantages": advantages.to(DEVICE)}
        batch["old_logprobs"], _ = compute_logprobs(model, batch, micro_batch)
        batch["ref_logprobs"] = batch["old_logprobs"]
        sync(); t2 = time.perf_counter()
        training.zero_gradients(model_ddp, optimizer)
        metrics = train_step_forward_backward(model_ddp, batch, "quatro", algo_cfg, micro_batch)
        training.optimizer_step(model_ddp, optimizer)
        sync(); t3 = time.perf_counter()
        generated = int(sample.response_lengths.sum())
        trained = tokens.numel()
        timings.append(dict(step=step, rollout_s=t1 - t0, logprob_s=t2 - t1, train_s=t3 - t2,
                            rollout_tok_s=generated / (t1 - t0), train_tok_s=trained / (t3 - t2),
                            loss=metrics.get("loss"), reward=float(rewards.mean())))
        print(f"[gpu_check] quatro step {step}: " + ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in timings[-1].items()), flush=True)
    last = timings[-1]  # the first step includes warm-up
    record("quatro_steps", steps=steps, step_s=f"{last['rollout_s'] + last['logprob_s'] + last['train_s']:.2f}",
           rollout_tokens_per_s=f"{last['rollout_tok_s']:.0f}", train_tokens_per_s=f"{last['train_tok_s']:.0f}",
           finite_loss=all(t["loss"] is not None and t["loss"] == t["loss"] for t in timings))
    return model_ddp, optimizer


def relative_difference(actual, expected):
    """max |actual - expected| / max |expected|."""
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-6)).item()


def packing_check(model, model_ddp, cfg, num_rows=64, rows_per_micro_batch=8):
    """Padded rows vs token budget vs packing (issue 15): tokens/s and agreement with padded."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from bench_packing import paper_like_lengths, synthetic_batch

    from quatro_nemo.algos import get_algorithm
    from quatro_nemo.megatron.batching import MicroBatching, padded_tokens, plan_micro_batches
    from quatro_nemo.megatron.forward import compute_logprobs, train_step_forward_backward
    from quatro_nemo.megatron.models import transformer_engine_available

    # The paper's lengths scaled to the model's context: 1/4 on the GPU (rows up to 896 tokens).
    scale = 1 / 64 if CPU_SMOKE else 1 / 4
    generator = torch.Generator().manual_seed(2)
    prompts, responses = paper_like_lengths(num_rows // 8, 8, generator, scale)
    batch = synthetic_batch(prompts, responses, cfg.vocab_size, generator)
    batch = {key: value.to(DEVICE) for key, value in batch.items()}
    batch["advantages"] = torch.randn(num_rows, generator=generator).to(DEVICE)
    algo_cfg = get_algorithm("quatro").config_cls(beta=0.0)
    budget = rows_per_micro_batch * batch["tokens"].shape[1]  # the padded micro-batch's size in tokens
    modes = {"padded": MicroBatching(rows=rows_per_micro_batch), "token_budget": MicroBatching(max_tokens=budget)}
    if transformer_engine_available():
        modes["packed"] = MicroBatching(max_tokens=budget, pack=True)
    real_tokens = int(batch["lengths"].sum())
    valid = torch.arange(batch["tokens"].shape[1] - 1, device=DEVICE).unsqueeze(0) < (batch["lengths"] - 1).unsqueeze(1)
    results, reference = {}, None
    for name, batching in modes.items():
        for _ in range(2):  # the second pass is timed (the first warms up kernels and the allocator)
            sync(); t0 = time.perf_counter()
            batch["old_logprobs"], _ = compute_logprobs(model, batch, batching)
            model_ddp.zero_grad_buffer()
            metrics = train_step_forward_backward(model_ddp, batch, "quatro", algo_cfg, batching)
            sync(); seconds = time.perf_counter() - t0
        logprobs = batch["old_logprobs"][valid].float()
        if reference is None:
            reference = (logprobs, metrics["loss"])
        computed = real_tokens if batching.pack else padded_tokens(plan_micro_batches(batch, batching))
        results[name] = dict(seconds=f"{seconds:.3f}", real_tokens_per_s=f"{real_tokens / seconds:.0f}",
                             computed_per_real_token=f"{computed / real_tokens:.2f}",
                             logprob_rel_diff_vs_padded=f"{relative_difference(logprobs, reference[0]):.2e}",
                             loss_diff_vs_padded=f"{abs(metrics['loss'] - reference[1]):.2e}")
    tolerance = 1e-5 if cfg.params_dtype == "float32" else 1e-2  # bf16 matmuls of other shapes round differently
    ok = all(float(r["logprob_rel_diff_vs_padded"]) <= tolerance for r in results.values())
    record("packing", te=transformer_engine_available(), real_tokens=real_tokens, ok=ok,
           **{f"{name}_{key}": value for name, r in results.items() for key, value in r.items()})
    if not ok:
        RESULT["failures"].append("packing")


def vllm_check(model, cfg, optimizer, num_prompts=16, n=8, prompt_len=64, new_tokens=128):
    from quatro_nemo.engine.memory_plan import VllmConfig
    from quatro_nemo.engine.vllm_backend import VllmRolloutBackend
    from quatro_nemo.megatron.hf_conversion import export_megatron_to_hf
    from quatro_nemo.megatron.sampling import SamplingParams, generate

    with tempfile.TemporaryDirectory() as tmp:
        export_megatron_to_hf(model, cfg, f"{tmp}/hf")
        t0 = time.perf_counter()
        backend = VllmRolloutBackend(model, eos_id=0, pad_id=0, model_config=cfg, hf_checkpoint=f"{tmp}/hf",
                                     vllm_config=VllmConfig(gpu_memory_utilization=0.35, enforce_eager=False),
                                     max_model_len=prompt_len + new_tokens)
        startup = time.perf_counter() - t0
        # Change the trainer's weights, then push: the engine must follow.
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.01 * torch.randn_like(param))
        backend.update_weights()
        generator = torch.Generator().manual_seed(1)
        prompts = torch.randint(1, cfg.vocab_size, (num_prompts, prompt_len), generator=generator).tolist()
        params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, seed=0)
        backend.generate(prompts, n, params)  # warm-up + push
        sync(); t1 = time.perf_counter()
        rollout = backend.generate(prompts, n, params)
        sync(); t2 = time.perf_counter()
        tokens_per_s = int(rollout.sample.response_lengths.sum()) / (t2 - t1)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
        from_vllm = backend.generate(prompts[:4], 1, greedy).sample
        model.eval()
        from_megatron = generate(model, prompts[:4], greedy, eos_id=0, pad_id=0)
        first = (from_vllm.tokens[:, prompt_len] == from_megatron.tokens[:, prompt_len].cpu()).float().mean().item()
    ok = first >= 0.75
    record("vllm", startup_s=f"{startup:.1f}", rollout_tokens_per_s=f"{tokens_per_s:.0f}",
           greedy_first_token_agreement=f"{first:.2f}", ok=ok)
    if not ok:
        RESULT["failures"].append("vllm")


def main() -> int:
    if not torch.cuda.is_available() and not CPU_SMOKE:
        print("[gpu_check] no CUDA device: nothing to check (--cpu-smoke runs the code paths on the CPU)", flush=True)
        return 1
    from quatro_nemo.megatron.models import build_model
    from quatro_nemo.megatron.parallel import destroy_parallel, initialize_parallel

    initialize_parallel(1, 1, seed=1234)
    environment()
    for name, check in [("hf_conversion", conversion_check)]:
        try:
            check()
        except Exception:
            traceback.print_exc()
            RESULT["failures"].append(name)
    try:
        cfg = small_qwen2_config()
        model = build_model(cfg)
        record("small_qwen2", parameters=sum(p.numel() for p in model.parameters()),
               te_spec=any("layer_norm_weight" in n for n, _ in model.named_parameters()))
        model_ddp, optimizer = quatro_steps(model, cfg, **(dict(steps=2, num_prompts=4, n=4, prompt_len=8, new_tokens=8,
                                                     micro_batch=4) if CPU_SMOKE else {}))
    except Exception:
        traceback.print_exc()
        RESULT["failures"].append("quatro_steps")
        model = None
    if model is not None:
        try:
            packing_check(model, model_ddp, cfg)
        except Exception:
            traceback.print_exc()
            RESULT["failures"].append("packing")
    if model is not None:
        try:
            import vllm  # noqa: F401
            has_vllm = True
        except Exception:
            has_vllm = False
            record("vllm", skipped="vllm not installed")
        if has_vllm:
            try:
                vllm_check(model, cfg, optimizer)
            except Exception:
                traceback.print_exc()
                RESULT["failures"].append("vllm")
    destroy_parallel()
    line = json.dumps(RESULT, default=str)
    print("GPU_CHECK_RESULT " + line, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_check.json"), "w") as handle:
            handle.write(line)
    return 1 if RESULT["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
