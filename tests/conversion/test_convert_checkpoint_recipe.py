"""recipes/convert_checkpoint.py: HF <-> full megatron file, verify, and a TP=2 training run's
per-rank checkpoint (written by the engine's own save_checkpoint) exported back to HF."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.distributed import run_ranks
from tests.conversion.test_hf_qwen2 import hf_state, tiny_qwen2

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "recipes"))

import convert_checkpoint  # noqa: E402

from quatro_nemo.megatron.hf_conversion import read_hf_checkpoint  # noqa: E402


def test_hf_to_megatron_file_and_back_is_identical(tmp_path):
    model = tiny_qwen2(tie=False, vocab_size=61)
    model.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    assert convert_checkpoint.main(["hf-to-megatron", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "m.pt"),
                                    "--params-dtype", "float32", "--vocab-multiple", "4"]) == 0
    cfg, _, full = convert_checkpoint.load_full_megatron_file(str(tmp_path / "m.pt"))
    assert cfg.vocab_size == 64 and full["embedding.word_embeddings.weight"].shape == (61, 32)
    assert convert_checkpoint.main(["megatron-to-hf", "--megatron", str(tmp_path / "m.pt"),
                                    "--out", str(tmp_path / "out"), "--tokenizer", str(tmp_path / "hf")]) == 0
    config, exported = read_hf_checkpoint(tmp_path / "out")
    assert config["vocab_size"] == 61 and (tmp_path / "out" / "tokenizer.json").is_file()
    original = hf_state(model)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    assert convert_checkpoint.verify(str(tmp_path / "hf")) == []


def test_bad_inputs_exit_2_naming_the_file(tmp_path, capsys):
    torch.save({"something": 1}, tmp_path / "bad.pt")
    assert convert_checkpoint.main(["megatron-to-hf", "--megatron", str(tmp_path / "bad.pt"),
                                    "--out", str(tmp_path / "o")]) == 2
    assert "bad.pt" in capsys.readouterr().err
    assert convert_checkpoint.main(["verify", "--hf", str(tmp_path / "missing")]) == 2
    assert "config.json" in capsys.readouterr().err


QWEN2_TINY_ARGS = ["model.architecture=qwen2", "model.normalization=RMSNorm", "model.swiglu=true",
                   "model.qkv_bias=true", "model.linear_bias=false", "model.position_embedding=rope",
                   "model.vocab_size=62", "model.hidden_size=32", "model.num_layers=2",
                   "model.num_attention_heads=4", "model.num_query_groups=2", "model.ffn_hidden_size=48",
                   "model.max_position_embeddings=64", "model.norm_eps=1e-6", "model.tie_embeddings=true",
                   "model.params_dtype=float32", "parallel.tensor=2", "parallel.pipeline=1"]


def _train_run_rank(rank: int, hf_dir: str, run_dir: str, out_dir: str) -> None:
    from quatro_nemo.engine import checkpoint as ckpt
    from quatro_nemo.megatron import training
    from quatro_nemo.megatron.hf_conversion import load_hf_into_megatron, model_config_from_hf
    from quatro_nemo.megatron.models import build_model
    from quatro_nemo.megatron.parallel import initialize_parallel

    # A "training run" at TP=2: the HF weights in megatron, saved by the engine's checkpoint writer.
    layout = initialize_parallel(2, 1, seed=3)
    hf_config, state = read_hf_checkpoint(hf_dir, lazy=True)
    cfg = model_config_from_hf(hf_config, params_dtype="float32")
    model = build_model(cfg)
    load_hf_into_megatron(model, state, cfg)
    policy_ddp = training.wrap_for_training(model, distributed_optimizer=True)
    optimizer = training.build_optimizer(policy_ddp, training.OptimizerSettings(lr=1e-3))
    ckpt.save_checkpoint(run_dir, 7, policy_ddp, optimizer, {"next_step": 7, "optimizer_steps": 0},
                         ckpt.layout_signature(layout))
    # run_to_hf re-initialises megatron's groups on the same process group.
    convert_checkpoint.run_to_hf(out_dir, QWEN2_TINY_ARGS + [f"run.dir={run_dir}"])


@pytest.mark.distributed
def test_run_checkpoint_at_tp2_exports_the_hf_weights(tmp_path):
    model = tiny_qwen2(tie=True, vocab_size=62)
    model.save_pretrained(tmp_path / "hf")
    run_ranks(2, _train_run_rank, str(tmp_path / "hf"), str(tmp_path / "run"), str(tmp_path / "out"))
    config, exported = read_hf_checkpoint(tmp_path / "out")
    assert config["num_key_value_heads"] == 2 and config["tie_word_embeddings"] is True
    original = hf_state(model)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
