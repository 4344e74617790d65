"""Hugging Face Qwen2 <-> megatron-core GPTModel: configs, weights, safetensors files.

The one module that knows both naming schemes (Qwen2 / Qwen2.5-Math, ``transformers``'
``modeling_qwen2.py``; megatron-core's ``GPTModel`` with the local or the Transformer Engine layer
spec). megatron-bridge, the maintained converter, cannot be installed with the pinned
megatron-core on CPU (docs/stack-facts.md); on a GPU cluster it may be used instead.

Everything here works on **full** (TP=1, PP=1) megatron state dicts; sharding is
:mod:`quatro_nemo.megatron.checkpoint`'s job. The mapping, per decoder layer ``i``:

=======================================================  ============================================
HF Qwen2                                                 megatron-core (local spec / TE spec)
=======================================================  ============================================
``model.embed_tokens.weight``                            ``embedding.word_embeddings.weight``
``model.layers.i.input_layernorm.weight``                ``decoder.layers.i.input_layernorm.weight`` /
                                                         ``...self_attention.linear_qkv.layer_norm_weight``
``model.layers.i.self_attn.{q,k,v}_proj.{weight,bias}``  ``...self_attention.linear_qkv.{weight,bias}``
                                                         (grouped by KV head, see :func:`fuse_qkv`)
``model.layers.i.self_attn.o_proj.weight``               ``...self_attention.linear_proj.weight``
``model.layers.i.post_attention_layernorm.weight``       ``decoder.layers.i.pre_mlp_layernorm.weight`` /
                                                         ``...mlp.linear_fc1.layer_norm_weight``
``model.layers.i.mlp.{gate,up}_proj.weight``             ``...mlp.linear_fc1.weight`` = ``[gate; up]``
``model.layers.i.mlp.down_proj.weight``                  ``...mlp.linear_fc2.weight``
``model.norm.weight``                                    ``decoder.final_layernorm.weight``
``lm_head.weight`` (untied models only)                  ``output_layer.weight``
=======================================================  ============================================

Semantics that match without conversion (checked by the logits test): RMSNorm
``x * rsqrt(mean(x^2) + eps) * w``; RoPE in the non-interleaved "rotate half" form with
``rotary_base = rope_theta``; softmax scale ``1/sqrt(head_dim)``; SwiGLU ``silu(gate) * up``.
Unsupported Qwen2 features raise ``ValueError`` naming the config key (sliding-window attention,
RoPE scaling, a head_dim other than hidden_size / num_attention_heads).
"""
from __future__ import annotations

import collections.abc
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch

from quatro_nemo.megatron.models import ModelConfig

HF_ARCHITECTURE = "Qwen2ForCausalLM"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Files copied next to an export so vLLM / transformers can load it as a complete model.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "generation_config.json")

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MCORE_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# One-to-one layer names: HF suffix -> megatron suffixes (local spec first, TE spec second).
_LAYER_NAMES: Dict[str, Tuple[str, ...]] = {
    "input_layernorm.weight": ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
    "self_attn.o_proj.weight": ("self_attention.linear_proj.weight",),
    "post_attention_layernorm.weight": ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
    "mlp.down_proj.weight": ("mlp.linear_fc2.weight",),
}
_GLOBAL_NAMES: Dict[str, str] = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------


def _rope_theta(hf_config: Mapping[str, object]) -> float:
    """``rope_theta`` from a legacy (top-level) or transformers-5 (``rope_parameters``) config."""
    parameters = hf_config.get("rope_parameters") or {}
    if isinstance(parameters, Mapping) and parameters.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.rope_type={parameters['rope_type']!r}: only default RoPE is supported")
    if hf_config.get("rope_scaling"):
        raise ValueError(f"rope_scaling={hf_config['rope_scaling']!r}: RoPE scaling is not supported")
    theta = hf_config.get("rope_theta", parameters.get("rope_theta") if isinstance(parameters, Mapping) else None)
    if theta is None:
        raise ValueError("config has neither rope_theta nor rope_parameters.rope_theta")
    return float(theta)


def model_config_from_hf(
    hf_config: Mapping[str, object], params_dtype: str = "bfloat16", vocab_multiple: int = 1
) -> ModelConfig:
    """A ``qwen2`` :class:`ModelConfig` from a Qwen2 ``config.json`` (as a dict).

    ``vocab_multiple`` pads the vocabulary up to a multiple (e.g. the TP size): the padded rows
    are zero and are trimmed again on export.
    """
    model_type = hf_config.get("model_type")
    if model_type != "qwen2":
        raise ValueError(f"config.json model_type={model_type!r}: only 'qwen2' checkpoints are supported")
    if hf_config.get("use_sliding_window"):
        raise ValueError("config.json use_sliding_window=true: sliding-window attention is not supported")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={hf_config['hidden_act']!r}: expected 'silu'")
    hidden, heads = int(hf_config["hidden_size"]), int(hf_config["num_attention_heads"])
    head_dim = hf_config.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != hidden:
        raise ValueError(f"config.json head_dim={head_dim} != hidden_size / num_attention_heads")
    vocab = int(hf_config["vocab_size"])
    padded_vocab = -(-vocab // vocab_multiple) * vocab_multiple
    return ModelConfig(
        architecture="qwen2",
        vocab_size=padded_vocab,
        hidden_size=hidden,
        num_layers=int(hf_config["num_hidden_layers"]),
        num_attention_heads=heads,
        num_query_groups=int(hf_config.get("num_key_value_heads") or heads),
        ffn_hidden_size=int(hf_config["intermediate_size"]),
        max_position_embeddings=int(hf_config["max_position_embeddings"]),
        rotary_base=int(_rope_theta(hf_config)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        norm_eps=float(hf_config["rms_norm_eps"]),
        params_dtype=params_dtype,
        attention_dropout=float(hf_config.get("attention_dropout", 0.0)),
    )


def hf_config_from_model_config(cfg: ModelConfig, vocab_size: Optional[int] = None,
                                base: Optional[Mapping[str, object]] = None) -> Dict[str, object]:
    """A Qwen2 ``config.json`` dict for an export of ``cfg``.

    ``base`` (the source checkpoint's config) keeps its other keys (token ids, ...);
    ``vocab_size`` is the unpadded vocabulary (default: ``cfg.vocab_size``).
    """
    _check_qwen2(cfg)
    dtype = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[cfg.params_dtype]
    config = dict(base or {})
    config.pop("rope_parameters", None)  # written in the legacy form every reader accepts
    config.update(
        architectures=[HF_ARCHITECTURE],
        model_type="qwen2",
        vocab_size=int(vocab_size or cfg.vocab_size),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=float(cfg.rotary_base),
        rope_scaling=None,
        tie_word_embeddings=cfg.tie_embeddings,
        use_sliding_window=False,
        attention_dropout=cfg.attention_dropout,
        torch_dtype=dtype,
    )
    return config


def _check_qwen2(cfg: ModelConfig) -> None:
    expected = dict(architecture="qwen2", normalization="RMSNorm", swiglu=True, qkv_bias=True,
                    linear_bias=False, position_embedding="rope")
    for key, value in expected.items():
        if getattr(cfg, key) != value:
            raise ValueError(f"model.{key}={getattr(cfg, key)!r}: a Qwen2 checkpoint needs {value!r}")


# ---------------------------------------------------------------------------------------------
# Fused QKV and SwiGLU layouts
# ---------------------------------------------------------------------------------------------


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int) -> torch.Tensor:
    """HF ``q_proj``/``k_proj``/``v_proj`` (weights or biases) -> megatron's fused ``linear_qkv``.

    megatron groups by KV head: ``[q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1, ...]``
    (``SelfAttention.get_query_key_value_tensors`` splits each group's block as
    ``[heads/groups * d, d, d]``). Shapes: q ``[heads*d, ...]``, k and v ``[groups*d, ...]``.
    """
    head_dim = q.shape[0] // num_heads
    rest = tuple(q.shape[1:])
    q = q.reshape((num_groups, num_heads // num_groups * head_dim) + rest)
    k = k.reshape((num_groups, head_dim) + rest)
    v = v.reshape((num_groups, head_dim) + rest)
    return torch.cat([q, k, v], dim=1).reshape(((num_heads + 2 * num_groups) * head_dim,) + rest)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_groups: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: megatron ``linear_qkv`` -> HF ``(q, k, v)``."""
    head_dim = qkv.shape[0] // (num_heads + 2 * num_groups)
    rest = tuple(qkv.shape[1:])
    q_per_group = num_heads // num_groups * head_dim
    grouped = qkv.reshape((num_groups, q_per_group + 2 * head_dim) + rest)
    q, k, v = torch.split(grouped, [q_per_group, head_dim, head_dim], dim=1)
    return (q.reshape((num_heads * head_dim,) + rest),
            k.reshape((num_groups * head_dim,) + rest),
            v.reshape((num_groups * head_dim,) + rest))


# ---------------------------------------------------------------------------------------------
# State dicts
# ---------------------------------------------------------------------------------------------


def _megatron_recipe(cfg: ModelConfig, transformer_engine: bool) -> Dict[str, Tuple[Tuple[str, ...], Callable]]:
    """For every full megatron parameter of ``cfg``: the HF names it is built from and how."""
    _check_qwen2(cfg)
    spec_index = 1 if transformer_engine else 0
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups

    def same(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return fuse_qkv(q, k, v, heads, groups)

    def gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        # Fused SwiGLU fc1 = [gate; up]: megatron's glu chunks its output in two, silu on the first.
        return torch.cat([gate, up], dim=0)

    recipe: Dict[str, Tuple[Tuple[str, ...], Callable]] = {}
    for hf_name, mcore_name in _GLOBAL_NAMES.items():
        if not (hf_name == "lm_head.weight" and cfg.tie_embeddings):
            recipe[mcore_name] = ((hf_name,), same)
    for layer in range(cfg.num_layers):
        hf, mc = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        for hf_suffix, mcore_suffixes in _LAYER_NAMES.items():
            recipe[mc + mcore_suffixes[min(spec_index, len(mcore_suffixes) - 1)]] = ((hf + hf_suffix,), same)
        for kind in ("weight", "bias"):
            recipe[mc + f"self_attention.linear_qkv.{kind}"] = (
                tuple(hf + f"self_attn.{p}_proj.{kind}" for p in "qkv"), qkv)
        recipe[mc + "mlp.linear_fc1.weight"] = ((hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), gate_up)
    return recipe


class MegatronViewOfHF(collections.abc.Mapping):
    """A read-only full megatron state dict computed on access from an HF state dict (or a lazy
    :class:`SafetensorsStateDict`), so each rank materialises only the tensors it loads.

    Construction checks that every HF key is used and every needed key exists (``KeyError``
    naming the key).
    """

    def __init__(self, hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig, transformer_engine: bool = False):
        self._hf_state = hf_state
        self._recipe = _megatron_recipe(cfg, transformer_engine)
        needed = {name for sources, _ in self._recipe.values() for name in sources}
        missing = sorted(needed - set(hf_state.keys()))
        if missing:
            raise KeyError(f"HF checkpoint has no {missing[0]!r} ({len(missing)} keys missing)")
        # Some tied exports still carry an lm_head copy; the embedding is the truth.
        ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
        unknown = sorted(set(hf_state.keys()) - needed - ignored)
        if unknown:
            raise KeyError(f"HF checkpoint keys with no megatron counterpart: {unknown[:5]}")

    def __getitem__(self, name: str) -> torch.Tensor:
        sources, build = self._recipe[name]
        return build(*(self._hf_state[source] for source in sources))

    def __iter__(self) -> Iterator[str]:
        return iter(self._recipe)

    def __len__(self) -> int:
        return len(self._recipe)


def hf_to_megatron_state_dict(hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig,
                              transformer_engine: bool = False) -> Dict[str, torch.Tensor]:
    """A Qwen2 HF state dict -> the full (TP=1, PP=1) megatron state dict of ``cfg``.

    ``transformer_engine`` selects the TE spec's fused layer-norm names. The vocabulary is left
    at the HF size; :func:`checkpoint.load_full_state_dict` pads it to ``cfg.vocab_size``. An
    unknown or missing HF key raises ``KeyError`` naming it.
    """
    return dict(MegatronViewOfHF(hf_state, cfg, transformer_engine).items())


def megatron_tensor_to_hf(name: str, tensor: torch.Tensor, cfg: ModelConfig,
                          vocab_size: Optional[int] = None) -> List[Tuple[str, torch.Tensor]]:
    """One full megatron tensor -> its HF tensor(s) (QKV and fc1 are split). Accepts both the
    local and the TE layer-norm names; ``vocab_size`` trims padded vocabulary rows.
    """
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        tensor = tensor[:vocab_size] if vocab_size is not None else tensor
        if name == "output_layer.weight" and cfg.tie_embeddings:
            return []
        return [("model.embed_tokens.weight" if name.startswith("embedding") else "lm_head.weight", tensor)]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", tensor)]
    match = _MCORE_LAYER.match(name)
    if match is None:
        raise KeyError(f"megatron parameter {name!r} has no HF Qwen2 counterpart")
    hf = f"model.layers.{match.group(1)}."
    suffix = match.group(2)
    for hf_suffix, mcore_suffixes in _LAYER_NAMES.items():
        if suffix in mcore_suffixes:
            return [(hf + hf_suffix, tensor)]
    qkv = re.fullmatch(r"self_attention\.linear_qkv\.(weight|bias)", suffix)
    if qkv:
        q, k, v = split_qkv(tensor, cfg.num_attention_heads, cfg.num_query_groups)
        kind = qkv.group(1)
        return [(hf + f"self_attn.q_proj.{kind}", q), (hf + f"self_attn.k_proj.{kind}", k),
                (hf + f"self_attn.v_proj.{kind}", v)]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = torch.chunk(tensor, 2, dim=0)
        return [(hf + "mlp.gate_proj.weight", gate), (hf + "mlp.up_proj.weight", up)]
    raise KeyError(f"megatron parameter {name!r} has no HF Qwen2 counterpart")


def iter_megatron_to_hf(named_tensors: Iterable[Tuple[str, torch.Tensor]], cfg: ModelConfig,
                        vocab_size: Optional[int] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """Stream ``(hf_name, tensor)`` from ``(megatron_name, full tensor)`` pairs, e.g. from
    :func:`checkpoint.iter_full_parameters` for a weight push to vLLM."""
    _check_qwen2(cfg)
    for name, tensor in named_tensors:
        yield from megatron_tensor_to_hf(name, tensor, cfg, vocab_size)


def megatron_to_hf_state_dict(full_state: Mapping[str, torch.Tensor], cfg: ModelConfig,
                              vocab_size: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """The full (TP=1, PP=1) megatron state dict -> a Qwen2 HF state dict."""
    return dict(iter_megatron_to_hf(full_state.items(), cfg, vocab_size))


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


class SafetensorsStateDict(collections.abc.Mapping):
    """A read-only state dict over the ``*.safetensors`` files of a directory; each tensor is read
    (memory-mapped) on access, so a rank that loads one TP/PP shard reads only what it needs."""

    def __init__(self, directory: os.PathLike):
        from safetensors import safe_open

        directory = Path(directory)
        index = directory / SAFETENSORS_INDEX
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {directory} (.bin checkpoints are not supported)")
        self._handles = [safe_open(str(directory / file), framework="pt") for file in files]
        self._file_of: Dict[str, int] = {}
        for number, handle in enumerate(self._handles):
            for key in handle.keys():
                self._file_of[key] = number

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._handles[self._file_of[name]].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


def read_hf_checkpoint(directory: os.PathLike, lazy: bool = False) -> Tuple[Dict[str, object], Mapping[str, torch.Tensor]]:
    """``(config.json dict, state dict)`` of an HF checkpoint directory (single or sharded
    safetensors); ``lazy`` returns a :class:`SafetensorsStateDict` instead of reading every
    tensor. Raises ``FileNotFoundError`` naming what is missing."""
    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: not a Hugging Face checkpoint directory")
    config = json.loads(config_path.read_text())
    state = SafetensorsStateDict(directory)
    return config, (state if lazy else dict(state.items()))


def write_hf_checkpoint(directory: os.PathLike, hf_state: Mapping[str, torch.Tensor],
                        hf_config: Mapping[str, object], max_shard_bytes: int = 5 * 2**30,
                        tokenizer_dir: Optional[os.PathLike] = None) -> List[Path]:
    """Write ``config.json`` and safetensors shards (+ index when more than one) to ``directory``;
    copy tokenizer files from ``tokenizer_dir`` when given. Returns the written weight files."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in hf_state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().cpu().contiguous()
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in hf_state.values())
        (directory / SAFETENSORS_INDEX).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (directory / "config.json").write_text(json.dumps(dict(hf_config), indent=2))
    if tokenizer_dir is not None:
        for file in TOKENIZER_FILES:
            source = Path(tokenizer_dir) / file
            if source.is_file():
                shutil.copy(source, directory / file)
    return [directory / name for name in names]


# ---------------------------------------------------------------------------------------------
# Model-level helpers (collective where they gather)
# ---------------------------------------------------------------------------------------------


def uses_transformer_engine_names(model) -> bool:
    """Whether ``model`` (a stage or its chunks) has the TE spec's fused layer-norm parameters."""
    from quatro_nemo.megatron.checkpoint import model_chunks

    return any(name.endswith("linear_qkv.layer_norm_weight")
               for chunk in model_chunks(model) for name, _ in chunk.named_parameters())


def load_hf_into_megatron(model, hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Load a Qwen2 HF state dict into this rank's shard of ``model`` (local, no communication).

    ``hf_state`` may be lazy (``read_hf_checkpoint(path, lazy=True)[1]``): only the tensors of
    this rank's stage are read and converted.
    """
    from quatro_nemo.megatron.checkpoint import load_full_state_dict

    view = MegatronViewOfHF(hf_state, cfg, transformer_engine=uses_transformer_engine_names(model))
    load_full_state_dict(model, view)


_CHECKED_FIELDS = ("architecture", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                   "ffn_hidden_size", "rotary_base", "tie_embeddings", "norm_eps", "normalization", "swiglu",
                   "qkv_bias", "linear_bias", "position_embedding")


def check_model_config_matches(cfg: ModelConfig, hf_config: Mapping[str, object], source: str) -> None:
    """``ValueError`` naming the first ``model.<key>`` that disagrees with ``source``'s config.json
    (the vocabulary may be padded: ``model.vocab_size`` >= the checkpoint's)."""
    expected = model_config_from_hf(hf_config, params_dtype=cfg.params_dtype)
    for key in _CHECKED_FIELDS:
        if getattr(cfg, key) != getattr(expected, key):
            raise ValueError(f"model.{key}={getattr(cfg, key)!r} but {source}/config.json gives "
                             f"{getattr(expected, key)!r}")
    if cfg.vocab_size < expected.vocab_size:
        raise ValueError(f"model.vocab_size={cfg.vocab_size} is smaller than {source}/config.json's "
                         f"vocab_size={expected.vocab_size}")


def load_hf_state_as_megatron(directory: os.PathLike, cfg: ModelConfig,
                              transformer_engine: Optional[bool] = None) -> Mapping[str, torch.Tensor]:
    """The full megatron state dict of an HF Qwen2 checkpoint directory, for
    :func:`checkpoint.load_full_state_dict`, after checking ``cfg`` against its config.json.

    Lazy (a :class:`MegatronViewOfHF` over memory-mapped safetensors): each rank reads only the
    tensors of its own stage. ``transformer_engine`` (default: whether TE imports, as
    :func:`models.build_model` decides) selects the layer-norm names of the layer spec.
    """
    from quatro_nemo.megatron.models import transformer_engine_available

    hf_config, hf_state = read_hf_checkpoint(directory, lazy=True)
    check_model_config_matches(cfg, hf_config, str(directory))
    if transformer_engine is None:
        transformer_engine = transformer_engine_available()
    return MegatronViewOfHF(hf_state, cfg, transformer_engine=transformer_engine)


def export_megatron_to_hf(model, cfg: ModelConfig, directory: os.PathLike, vocab_size: Optional[int] = None,
                          base_config: Optional[Mapping[str, object]] = None,
                          tokenizer_dir: Optional[os.PathLike] = None) -> Optional[List[Path]]:
    """Gather ``model`` (collective: every rank calls) and write an HF Qwen2 checkpoint from
    global rank 0 (returns its files there, None elsewhere). ``vocab_size``: the unpadded
    vocabulary to write (default ``base_config['vocab_size']`` or ``cfg.vocab_size``)."""
    import torch.distributed as dist

    from quatro_nemo.megatron.checkpoint import gather_full_state_dict

    if vocab_size is None:
        vocab_size = int((base_config or {}).get("vocab_size", cfg.vocab_size))
    full = gather_full_state_dict(model, vocab_size=vocab_size, to_cpu=True)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    hf_state = megatron_to_hf_state_dict(full, cfg)
    return write_hf_checkpoint(directory, hf_state, hf_config_from_model_config(cfg, vocab_size, base_config),
                               tokenizer_dir=tokenizer_dir)


__all__ = [
    "MegatronViewOfHF",
    "check_model_config_matches",
    "load_hf_state_as_megatron",
    "SafetensorsStateDict",
    "export_megatron_to_hf",
    "fuse_qkv",
    "hf_config_from_model_config",
    "hf_to_megatron_state_dict",
    "iter_megatron_to_hf",
    "load_hf_into_megatron",
    "megatron_tensor_to_hf",
    "megatron_to_hf_state_dict",
    "model_config_from_hf",
    "read_hf_checkpoint",
    "split_qkv",
    "write_hf_checkpoint",
]
