"""Llama attention (GQA, RoPE) over a committed KV cache plus a token tree, and its commit."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..kernels import tree_attention
from .cache import AttnLayerState, AttnScratch

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


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class LlamaAttention(nn.Module):
    kind = "attn"

    def __init__(self, d_model, num_heads, num_kv_heads, head_dim, rope_theta, rope_scaling, device=None, dtype=None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})")
        f = dict(bias=False, device=device, dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(d_model, num_heads * head_dim, **f)
        self.k_proj = nn.Linear(d_model, num_kv_heads * head_dim, **f)
        self.v_proj = nn.Linear(d_model, num_kv_heads * head_dim, **f)
        self.o_proj = nn.Linear(num_heads * head_dim, d_model, **f)
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope_theta, rope_scaling).to(device), persistent=False)

    def _rope(self, t, positions):
        freqs = positions[..., None].float() * self.inv_freq  # [b, n, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, :, None]
        cos, sin = emb.cos().to(t.dtype), emb.sin().to(t.dtype)
        return t * cos + _rotate_half(t) * sin

    def _qkv(self, h, positions):
        q = self._rope(self.q_proj(h).unflatten(-1, (self.num_heads, self.head_dim)), positions)
        k = self._rope(self.k_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim)), positions)
        return q, k, self.v_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim))

    def tree(self, h, ctx, state: AttnLayerState):
        """Outputs for every tree node (node i sees the committed prefix and its ancestors-or-self)
        and the nodes' K/V for commit. The model checked ``seqlens`` against the cache once."""
        q, k, v = self._qkv(h, ctx.positions)
        out = tree_attention(q, state.k, state.v, ctx.seqlens, k, v, ctx.index, validate=False,
                             backend=ctx.kernel_backend)
        return self.o_proj(out.flatten(-2)), (k, v)

    def step(self, h, state: AttnLayerState, ctx):
        """One token per row ``h [b, d]`` at position ``seqlens``: attends to the prefix and itself
        (the one-node tree), then writes its K/V into slot ``seqlens`` of each row (``seqlens`` is
        advanced by the model)."""
        seqlens = ctx.seqlens
        q, k, v = self._qkv(h[:, None], seqlens[:, None])
        out = tree_attention(q, state.k, state.v, seqlens, k, v, ctx.root, validate=False,
                             backend=ctx.kernel_backend)
        rows = torch.arange(h.shape[0], device=h.device)
        state.k[rows, seqlens] = k[:, 0]
        state.v[rows, seqlens] = v[:, 0]
        return self.o_proj(out[:, 0].flatten(-2))

    @staticmethod
    def stack_scratch(per_layer) -> AttnScratch:
        return AttnScratch(*(torch.stack(parts) for parts in zip(*per_layer)))

    @staticmethod
    def commit_layers(model, cache, scratch: AttnScratch, accepted, num_accepted, kernel_backend: str):
        """Every attention layer at once: path node t's K/V into slot ``seqlens + t``, where it sat
        in the verify pass, so its RoPE is already right. Entries past ``num_accepted`` land in
        slots past the new length, which hold nothing committed, so no mask (and no host sync)."""
        batch, L = accepted.shape
        rows = torch.arange(batch, device=accepted.device)[:, None]
        slots = cache.seqlens[:, None] + torch.arange(L, device=accepted.device)
        cache.k[:, rows, slots] = scratch.k[:, rows, accepted]
        cache.v[:, rows, slots] = scratch.v[:, rows, accepted]
