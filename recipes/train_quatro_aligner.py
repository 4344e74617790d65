"""Train QUATRO (or any registry baseline) with NeMo-Aligner 0.7.0 (docs/aligner.md).

Runs in the NeMo-Aligner container (NeMo 2.1, megatron-core 0.10, TE, apex, TRT-LLM), with this
repository installed (``pip install --no-deps -e .``). NeMo-style Hydra config
``conf/aligner/gpt_quatro_actor.yaml``; one process per GPU (``torchrun`` or ``srun``):

    torchrun --nproc-per-node 8 recipes/train_quatro_aligner.py \\
        pretrained_checkpoint.restore_from_path=/ckpt/model.nemo \\
        quatro.data.train_file=data/math_train.jsonl quatro.data.validation_file=data/math500.jsonl \\
        ++model.tensor_model_parallel_size=2 algorithm@model.quatro.algorithm=quatro

The flow is NeMo-Aligner's ``examples/nlp/gpt/train_gpt_reinforce_actor.py`` with the QUATRO
actor and trainer (``quatro_nemo.aligner``), this project's JSONL problems with dataset ids, and
the reward client from ``quatro.reward`` (verifier in-process, or the remote reward server).
SIGUSR1/SIGTERM save a checkpoint at the next step boundary and exit with code 75 (requeue me);
rerunning the same command resumes from it (``exp_manager.resume_if_exists``), as
``slurm/quatro_aligner.sh`` does.
"""
from functools import partial

import torch
import torch.multiprocessing as mp
from megatron.core.utils import divide
from omegaconf.omegaconf import OmegaConf

from nemo.core.config import hydra_runner
from nemo.utils import logging
from nemo.utils.exp_manager import exp_manager
from nemo_aligner.data.nlp.builders import build_dataloader, collate_with_pad_to_max_batch
from nemo_aligner.utils import parallel_state
from nemo_aligner.utils.batch_iterators import get_batch_iterator_cls
from nemo_aligner.utils.distributed import Timer
from nemo_aligner.utils.train_script_utils import (
    CustomLoggerWrapper,
    add_custom_checkpoint_callback,
    extract_optimizer_scheduler_from_ptl_model,
    init_distributed,
    init_peft,
    init_using_ptl,
    resolve_and_create_trainer,
    retrieve_custom_trainer_state_dict,
)
from nemo_aligner.utils.utils import load_and_override_model_config, load_from_nemo, retrieve_model_state_dict_in_cpu
from quatro_nemo.aligner.actor import QuatroReinforceActor
from quatro_nemo.aligner.config import register_recipe_configs, validate_recipe_config
from quatro_nemo.aligner.data import ProblemPromptDataset, collate_with_prompt_ids
from quatro_nemo.data.schema import read_problems
from quatro_nemo.aligner.rewards import build_reward_client
from quatro_nemo.aligner.trainer import QuatroReinforceTrainer
from quatro_nemo.megatron.preemption import preemption_exits

register_recipe_configs()

mp.set_start_method("spawn", force=True)


def build_datasets(cfg, tokenizer):
    """Train and validation prompt datasets; validation ids follow the training ids, so one reward
    client (indexed by dataset id) serves both."""
    train_problems = read_problems(cfg.quatro.data.train_file)
    validation_problems = read_problems(cfg.quatro.data.validation_file)
    max_prompt_length = cfg.model.encoder_seq_length - cfg.model.reinforce.length_params.max_length
    template = cfg.quatro.data.prompt_template
    train_ds = ProblemPromptDataset(train_problems, tokenizer, template, max_prompt_length)
    validation_ds = ProblemPromptDataset(validation_problems, tokenizer, template, max_prompt_length,
                                         id_offset=len(train_problems))
    return train_ds, validation_ds, train_problems + validation_problems


@hydra_runner(config_path="../conf", config_name="aligner/gpt_quatro_actor")
def main(cfg) -> None:
    validate_recipe_config(cfg)
    cfg.model = load_and_override_model_config(cfg.pretrained_checkpoint.restore_from_path, cfg.model)
    logging.info(f"\n{OmegaConf.to_yaml(cfg)}")

    trainer = resolve_and_create_trainer(cfg, "reinforce")
    exp_manager(trainer, cfg.exp_manager)
    logger = CustomLoggerWrapper(trainer.loggers)

    ptl_model = load_from_nemo(
        QuatroReinforceActor, cfg.model, trainer, strict=True, restore_path=cfg.pretrained_checkpoint.restore_from_path
    )
    init_peft(ptl_model, cfg.model)
    # pi_ref for the k3 KL: a CPU copy of the initial weights (or the adapters switched off with PEFT).
    if ptl_model.needs_reference_logprobs and cfg.model.peft.peft_scheme == "none":
        ptl_model.init_policy_state_dict = retrieve_model_state_dict_in_cpu(
            ptl_model, megatron_amp_O2=cfg.model.get("megatron_amp_O2", False)
        )

    custom_trainer_state_dict = retrieve_custom_trainer_state_dict(trainer) if trainer.ckpt_path else None
    init_distributed(trainer, ptl_model, cfg.model.get("transformer_engine", False))

    train_ds, validation_ds, problems = build_datasets(cfg, ptl_model.tokenizer)
    collate_fn = collate_with_prompt_ids(
        collate_with_pad_to_max_batch(
            cfg.model.reinforce.length_params.max_length, ptl_model.tokenizer.eos_id, cfg,
            generate_masks_and_position_ids=False,
        )
    )
    train_dataloader_builder = partial(
        build_dataloader, cfg=cfg, dataset=train_ds, mbs=cfg.model.reinforce.rollout_micro_batch_size,
        gbs=cfg.model.reinforce.num_rollout_samples, collate_fn=collate_fn, load_gbs=False,
    )
    val_dataloader_builder = partial(
        build_dataloader, cfg=cfg, dataset=validation_ds, mbs=cfg.model.reinforce.val_rollout_micro_batch_size,
        gbs=cfg.model.reinforce.num_val_samples, collate_fn=collate_fn, load_gbs=False, use_random_sampler=False,
    )
    # As in NeMo-Aligner's recipe: PTL needs a dataloader to set up; it is never used.
    dummy_train_dataloader = torch.utils.data.DataLoader(
        dataset=train_ds, batch_size=divide(cfg.model.global_batch_size, parallel_state.get_data_parallel_world_size())
    )
    init_using_ptl(trainer, ptl_model, dummy_train_dataloader, train_ds)
    del ptl_model._train_dl
    del dummy_train_dataloader

    optimizer, scheduler = extract_optimizer_scheduler_from_ptl_model(ptl_model)
    ckpt_callback = add_custom_checkpoint_callback(trainer, ptl_model)
    logger.log_hyperparams(OmegaConf.to_container(cfg))

    rm = build_reward_client(cfg.quatro.reward, cfg.remote_rm, problems, ptl_model.tokenizer)
    timer = Timer(cfg.exp_manager.get("max_time_per_run") if cfg.exp_manager else None)
    batch_iterator_cls = get_batch_iterator_cls(cfg.trainer.reinforce.get("batch_iterator", {}))

    quatro_trainer = QuatroReinforceTrainer(
        cfg=cfg.trainer.reinforce,
        model=ptl_model,
        optimizer=optimizer,
        scheduler=scheduler,
        train_dataloader_builder=train_dataloader_builder,
        val_dataloader_builder=val_dataloader_builder,
        collate_fn=collate_fn,
        rm=rm,
        batch_iterator_cls=batch_iterator_cls,
        logger=logger,
        ckpt_callback=ckpt_callback,
        run_timer=timer,
    )
    if custom_trainer_state_dict is not None:
        quatro_trainer.load_state_dict(custom_trainer_state_dict)
    try:
        # Preempted -> exit 75 (a SystemExit: inside main, Hydra's job runner would turn the
        # exception itself into exit code 1).
        with preemption_exits():
            quatro_trainer.fit()
    finally:
        communicator = getattr(rm, "communicator", None)  # the remote client's PyTriton threads
        if communicator is not None:
            communicator.close()


if __name__ == "__main__":
    main()
