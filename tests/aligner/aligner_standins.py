"""Stand-ins for what a NeMo-Aligner trainer needs and CPU tests cannot build, shared by the
trainer tests (``test_aligner_trainer_*.py``): a NeMo model needs a ``.nemo`` checkpoint and, in
practice, CUDA. Everything else the trainer touches is real: NeMo-Aligner's ``ReinforceTrainer``
code, its ``build_dataloader`` (Megatron sampler), collate function, batch iterator and run
``Timer``, and this project's dataset, reward client and advantage estimators.
"""
from functools import partial

import torch
from omegaconf import OmegaConf

NUM_PROBLEMS, PROMPTS_PER_STEP, NUM_RESPONSES, ROLLOUT_MBS = 16, 4, 4, 2
GLOBAL_BATCH_SIZE, INNER_LOOPS, DELTA = 8, 2, 0.1
MAX_RESPONSE = 3


class Tokenizer:
    eos_id = 0

    def text_to_ids(self, text):
        return [1 + ord(char) % 9 for char in text]

    def ids_to_text(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def score(problem, response):
    """The stand-in verifier's rule (reward in {0, 0.5, 1})."""
    return ((len(response) + sum(map(ord, response)) + int(problem["answer"])) % 3) / 2


class Verifier:
    def score_batch(self, problems, responses):
        return [score(p, r) for p, r in zip(problems, responses)]


class Actor:
    """Stand-in for QuatroReinforceActor: the attributes and calls the trainer uses.

    ``on_training_call(call_number)`` (optional) runs at each training micro-step (numbered from 1).
    """

    def __init__(self, rank, on_training_call=None):
        from quatro_nemo.algos import get_algorithm

        self.rank = rank
        self.tokenizer = Tokenizer()
        self.algorithm = get_algorithm("quatro")
        self.algorithm_config = self.algorithm.config_cls(delta=DELTA, beta=0.01)
        self.needs_reference_logprobs = True
        self.generated = []  # (prompt_id, tokens, prompt_len, response_len) per response, in order
        self.prompt_ids_asked = []  # the dataset ids of every generation call (training and validation)
        self.trained_on = []  # the training batches get_loss_and_metrics saw, in order
        self.calls = 0
        self.on_training_call = on_training_call

    def infer(self, batch):
        self.prompt_ids_asked.append(batch["prompt_ids"].tolist())
        tokens = batch["text"].clone()
        prompt_lengths = batch["length"].clone()
        response_lengths = torch.empty_like(prompt_lengths)
        for row in range(tokens.size(0)):
            self.calls += 1
            length = 1 + (self.rank + self.calls) % MAX_RESPONSE
            start = int(prompt_lengths[row])
            tokens[row, start:start + length] = 1 + (torch.arange(length) * (self.calls + 3 * self.rank)) % 9
            response_lengths[row] = start + length
            if not self.trained_on:  # the training rollouts (validation comes after training)
                self.generated.append((int(batch["prompt_ids"][row]), tokens[row, :start + length].clone(),
                                       start, start + length))
        return {"response_tokens": tokens, "response_lengths": response_lengths,
                "prompt_lengths": prompt_lengths, "is_end": torch.ones(tokens.size(0), dtype=torch.bool)}

    def get_inference_log_probs(self, tokens):
        return -0.1 * tokens[:, 1:].float()

    def get_init_policy_logprobs(self, tokens):
        return -0.2 * tokens[:, 1:].float()

    def get_loss_and_metrics(self, batch, forward_only):
        self.trained_on.append({k: v.clone() for k, v in batch.items()})
        if self.on_training_call is not None:
            self.on_training_call(len(self.trained_on))
        return 0.0, {"policy/loss": 0.0}

    def prepare_for_inference(self):
        pass

    finish_inference = prepare_for_training = prepare_for_training_step = prepare_for_inference
    finish_training_step = finish_training = prepare_for_inference


class Optimizer:
    param_groups = [{"lr": 1e-6}]

    def zero_grad(self):
        pass

    def step(self):
        pass


class Scheduler:
    def step(self):
        pass


class Logger:
    def log_metrics(self, *args, **kwargs):
        pass

    def log_table(self, *args, **kwargs):
        pass

    def finalize(self):
        pass


class Checkpoint:
    def custom_save(self, monitor_candidates, is_train_end):
        pass


def problems():
    return [{"id": f"p{i}", "benchmark": "test", "prompt": "q" * (1 + i % 3) + str(i), "answer": str(i % 3)}
            for i in range(NUM_PROBLEMS)]


def build_trainer(actor, ckpt_callback, **trainer_options):
    """A ``QuatroReinforceTrainer`` over the 16 stand-in problems, 4 prompts x 4 responses per step,
    optimizer steps of 8 sequences, K = 2; ``trainer_options`` override ``trainer.reinforce`` keys.
    Call after ``initialize_parallel``."""
    from nemo_aligner.data.nlp.builders import build_dataloader, collate_with_pad_to_max_batch
    from nemo_aligner.utils.batch_iterators import DefaultBatchIterator
    from nemo_aligner.utils.distributed import Timer

    from quatro_nemo.aligner.data import ProblemPromptDataset, collate_with_prompt_ids
    from quatro_nemo.aligner.rewards import VerifierRewardClient
    from quatro_nemo.aligner.trainer import QuatroReinforceTrainer

    tokenizer = Tokenizer()
    dataset = ProblemPromptDataset(problems(), tokenizer, "{prompt}", max_prompt_length=8)
    cfg = OmegaConf.create({"model": {"seed": 7, "data": {"num_workers": 0}}})
    collate_fn = collate_with_prompt_ids(
        collate_with_pad_to_max_batch(MAX_RESPONSE, tokenizer.eos_id, cfg, generate_masks_and_position_ids=False))
    builder = partial(build_dataloader, cfg=cfg, dataset=dataset, mbs=ROLLOUT_MBS, gbs=PROMPTS_PER_STEP,
                      collate_fn=collate_fn, load_gbs=False)
    trainer_cfg = OmegaConf.create({
        "max_epochs": 1, "max_steps": 1, "val_check_interval": 10, "save_interval": 10,
        "gradient_clip_val": 0.0, "initial_policy_kl_penalty": 0.0, "use_absolute_kl": True,
        "num_rollouts_per_prompt": NUM_RESPONSES, "rollout_batch_seq_length": None,
        "model_gbs": GLOBAL_BATCH_SIZE, "model_mbs": 1,
        "quatro": {"inner_loops": INNER_LOOPS, "shuffle_groups": False, "seed": 3},
        **trainer_options,
    })
    return QuatroReinforceTrainer(
        cfg=trainer_cfg, model=actor, optimizer=Optimizer(), scheduler=Scheduler(),
        train_dataloader_builder=builder, val_dataloader_builder=builder, collate_fn=collate_fn,
        rm=VerifierRewardClient(Verifier(), problems(), tokenizer), batch_iterator_cls=DefaultBatchIterator,
        logger=Logger(), ckpt_callback=ckpt_callback, run_timer=Timer(None),
    )
