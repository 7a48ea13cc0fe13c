"""Model configurations; every size comes from the checkpoint, defaults are mamba_ssm's."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .layers.attention import ROPE_TYPES, AttentionConfig


def require(config: dict, key: str, file):
    """``config[key]``, or a ValueError naming the file and the key."""
    if key not in config:
        raise ValueError(f"{file}: missing key {key!r}")
    return config[key]


def flag(config: dict, key: str, default: bool, file) -> bool:
    """``config[key]`` (``default`` when absent or null), which must be a JSON boolean."""
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{file}: {key} must be true or false, got {value!r}")
    return value


def dt_limit_of(value, file, key: str = "time_step_limit") -> tuple[float, float]:
    """A (min, max) dt clamp as the configs write it (None: no clamp)."""
    if value is None:
        return (0.0, math.inf)
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{file}: {key} must be a pair of numbers, got {value!r}") from None
    return lo, hi


def layer_indices(name: str, indices, n_layer: int) -> tuple[int, ...]:
    """Sorted layer indices, each in [0, n_layer)."""
    indices = tuple(sorted(int(i) for i in indices))
    bad = [i for i in indices if not 0 <= i < n_layer]
    if bad:
        raise ValueError(f"{name} {bad} outside [0, n_layer = {n_layer})")
    return indices


GATE_NORMS = ("gate_first", "gate_last", "none")


def attention_of(config: dict, file, rope_types: tuple[str, ...] = ROPE_TYPES, **fields) -> AttentionConfig:
    """A transformers attention layer's config: heads, KV heads, head_dim (default hidden / heads),
    RoPE from 4.x ``rope_theta`` / ``rope_scaling`` or 5.x ``rope_parameters`` (types in
    ``rope_types``), ``attention_bias`` on all four projections; ``fields`` override."""
    hidden, heads = require(config, "hidden_size", file), require(config, "num_attention_heads", file)
    rope = dict(config.get("rope_parameters") or {**(config.get("rope_scaling") or {}),
                                                   "rope_theta": config.get("rope_theta", 10000.0)})
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    if rope["rope_type"] not in rope_types:
        raise ValueError(f"{file}: rope_type {rope['rope_type']!r} is not supported (supported: {rope_types})")
    bias = flag(config, "attention_bias", False, file)
    return AttentionConfig(**{
        **dict(num_heads=heads, num_kv_heads=config.get("num_key_value_heads") or heads,
               head_dim=config.get("head_dim") or hidden // heads, rope_theta=float(rope.get("rope_theta", 10000.0)),
               rope_scaling=None if rope["rope_type"] == "default" else rope, qkv_bias=bias, o_bias=bias),
        **fields})


def rope_parameters(a: AttentionConfig, **extra) -> dict:
    """The 5.x ``rope_parameters`` of ``a`` (the inverse of :func:`attention_of`)."""
    return dict(a.rope_scaling or {"rope_type": "default"}, rope_theta=a.rope_theta, **extra)


@dataclass(frozen=True)
class Mamba2Config:
    """mamba_ssm ``MambaConfig`` with ``ssm_cfg = {"layer": "Mamba2", ...}`` flattened.

    Assumes the settings every state-spaces Mamba2 checkpoint uses: gated RMSNorm with the gate
    before the norm, D per head, no MLP, RMSNorm blocks.
    """

    d_model: int
    n_layer: int
    vocab_size: int
    d_state: int = 128
    d_conv: int = 4
    expand: int = 2
    headdim: int = 64
    ngroups: int = 1
    chunk_size: int = 256
    dt_limit: tuple[float, float] = (0.0, math.inf)
    conv_bias: bool = True
    bias: bool = False
    pad_vocab_size_multiple: int = 16
    tie_embeddings: bool = True
    residual_in_fp32: bool = True
    norm_eps: float = 1e-5
    # MambaInLlama's variant: x and B are d_xb wide (one group per KV head), convolved un-repeated
    # and repeated to the heads afterwards; None is standard Mamba2.
    d_xb: int | None = None
    # The SSM width when it is not expand * d_model (Nemotron Nano 2: heads * head_dim).
    d_ssm: int | None = None
    # transformers' hybrids round the gated norm's output to the model dtype before the weight
    # multiply; mamba_ssm multiplies in fp32 and rounds once.
    norm_round_before_weight: bool = False
    # True: dt_limit clamps dt in prefill only, as mamba_ssm's and transformers' chunked scans do
    # and their one-token steps do not (a Nemotron-H limit above 0 matters); decoding
    # (step, tree pass, commit) then leaves dt unclamped. False: every path clamps.
    dt_limit_prefill_only: bool = False
    # The gate around the SSM output y: "gate_first" norm(y * silu(z)) (mamba_ssm), "gate_last"
    # norm(y) * silu(z), "none" y * silu(z) without a norm (Falcon-H1's mamba_rms_norm=False).
    gate_norm: str = "gate_first"
    # Falcon-H1's µP multipliers of the in_proj output's z, x, B, C and dt segments; None: all 1.
    proj_scales: tuple[float, float, float, float, float] | None = None
    out_proj_bias: bool | None = None  # None: ``bias``, as for in_proj

    def __post_init__(self):
        if self.gate_norm not in GATE_NORMS:
            raise ValueError(f"Mamba2Config.gate_norm must be one of {GATE_NORMS}, got {self.gate_norm!r}")
        if self.proj_scales is not None:
            object.__setattr__(self, "proj_scales", tuple(float(v) for v in self.proj_scales))
            if len(self.proj_scales) != 5:
                raise ValueError(f"Mamba2Config.proj_scales must be 5 numbers (z, x, B, C, dt), got {self.proj_scales}")
        for name in ("conv_bias", "bias", "tie_embeddings", "residual_in_fp32", "norm_round_before_weight",
                     "dt_limit_prefill_only"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Mamba2Config.{name} must be a bool, got {getattr(self, name)!r}")
        if not (isinstance(self.norm_eps, (int, float)) and self.norm_eps > 0):
            raise ValueError(f"Mamba2Config.norm_eps must be a positive number, got {self.norm_eps!r}")
        lo, hi = self.dt_limit
        if not 0 <= lo <= hi:
            raise ValueError(f"Mamba2Config.dt_limit must satisfy 0 <= min <= max, got {self.dt_limit}")
        for name in ("d_model", "n_layer", "vocab_size", "d_state", "d_conv", "expand", "headdim", "ngroups", "d_ssm",
                     "chunk_size", "pad_vocab_size_multiple"):
            value = getattr(self, name)
            if (value is not None or name != "d_ssm") and (not isinstance(value, int) or value < 1):
                raise ValueError(f"Mamba2Config.{name} must be a positive integer, got {value!r}")
        if self.d_inner % self.headdim:
            raise ValueError(f"d_inner = {self.d_inner} must be a multiple of headdim = {self.headdim}")
        if self.nheads % self.ngroups:
            raise ValueError(f"nheads = {self.nheads} must be a multiple of ngroups = {self.ngroups}")
        if self.d_xb is not None:
            x_heads, b_groups = divmod(self.d_xb, self.headdim), divmod(self.d_xb, self.d_state)
            if x_heads[1] or b_groups[1] or self.nheads % x_heads[0] or self.ngroups % b_groups[0]:
                raise ValueError(f"d_xb = {self.d_xb} must split into whole heads (headdim {self.headdim}) and "
                                 f"groups (d_state {self.d_state}) dividing nheads {self.nheads} and ngroups {self.ngroups}")

    @property
    def d_inner(self) -> int:
        return self.d_ssm if self.d_ssm is not None else self.expand * self.d_model

    @property
    def nheads(self) -> int:
        return self.d_inner // self.headdim

    @property
    def x_dim(self) -> int:
        return self.d_xb if self.d_xb is not None else self.d_inner

    @property
    def B_dim(self) -> int:
        return self.d_xb if self.d_xb is not None else self.ngroups * self.d_state

    @property
    def C_dim(self) -> int:
        return self.ngroups * self.d_state

    @property
    def conv_dim(self) -> int:
        return self.x_dim + self.B_dim + self.C_dim

    @property
    def d_in_proj(self) -> int:
        return self.d_inner + self.conv_dim + self.nheads

    @property
    def out_bias(self) -> bool:
        return self.bias if self.out_proj_bias is None else self.out_proj_bias

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_size_multiple
        return -(-self.vocab_size // m) * m


@dataclass(frozen=True)
class HybridConfig:
    """MambaInLlama: Llama decoder layers whose token mixer is attention at ``attn_layers`` and a
    Mamba2 mixer in the d_xb variant elsewhere (nheads = ngroups, headdim = d_state)."""

    d_model: int
    n_layer: int
    vocab_size: int
    attn_layers: tuple[int, ...]
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    d_inner: int
    d_xb: int
    d_state: int
    ngroups: int
    d_conv: int = 4
    conv_bias: bool = True
    bias: bool = False
    dt_limit: tuple[float, float] = (0.0, math.inf)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", ...}; None is plain RoPE
    tie_word_embeddings: bool = False

    def __post_init__(self):
        object.__setattr__(self, "attn_layers", layer_indices("attn_layers", self.attn_layers, self.n_layer))
        if self.d_inner % self.d_model:
            raise ValueError(f"d_inner = {self.d_inner} must be a multiple of d_model = {self.d_model}")
        self.mamba  # validates the Mamba2 side

    @property
    def attention(self) -> AttentionConfig:
        return AttentionConfig(self.num_attention_heads, self.num_key_value_heads, self.head_dim, self.rope_theta,
                               self.rope_scaling)

    @property
    def ssm_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layer) if i not in self.attn_layers)

    @property
    def mamba(self) -> Mamba2Config:
        return Mamba2Config(
            d_model=self.d_model, n_layer=self.n_layer, vocab_size=self.vocab_size, d_state=self.d_state,
            d_conv=self.d_conv, expand=self.d_inner // self.d_model, headdim=self.d_state, ngroups=self.ngroups,
            dt_limit=self.dt_limit, conv_bias=self.conv_bias, bias=self.bias, pad_vocab_size_multiple=1,
            tie_embeddings=self.tie_word_embeddings, residual_in_fp32=False, norm_eps=self.rms_norm_eps,
            d_xb=self.d_xb,
        )
