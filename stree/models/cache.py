"""Committed decoding state of a Mamba2 LM, plus the scratch one tree verify pass leaves for commit."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SSMScratch:
    """Per-node activations of one layer's last ``forward_tree``: what replay needs, nothing more."""

    xBC: torch.Tensor  # [b, n, conv_dim] raw, before the conv
    x: torch.Tensor  # [b, n, h, p] after conv and SiLU
    dt: torch.Tensor  # [b, n, h] raw, before bias
    B: torch.Tensor  # [b, n, g, s] after conv and SiLU


@dataclass
class Mamba2Cache:
    """``conv`` ``[layers, b, conv_dim, d_conv]`` in model dtype (raw inputs, newest last);
    ``ssm`` ``[layers, b, h, p, s]`` fp32; ``seqlens`` ``[b]`` tokens committed per row."""

    conv: torch.Tensor
    ssm: torch.Tensor
    seqlens: torch.Tensor
    max_length: int
    scratch: list[SSMScratch | None] = field(default_factory=list)
    tree_n: int | None = None  # nodes of the tree the scratch belongs to

    @property
    def batch_size(self) -> int:
        return self.ssm.shape[1]

    def select(self, rows: torch.Tensor) -> "Mamba2Cache":
        """A copy of the committed state of ``rows`` (a LongTensor of row indices); no scratch."""
        return Mamba2Cache(self.conv[:, rows], self.ssm[:, rows], self.seqlens[rows], self.max_length,
                           [None] * len(self.scratch))

    def assign(self, rows: torch.Tensor, other: "Mamba2Cache") -> None:
        """Write ``other``'s committed state (from :meth:`select`) back into ``rows``."""
        self.conv[:, rows] = other.conv
        self.ssm[:, rows] = other.ssm
        self.seqlens[rows] = other.seqlens

    def clone(self) -> "Mamba2Cache":
        return self.select(torch.arange(self.batch_size, device=self.seqlens.device))
