"""Llama attention (GQA, RoPE) over a committed KV cache plus a token tree, and its commit; with
the variants the hybrid families use: RoPE on part of each head (Bamba), none at all (Nemotron-H),
biased projections."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ...kernels import tree_attention
from ..cache import AttnLayerState, AttnScratch
from ..base import scaled
from .linear import Linear

ROPE_TYPES = ("default", "llama3")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies of RoPE; ``scaling`` with ``rope_type`` "llama3" applies Llama 3.1's
    wavelength-dependent rescaling (factor, low/high_freq_factor, original_max_position_embeddings)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {kind!r}")
    if kind == "default":
        return inv.float()
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled).float()


@dataclass(frozen=True)
class AttentionConfig:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", ...}; None is plain RoPE
    rotary_dim: int | None = None  # RoPE on the first rotary_dim channels of a head; None: all, 0: no RoPE
    qkv_bias: bool = False
    o_bias: bool = False
    softmax_scale: float | None = None  # None: 1 / sqrt(head_dim); Granite 4.0: attention_multiplier
    key_scale: float = 1.0  # Falcon-H1's key_multiplier on k before RoPE

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                             f"({self.num_kv_heads})")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not 0 <= self.rotary_dim <= self.head_dim):
            raise ValueError(f"rotary_dim must be even and in [0, head_dim = {self.head_dim}], got {self.rotary_dim}")

    @property
    def rope_dim(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class LlamaAttention(nn.Module):
    kind = "attn"

    def __init__(self, d_model, cfg: AttentionConfig, device=None, dtype=None):
        super().__init__()
        f = dict(device=device, dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg, self.rope_dim = cfg, cfg.rope_dim
        self.q_proj = Linear(d_model, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias, **f)
        self.k_proj = Linear(d_model, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias, **f)
        self.v_proj = Linear(d_model, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias, **f)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, d_model, bias=cfg.o_bias, **f)
        if self.rope_dim:
            self.register_buffer("inv_freq", self.rope_frequencies(device), persistent=False)

    def rope_frequencies(self, device) -> torch.Tensor:
        return rope_inv_freq(self.rope_dim, self.cfg.rope_theta, self.cfg.rope_scaling).to(device)

    def make_buffers(self, device) -> None:
        """The buffers no checkpoint holds (RoPE's inverse frequencies), after loading on "meta"."""
        if self.rope_dim:
            self.inv_freq = self.rope_frequencies(device)

    def _rope(self, t, positions):
        if not self.rope_dim:
            return t
        freqs = positions[..., None].float() * self.inv_freq  # [b, n, rope_dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, :, None]
        cos, sin = emb.cos().to(t.dtype), emb.sin().to(t.dtype)
        if self.rope_dim == self.head_dim:
            return t * cos + _rotate_half(t) * sin
        rot, rest = t[..., :self.rope_dim], t[..., self.rope_dim:]
        return torch.cat([rot * cos + _rotate_half(rot) * sin, rest], dim=-1)

    def _qkv(self, h, positions):
        q = self._rope(self.q_proj(h).unflatten(-1, (self.num_heads, self.head_dim)), positions)
        k = self._rope(scaled(self.k_proj(h), self.cfg.key_scale).unflatten(-1, (self.num_kv_heads, self.head_dim)),
                       positions)
        return q, k, self.v_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim))

    def tree(self, h, ctx, state: AttnLayerState):
        """Outputs for every tree node (node i sees the committed prefix and its ancestors-or-self)
        and the nodes' K/V for commit. The model checked ``seqlens`` against the cache once."""
        q, k, v = self._qkv(h, ctx.positions)
        out = tree_attention(q, state.k, state.v, ctx.seqlens, k, v, ctx.index, validate=False,
                             softmax_scale=self.cfg.softmax_scale, backend=ctx.kernel_backend)
        return self.o_proj(out.flatten(-2)), (k, v)

    def step(self, h, state: AttnLayerState, ctx):
        """One token per row ``h [b, d]`` at position ``seqlens``: attends to the prefix and itself
        (the one-node tree), then writes its K/V into slot ``seqlens`` of each row (``seqlens`` is
        advanced by the model)."""
        seqlens = ctx.seqlens
        q, k, v = self._qkv(h[:, None], seqlens[:, None])
        out = tree_attention(q, state.k, state.v, seqlens, k, v, ctx.root, validate=False,
                             softmax_scale=self.cfg.softmax_scale, backend=ctx.kernel_backend)
        rows = torch.arange(h.shape[0], device=h.device)
        state.k[rows, seqlens] = k[:, 0]
        state.v[rows, seqlens] = v[:, 0]
        return self.o_proj(out[:, 0].flatten(-2))

    @staticmethod
    def stack_scratch(per_layer) -> AttnScratch:
        return AttnScratch(*(torch.stack(parts) for parts in zip(*per_layer)))

    @staticmethod
    def commit_layers(model, cache, scratch: AttnScratch, accepted, num_accepted, kernel_backend: str, prefill: bool,
                      cu_seqlens=None):
        """Every attention layer at once: path node t's K/V into slot ``seqlens + t``, where it sat
        in the verify pass, so its RoPE is already right. Entries past ``num_accepted`` land in
        slots past the new length, which hold nothing committed, so no mask (and no host sync). A
        packed pass (``cu_seqlens``) holds every tree's nodes in its one row, tree r's from
        ``cu_seqlens[r]``."""
        batch, L = accepted.shape
        rows = torch.arange(batch, device=accepted.device)[:, None]
        slots = cache.seqlens[:, None] + torch.arange(L, device=accepted.device)
        if cu_seqlens is None:
            cache.k[:, rows, slots] = scratch.k[:, rows, accepted]
            cache.v[:, rows, slots] = scratch.v[:, rows, accepted]
        else:
            nodes = accepted + cu_seqlens[:-1, None].to(accepted.dtype)
            cache.k[:, rows, slots] = scratch.k[:, 0, nodes]
            cache.v[:, rows, slots] = scratch.v[:, 0, nodes]
