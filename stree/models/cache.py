"""Committed decoding state of a model, plus the scratch one tree verify pass leaves for commit."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SSMScratch:
    """Per-node activations of one Mamba2 layer's last ``forward_tree``: what replay needs."""

    xBC: torch.Tensor  # [b, n, conv_dim] raw, before the conv
    x: torch.Tensor  # [b, n, h, p] after conv and SiLU (repeated to heads)
    dt: torch.Tensor  # [b, n, h] raw, before bias
    B: torch.Tensor  # [b, n, g, s] after conv and SiLU


@dataclass
class AttnScratch:
    """The tree nodes' keys (after RoPE) and values of one attention layer's last ``forward_tree``."""

    k: torch.Tensor  # [b, n, hkv, d]
    v: torch.Tensor


@dataclass
class ModelCache:
    """Per-row committed state. SSM layers: ``conv`` ``[ssm_layers, b, conv_dim, d_conv]`` (model
    dtype, raw inputs, newest last) and ``ssm`` ``[ssm_layers, b, h, p, s]`` fp32. Attention layers:
    ``k``, ``v`` ``[attn_layers, b, max_length, hkv, d]``. ``seqlens`` ``[b]``: tokens committed."""

    conv: torch.Tensor | None
    ssm: torch.Tensor | None
    k: torch.Tensor | None
    v: torch.Tensor | None
    seqlens: torch.Tensor
    max_length: int
    scratch: list = field(default_factory=list)
    tree_n: int | None = None  # nodes of the tree the scratch belongs to

    def drop_scratch(self) -> None:
        """Forget the last tree pass: once the state moves on, a commit of it would be wrong."""
        self.scratch = [None] * len(self.scratch)
        self.tree_n = None

    @property
    def batch_size(self) -> int:
        return self.seqlens.shape[0]

    def select(self, rows: torch.Tensor) -> "ModelCache":
        """A copy of the committed state of ``rows`` (a LongTensor of row indices); no scratch."""
        take = lambda t: t[:, rows] if t is not None else None
        return ModelCache(take(self.conv), take(self.ssm), take(self.k), take(self.v), self.seqlens[rows],
                          self.max_length, [None] * len(self.scratch))

    def assign(self, rows: torch.Tensor, other: "ModelCache") -> None:
        """Write ``other``'s committed state (from :meth:`select`) back into ``rows``."""
        for name in ("conv", "ssm", "k", "v"):
            mine = getattr(self, name)
            if mine is not None:
                mine[:, rows] = getattr(other, name)
        self.seqlens[rows] = other.seqlens

    def clone(self) -> "ModelCache":
        return self.select(torch.arange(self.batch_size, device=self.seqlens.device))
