#!/usr/bin/env python
"""Convert Qwen2 checkpoints between Hugging Face and megatron-core (quatro_nemo.megatron.hf_conversion).

    # HF -> one layout-free megatron state dict (loads into any TP x PP with load_full_state_dict)
    python recipes/convert_checkpoint.py hf-to-megatron --hf checkpoints/Qwen2.5-Math-1.5B --out q1p5b.pt

    # that file -> HF safetensors (+ tokenizer files copied from --tokenizer)
    python recipes/convert_checkpoint.py megatron-to-hf --megatron q1p5b.pt --out export/ --tokenizer checkpoints/Qwen2.5-Math-1.5B

    # a training run's checkpoint (per-rank shards) -> HF safetensors, for evaluation with vLLM.
    # Run with the training layout's world size and the training command's key=value arguments:
    torchrun --nproc-per-node 8 recipes/convert_checkpoint.py run-to-hf --out export/ [--step 120] \
        -- config=quatro_7b run.dir=/scratch/runs/q7b

    # a training run's checkpoint, before the run resumes at other TP/PP sizes: written again
    # beside itself in a format any layout loads. Run at the TP and PP sizes that saved it (any
    # data-parallel size, e.g. one process per model shard); key=value overrides after -- (e.g.
    # trainer.device=cpu to convert on CPUs, over gloo):
    torchrun --nproc-per-node 2 recipes/convert_checkpoint.py reshard /scratch/runs/q7b [--step 120]

    # HF -> megatron -> HF must give identical tensors
    python recipes/convert_checkpoint.py verify --hf checkpoints/Qwen2.5-Math-1.5B

Exit code 0 on success, 2 on a usage or config error (the message names the file or key).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from quatro_nemo.megatron.hf_conversion import (  # noqa: E402
    hf_config_from_model_config,
    hf_to_megatron_state_dict,
    megatron_to_hf_state_dict,
    model_config_from_hf,
    read_hf_checkpoint,
    write_hf_checkpoint,
)
from quatro_nemo.megatron.models import ModelConfig  # noqa: E402

FORMAT = "quatro-nemo/full-megatron-state-dict/v1"


def hf_to_megatron(hf_dir: str, out: str, params_dtype: str = "bfloat16", vocab_multiple: int = 1,
                   transformer_engine: bool = False) -> None:
    """Write ``{"format", "model_config", "hf_config", "state_dict"}`` (full, TP=1/PP=1 names)."""
    hf_config, hf_state = read_hf_checkpoint(hf_dir, lazy=True)
    cfg = model_config_from_hf(hf_config, params_dtype=params_dtype, vocab_multiple=vocab_multiple)
    full = hf_to_megatron_state_dict(hf_state, cfg, transformer_engine=transformer_engine)
    dtype = cfg.torch_dtype
    torch.save({"format": FORMAT, "model_config": cfg.to_dict(), "hf_config": hf_config,
                "state_dict": {k: v.to(dtype) for k, v in full.items()}}, out)


def load_full_megatron_file(path: str):
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path}: not a file written by 'convert_checkpoint.py hf-to-megatron' ({FORMAT})")
    return ModelConfig(**payload["model_config"]), payload.get("hf_config"), payload["state_dict"]


def megatron_to_hf(megatron_file: str, out: str, tokenizer: Optional[str] = None) -> None:
    cfg, hf_config, full = load_full_megatron_file(megatron_file)
    vocab = int((hf_config or {}).get("vocab_size", cfg.vocab_size))
    hf_state = megatron_to_hf_state_dict(full, cfg, vocab_size=vocab)
    write_hf_checkpoint(out, hf_state, hf_config_from_model_config(cfg, vocab, base=hf_config),
                        tokenizer_dir=tokenizer)


def verify(hf_dir: str) -> List[str]:
    """Names of the tensors that HF -> megatron -> HF does not reproduce exactly (empty: all do)."""
    hf_config, hf_state = read_hf_checkpoint(hf_dir, lazy=True)
    cfg = model_config_from_hf(hf_config, params_dtype="float32")
    back = megatron_to_hf_state_dict(hf_to_megatron_state_dict(hf_state, cfg), cfg)
    expected = {k for k in hf_state if not (cfg.tie_embeddings and k == "lm_head.weight")}
    bad = sorted(expected ^ set(back))
    bad += [k for k in sorted(expected & set(back)) if not torch.equal(back[k], hf_state[k])]
    return bad


def run_to_hf(out: str, train_args: Sequence[str], step: Optional[int] = None) -> None:
    """Every rank of a layout given by the training arguments (any layout: run checkpoints are
    sharded with global offsets): build the model, load its shard, export (collective; rank 0
    writes). Base config and tokenizer come from task.hf_checkpoint."""
    from quatro_nemo.engine import checkpoint as ckpt
    from quatro_nemo.engine.config import load_config
    from quatro_nemo.megatron.hf_conversion import export_megatron_to_hf
    from quatro_nemo.megatron.models import build_model
    from quatro_nemo.megatron.parallel import initialize_parallel

    config = load_config(train_args)
    cfg = config.model
    run_dir = config.run.dir
    step = ckpt.latest_step(run_dir) if step is None else step
    if step is None:
        raise FileNotFoundError(f"no complete checkpoint under {run_dir}/checkpoints")
    initialize_parallel(config.parallel.tensor, config.parallel.pipeline, seed=config.run.seed)
    model = build_model(cfg)
    ckpt.load_model_weights(run_dir, step, model)   # sharded: loads at any layout
    hf_dir = (config.task.hf_checkpoint or None) if config.task.name == "jsonl" else None
    base = read_hf_checkpoint(hf_dir, lazy=True)[0] if hf_dir and os.path.isdir(hf_dir) else None
    export_megatron_to_hf(model, cfg, out, base_config=base, tokenizer_dir=hf_dir if base else None)


def reshard(run_dir: str, step: Optional[int] = None, overrides: Sequence[str] = ()) -> str:
    """Every rank of a layout with the saved TP and PP sizes (any data-parallel size): build the
    run's model, DDP and optimizer from its own config.yaml (with ``overrides``), load checkpoint
    ``step`` (default: the newest) and write it again in the fully_reshardable format beside
    itself (``quatro_nemo.engine.checkpoint.write_reshardable_copy``). Returns the new folder."""
    from omegaconf import OmegaConf

    from quatro_nemo.engine import checkpoint as ckpt
    from quatro_nemo.engine.config import validate
    from quatro_nemo.engine.loop import build_training_state, select_device
    from quatro_nemo.engine.task import build_task
    from quatro_nemo.megatron.models import build_model
    from quatro_nemo.megatron.parallel import initialize_parallel

    config_path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path}: not a run directory (no config.yaml)")
    config = validate(OmegaConf.merge(OmegaConf.load(config_path), OmegaConf.from_dotlist(list(overrides))))
    step = ckpt.latest_step(run_dir) if step is None else step
    if step is None:
        raise FileNotFoundError(f"no complete checkpoint under {run_dir}/checkpoints")
    saved = ckpt.saved_layout(run_dir, step)
    select_device(config.trainer.device)
    initialize_parallel(saved["tensor"], saved["pipeline"], seed=config.run.seed)
    policy = build_model(build_task(config).model_config(config.model))
    policy_ddp, optimizer = build_training_state(policy, config.trainer, config.scale.distributed_optimizer)
    return ckpt.write_reshardable_copy(run_dir, step, policy_ddp, optimizer)


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    train_args: List[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, train_args = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("hf-to-megatron")
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--params-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--vocab-multiple", type=int, default=1)
    p.add_argument("--transformer-engine", action="store_true", help="TE spec layer-norm names")
    p = sub.add_parser("megatron-to-hf")
    p.add_argument("--megatron", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default=None)
    p = sub.add_parser("run-to-hf")
    p.add_argument("--out", required=True)
    p.add_argument("--step", type=int, default=None)
    p = sub.add_parser("reshard")
    # positional: torchrun's own parser would take "--run" for its --run-path
    p.add_argument("run_dir", help="the run directory (run.dir)")
    p.add_argument("--step", type=int, default=None)
    p = sub.add_parser("verify")
    p.add_argument("--hf", required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "hf-to-megatron":
            hf_to_megatron(args.hf, args.out, args.params_dtype, args.vocab_multiple, args.transformer_engine)
        elif args.command == "megatron-to-hf":
            megatron_to_hf(args.megatron, args.out, args.tokenizer)
        elif args.command == "run-to-hf":
            run_to_hf(args.out, train_args, args.step)
        elif args.command == "reshard":
            written = reshard(args.run_dir, args.step, train_args)
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"written: {written}; resume the run at its new layout")
        else:
            bad = verify(args.hf)
            if bad:
                print(f"round trip differs for {len(bad)} tensors, e.g. {bad[:5]}", file=sys.stderr)
                return 1
            print(f"{args.hf}: HF -> megatron -> HF reproduces every tensor exactly")
    except (ValueError, KeyError, FileNotFoundError) as exc:
        print(f"convert_checkpoint: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
