"""Does vLLM compute with the weights megatron pushed? (``vllm.check_push``: the GPU check's.)

After a push, the engine layers that a wrong name mapping or row order would break are run on
fixed random inputs ``X`` [k, hidden] and their outputs compared with ``X`` through megatron's own
full tensors, put in vLLM's row order here, independently of the HF mapping the push goes through
(:mod:`quatro_nemo.megatron.hf_conversion`):

- ``self_attn.qkv_proj`` (weight and bias) holds ``[q; k; v]``: every query head, then each KV
  group's key, then each one's value; megatron's ``linear_qkv`` groups them per KV group,
  ``[q heads of g, k_g, v_g]`` (:func:`vllm_qkv_rows`);
- ``mlp.gate_up_proj`` holds ``[gate; up]``, as megatron's ``linear_fc1`` does;
- the logits (the model's ``compute_logits``, i.e. ``lm_head``) against megatron's output layer, or
  its word embedding when the embeddings are tied (the engine is always untied:
  :func:`quatro_nemo.engine.vllm_backend.write_engine_model_dir`).

The engine's weights are run rather than read: vLLM's CPU build packs its linear weights into
oneDNN handles and leaves the parameters empty (``dispatch_cpu_unquantized_gemm`` in
``vllm/model_executor/layers/utils.py``, 0.32.0), so only the layers' outputs are the same on the
GPU and the CPU. ``k`` random inputs give each output row a value, so equal outputs mean equal
rows in the same order: a swapped gate/up or a mis-grouped QKV gives a relative error near 1.4.

Each push's metrics (the largest over layers) are ``engine_push/qkv_rel_err``,
``engine_push/gate_up_rel_err`` and ``engine_push/logits_rel_err``:
``||engine - megatron||_F / ||megatron||_F``, ~3e-3 in bf16 (rounding of the engine's output), ~1e-7
in float32; a layer missing on either side counts as ``inf``. One engine per rank (vLLM tensor
parallel 1, checked by ``VllmConfig``): this rank's engine against the full tensors.
"""
from __future__ import annotations

import re
from typing import Dict, Iterable, Iterator, Tuple

import torch

PROBE_ROWS = 4
PROBE_SEED = 1234
CHECKED = ("qkv", "gate_up", "logits")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(self_attention\.linear_qkv\.weight|self_attention\.linear_qkv\.bias|"
                    r"mlp\.linear_fc1\.weight)$")


def probe_inputs(hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The fixed inputs ``X`` [PROBE_ROWS, hidden_size] (CPU, in the model's dtype)."""
    generator = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randn(PROBE_ROWS, hidden_size, generator=generator).to(dtype)


def vllm_qkv_rows(num_heads: int, num_groups: int, head_dim: int) -> torch.Tensor:
    """For each row of vLLM's ``qkv_proj`` (``[q; k; v]``), its row in megatron's ``linear_qkv``
    (per KV group ``g``: ``heads/groups`` query heads, one key head, one value head)."""
    q_rows = num_heads // num_groups * head_dim
    group_start = (torch.arange(num_groups) * (q_rows + 2 * head_dim))[:, None]
    q = (group_start + torch.arange(q_rows)).reshape(-1)
    k = (group_start + q_rows + torch.arange(head_dim)).reshape(-1)
    v = (group_start + q_rows + head_dim + torch.arange(head_dim)).reshape(-1)
    return torch.cat([q, k, v])


def engine_layer_outputs(worker, probes: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Run in the vLLM worker (``LLM.collective_rpc``): ``{"<layer>.qkv", "<layer>.gate_up",
    "logits"}`` -> the outputs (float32, CPU) of the Qwen2 model's layers on ``probes``."""
    model = worker.model_runner.get_model()
    embedding = model.model.embed_tokens.weight
    x = probes.to(device=embedding.device, dtype=embedding.dtype)
    outputs: Dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            outputs[f"{index}.qkv"] = layer.self_attn.qkv_proj(x)[0].float().cpu()   # (output, bias)
            outputs[f"{index}.gate_up"] = layer.mlp.gate_up_proj(x)[0].float().cpu()
        outputs["logits"] = model.compute_logits(x).float().cpu()
    return outputs


class PushCheck:
    """Megatron's side of one push: :meth:`tap` the ``(megatron name, full tensor)`` stream the push
    consumes (:func:`quatro_nemo.megatron.checkpoint.iter_full_parameters`), then :meth:`compare`
    with the engine once it has loaded the push. ``model_config``: the policy's
    :class:`~quatro_nemo.megatron.models.ModelConfig` (Qwen2)."""

    def __init__(self, model_config):
        self.tied = model_config.tie_embeddings
        self.probes = probe_inputs(model_config.hidden_size, model_config.torch_dtype)
        head_dim = model_config.hidden_size // model_config.num_attention_heads
        self.qkv_rows = vllm_qkv_rows(model_config.num_attention_heads, model_config.num_query_groups, head_dim)
        self.expected: Dict[str, torch.Tensor] = {}

    def _through(self, tensor: torch.Tensor) -> torch.Tensor:
        """``X @ W^T`` [PROBE_ROWS, rows of W] in float32, on the CPU."""
        return (self.probes.to(tensor.device).float() @ tensor.float().t()).cpu()

    def _observe(self, name: str, tensor: torch.Tensor) -> None:
        if name == "output_layer.weight" or (name == "embedding.word_embeddings.weight" and self.tied):
            self.expected["logits"] = self._through(tensor)
            return
        match = _LAYER.match(name)
        if match is None:
            return
        layer, what = match.group(1), match.group(2)
        if what.endswith("linear_qkv.weight"):
            key, value = f"{layer}.qkv", self._through(tensor)[:, self.qkv_rows]
        elif what.endswith("linear_qkv.bias"):
            key, value = f"{layer}.qkv", tensor.float().cpu()[self.qkv_rows]
        else:
            key, value = f"{layer}.gate_up", self._through(tensor)
        self.expected[key] = self.expected[key] + value if key in self.expected else value

    def tap(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> Iterator[Tuple[str, torch.Tensor]]:
        """The same stream, observed on its way to the engine."""
        self.expected = {}
        for name, tensor in named_tensors:
            self._observe(name, tensor)
            yield name, tensor

    def errors(self, engine: Dict[str, torch.Tensor]) -> Dict[str, float]:
        """``engine_push/<kind>_rel_err`` of the engine's outputs (:func:`engine_layer_outputs`)
        against :attr:`expected` (module docstring)."""
        worst = dict.fromkeys(CHECKED, 0.0)
        for key in set(engine) | set(self.expected):
            kind = key.split(".")[-1]
            if key not in engine or key not in self.expected:
                worst[kind] = float("inf")
                continue
            got, want = engine[key], self.expected[key]
            columns = min(got.shape[-1], want.shape[-1])  # the logits: vLLM may pad its vocabulary
            got, want = got[..., :columns], want[..., :columns]
            error = float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want).clamp(min=1e-30))
            worst[kind] = max(worst[kind], error)
        return {f"engine_push/{kind}_rel_err": value for kind, value in worst.items()}

    def compare(self, llm) -> Dict[str, float]:
        """:meth:`errors` of this rank's engine (``llm``, vLLM tensor parallel 1) after the push."""
        return self.errors(llm.collective_rpc(engine_layer_outputs, args=(self.probes,))[0])
