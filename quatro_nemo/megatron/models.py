"""Model builders: a typed :class:`ModelConfig` -> this rank's megatron-core ``GPTModel`` stage.

Two architectures, both megatron-core ``GPTModel``s:

- ``"gpt"``: the tiny CPU model. LayerNorm, GELU MLP, biases everywhere, learned absolute
  position embeddings.
- ``"qwen2"``: a Qwen2-style decoder (Qwen2 / Qwen2.5-Math, https://arxiv.org/abs/2407.10671):
  RMSNorm, SwiGLU MLP without biases, bias only on Q/K/V, grouped-query attention
  (``num_query_groups``), RoPE with ``rotary_base``, tied or untied embeddings.

The layer spec is megatron-core's local (pure PyTorch) spec unless Transformer Engine imports
(GPU clusters), then the TE spec. Without CUDA, weights are initialised on the CPU
(``use_cpu_initialization=True``) from the seed set by ``initialize_parallel``: the TP shards are
then exact slices of the TP=1 weights, which the equivalence tests rely on. With CUDA they are
created on the GPU. bf16/fp16 models come wrapped in megatron's ``Float16Module``.

Differences between megatron-core versions (0.10 in the NeMo-Aligner container, 0.16.1 in .venv,
0.19 in .venv-cluster and the image) are
handled only in :func:`_layer_spec` and :func:`_transformer_config_kwargs`.

megatron's fused kernels are on where the process can run them (:func:`fusions_for` of the
:class:`FusionCapability` detected at build time), off on the CPU: gradient-accumulation fusion
(weight gradients accumulated into DDP's float32 ``main_grad`` inside the GEMM), the fused RoPE
and the fused SwiGLU. The same model runs the same kernels in every pass (pi_old's log-probs, the
training forward, its recomputation), so pi_old still equals the training forward bit for bit.

:func:`global_parameter_name` names this rank's parameters as in the full (TP=1, PP=1) model;
TP slicing and gathering of full tensors live in :mod:`quatro_nemo.megatron.checkpoint`.
"""
from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

from quatro_nemo.megatron import parallel
from quatro_nemo.validation import choices, coerce_choices

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Architecture = choices("Architecture", ("gpt", "qwen2"), __name__)
Normalization = choices("Normalization", ("LayerNorm", "RMSNorm"), __name__)
PositionEmbedding = choices("PositionEmbedding", ("learned_absolute", "rope"), __name__)
ParamsDtype = choices("ParamsDtype", tuple(_DTYPES), __name__)


@dataclass
class ModelConfig:
    """Shape and flavour of a decoder. ``architecture`` fills the flavour defaults left as None.

    Validated in ``__post_init__``; a bad value raises ``ValueError`` naming the field (a
    :class:`~quatro_nemo.validation.ConfigError` for a choice; Hydra rejects one while composing).
    """

    vocab_size: Optional[int] = 64  # None (run configs only): the task's vocabulary, Task.model_config
    hidden_size: int = 32
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None  # None: = num_attention_heads (no GQA)
    ffn_hidden_size: Optional[int] = None  # None: 4 * hidden_size
    max_position_embeddings: int = 64
    architecture: Architecture = Architecture.gpt
    # Flavour switches: None takes the architecture's default (see ARCHITECTURE_DEFAULTS).
    normalization: Optional[Normalization] = None
    swiglu: Optional[bool] = None
    qkv_bias: Optional[bool] = None
    linear_bias: Optional[bool] = None  # biases on the other linear layers
    position_embedding: Optional[PositionEmbedding] = None
    rotary_base: int = 10000
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    init_method_std: float = 0.02
    params_dtype: ParamsDtype = ParamsDtype.float32
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    extra: Dict[str, Any] = field(default_factory=dict)  # passed to TransformerConfig as is

    def __post_init__(self) -> None:
        coerce_choices(self, "model")
        for key, value in ARCHITECTURE_DEFAULTS[self.architecture].items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        for key in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                    "num_query_groups", "ffn_hidden_size", "max_position_embeddings"):
            if key == "vocab_size" and self.vocab_size is None:
                continue
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)!r} must be a positive integer")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"model.num_query_groups={self.num_query_groups}"
            )
        if self.norm_eps <= 0:
            raise ValueError(f"model.norm_eps={self.norm_eps} must be > 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.params_dtype]

    def to_dict(self) -> Dict[str, object]:
        return asdict(self)


ARCHITECTURE_DEFAULTS: Dict[Architecture, Dict[str, object]] = {
    Architecture.gpt: dict(normalization=Normalization.LayerNorm, swiglu=False, qkv_bias=True, linear_bias=True,
                           position_embedding=PositionEmbedding.learned_absolute),
    Architecture.qwen2: dict(normalization=Normalization.RMSNorm, swiglu=True, qkv_bias=True, linear_bias=False,
                             position_embedding=PositionEmbedding.rope),
}


def transformer_engine_available() -> bool:
    """True when Transformer Engine imports (never on the CPU machines: it needs libcuda)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or OSError for missing CUDA libraries
        return False
    return True


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # ImportError, or OSError for missing CUDA libraries
        return False
    return True


@dataclass(frozen=True)
class FusionCapability:
    """Which of megatron's fused kernels this process can run (:meth:`detect`)."""

    cuda: bool
    transformer_engine: bool  # TE imports: its fused RoPE, its linears' fused weight-gradient accumulation
    apex_fused_wgrad: bool    # apex's ``fused_weight_gradient_mlp_cuda`` CUDA extension imports

    @classmethod
    def detect(cls) -> "FusionCapability":
        cuda = torch.cuda.is_available()
        return cls(cuda=cuda, transformer_engine=cuda and transformer_engine_available(),
                   apex_fused_wgrad=cuda and _importable("fused_weight_gradient_mlp_cuda"))


@dataclass(frozen=True)
class Fusions:
    """megatron ``TransformerConfig``'s fusion switches that :func:`fusions_for` sets."""

    gradient_accumulation_fusion: bool
    apply_rope_fusion: bool
    bias_activation_fusion: bool


def fusions_for(capability: FusionCapability, cfg: ModelConfig, megatron_ddp: bool) -> Fusions:
    """The fusions a model of ``cfg`` gets on a device with ``capability`` (megatron-core 0.19.2):

    - ``gradient_accumulation_fusion``: CUDA and apex's ``fused_weight_gradient_mlp_cuda``. The
      output layer is always megatron's own ``tensor_parallel.ColumnParallelLinear``
      (``GPTModel``: TE's LM head only under MXFP8), whose constructor raises without that
      extension (``tensor_parallel/layers.py``); TE's linears take the same switch as
      ``fuse_wgrad_accumulation`` (``extensions/transformer_engine.py``). Both write into the
      ``main_grad`` buffers megatron's DDP gives each parameter: a model trained without megatron's
      DDP (``megatron_ddp=False``, the countdown warm start's plain torch AdamW) keeps it off.
    - ``apply_rope_fusion``: CUDA, Transformer Engine (``rope_utils``: TE's
      ``fused_apply_rotary_pos_emb`` / ``_thd``; ``TransformerConfig`` refuses it without them) and
      a RoPE model.
    - ``bias_activation_fusion``: CUDA and a SwiGLU MLP (``mlp.py``: megatron's ``bias_swiglu_impl``,
      ``torch.compile``d by ``megatron.core.jit``; the same function of its input, with a
      hand-written backward). Not for the GELU MLP: its fused kernel is the tanh approximation
      (``fused_bias_gelu``), another function than ``F.gelu``.

    Off on the CPU: nothing to gain there (``compat.py``'s workaround 7 keeps megatron's fused
    functions eager), and the CPU tests compare against unfused references.
    """
    return Fusions(
        gradient_accumulation_fusion=capability.cuda and capability.apex_fused_wgrad and megatron_ddp,
        apply_rope_fusion=capability.cuda and capability.transformer_engine
        and cfg.position_embedding == PositionEmbedding.rope,
        bias_activation_fusion=capability.cuda and bool(cfg.swiglu),
    )


def _layer_spec(cfg: ModelConfig, use_transformer_engine: bool):
    """The layer spec; the one place that knows megatron-core's spec signatures (0.10 .. 0.19)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_transformer_engine:
        # TE's fused layernorm-linear handles LayerNorm and RMSNorm from TransformerConfig.
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    local_spec = gpt_layer_specs.get_gpt_layer_local_spec
    if "normalization" in inspect.signature(local_spec).parameters:
        return local_spec(normalization=str(cfg.normalization))
    if cfg.normalization != "LayerNorm":  # megatron-core < 0.11: the local spec is LayerNorm only
        raise ValueError(
            f"model.normalization={str(cfg.normalization)!r} needs megatron-core >= 0.11 without "
            "Transformer Engine (this megatron-core's local layer spec has LayerNorm only)"
        )
    return local_spec()


def _transformer_config_kwargs(cfg: ModelConfig, fusions: Fusions) -> Dict[str, object]:
    """Keyword arguments of TransformerConfig present in every supported megatron-core."""
    dtype = cfg.torch_dtype
    return dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        normalization=str(cfg.normalization),
        layernorm_epsilon=cfg.norm_eps,
        gated_linear_unit=cfg.swiglu,
        activation_func=F.silu if cfg.swiglu else F.gelu,
        add_bias_linear=cfg.linear_bias,
        add_qkv_bias=cfg.qkv_bias,
        init_method_std=cfg.init_method_std,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        tensor_model_parallel_size=parallel.tp_size(),
        pipeline_model_parallel_size=parallel.pp_size(),
        sequence_parallel=False,
        # CPU initialisation makes TP shards exact slices of the TP=1 weights (the equivalence
        # tests rely on it); on GPUs weights are created on the device (a 7B model in seconds).
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        gradient_accumulation_fusion=fusions.gradient_accumulation_fusion,
        apply_rope_fusion=fusions.apply_rope_fusion,
        bias_activation_fusion=fusions.bias_activation_fusion,
        masked_softmax_fusion=False,  # the local spec's unfused softmax; TE's attention has its own
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        # Each micro-batch loss is its additive share of the global loss (megatron/loss.py):
        # megatron then neither divides it by the number of micro-batches nor averages
        # gradients over data-parallel ranks (they are summed).
        calculate_per_token_loss=True,
    )


def build_transformer_config(cfg: ModelConfig, fusions: Fusions):
    """megatron-core TransformerConfig for ``cfg`` under the current parallel layout, with
    ``fusions`` (:func:`fusions_for`).

    Under pipeline parallelism micro-batches differ in shape (token budgets, packing, a shorter
    last slice), so the stages send each activation's shape ahead of it
    (``variable_seq_lengths``, megatron's p2p shape exchange). megatron-core refuses that flag
    with its default MoE token dispatcher ("allgather") even for a dense model, so the dispatcher
    is set to "alltoall" with it; these models have no experts, so no dispatcher is ever built.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = _transformer_config_kwargs(cfg, fusions)
    if parallel.pp_size() > 1:
        kwargs.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    kwargs.update(cfg.extra)
    return TransformerConfig(**kwargs)


def build_model(cfg: ModelConfig, use_transformer_engine: Optional[bool] = None, megatron_ddp: bool = True):
    """This rank's pipeline stage of the model, on :func:`compat.current_device`.

    Call after :func:`quatro_nemo.megatron.parallel.initialize_parallel`. The output layer is
    vocab-parallel (``parallel_output=True``): logits come out as ``[L, S, V/TP]`` (megatron's
    sequence-first layout) on the last stage; earlier stages return hidden states.
    ``megatron_ddp``: the model trains inside megatron's DDP or not at all (:func:`fusions_for`);
    False for one trained by a plain torch optimizer.
    """
    from megatron.core.models.gpt import GPTModel

    from quatro_nemo.megatron.compat import current_device

    tp = parallel.tp_size()
    if cfg.vocab_size % tp != 0:
        raise ValueError(f"model.vocab_size={cfg.vocab_size} is not divisible by tensor_parallel={tp}")
    if cfg.num_query_groups % tp != 0:
        raise ValueError(f"model.num_query_groups={cfg.num_query_groups} is not divisible by tensor_parallel={tp}")
    pp = parallel.pp_size()
    if cfg.num_layers % pp != 0:
        raise ValueError(f"model.num_layers={cfg.num_layers} is not divisible by pipeline_parallel={pp}")
    if use_transformer_engine is None:
        use_transformer_engine = transformer_engine_available()

    model = GPTModel(
        config=build_transformer_config(cfg, fusions_for(FusionCapability.detect(), cfg, megatron_ddp)),
        transformer_layer_spec=_layer_spec(cfg, use_transformer_engine),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=parallel.is_first_stage(),
        post_process=parallel.is_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_embeddings,
        position_embedding_type=str(cfg.position_embedding),
        rotary_base=cfg.rotary_base,
    )
    model = model.to(current_device())
    if cfg.torch_dtype != torch.float32:
        # Megatron-LM's mixed-precision wrapper: casts the embedding output to the params dtype
        # and the last stage's logits back to float32 (the local spec keeps norms in float32).
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(model.config, model)
    return model


_LAYER_NAME = re.compile(r"^(?P<prefix>(?:.*\.)?decoder\.layers\.)(?P<index>\d+)(?P<rest>\..*)$")


def _layer_offset(model) -> int:
    """Global index of this stage's first transformer layer."""
    layers = model.decoder.layers
    if len(layers) == 0:
        return 0
    return layers[0].layer_number - 1  # megatron's layer_number is global and 1-based


def global_parameter_name(model, local_name: str) -> str:
    """Name of a local parameter in the full PP=1 model (decoder layer indices made global)."""
    if local_name == "output_layer.weight" and getattr(model, "share_embeddings_and_output_weights", False):
        # With PP > 1 the last stage holds a copy of the tied embedding (kept equal by megatron's
        # embedding-group all-reduce); the full model has only the input embedding.
        return "embedding.word_embeddings.weight"
    match = _LAYER_NAME.match(local_name)
    if match is None:
        return local_name
    index = int(match.group("index")) + _layer_offset(model)
    return f"{match.group('prefix')}{index}{match.group('rest')}"
