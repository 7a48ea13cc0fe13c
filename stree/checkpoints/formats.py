"""Checkpoint formats: which one a directory holds, and each format's config files read into
stree's config classes and written from them, in one place per format.

Formats: ``mamba_ssm`` (config.json with ``ssm_cfg``; ``backbone.embedding``), ``hf`` (transformers
Mamba2: ``model_type`` "mamba2", ``backbone.embeddings``), ``mil`` (MambaInLlama: the Llama
config.json plus mamba_config.json, HF Llama parameter names, lm_head tied when the file has none),
and the transformers families by their ``model_type``: ``bamba``, ``nemotron_h``,
``granitemoehybrid``, ``falcon_h1``, and the attention-only ``llama`` and ``qwen2`` (their config
classes read and write these themselves: ``from_hf`` / ``to_hf``). Configs as transformers 4.x and
5.x write them, infinity included (``Infinity`` literals, 5.x's ``{"__float__": "Infinity"}``).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..models.families.bamba import BambaLM
from ..models.config import HybridConfig, Mamba2Config, dt_limit_of, flag, require
from ..models.families.falcon_h1 import FalconH1LM
from ..models.families.granite import GraniteLM
from ..models.families.mambainllama import HybridLM
from ..models.families.llama import LlamaLM, Qwen2LM
from ..models.families.mamba2 import Mamba2LM
from ..models.families.nemotron_h import NemotronHLM

# transformers families, by model_type: the class reads its config (config_class.from_hf) and
# its parameter names are the files' own.
FAMILIES = {cls.model_type: cls for cls in (BambaLM, NemotronHLM, GraniteLM, FalconH1LM, LlamaLM, Qwen2LM)}
FORMATS = ("mamba_ssm", "hf", "mil", *FAMILIES)
# Families a user may have in mind, refused by name (the message says what is supported).
_KNOWN_UNSUPPORTED = ("zamba2", "jamba", "qwen3_next", "mamba", "falcon_mamba", "lfm2")
# mamba_ssm Mamba2 options this implementation does not compute; a checkpoint that sets them is refused.
_UNSUPPORTED_SSM = {"D_has_hdim": False, "rmsnorm": True, "norm_before_gate": False}
# The one parameter a format names apart from stree: transformers' Mamba2 embedding (file, model)
_RENAMES = {"hf": ("backbone.embeddings.", "backbone.embedding.")}


def model_key(fmt: str, key: str) -> str:
    """A parameter name of a ``fmt`` file as the stree model names it."""
    return key.replace(*_RENAMES[fmt], 1) if fmt in _RENAMES else key


def file_key(fmt: str, key: str) -> str:
    """A stree parameter name as a ``fmt`` file names it."""
    return key.replace(*reversed(_RENAMES[fmt]), 1) if fmt in _RENAMES else key


def tied(cfg) -> bool:
    """Whether a config ties the head to the embedding (mamba_ssm's name, or transformers')."""
    return getattr(cfg, "tie_embeddings", getattr(cfg, "tie_word_embeddings", False))


def with_file_head(fmt: str, cfg, has_head: bool):
    """``cfg`` as the weights files say: a MambaInLlama checkpoint without an lm_head (the 3B
    ships none) ties it to the embedding whatever its config says."""
    if fmt == "mil" and not has_head:
        return HybridConfig(**{**cfg.__dict__, "tie_word_embeddings": True})
    return cfg


def json_object(pairs):
    """transformers 5 writes non-finite floats as ``{"__float__": "Infinity"}``."""
    obj = dict(pairs)
    if obj.keys() == {"__float__"} and isinstance(obj["__float__"], str):
        try:
            return float(obj["__float__"])
        except ValueError:
            pass  # left as a dict: the key that reads it names the file
    return obj


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(), object_pairs_hook=json_object)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def detect_format(path) -> str:
    path = Path(path)
    if path.is_file():
        raise ValueError(f"{path} is a file: give the checkpoint directory that holds it")
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    config = read_json(path / "config.json")
    if (path / "mamba_config.json").exists():
        return "mil"
    model_type = config.get("model_type")
    if model_type == "mamba2":
        return "hf"
    if model_type in FAMILIES:
        return model_type
    if isinstance(config.get("ssm_cfg"), dict):
        return "mamba_ssm"
    supported = ", ".join(repr(t) for t in ("mamba2", *FAMILIES))
    if model_type in _KNOWN_UNSUPPORTED:
        raise ValueError(f"{path / 'config.json'}: model_type {model_type!r} is not supported (supported: {supported}, "
                         "mamba_ssm's ssm_cfg, MambaInLlama)")
    raise ValueError(f"{path / 'config.json'}: unknown checkpoint format (model_type {model_type!r}; supported: "
                     f"{supported}, mamba_ssm's ssm_cfg, MambaInLlama)")


def read_mamba_ssm(config: dict, file: Path) -> Mamba2Config:
    ssm = config["ssm_cfg"]
    if ssm.get("layer", "Mamba1") != "Mamba2":
        raise ValueError(f"{file}: ssm_cfg.layer is {ssm.get('layer')!r}, only 'Mamba2' is supported")
    for key, value in _UNSUPPORTED_SSM.items():
        if ssm.get(key, value) != value:
            raise ValueError(f"{file}: ssm_cfg.{key} = {ssm[key]!r} is not supported (only {value!r})")
    if config.get("d_intermediate", 0) or config.get("attn_layer_idx"):
        raise ValueError(f"{file}: d_intermediate / attn_layer_idx (mamba_ssm MLP or attention layers) are not supported")
    if not config.get("rms_norm", True):
        raise ValueError(f"{file}: rms_norm = false (LayerNorm blocks) is not supported")
    d_model = require(config, "d_model", file)
    expand = ssm.get("expand", 2)
    if ssm.get("d_ssm") not in (None, expand * d_model):
        raise ValueError(f"{file}: ssm_cfg.d_ssm different from d_inner is not supported")
    return Mamba2Config(
        d_model=d_model, n_layer=require(config, "n_layer", file), vocab_size=require(config, "vocab_size", file),
        d_state=ssm.get("d_state", 128), d_conv=ssm.get("d_conv", 4), expand=expand, headdim=ssm.get("headdim", 64),
        ngroups=ssm.get("ngroups", 1), chunk_size=ssm.get("chunk_size", 256),
        dt_limit=dt_limit_of(ssm.get("dt_limit"), file, "ssm_cfg.dt_limit"),
        conv_bias=flag(ssm, "conv_bias", True, file), bias=flag(ssm, "bias", False, file),
        pad_vocab_size_multiple=config.get("pad_vocab_size_multiple", 8),
        tie_embeddings=flag(config, "tie_embeddings", True, file), residual_in_fp32=flag(config, "residual_in_fp32", True, file),
    )


def read_hf(config: dict, file: Path) -> Mamba2Config:
    hidden, expand, head_dim = (require(config, k, file) for k in ("hidden_size", "expand", "head_dim"))
    num_heads = require(config, "num_heads", file)
    if num_heads * head_dim != hidden * expand:
        raise ValueError(f"{file}: num_heads * head_dim = {num_heads * head_dim} != hidden_size * expand = {hidden * expand}")
    return Mamba2Config(
        d_model=hidden, n_layer=require(config, "num_hidden_layers", file),
        vocab_size=require(config, "vocab_size", file), d_state=require(config, "state_size", file),
        d_conv=config.get("conv_kernel", 4), expand=expand, headdim=head_dim,
        ngroups=require(config, "n_groups", file), chunk_size=config.get("chunk_size", 256),
        dt_limit=dt_limit_of(config.get("time_step_limit"), file),
        conv_bias=flag(config, "use_conv_bias", True, file), bias=flag(config, "use_bias", False, file),
        pad_vocab_size_multiple=1,  # transformers stores the padded size as vocab_size
        tie_embeddings=flag(config, "tie_word_embeddings", False, file), residual_in_fp32=flag(config, "residual_in_fp32", True, file),
        norm_eps=config.get("layer_norm_epsilon", 1e-5),
    )


def read_mil(config: dict, config_file: Path, mamba: dict, mamba_file: Path, plain_rope: bool) -> HybridConfig:
    if mamba.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{mamba_file}: hidden_act {mamba['hidden_act']!r} is not supported (only 'silu')")
    ssm = require(mamba, "ssm_cfg", mamba_file)
    heads = require(config, "num_attention_heads", config_file)
    hidden = require(mamba, "d_model", mamba_file)
    scaling = config.get("rope_scaling")
    if scaling is not None:
        scaling = dict(scaling, rope_type=scaling.get("rope_type", scaling.get("type", "default")))
        if scaling["rope_type"] == "default":
            scaling = None
    return HybridConfig(
        d_model=hidden, n_layer=require(mamba, "n_layer", mamba_file),
        vocab_size=mamba.get("vocab_size") or require(config, "vocab_size", config_file),
        attn_layers=tuple(require(mamba, "attn_layers", mamba_file)),
        intermediate_size=require(mamba, "intermediate_size", mamba_file), num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or hidden // heads, d_inner=require(mamba, "d_inner", mamba_file),
        d_xb=require(mamba, "d_xb", mamba_file), d_state=ssm.get("d_state", 128), ngroups=ssm.get("ngroups", 1),
        d_conv=ssm.get("d_conv", 4), rms_norm_eps=mamba.get("rms_norm_eps", config.get("rms_norm_eps", 1e-5)),
        rope_theta=config.get("rope_theta", 10000.0), rope_scaling=None if plain_rope else scaling,
        tie_word_embeddings=flag(config, "tie_word_embeddings", False, config_file),
    )


def read_config(fmt: str, raw: dict, path: Path, plain_rope: bool):
    """The model class and config of a checkpoint directory; errors name the config file."""
    config_file = path / "config.json"
    try:
        if fmt == "mil":
            mamba_file = path / "mamba_config.json"
            return HybridLM, read_mil(raw, config_file, read_json(mamba_file), mamba_file, plain_rope)
        if fmt in FAMILIES:
            return FAMILIES[fmt], FAMILIES[fmt].config_class.from_hf(raw, config_file)
        return Mamba2LM, read_hf(raw, config_file) if fmt == "hf" else read_mamba_ssm(raw, config_file)
    except ValueError as exc:  # a config class's own check names no file
        if str(path) in str(exc):
            raise
        raise ValueError(f"{config_file}: {exc}") from None




def config_files(model, fmt: str) -> dict[str, dict]:
    """The config file(s) of ``model`` in format ``fmt`` (file name: JSON object), the inverse of
    :func:`read_config`."""
    cfg = model.cfg
    if fmt in FAMILIES:
        return {"config.json": cfg.to_hf()}
    if fmt == "mil":
        mamba = dict(d_model=cfg.d_model, ssm_cfg=dict(expand=cfg.d_inner // cfg.d_model, ngroups=cfg.ngroups,
                                                       d_state=cfg.d_state, d_conv=cfg.d_conv),
                     rms_norm_eps=cfg.rms_norm_eps, vocab_size=None, d_inner=cfg.d_inner, d_xb=cfg.d_xb,
                     intermediate_size=cfg.intermediate_size, hidden_act="silu", n_layer=cfg.n_layer,
                     attn_layers=list(cfg.attn_layers))
        llama = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=cfg.vocab_size,
                     hidden_size=cfg.d_model, intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.n_layer,
                     num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                     head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                     rope_scaling=cfg.rope_scaling, tie_word_embeddings=cfg.tie_word_embeddings)
        return {"mamba_config.json": mamba, "config.json": llama}
    if fmt == "hf":
        return {"config.json": dict(
            model_type="mamba2", architectures=["Mamba2ForCausalLM"], hidden_size=cfg.d_model,
            num_hidden_layers=cfg.n_layer, vocab_size=cfg.padded_vocab_size, state_size=cfg.d_state,
            conv_kernel=cfg.d_conv, expand=cfg.expand, num_heads=cfg.nheads, head_dim=cfg.headdim,
            n_groups=cfg.ngroups, chunk_size=cfg.chunk_size, time_step_limit=list(cfg.dt_limit),
            use_bias=cfg.bias, use_conv_bias=cfg.conv_bias, tie_word_embeddings=cfg.tie_embeddings,
            residual_in_fp32=cfg.residual_in_fp32, layer_norm_epsilon=cfg.norm_eps)}
    ssm = dict(layer="Mamba2", d_state=cfg.d_state, d_conv=cfg.d_conv, expand=cfg.expand, headdim=cfg.headdim,
               ngroups=cfg.ngroups, chunk_size=cfg.chunk_size, dt_limit=list(cfg.dt_limit), bias=cfg.bias,
               conv_bias=cfg.conv_bias)
    return {"config.json": dict(d_model=cfg.d_model, d_intermediate=0, n_layer=cfg.n_layer, vocab_size=cfg.vocab_size,
                                ssm_cfg=ssm, attn_layer_idx=[], attn_cfg={}, rms_norm=True,
                                residual_in_fp32=cfg.residual_in_fp32, fused_add_norm=True,
                                pad_vocab_size_multiple=cfg.pad_vocab_size_multiple,
                                tie_embeddings=cfg.tie_embeddings)}
