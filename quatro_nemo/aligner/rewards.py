"""Rewards for NeMo-Aligner without a PyTriton reward server: this project's verifiers in-process.

NeMo-Aligner's trainers call ``rm.infer_rm(rollout_batch)`` and later ``future.result()``, which
must return a ``[b, 1]`` float tensor, identical on every rank of the model-parallel group
(``nemo_aligner/models/nlp/gpt/reward_critic_clients.py``: ``RemoteGPTRMClient`` /
``RMFutureResult``). :class:`VerifierRewardClient` has that interface and scores each response
with a verifier from ``quatro_nemo.rewards`` (``get_verifier(name).score_batch(problems,
responses)``, ``docs/interfaces.md``). The remote option (a reward-model server) stays available:
``build_reward_client`` returns NeMo-Aligner's own ``RemoteGPTRMClient`` for ``kind: remote``.

Scoring is deterministic, so every rank scores its own rollouts and no broadcast is needed.
The rollout batch must carry ``prompt_ids`` (dataset ids, added by the QUATRO trainer) so the
client can find each response's problem (its reference answer).
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence

import torch


class ResolvedRewards:
    """A finished "future": ``result()`` returns the ``[b, 1]`` rewards (NeMo-Aligner's protocol)."""

    def __init__(self, rewards: torch.Tensor):
        self._rewards = rewards

    def result(self) -> torch.Tensor:
        return self._rewards


def decode_responses(tokenizer: Any, rollout_batch: Mapping[str, torch.Tensor]) -> List[str]:
    """Response texts of a NeMo-Aligner rollout batch.

    ``response_tokens`` [b, L] hold prompt + response; the response of row ``i`` is
    ``response_tokens[i, prompt_lengths[i] : response_lengths[i]]`` (``ReinforceTrainer.
    compute_rollout_metrics`` slices the same way). ``tokenizer.ids_to_text`` is NeMo's API.
    """
    tokens = rollout_batch["response_tokens"].cpu()
    starts = rollout_batch["prompt_lengths"].cpu().tolist()
    ends = rollout_batch["response_lengths"].cpu().tolist()
    return [tokenizer.ids_to_text(row[start:end].tolist()) for row, start, end in zip(tokens, starts, ends)]


class VerifierRewardClient:
    """A reward-model client backed by a ``quatro_nemo.rewards`` verifier.

    Args:
        verifier: an object with ``score_batch(problems, responses) -> list[float]``.
        problems: the dataset's problem records, indexed by dataset id (``prompt_ids``).
        tokenizer: NeMo tokenizer (``ids_to_text``) used to decode responses.
    """

    def __init__(self, verifier: Any, problems: Sequence[Dict[str, Any]], tokenizer: Any):
        self.verifier = verifier
        self.problems = problems
        self.tokenizer = tokenizer

    def infer_rm(self, rollout_batch: Mapping[str, torch.Tensor]) -> ResolvedRewards:
        if "prompt_ids" not in rollout_batch:
            raise KeyError(
                "VerifierRewardClient needs rollout_batch['prompt_ids'] (dataset ids); use the QUATRO "
                "trainer (quatro_nemo.aligner.trainer.QuatroReinforceTrainer), which adds them"
            )
        ids = rollout_batch["prompt_ids"].cpu().tolist()
        problems = [self.problems[i] for i in ids]
        responses = decode_responses(self.tokenizer, rollout_batch)
        scores = self.verifier.score_batch(problems, responses)
        if len(scores) != len(responses):
            raise ValueError(f"verifier returned {len(scores)} scores for {len(responses)} responses")
        device = rollout_batch["response_tokens"].device
        return ResolvedRewards(torch.tensor(scores, dtype=torch.float32, device=device).view(-1, 1))


REWARD_KINDS = ("verifier", "remote")


def build_reward_client(
    reward_cfg: Mapping[str, Any],
    remote_rm_cfg: Any,
    problems: Sequence[Dict[str, Any]],
    tokenizer: Any,
) -> Any:
    """The reward client named by the ``quatro.reward`` config section.

    ``kind: verifier`` (default): :class:`VerifierRewardClient` with ``get_verifier(verifier)``.
    ``kind: remote``: NeMo-Aligner's ``RemoteGPTRMClient(remote_rm_cfg)`` (a PyTriton reward
    model server, as in NeMo-Aligner's own REINFORCE recipe).
    """
    kind = reward_cfg.get("kind", "verifier")
    if kind not in REWARD_KINDS:
        raise ValueError(f"quatro.reward.kind must be one of {list(REWARD_KINDS)}, got {kind!r}")
    if kind == "remote":
        from nemo_aligner.models.nlp.gpt.reward_critic_clients import RemoteGPTRMClient

        return RemoteGPTRMClient(remote_rm_cfg)
    from quatro_nemo.rewards import get_verifier

    return VerifierRewardClient(get_verifier(reward_cfg.get("verifier", "math")), problems, tokenizer)
