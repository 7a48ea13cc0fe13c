"""Granite 4.0-H (transformers ``GraniteMoeHybridForCausalLM``): Llama-style pre-norm layers whose
token mixer is Bamba's Mamba2 or GQA attention (no positional encoding unless
``position_embedding_type`` is "rope"), followed by a shared SwiGLU MLP plus, with
``num_local_experts > 0``, a top-k mixture of experts. The µP scalars: embeddings times
``embedding_multiplier``, every sub-layer output times ``residual_multiplier`` before its residual
add, ``attention_multiplier`` as the softmax scale, logits divided by ``logits_scaling``. Norms
round before the weight multiply, as transformers computes them. Parameter names are the
checkpoints' (which transformers 4.x and 5.x write; see :mod:`stree.models.layers.moe`)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..layers.attention import AttentionConfig, LlamaAttention
from .bamba import bamba_mixer_config, bamba_mixer_hf
from ..base import Block, TreeLM
from ..config import Mamba2Config, attention_of, flag, require, rope_parameters
from ..layers.mamba2 import Mamba2Mixer
from ..layers.norms import RMSNorm
from ..layers.mlp import FusedSwiGLU
from ..layers.moe import TopKMoE

# transformers 5 writes "linear_attention" / "full_attention"; 4.x and the checkpoints "mamba" / "attention"
LAYER_TYPES = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention"}


@dataclass(frozen=True)
class GraniteConfig:
    d_model: int
    vocab_size: int
    layer_types: tuple[str, ...]  # "mamba" | "attention", one per layer
    shared_intermediate_size: int
    attention: AttentionConfig
    mamba: Mamba2Config
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False

    @property
    def n_layer(self) -> int:
        return len(self.layer_types)

    @classmethod
    def from_hf(cls, config: dict, file) -> "GraniteConfig":
        """From a transformers ``config.json`` (4.x or 5.x) of model_type "granitemoehybrid"."""
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{file}: hidden_act {config['hidden_act']!r} is not supported (only 'silu')")
        layers = require(config, "num_hidden_layers", file)
        types = config.get("layer_types") or config.get("layers_block_type") or ["mamba"] * layers
        unknown = sorted({str(t) for t in types} - set(LAYER_TYPES))
        if unknown or len(types) != layers:
            raise ValueError(f"{file}: layer_types must be {layers} of {sorted(LAYER_TYPES)}, got {types}")
        position = config.get("position_embedding_type")
        if position not in (None, "rope"):
            raise ValueError(f"{file}: position_embedding_type {position!r} is not supported (None or 'rope')")
        attention = attention_of(config, file, rope_types=("default",), rotary_dim=None if position else 0,
                                 softmax_scale=float(config.get("attention_multiplier", 1.0)))
        eps = float(config.get("rms_norm_eps", 1e-6))
        tie = flag(config, "tie_word_embeddings", False, file)
        experts = int(config.get("num_local_experts", 8) or 0)
        return cls(
            require(config, "hidden_size", file), require(config, "vocab_size", file),
            tuple(LAYER_TYPES[t] for t in types), config.get("shared_intermediate_size", 1024), attention,
            bamba_mixer_config(config, file, layers, eps, tie), experts,
            int(config.get("num_experts_per_tok", 2)) if experts else 0,
            int(config.get("intermediate_size", 11008)) if experts else 0,
            float(config.get("embedding_multiplier", 1.0)), float(config.get("residual_multiplier", 1.0)),
            float(config.get("logits_scaling", 1.0)), eps, tie)

    def to_hf(self) -> dict:
        a = self.attention
        out = dict(
            model_type="granitemoehybrid", architectures=["GraniteMoeHybridForCausalLM"],
            vocab_size=self.vocab_size, hidden_size=self.d_model, num_hidden_layers=self.n_layer,
            layer_types=["linear_attention" if t == "mamba" else "full_attention" for t in self.layer_types],
            shared_intermediate_size=self.shared_intermediate_size, num_local_experts=self.num_experts,
            num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim,
            attention_bias=a.qkv_bias, attention_multiplier=a.softmax_scale,
            position_embedding_type=None if a.rotary_dim == 0 else "rope", rope_parameters=rope_parameters(a),
            **bamba_mixer_hf(self.mamba, self.d_model), embedding_multiplier=self.embedding_multiplier,
            residual_multiplier=self.residual_multiplier, logits_scaling=self.logits_scaling,
            rms_norm_eps=self.rms_norm_eps, hidden_act="silu", tie_word_embeddings=self.tie_word_embeddings)
        if self.num_experts:
            out.update(num_experts_per_tok=self.experts_per_token, intermediate_size=self.expert_intermediate_size)
        return out


class GraniteLayer(nn.Module):
    def __init__(self, cfg: GraniteConfig, kind: str, device=None, dtype=None):
        super().__init__()
        f = dict(device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, **f, round_before_weight=True)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, **f, round_before_weight=True)
        self.shared_mlp = FusedSwiGLU(cfg.d_model, cfg.shared_intermediate_size, **f)
        if cfg.num_experts:
            self.block_sparse_moe = TopKMoE(cfg.d_model, cfg.num_experts, cfg.experts_per_token,
                                            cfg.expert_intermediate_size, **f)
        if kind == "attention":
            self.self_attn = LlamaAttention(cfg.d_model, cfg.attention, **f)
        else:
            self.mamba = Mamba2Mixer(cfg.mamba, **f)

    def feed_forward(self, x):
        out = self.shared_mlp(x)
        return self.block_sparse_moe(x) + out if hasattr(self, "block_sparse_moe") else out

    def block(self, scale: float) -> Block:
        mixer = self.self_attn if hasattr(self, "self_attn") else self.mamba
        return Block(self.input_layernorm, mixer, self.post_attention_layernorm, self.feed_forward,
                     out_scale=scale, mlp_scale=scale)


class GraniteBody(nn.Module):
    def __init__(self, cfg: GraniteConfig, device=None, dtype=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList(GraniteLayer(cfg, kind, device, dtype) for kind in cfg.layer_types)
        self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, device, dtype, round_before_weight=True)


class GraniteLM(TreeLM):
    model_type = "granitemoehybrid"
    embed_key = "model.embed_tokens.weight"
    final_norm_name = "model.norm"
    config_class = GraniteConfig

    def __init__(self, cfg: GraniteConfig, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.model = GraniteBody(cfg, device, dtype)
        self.make_head(cfg.d_model, cfg.vocab_size, cfg.tie_word_embeddings, device, dtype)
        self.residual_fp32 = False
        self.embed_scale, self.logits_scale = cfg.embedding_multiplier, 1.0 / cfg.logits_scaling
        self.blocks = [layer.block(cfg.residual_multiplier) for layer in self.model.layers]

    # transformers 5's in-memory names of the experts' parameters, and the checkpoints' (from_transformers)
    memory_names = {"block_sparse_moe.experts.gate_up_proj": "block_sparse_moe.input_linear.weight",
                    "block_sparse_moe.experts.down_proj": "block_sparse_moe.output_linear.weight",
                    "block_sparse_moe.router.weight": "block_sparse_moe.router.layer.weight"}
