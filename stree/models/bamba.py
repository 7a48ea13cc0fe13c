"""Bamba (transformers ``BambaForCausalLM``, IBM's Bamba-9B): Llama decoder layers whose token
mixer is GQA attention with RoPE on the first half of each head at ``attn_layer_indices`` and a
standard Mamba2 mixer elsewhere; SwiGLU MLP; residual stream in the model dtype; every norm
rounds to the model dtype before its weight multiply, as transformers computes it. Parameter
names are transformers' (``model.layers.i.mamba.*``, ``.self_attn.*``, ``.feed_forward.*``)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .attention import AttentionConfig, LlamaAttention
from .base import Block, TreeLM
from .config import Mamba2Config, dt_limit_of, layer_indices, require
from .mamba2 import Mamba2Mixer, RMSNorm
from .mlp import SwiGLU


@dataclass(frozen=True)
class BambaConfig:
    d_model: int
    n_layer: int
    vocab_size: int
    attn_layers: tuple[int, ...]
    intermediate_size: int
    attention: AttentionConfig
    mamba: Mamba2Config
    rms_norm_eps: float = 1e-5
    mlp_bias: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self):
        object.__setattr__(self, "attn_layers", layer_indices("attn_layer_indices", self.attn_layers, self.n_layer))

    @classmethod
    def from_hf(cls, config: dict, file) -> "BambaConfig":
        """From a transformers ``config.json`` (4.x or 5.x) of model_type "bamba"."""
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{file}: hidden_act {config['hidden_act']!r} is not supported (only 'silu')")
        hidden, layers, heads = (require(config, k, file) for k in ("hidden_size", "num_hidden_layers",
                                                                    "num_attention_heads"))
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"{file}: rope_type {rope['rope_type']!r} is not supported for bamba (only 'default')")
        head_dim = config.get("head_dim") or hidden // heads
        attention = AttentionConfig(
            heads, config.get("num_key_value_heads") or heads, head_dim,
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            rotary_dim=int(head_dim * 0.5),  # transformers hard-codes partial_rotary_factor 0.5 for Bamba
            qkv_bias=bool(config.get("attention_bias", False)), o_bias=bool(config.get("attention_bias", False)))
        mamba_heads, mamba_head_dim = require(config, "mamba_n_heads", file), require(config, "mamba_d_head", file)
        d_inner = int(config.get("mamba_expand", 2) * hidden)
        if mamba_heads * mamba_head_dim != d_inner:
            raise ValueError(f"{file}: mamba_n_heads * mamba_d_head = {mamba_heads * mamba_head_dim} != "
                             f"mamba_expand * hidden_size = {d_inner}")
        tie = bool(config.get("tie_word_embeddings", False))
        eps = float(config.get("rms_norm_eps", 1e-5))
        mamba = Mamba2Config(
            d_model=hidden, n_layer=layers, vocab_size=require(config, "vocab_size", file),
            d_state=require(config, "mamba_d_state", file), d_conv=config.get("mamba_d_conv", 4),
            expand=max(1, d_inner // hidden), headdim=mamba_head_dim, ngroups=config.get("mamba_n_groups", 1),
            chunk_size=config.get("mamba_chunk_size", 256), dt_limit=dt_limit_of(config.get("time_step_limit"), file),
            conv_bias=config.get("mamba_conv_bias", True), bias=config.get("mamba_proj_bias", False),
            pad_vocab_size_multiple=1, tie_embeddings=tie, residual_in_fp32=False, norm_eps=eps, d_ssm=d_inner,
            norm_round_before_weight=True)
        return cls(hidden, layers, mamba.vocab_size, tuple(config.get("attn_layer_indices") or ()),
                   require(config, "intermediate_size", file), attention, mamba, eps,
                   bool(config.get("mlp_bias", False)), tie)

    def to_hf(self) -> dict:
        a, m = self.attention, self.mamba
        return dict(
            model_type="bamba", architectures=["BambaForCausalLM"], vocab_size=self.vocab_size,
            hidden_size=self.d_model, num_hidden_layers=self.n_layer, intermediate_size=self.intermediate_size,
            attn_layer_indices=list(self.attn_layers), num_attention_heads=a.num_heads,
            num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim, attention_bias=a.qkv_bias,
            rope_parameters=dict(rope_type="default", rope_theta=a.rope_theta, partial_rotary_factor=0.5),
            mamba_n_heads=m.nheads, mamba_d_head=m.headdim, mamba_n_groups=m.ngroups, mamba_d_state=m.d_state,
            mamba_d_conv=m.d_conv, mamba_expand=m.d_inner // self.d_model if m.d_inner % self.d_model == 0 else m.d_inner / self.d_model, mamba_chunk_size=m.chunk_size,
            mamba_conv_bias=m.conv_bias, mamba_proj_bias=m.bias, time_step_limit=list(m.dt_limit),
            rms_norm_eps=self.rms_norm_eps, mlp_bias=self.mlp_bias, hidden_act="silu",
            tie_word_embeddings=self.tie_word_embeddings)


class BambaLayer(nn.Module):
    def __init__(self, cfg: BambaConfig, attention: bool, device=None, dtype=None):
        super().__init__()
        f = dict(device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, **f, round_before_weight=True)
        self.pre_ff_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, **f, round_before_weight=True)
        self.feed_forward = SwiGLU(cfg.d_model, cfg.intermediate_size, bias=cfg.mlp_bias, **f)
        if attention:
            self.self_attn = LlamaAttention(cfg.d_model, cfg.attention, **f)
        else:
            self.mamba = Mamba2Mixer(cfg.mamba, **f)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn if hasattr(self, "self_attn") else self.mamba


class BambaBody(nn.Module):
    def __init__(self, cfg: BambaConfig, device=None, dtype=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList(BambaLayer(cfg, i in cfg.attn_layers, device, dtype) for i in range(cfg.n_layer))
        self.final_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, device, dtype, round_before_weight=True)


class BambaLM(TreeLM):
    model_type = "bamba"
    embed_key = "model.embed_tokens.weight"
    final_norm_name = "model.final_layernorm"
    config_class = BambaConfig

    def __init__(self, cfg: BambaConfig, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.model = BambaBody(cfg, device, dtype)
        self.make_head(cfg.d_model, cfg.vocab_size, cfg.tie_word_embeddings, device, dtype)
        self.residual_fp32 = False
        self.blocks = [Block(layer.input_layernorm, layer.mixer, layer.pre_ff_layernorm, layer.feed_forward)
                       for layer in self.model.layers]
