"""The recipe's Hydra config, start-up validation, problem dataset and verifier reward client
(pure modules: run in the main environment too)."""
import json
import os

import hydra
import pytest
import torch

from quatro_nemo.aligner.config import register_recipe_configs, validate_recipe_config
from quatro_nemo.aligner.data import ProblemPromptDataset, collate_with_prompt_ids
from quatro_nemo.data.schema import read_problems
from quatro_nemo.aligner.rewards import VerifierRewardClient, build_reward_client

CONF_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "conf")


@pytest.fixture
def problem_files(tmp_path):
    paths = []
    for split, count in (("train", 3), ("val", 2)):
        path = tmp_path / f"{split}.jsonl"
        path.write_text("".join(json.dumps({"id": f"{split}{i}", "benchmark": "t", "prompt": f"p{i}",
                                            "answer": str(i)}) + "\n" for i in range(count)))
        paths.append(str(path))
    return paths


def _compose(overrides):
    register_recipe_configs()
    with hydra.initialize_config_dir(config_dir=os.path.abspath(CONF_DIR), version_base=None):
        return hydra.compose(config_name="aligner/gpt_quatro_actor", overrides=overrides)


def test_shipped_config_composes_and_validates(problem_files):
    train, val = problem_files
    cfg = _compose([f"quatro.data.train_file={train}", f"quatro.data.validation_file={val}",
                    "pretrained_checkpoint.restore_from_path=x.nemo",
                    "algorithm@model.quatro.algorithm=gspo", "++model.quatro.algorithm.beta=0.0",
                    "++model.tensor_model_parallel_size=2"])
    spec, config = validate_recipe_config(cfg)
    assert spec.name == "gspo" and config.beta == 0.0
    assert validate_recipe_config(_compose([f"quatro.data.train_file={train}",
                                            f"quatro.data.validation_file={val}"]))[0].name == "quatro"


@pytest.mark.parametrize("override,message", [
    ("trainer.reinforce.initial_policy_kl_penalty=0.01", "initial_policy_kl_penalty"),
    ("model.global_batch_size=100", "model.global_batch_size"),
    ("trainer.reinforce.num_rollouts_per_prompt=1", "num_rollouts_per_prompt"),
    ("trainer.reinforce.quatro.inner_loops=0", "inner_loops"),
    ("++model.quatro.algorithm.dleta=0.1", "dleta"),
    ("quatro.reward.kind=http", "quatro.reward.kind"),
    ("trainer.reinforce.save_interval=0", "trainer.reinforce.save_interval"),
])
def test_bad_config_names_the_key(problem_files, override, message):
    train, val = problem_files
    cfg = _compose([f"quatro.data.train_file={train}", f"quatro.data.validation_file={val}", override])
    with pytest.raises(ValueError, match=message):
        validate_recipe_config(cfg)


def test_missing_data_file_names_the_key(problem_files):
    cfg = _compose([f"quatro.data.train_file={problem_files[0]}", "quatro.data.validation_file=/nope.jsonl"])
    with pytest.raises(ValueError, match="quatro.data.validation_file"):
        validate_recipe_config(cfg)


def test_read_problems_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"id": "a", "benchmark": "t", "prompt": "p", "answer": "1"}) + "\n"
                    + json.dumps({"id": "b", "prompt": "p"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl line 2"):
        read_problems(str(path))


class Tokenizer:
    eos_id = 0

    def text_to_ids(self, text):
        return [ord(c) - 96 for c in text]  # a -> 1

    def ids_to_text(self, ids):
        return "".join(chr(i + 96) for i in ids)


def test_dataset_items_and_collate_carry_dataset_ids():
    problems = [{"id": "x", "prompt": "ab"}, {"id": "y", "prompt": "cde"}]
    dataset = ProblemPromptDataset(problems, Tokenizer(), "z{prompt}", max_prompt_length=4, id_offset=10)
    assert dataset[1]["text"].tolist() == [26, 3, 4, 5] and dataset[1]["length"] == 4 and dataset[1]["idx"] == 11

    def nemo_like_collate(items):  # keeps only text/length, as NeMo-Aligner's collate does
        return {"length": torch.tensor([item["length"] for item in items])}

    batch = collate_with_prompt_ids(nemo_like_collate)([dataset[1], dataset[0]])
    assert batch["prompt_ids"].tolist() == [11, 10]
    with pytest.raises(ValueError, match="'y'"):
        ProblemPromptDataset(problems, Tokenizer(), "{prompt}", max_prompt_length=2)[1]


def test_verifier_client_scores_each_response_against_its_problem():
    seen = []

    class Verifier:
        def score_batch(self, problems, responses):
            seen.append((problems, responses))
            return [float(p["answer"] == r) for p, r in zip(problems, responses)]

    problems = [{"id": "a", "answer": "cd"}, {"id": "b", "answer": "xy"}]
    client = VerifierRewardClient(Verifier(), problems, Tokenizer())
    rollout_batch = {  # prompt "ab" + response; lengths count prompt + response; rows not in id order
        "response_tokens": torch.tensor([[1, 2, 24, 25, 26], [1, 2, 3, 4, 0]]),
        "prompt_lengths": torch.tensor([2, 2]),
        "response_lengths": torch.tensor([4, 4]),
        "prompt_ids": torch.tensor([1, 0]),
    }
    rewards = client.infer_rm(rollout_batch).result()
    assert rewards.shape == (2, 1) and rewards.flatten().tolist() == [1.0, 1.0]
    assert seen[0] == ([problems[1], problems[0]], ["xy", "cd"])
    with pytest.raises(KeyError, match="prompt_ids"):
        client.infer_rm({k: v for k, v in rollout_batch.items() if k != "prompt_ids"})


def test_build_reward_client_rejects_unknown_kind():
    with pytest.raises(ValueError, match="quatro.reward.kind"):
        build_reward_client({"kind": "http"}, None, [], Tokenizer())
