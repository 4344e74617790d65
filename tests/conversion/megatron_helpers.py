"""Helpers shared by the conversion tests: a pipeline-aware forward that returns full logits."""
from __future__ import annotations

from typing import Optional

import torch


def forward_logits(model, tokens: torch.Tensor) -> Optional[torch.Tensor]:
    """Full-vocabulary logits ``[B, L, V]`` of ``tokens [B, L]`` through megatron's schedule.

    Runs megatron's own forward-only pipeline schedule (so PP > 1 works); returns the logits on the
    last pipeline stage (gathered over TP) and None on other stages.
    """
    from quatro_nemo.megatron import parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch, length = tokens.shape
    position_ids = torch.arange(length).unsqueeze(0).expand(batch, length)

    def forward_step(data_iterator, chunk):
        output = chunk(tokens, position_ids, None)

        def keep_output(output_tensor, non_loss_data=False):
            return output_tensor.detach()

        return output, keep_output

    collected = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
        seq_length=length, micro_batch_size=batch, forward_only=True, collect_non_loss_data=True,
    )
    if not parallel.is_last_stage():
        return None
    local = collected[0]
    assert local.shape[:2] == (batch, length), local.shape
    tp = parallel.tp_size()
    if tp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=parallel.tp_group())
    return torch.cat(parts, dim=-1)
