"""Nemotron-H (transformers ``NemotronHForCausalLM``: Nemotron-H, Nemotron Nano 2): every layer is
one pre-norm residual op, Mamba2 ("M"), attention without positional encoding ("*"), a
squared-ReLU MLP ("-") or a mixture of squared-ReLU experts with a shared expert ("E", Nemotron
3 Nano; see :class:`stree.models.layers.moe.GroupedMoE`); residual stream in the model dtype. The
Mamba2 mixer is heads x head_dim wide with grouped gated norm (n_groups groups), and clamps dt to the
config's ``time_step_limit`` in prefill only, as transformers' chunked scan does and its step does
not (transformers before 5.25 clamped at ``time_step_min`` whatever the limit said; the original
code reads the limit). Parameter names are the checkpoints' (``backbone.layers.i.mixer.*``,
``backbone.embeddings``, ``backbone.norm_f``)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..layers.attention import AttentionConfig, LlamaAttention
from ..base import Block, TreeLM
from ..config import Mamba2Config, dt_limit_of, flag, require
from ..layers.mamba2 import Mamba2Mixer
from ..layers.norms import RMSNorm
from ..layers.mlp import ReluSquaredMLP
from ..layers.moe import GroupedMoE, check_group_routing

LAYER_TYPES = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe",
               "linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention",
               "mlp": "mlp", "moe": "moe"}


@dataclass(frozen=True)
class NemotronHConfig:
    d_model: int
    vocab_size: int
    layer_types: tuple[str, ...]  # "mamba" | "attention" | "mlp", one per layer
    intermediate_size: int
    attention: AttentionConfig
    mamba: Mamba2Config
    norm_eps: float = 1e-5
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    # the "moe" layers' experts (0: the model has none)
    n_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    moe_shared_intermediate_size: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    moe_latent_size: int | None = None

    def __post_init__(self):
        bad = sorted(set(self.layer_types) - {"mamba", "attention", "mlp", "moe"})
        if bad:
            raise ValueError(f"layer types {bad} are not supported (mamba, attention, mlp, moe)")
        if "moe" in self.layer_types:
            check_group_routing(self.n_experts, self.experts_per_token, self.n_group, self.topk_group)

    @property
    def n_layer(self) -> int:
        return len(self.layer_types)

    @classmethod
    def from_hf(cls, config: dict, file) -> "NemotronHConfig":
        """From a transformers ``config.json`` of model_type "nemotron_h" (``layers_block_type`` as
        transformers 5 writes it, or the checkpoints' ``hybrid_override_pattern``)."""
        pattern = config.get("layers_block_type") or config.get("hybrid_override_pattern")
        if pattern is None:
            raise ValueError(f"{file}: missing key 'hybrid_override_pattern' (or 'layers_block_type')")
        unknown = sorted({str(t) for t in pattern} - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"{file}: unknown layer types {unknown} in the layer pattern")
        types = tuple(LAYER_TYPES[t] for t in pattern)
        for key in ("mamba_hidden_act",):
            if config.get(key, "silu") != "silu":
                raise ValueError(f"{file}: {key} {config[key]!r} is not supported (only 'silu')")
        if config.get("mlp_hidden_act", "relu2") != "relu2":
            raise ValueError(f"{file}: mlp_hidden_act {config['mlp_hidden_act']!r} is not supported (only 'relu2')")
        hidden, heads = require(config, "hidden_size", file), require(config, "num_attention_heads", file)
        head_dim = config.get("head_dim") or config.get("attention_head_dim") or hidden // heads
        attention = AttentionConfig(heads, config.get("num_key_value_heads") or heads, head_dim, rotary_dim=0)
        mamba_heads, mamba_head_dim = require(config, "mamba_num_heads", file), config.get("mamba_head_dim", 64)
        d_inner = mamba_heads * mamba_head_dim
        tie = flag(config, "tie_word_embeddings", False, file)
        eps = float(config.get("layer_norm_epsilon", 1e-5))
        mamba = Mamba2Config(
            d_model=hidden, n_layer=len(types), vocab_size=require(config, "vocab_size", file),
            d_state=require(config, "ssm_state_size", file), d_conv=config.get("conv_kernel", 4),
            expand=max(1, d_inner // hidden), headdim=mamba_head_dim, ngroups=config.get("n_groups", 8),
            chunk_size=config.get("chunk_size", 128),
            # the chunked scan's clamp, as transformers (since 5.25) and the original code read it
            dt_limit=dt_limit_of(config.get("mamba_dt_limit", config.get("time_step_limit")), file),
            conv_bias=flag(config, "use_conv_bias", True, file), bias=flag(config, "use_bias", False, file),
            pad_vocab_size_multiple=1, tie_embeddings=tie, residual_in_fp32=False, norm_eps=eps, d_ssm=d_inner,
            norm_round_before_weight=True, dt_limit_prefill_only=True)
        moe = {}
        if "moe" in types:
            experts = config.get("n_routed_experts") or config.get("num_local_experts") or 8
            moe = dict(n_experts=int(experts), experts_per_token=int(config.get("num_experts_per_tok", 2)),
                       moe_intermediate_size=int(config.get("moe_intermediate_size", 7688)),
                       moe_shared_intermediate_size=int(config.get("moe_shared_expert_intermediate_size", 7688)),
                       n_group=int(config.get("n_group", 1)), topk_group=int(config.get("topk_group", 1)),
                       norm_topk_prob=flag(config, "norm_topk_prob", True, file),
                       routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
                       moe_latent_size=config.get("moe_latent_size"))
        return cls(hidden, mamba.vocab_size, types, config.get("intermediate_size", 4 * hidden), attention, mamba,
                   eps, flag(config, "mlp_bias", False, file), tie, **moe)

    def to_hf(self) -> dict:
        a, m = self.attention, self.mamba
        pattern = "".join({"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}[t] for t in self.layer_types)
        moe = {}
        if self.n_experts:
            moe = dict(n_routed_experts=self.n_experts, num_experts_per_tok=self.experts_per_token,
                       moe_intermediate_size=self.moe_intermediate_size,
                       moe_shared_expert_intermediate_size=self.moe_shared_intermediate_size, n_group=self.n_group,
                       topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob,
                       routed_scaling_factor=self.routed_scaling_factor, moe_latent_size=self.moe_latent_size)
        return dict(**moe,
            model_type="nemotron_h", architectures=["NemotronHForCausalLM"], vocab_size=self.vocab_size,
            hidden_size=self.d_model, num_hidden_layers=self.n_layer, hybrid_override_pattern=pattern,
            intermediate_size=self.intermediate_size, num_attention_heads=a.num_heads,
            num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim, mamba_num_heads=m.nheads,
            mamba_head_dim=m.headdim, n_groups=m.ngroups, ssm_state_size=m.d_state, conv_kernel=m.d_conv,
            expand=m.expand, chunk_size=m.chunk_size, time_step_limit=list(m.dt_limit), use_conv_bias=m.conv_bias,
            use_bias=m.bias, mlp_bias=self.mlp_bias, layer_norm_epsilon=self.norm_eps, mamba_hidden_act="silu",
            mlp_hidden_act="relu2", tie_word_embeddings=self.tie_word_embeddings)


class NemotronHLayer(nn.Module):
    def __init__(self, cfg: NemotronHConfig, kind: str, device=None, dtype=None):
        super().__init__()
        f = dict(device=device, dtype=dtype)
        self.kind = kind
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, **f)
        if kind == "mamba":
            self.mixer = Mamba2Mixer(cfg.mamba, **f)
        elif kind == "attention":
            self.mixer = LlamaAttention(cfg.d_model, cfg.attention, **f)
        elif kind == "moe":
            self.mixer = GroupedMoE(cfg.d_model, cfg.n_experts, cfg.experts_per_token, cfg.moe_intermediate_size,
                                    cfg.moe_shared_intermediate_size, n_group=cfg.n_group, topk_group=cfg.topk_group,
                                    normalize=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor,
                                    latent=cfg.moe_latent_size, bias=cfg.mlp_bias, **f)
        else:
            self.mixer = ReluSquaredMLP(cfg.d_model, cfg.intermediate_size, bias=cfg.mlp_bias, **f)

    def block(self) -> Block:
        if self.kind in ("mlp", "moe"):  # stateless: the block loop's MLP slot, no token mixer
            return Block(None, None, self.norm, self.mixer)
        return Block(self.norm, self.mixer)


class NemotronHBody(nn.Module):
    def __init__(self, cfg: NemotronHConfig, device=None, dtype=None):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList(NemotronHLayer(cfg, kind, device, dtype) for kind in cfg.layer_types)
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps, device, dtype)


class NemotronHLM(TreeLM):
    model_type = "nemotron_h"
    embed_key = "backbone.embeddings.weight"
    final_norm_name = "backbone.norm_f"
    config_class = NemotronHConfig

    def __init__(self, cfg: NemotronHConfig, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.backbone = NemotronHBody(cfg, device, dtype)
        self.make_head(cfg.d_model, cfg.vocab_size, cfg.tie_word_embeddings, device, dtype)
        self.residual_fp32 = False
        self.blocks = [layer.block() for layer in self.backbone.layers]

    @staticmethod
    def file_state(state: dict) -> dict:
        """transformers' in-memory state dict as the checkpoints lay it out: its stacked experts
        (``experts.up_proj [E, I, d]``) as per-expert rows, views that share the storage."""
        out = {}
        for key, value in state.items():
            head, _, name = key.rpartition("experts.")
            if head and name in ("up_proj", "down_proj") and value.dim() == 3:
                out.update({f"{head}experts.{e}.{name}.weight": value[e] for e in range(value.shape[0])})
            else:
                out[key] = value
        return out
