"""The 7B cluster config, shrunk to a tiny model on the CPU: ``torchrun --nproc-per-node 2
recipes/train.py config=quatro_7b`` (TP=2, its vLLM section: one engine over both ranks) with
``model.*`` overrides, the shipped MATH fixture rows (converted by ``recipes/prepare_data.py``), a
tiny Hugging Face Qwen2 checkpoint built here (byte-level tokenizer, no download) and the fake vLLM
of ``tests/engine/fake_vllm`` on ``PYTHONPATH``. Everything else is the product's own path."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quatro_nemo.engine.config import load_config
from quatro_nemo.engine.logging import read_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FAKE_VLLM = Path(__file__).resolve().parent / "fake_vllm"
VOCAB = 260  # 256 bytes + 2 special tokens, padded to an even size (TP=2)
TINY_MODEL = ["model.vocab_size=260", "model.hidden_size=32", "model.num_layers=2", "model.num_attention_heads=4",
              "model.num_query_groups=2", "model.ffn_hidden_size=64", "model.max_position_embeddings=512",
              "model.params_dtype=float32",
              # Full recomputation does not run on the CPU yet: megatron's recompute replays the forward
              # inside backward, where get_default_causal_mask allocates on "cuda" past the CPU shim.
              "model.extra.recompute_granularity=null", "model.extra.recompute_method=null",
              "model.extra.recompute_num_layers=null"]


def write_tiny_hf_checkpoint(directory: Path) -> dict:
    """A random tiny Qwen2 (transformers) and a byte-level BPE tokenizer without merges."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<|endoftext|>": 256, "<|im_end|>": 257})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                         pad_token="<|endoftext|>").save_pretrained(directory)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                                      initializer_range=0.3)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    # as Qwen2.5 base checkpoints: the chat end token also ends a response
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 256]}))
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def prepare_math_fixtures(data_dir: Path) -> None:
    rows = json.loads((REPO / "tests" / "fixtures" / "eval" / "raw_rows.json").read_text())
    for name in ("math_train", "math500"):
        raw = data_dir / f"{name}_raw.jsonl"
        raw.write_text("".join(json.dumps(row) + "\n" for row in rows[name]))
        subprocess.run([sys.executable, str(REPO / "recipes" / "prepare_data.py"), "--dataset", name,
                        "--input", str(raw), "--out", str(data_dir)], check=True, cwd=REPO, timeout=120)


def test_quatro_7b_config_trains_two_steps_at_tp2_with_the_fake_engine(tmp_path):
    hf_dir, data_dir, record_dir, run_dir = (tmp_path / name for name in ("hf", "data", "fake_vllm", "run"))
    initial = write_tiny_hf_checkpoint(hf_dir)
    data_dir.mkdir()
    prepare_math_fixtures(data_dir)
    args = ["config=quatro_7b", *TINY_MODEL, "trainer.device=cpu", "trainer.steps=2", "trainer.prompts_per_step=2",
            "trainer.checkpoint_every=1", "trainer.eval_every=0", "rollout.n=2", "rollout.max_new_tokens=8",
            "parallel.micro_batch_size=2", "eval.num_problems=1", "eval.n_samples=2", "cluster.gpus_per_node=2",
            f"task.train_path={data_dir / 'math_train.jsonl'}", f"task.eval_path={data_dir / 'math500.jsonl'}",
            f"task.hf_checkpoint={hf_dir}", f"run.dir={run_dir}", "logging.tensorboard=false", "run.progress_bar=false"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{FAKE_VLLM}",
               QUATRO_FAKE_VLLM_RECORD=str(record_dir))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(REPO / "recipes" / "train.py"), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    train = [r for r in read_metrics(str(run_dir / "metrics.jsonl")) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    engines = [torch.load(record_dir / f"rank{rank}-engine0.pt", weights_only=False) for rank in (0, 1)]
    for engine in engines:
        start = engine["events"][0]
        # conf/quatro_7b.yaml's vllm: section: one engine over the two tensor-parallel ranks
        assert start["tensor_parallel_size"] == 2 and start["gpu_memory_utilization"] == 0.5
        assert start["max_num_seqs"] == load_config(["config=quatro_7b"]).vllm.max_num_seqs   # the planner's (324)
        assert start["enable_sleep_mode"] is True and start["max_model_len"] == 512
        # eval at step 0, the rollouts of steps 0 and 1, the final eval
        assert len(engine["pushes"]) == 4
        requests = [r for event in engine["events"] if event["call"] == "generate" for r in event["requests"]]
        # the tokenizer's <|endoftext|> and the generation config's <|im_end|>
        assert requests and all(r["params"]["stop_token_ids"] == [256, 257] for r in requests)
    for before, after in zip(*(engine["pushes"] for engine in engines)):  # both ranks get the full weights
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    first = engines[0]["pushes"][0]  # the base model before any step: the HF checkpoint's tensors
    assert first.keys() == initial.keys()
    assert all(torch.equal(first[k], initial[k].float()) for k in initial)
