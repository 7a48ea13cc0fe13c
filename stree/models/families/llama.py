"""Attention-only targets (transformers ``LlamaForCausalLM``, ``Qwen2ForCausalLM``) on the same
block loop, so that the drafters built for any model (n-gram, STAND, consensus) serve transformer
models too, as in their papers. Llama blocks: RMSNorm (rounded before the weight, as
transformers computes it), GQA attention with RoPE (plain or Llama 3's scaling), SwiGLU MLP.
Qwen2 differs in its q/k/v biases; its sliding window is refused."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..layers.attention import AttentionConfig, LlamaAttention
from ..base import Block, TreeLM
from ..config import attention_of, flag, require, rope_parameters
from ..layers.norms import RMSNorm
from ..layers.mlp import SwiGLU


@dataclass(frozen=True)
class TransformerConfig:
    model_type: str  # "llama" | "qwen2"
    d_model: int
    n_layer: int
    vocab_size: int
    intermediate_size: int
    attention: AttentionConfig
    rms_norm_eps: float = 1e-6
    mlp_bias: bool = False
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, config: dict, file) -> "TransformerConfig":
        """From a transformers ``config.json`` (4.x ``rope_theta`` / ``rope_scaling`` or 5.x
        ``rope_parameters``) of model_type "llama" or "qwen2"."""
        model_type = config.get("model_type")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{file}: hidden_act {config['hidden_act']!r} is not supported (only 'silu')")
        if model_type == "qwen2" and config.get("use_sliding_window"):
            raise ValueError(f"{file}: use_sliding_window = true is not supported")
        attention = attention_of(config, file, **(dict(qkv_bias=True, o_bias=False) if model_type == "qwen2" else {}))
        hidden = require(config, "hidden_size", file)
        return cls(model_type, hidden, require(config, "num_hidden_layers", file), require(config, "vocab_size", file),
                   require(config, "intermediate_size", file), attention, float(config.get("rms_norm_eps", 1e-6)),
                   flag(config, "mlp_bias", False, file), flag(config, "tie_word_embeddings", False, file))

    def to_hf(self) -> dict:
        a = self.attention
        out = dict(model_type=self.model_type, architectures=[("Llama" if self.model_type == "llama" else "Qwen2")
                                                              + "ForCausalLM"],
                   vocab_size=self.vocab_size, hidden_size=self.d_model, num_hidden_layers=self.n_layer,
                   intermediate_size=self.intermediate_size, num_attention_heads=a.num_heads,
                   num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim, rope_parameters=rope_parameters(a),
                   rms_norm_eps=self.rms_norm_eps, hidden_act="silu", tie_word_embeddings=self.tie_word_embeddings)
        if self.model_type == "llama":
            out.update(attention_bias=a.qkv_bias, mlp_bias=self.mlp_bias)
        return out


class TransformerLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig, device=None, dtype=None):
        super().__init__()
        f = dict(device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, **f, round_before_weight=True)
        self.self_attn = LlamaAttention(cfg.d_model, cfg.attention, **f)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, **f, round_before_weight=True)
        self.mlp = SwiGLU(cfg.d_model, cfg.intermediate_size, bias=cfg.mlp_bias, **f)


class TransformerBody(nn.Module):
    def __init__(self, cfg: TransformerConfig, device=None, dtype=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList(TransformerLayer(cfg, device, dtype) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, device, dtype, round_before_weight=True)


class LlamaLM(TreeLM):
    model_type = "llama"
    embed_key = "model.embed_tokens.weight"
    final_norm_name = "model.norm"
    config_class = TransformerConfig

    def __init__(self, cfg: TransformerConfig, device=None, dtype=None):
        super().__init__()
        if cfg.model_type != self.model_type:
            raise ValueError(f"{type(self).__name__} needs a {self.model_type!r} config, got {cfg.model_type!r}")
        self.cfg = cfg
        self.model = TransformerBody(cfg, device, dtype)
        self.make_head(cfg.d_model, cfg.vocab_size, cfg.tie_word_embeddings, device, dtype)
        self.residual_fp32 = False
        self.blocks = [Block(layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp)
                       for layer in self.model.layers]


class Qwen2LM(LlamaLM):
    model_type = "qwen2"
