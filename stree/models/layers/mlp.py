"""The feed-forward layers of the families: SwiGLU (Llama, MambaInLlama, Bamba; Falcon-H1 with
its gate and down multipliers), SwiGLU with gate and up in one matrix (Granite 4.0's shared MLP)
and the ungated squared-ReLU MLP (Nemotron-H). Parameter names are transformers'."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from ..base import scaled
from .linear import Linear


class SwiGLU(nn.Module):
    def __init__(self, d_model, intermediate_size, bias: bool = False, device=None, dtype=None,
                 gate_scale: float = 1.0, down_scale: float = 1.0):
        super().__init__()
        f = dict(bias=bias, device=device, dtype=dtype)
        self.gate_proj = Linear(d_model, intermediate_size, **f)
        self.up_proj = Linear(d_model, intermediate_size, **f)
        self.down_proj = Linear(intermediate_size, d_model, **f)
        self.gate_scale, self.down_scale = gate_scale, down_scale

    def forward(self, x):
        gate = F.silu(scaled(self.gate_proj(x), self.gate_scale))
        return scaled(self.down_proj(self.up_proj(x) * gate), self.down_scale)


class FusedSwiGLU(nn.Module):
    """``output_linear(silu(g) * u)`` with ``g, u`` the halves of ``input_linear(x)``."""

    def __init__(self, d_model, intermediate_size, device=None, dtype=None):
        super().__init__()
        f = dict(bias=False, device=device, dtype=dtype)
        self.input_linear = Linear(d_model, 2 * intermediate_size, **f)
        self.output_linear = Linear(intermediate_size, d_model, **f)

    def forward(self, x):
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(F.silu(gate) * up)


class ReluSquaredMLP(nn.Module):
    def __init__(self, d_model, intermediate_size, bias: bool = False, device=None, dtype=None):
        super().__init__()
        f = dict(bias=bias, device=device, dtype=dtype)
        self.up_proj = Linear(d_model, intermediate_size, **f)
        self.down_proj = Linear(intermediate_size, d_model, **f)

    def forward(self, x):
        return self.down_proj(F.relu(self.up_proj(x)).square())
