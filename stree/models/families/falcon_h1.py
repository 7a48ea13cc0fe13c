"""Falcon-H1 (transformers ``FalconH1ForCausalLM``): every layer runs a Mamba2 mixer and GQA
attention (RoPE) in parallel on the same normed input and adds both outputs to the residual, then
a SwiGLU MLP. On the block loop a layer is two blocks, the attention one ``parallel`` to the Mamba2
one (so the cache holds one SSM and one attention state per layer).

µP multipliers everywhere: the Mamba2 input (``ssm_in_multiplier``), its in_proj output per
segment (``ssm_multipliers`` for z, x, B, C, dt: transformers' ``mup_vector``) and its output
(``ssm_out_multiplier``); the attention input, keys and output (``attention_in_multiplier``,
``key_multiplier``, ``attention_out_multiplier``); the MLP gate and output (``mlp_multipliers``);
embeddings and logits (``embedding_multiplier``, ``lm_head_multiplier``). The Mamba2 width is
``mamba_d_ssm``; its gate is y * silu(z) without a norm unless ``mamba_rms_norm`` (then a grouped
norm before or after the gate, ``mamba_norm_before_gate``). Parameter names are transformers'."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..layers.attention import AttentionConfig, LlamaAttention
from .bamba import bamba_mixer_config
from ..base import Block, TreeLM
from ..config import Mamba2Config, attention_of, flag, require, rope_parameters
from ..layers.mamba2 import Mamba2Mixer
from ..layers.norms import RMSNorm
from ..layers.mlp import SwiGLU


def _numbers(value, n: int, key: str, file) -> tuple[float, ...]:
    try:
        out = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        out = ()
    if len(out) != n:
        raise ValueError(f"{file}: {key} must be a list of {n} numbers, got {value!r}")
    return out


@dataclass(frozen=True)
class FalconH1Config:
    d_model: int
    n_layer: int
    vocab_size: int
    intermediate_size: int
    attention: AttentionConfig
    mamba: Mamba2Config
    mlp_bias: bool = False
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)

    @classmethod
    def from_hf(cls, config: dict, file) -> "FalconH1Config":
        """From a transformers ``config.json`` (4.x or 5.x) of model_type "falcon_h1"."""
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{file}: hidden_act {config['hidden_act']!r} is not supported (only 'silu')")
        hidden, layers = require(config, "hidden_size", file), require(config, "num_hidden_layers", file)
        attention = attention_of(config, file, key_scale=float(config.get("key_multiplier", 1.0)))
        eps = float(config.get("rms_norm_eps", 1e-5))
        tie = flag(config, "tie_word_embeddings", False, file)
        scales = _numbers(config.get("ssm_multipliers") or [1.0] * 5, 5, "ssm_multipliers", file)
        gate_norm = "none" if not flag(config, "mamba_rms_norm", False, file) else (
            "gate_last" if flag(config, "mamba_norm_before_gate", True, file) else "gate_first")
        mamba = bamba_mixer_config(config, file, layers, eps, tie, norm_round_before_weight=False, gate_norm=gate_norm,
                                   proj_scales=None if scales == (1.0,) * 5 else scales,
                                   out_proj_bias=flag(config, "projectors_bias", False, file))
        f = lambda key: float(config.get(key, 1.0))
        return cls(hidden, layers, mamba.vocab_size, require(config, "intermediate_size", file), attention, mamba,
                   flag(config, "mlp_bias", False, file), eps, tie, f("embedding_multiplier"),
                   f("lm_head_multiplier"), f("attention_in_multiplier"), f("attention_out_multiplier"),
                   f("ssm_in_multiplier"), f("ssm_out_multiplier"),
                   _numbers(config.get("mlp_multipliers") or [1.0, 1.0], 2, "mlp_multipliers", file))

    def to_hf(self) -> dict:
        a, m = self.attention, self.mamba
        return dict(
            model_type="falcon_h1", architectures=["FalconH1ForCausalLM"], vocab_size=self.vocab_size,
            hidden_size=self.d_model, num_hidden_layers=self.n_layer, intermediate_size=self.intermediate_size,
            num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim,
            attention_bias=a.qkv_bias, rope_parameters=rope_parameters(a), key_multiplier=a.key_scale,
            mamba_d_ssm=m.d_inner, mamba_n_heads=m.nheads, mamba_d_head=m.headdim, mamba_n_groups=m.ngroups,
            mamba_d_state=m.d_state, mamba_d_conv=m.d_conv, mamba_expand=m.expand, mamba_chunk_size=m.chunk_size,
            mamba_conv_bias=m.conv_bias, mamba_proj_bias=m.bias, projectors_bias=m.out_bias,
            mamba_rms_norm=m.gate_norm != "none", mamba_norm_before_gate=m.gate_norm == "gate_last",
            time_step_limit=list(m.dt_limit), ssm_multipliers=list(m.proj_scales or (1.0,) * 5),
            mlp_bias=self.mlp_bias, rms_norm_eps=self.rms_norm_eps, hidden_act="silu",
            tie_word_embeddings=self.tie_word_embeddings, embedding_multiplier=self.embedding_multiplier,
            lm_head_multiplier=self.lm_head_multiplier, attention_in_multiplier=self.attention_in_multiplier,
            attention_out_multiplier=self.attention_out_multiplier, ssm_in_multiplier=self.ssm_in_multiplier,
            ssm_out_multiplier=self.ssm_out_multiplier, mlp_multipliers=list(self.mlp_multipliers))


class FalconH1Layer(nn.Module):
    def __init__(self, cfg: FalconH1Config, device=None, dtype=None):
        super().__init__()
        f = dict(device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, **f, round_before_weight=True)
        self.pre_ff_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, **f, round_before_weight=True)
        self.mamba = Mamba2Mixer(cfg.mamba, **f)
        self.self_attn = LlamaAttention(cfg.d_model, cfg.attention, **f)
        self.feed_forward = SwiGLU(cfg.d_model, cfg.intermediate_size, bias=cfg.mlp_bias, **f,
                                   gate_scale=cfg.mlp_multipliers[0], down_scale=cfg.mlp_multipliers[1])

    def blocks(self, cfg: FalconH1Config) -> list[Block]:
        return [Block(self.input_layernorm, self.mamba, in_scale=cfg.ssm_in_multiplier,
                      out_scale=cfg.ssm_out_multiplier),
                Block(None, self.self_attn, self.pre_ff_layernorm, self.feed_forward, parallel=True,
                      in_scale=cfg.attention_in_multiplier, out_scale=cfg.attention_out_multiplier)]


class FalconH1Body(nn.Module):
    def __init__(self, cfg: FalconH1Config, device=None, dtype=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList(FalconH1Layer(cfg, device, dtype) for _ in range(cfg.n_layer))
        self.final_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, device, dtype, round_before_weight=True)


class FalconH1LM(TreeLM):
    model_type = "falcon_h1"
    embed_key = "model.embed_tokens.weight"
    final_norm_name = "model.final_layernorm"
    config_class = FalconH1Config

    def __init__(self, cfg: FalconH1Config, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.model = FalconH1Body(cfg, device, dtype)
        self.make_head(cfg.d_model, cfg.vocab_size, cfg.tie_word_embeddings, device, dtype)
        self.residual_fp32 = False
        self.embed_scale, self.logits_scale = cfg.embedding_multiplier, cfg.lm_head_multiplier
        self.blocks = [blk for layer in self.model.layers for blk in layer.blocks(cfg)]
