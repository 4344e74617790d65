"""QUATRO actor for NeMo-Aligner 0.7.0: ``MegatronGPTReinforceActorModel`` with this project's loss.

Imports NeMo and NeMo-Aligner: import this module only where they are installed (the
NeMo-Aligner container, or ``.venv-aligner``). What changes against the parent
(``nemo_aligner/models/nlp/gpt/megatron_gpt_reinforce_actor.py``):

- **Loss closure**: the registry's policy loss for ``model.quatro.algorithm`` (QUATRO or any
  baseline, ``quatro_nemo.algos``) on the TP-complete per-token log-probs of NeMo-Aligner's own
  ``from_parallel_logits_to_logprobs``, with the k3 reference KL (``beta > 0``) from the
  reference log-probs the trainer computed. The parent's REINFORCE loss and its
  ``rewards_with_kl`` / ``baseline`` keys are gone.
- **Only the keys a stage needs** are moved to its device (``loss.keys_for_stage``): the loss
  tensors (``response_mask``, ``advantages``, ``old_logprobs``, ``ref_logprobs``) go to the last
  pipeline stage only, where the closure runs.
- **Any micro-batch size**: each micro-batch loss is its additive share of the global-batch loss
  (global counts all-reduced over DP once per optimizer step), scaled by
  ``num_microbatches * dp`` to undo Megatron's division and NeMo's DP averaging (``loss.py``).
- **Metrics**: additive shares summed over micro-batches and DP ranks (max/min keys reduced with
  max/min), then broadcast from the last pipeline stage, once per optimizer step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from omegaconf import OmegaConf

from nemo.collections.nlp.modules.common.megatron.utils import get_iterator_k_split
from nemo_aligner.models.nlp.gpt.megatron_gpt_reinforce_actor import MegatronGPTReinforceActorModel
from nemo_aligner.utils import parallel_state
from nemo_aligner.utils.distributed import from_parallel_logits_to_logprobs
from nemo_aligner.utils.train_utils import set_sync_funcs
from quatro_nemo.algos import AlgorithmSpec, LossNormalizer, build_algorithm
from quatro_nemo.aligner.loss import keys_for_stage, loss_scale, microbatch_loss
from quatro_nemo.megatron.compat import current_device
from quatro_nemo.megatron.loss import broadcast_from_last_stage, global_loss_normalizer, reduce_metrics

# The config section (under ``model``) that names the algorithm: ``model.quatro.algorithm``.
ALGORITHM_SECTION = "quatro.algorithm"


@dataclass
class StepLossContext:
    """What the loss closure needs beyond the micro-batch, fixed for one optimizer step."""

    normalizer: LossNormalizer
    scale: float


class QuatroReinforceActor(MegatronGPTReinforceActorModel):
    """NeMo-Aligner REINFORCE actor whose loss is this project's policy loss (any registry algorithm).

    Config: ``model.quatro.algorithm`` = ``{name: quatro, delta: ..., beta: ...}`` (fields of the
    algorithm's config dataclass; unknown keys raise ValueError naming the key).
    """

    def __init__(self, cfg, trainer):
        super().__init__(cfg, trainer=trainer)
        self.configure_algorithm(cfg)

    def configure_algorithm(self, cfg) -> None:
        """Validate ``model.quatro.algorithm`` and keep (spec, config) on the model."""
        section = OmegaConf.select(cfg, ALGORITHM_SECTION)
        if section is None:
            raise ValueError(f"model.{ALGORITHM_SECTION} is required (e.g. {{name: quatro, delta: 0.1}})")
        if not isinstance(section, dict):
            section = OmegaConf.to_container(section, resolve=True)
        spec, config = build_algorithm(section, source=f"model.{ALGORITHM_SECTION}")
        self.algorithm: AlgorithmSpec = spec
        self.algorithm_config = config
        self._step_loss_context: Optional[StepLossContext] = None

    @property
    def needs_reference_logprobs(self) -> bool:
        """The k3 reference KL is in the loss (paper App. B): the trainer computes pi_ref log-probs."""
        return self.algorithm_config.beta > 0

    # training calls
    def get_actor_forward_output_and_loss_func(self):
        context = self._step_loss_context
        if context is None:
            raise RuntimeError("the loss closure is built by get_loss_and_metrics (it sets the global normaliser)")
        policy_loss, config = self.algorithm.policy_loss, self.algorithm_config

        def fwd_output_and_loss_func(data_iterator, model):
            batch = next(data_iterator)
            required_keys = keys_for_stage(
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.is_pipeline_first_stage(),
                parallel_state.is_pipeline_last_stage(),
            )
            device = current_device()
            batch = {
                key: value.to(device, non_blocking=True) if key in required_keys and value is not None else None
                for key, value in batch.items()
            }
            parallel_logits = model(
                batch["response_tokens"], batch["position_ids"], batch["attention_mask"], labels=None
            )

            def loss_func(parallel_logits):
                # [s, L, V/TP] -> [s, L-1] log p(response_tokens[:, t+1]), TP-complete on every TP rank.
                logprobs = from_parallel_logits_to_logprobs(
                    vocab_parallel_logits=parallel_logits, target=batch["response_tokens"], higher_stability=True
                )
                return microbatch_loss(logprobs, batch, policy_loss, config, context.normalizer, context.scale)

            return parallel_logits, loss_func

        return fwd_output_and_loss_func

    def get_loss_and_metrics(self, batch, forward_only):
        sequence_length = batch["response_tokens"].size(1)
        attention_mask, _, position_ids = self.get_ltor_masks_and_position_ids(tokens=batch["response_tokens"])
        batch["attention_mask"] = attention_mask
        batch["position_ids"] = position_ids

        num_microbatches = get_num_microbatches()
        dp_size = parallel_state.get_data_parallel_world_size()
        self._step_loss_context = StepLossContext(
            normalizer=global_loss_normalizer(batch["response_mask"].to(current_device()),
                                              parallel_state.get_data_parallel_group()),
            scale=loss_scale(num_microbatches, dp_size),
        )
        try:
            data_iter = get_iterator_k_split(batch, num_microbatches)
            set_sync_funcs(self, forward_only)
            fwd_bwd_function = get_forward_backward_func()
            metrics_per_microbatch = fwd_bwd_function(
                forward_step_func=self.get_actor_forward_output_and_loss_func(),
                data_iterator=self._make_data_iterator_list(data_iter),
                model=self.model,
                num_microbatches=num_microbatches,
                forward_only=forward_only,
                seq_length=sequence_length,
                micro_batch_size=self.cfg.micro_batch_size,
            )
        finally:
            self._step_loss_context = None
        metrics = self.reduce_step_metrics(metrics_per_microbatch)
        return metrics["policy/loss"], metrics

    def reduce_step_metrics(self, metrics_per_microbatch) -> Dict[str, float]:
        """Global metrics of one optimizer step, identical on every rank (see module doc)."""
        metrics = None
        if parallel_state.is_pipeline_last_stage():
            metrics = reduce_metrics(metrics_per_microbatch, parallel_state.get_data_parallel_group())
        return broadcast_from_last_stage(metrics)
