"""The feed-forward layers of the hybrid families: SwiGLU (Llama, MambaInLlama, Bamba) and the
ungated squared-ReLU MLP (Nemotron-H). Parameter names are transformers'."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    def __init__(self, d_model, intermediate_size, bias: bool = False, device=None, dtype=None):
        super().__init__()
        f = dict(bias=bias, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(d_model, intermediate_size, **f)
        self.up_proj = nn.Linear(d_model, intermediate_size, **f)
        self.down_proj = nn.Linear(intermediate_size, d_model, **f)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ReluSquaredMLP(nn.Module):
    def __init__(self, d_model, intermediate_size, bias: bool = False, device=None, dtype=None):
        super().__init__()
        f = dict(bias=bias, device=device, dtype=dtype)
        self.up_proj = nn.Linear(d_model, intermediate_size, **f)
        self.down_proj = nn.Linear(intermediate_size, d_model, **f)

    def forward(self, x):
        return self.down_proj(F.relu(self.up_proj(x)).square())
