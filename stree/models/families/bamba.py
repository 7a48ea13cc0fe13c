"""Bamba (transformers ``BambaForCausalLM``, IBM's Bamba-9B): Llama decoder layers whose token
mixer is GQA attention with RoPE on the first half of each head at ``attn_layer_indices`` and a
standard Mamba2 mixer elsewhere; SwiGLU MLP; residual stream in the model dtype; every norm
rounds to the model dtype before its weight multiply, as transformers computes it. Parameter
names are transformers' (``model.layers.i.mamba.*``, ``.self_attn.*``, ``.feed_forward.*``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from ..layers.attention import AttentionConfig, LlamaAttention
from ..base import Block, TreeLM
from ..config import Mamba2Config, attention_of, dt_limit_of, flag, layer_indices, require, rope_parameters
from ..layers.mamba2 import Mamba2Mixer
from ..layers.norms import RMSNorm
from ..layers.mlp import SwiGLU


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
        hidden, layers = require(config, "hidden_size", file), require(config, "num_hidden_layers", file)
        attention = attention_of(config, file, rope_types=("default",))
        # transformers hard-codes partial_rotary_factor 0.5 for Bamba
        attention = replace(attention, rotary_dim=int(attention.head_dim * 0.5))
        tie = flag(config, "tie_word_embeddings", False, file)
        eps = float(config.get("rms_norm_eps", 1e-5))
        mamba = bamba_mixer_config(config, file, layers, eps, tie)
        return cls(hidden, layers, mamba.vocab_size, tuple(config.get("attn_layer_indices") or ()),
                   require(config, "intermediate_size", file), attention, mamba, eps,
                   flag(config, "mlp_bias", False, file), tie)

    def to_hf(self) -> dict:
        a, m = self.attention, self.mamba
        return dict(
            model_type="bamba", architectures=["BambaForCausalLM"], vocab_size=self.vocab_size,
            hidden_size=self.d_model, num_hidden_layers=self.n_layer, intermediate_size=self.intermediate_size,
            attn_layer_indices=list(self.attn_layers), num_attention_heads=a.num_heads,
            num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim, attention_bias=a.qkv_bias,
            rope_parameters=rope_parameters(a, partial_rotary_factor=0.5),
            **bamba_mixer_hf(m, self.d_model),
            rms_norm_eps=self.rms_norm_eps, mlp_bias=self.mlp_bias, hidden_act="silu",
            tie_word_embeddings=self.tie_word_embeddings)


def bamba_mixer_config(config: dict, file, n_layer: int, eps: float, tie: bool, **fields) -> Mamba2Config:
    """transformers' BambaMixer and its descendants (Bamba, Granite 4.0-H, Falcon-H1) from their
    ``mamba_*`` keys: heads x head_dim = ``mamba_d_ssm`` or else mamba_expand * hidden_size ("auto"
    head_dim: the quotient), rounded gated norm, dt clamped in the chunked prefill only; ``fields``
    override (Falcon-H1's gate and multipliers)."""
    hidden = require(config, "hidden_size", file)
    d_inner = config.get("mamba_d_ssm") or int(config.get("mamba_expand", 2) * hidden)
    heads, head_dim = require(config, "mamba_n_heads", file), config.get("mamba_d_head", "auto")
    head_dim = d_inner // heads if head_dim in (None, "auto") else head_dim
    if heads * head_dim != d_inner:
        raise ValueError(f"{file}: mamba_n_heads * mamba_d_head = {heads * head_dim} != the Mamba2 width "
                         f"(mamba_d_ssm, else mamba_expand * hidden_size) = {d_inner}")
    return Mamba2Config(**{**dict(
        d_model=hidden, n_layer=n_layer, vocab_size=require(config, "vocab_size", file),
        d_state=require(config, "mamba_d_state", file), d_conv=config.get("mamba_d_conv", 4),
        expand=max(1, d_inner // hidden), headdim=head_dim, ngroups=config.get("mamba_n_groups", 1),
        chunk_size=config.get("mamba_chunk_size", 256), dt_limit=dt_limit_of(config.get("time_step_limit"), file),
        conv_bias=flag(config, "mamba_conv_bias", True, file), bias=flag(config, "mamba_proj_bias", False, file),
        pad_vocab_size_multiple=1, tie_embeddings=tie, residual_in_fp32=False, norm_eps=eps, d_ssm=d_inner,
        norm_round_before_weight=True, dt_limit_prefill_only=True), **fields})


def bamba_mixer_hf(m: Mamba2Config, d_model: int) -> dict:
    """The ``mamba_*`` keys of :func:`bamba_mixer_config`'s config."""
    expand = m.d_inner // d_model if m.d_inner % d_model == 0 else m.d_inner / d_model
    return dict(mamba_n_heads=m.nheads, mamba_d_head=m.headdim, mamba_n_groups=m.ngroups, mamba_d_state=m.d_state,
                mamba_d_conv=m.d_conv, mamba_expand=expand, mamba_chunk_size=m.chunk_size,
                mamba_conv_bias=m.conv_bias, mamba_proj_bias=m.bias, time_step_limit=list(m.dt_limit))


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
