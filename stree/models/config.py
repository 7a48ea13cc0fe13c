"""Model configurations; every size comes from the checkpoint, defaults are mamba_ssm's."""

from __future__ import annotations

import math
from dataclasses import dataclass


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

    def __post_init__(self):
        for name in ("d_model", "n_layer", "vocab_size", "d_state", "d_conv", "expand", "headdim", "ngroups"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Mamba2Config.{name} must be a positive integer, got {value!r}")
        if self.d_inner % self.headdim:
            raise ValueError(f"d_inner = expand * d_model = {self.d_inner} must be a multiple of headdim = {self.headdim}")
        if self.nheads % self.ngroups:
            raise ValueError(f"nheads = {self.nheads} must be a multiple of ngroups = {self.ngroups}")

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def nheads(self) -> int:
        return self.d_inner // self.headdim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.ngroups * self.d_state

    @property
    def d_in_proj(self) -> int:
        return 2 * self.d_inner + 2 * self.ngroups * self.d_state + self.nheads

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_size_multiple
        return -(-self.vocab_size // m) * m
