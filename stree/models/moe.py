"""Sparse mixture-of-experts feed-forward (Granite 4.0-H): a linear router, softmax over each
token's top-k router logits, SwiGLU experts with gate and up fused (``gate_up_proj [E, 2I, d]``,
``down_proj [E, d, I]``). Parameter names are transformers 5's (``router.weight``,
``experts.gate_up_proj``, ``experts.down_proj``).

The fast path groups the (token, expert) pairs by expert and runs each projection as one grouped
matmul (``torch._grouped_mm``) with offsets computed on the device: every expert's weights are
read once, whatever the number of tokens (a tree verify routes dozens), and nothing syncs with
the host. :func:`moe_reference`, each token through its own k experts, is what it is tested
against and what runs where the grouped matmul cannot (rows not a multiple of 16 bytes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def route(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts ``[T, k]`` and their weights (softmax over the k fp32 router
    logits, in the model dtype)."""
    top, experts = F.linear(x, router).float().topk(top_k, dim=-1)
    return top.softmax(dim=-1).to(x.dtype), experts


def moe_reference(x, router, gate_up, down, top_k: int) -> torch.Tensor:
    """The definition: ``sum_j w_j * down[e_j] (silu(g) * u)`` with ``g, u = gate_up[e_j] x`` for
    each token's k experts e_j (gathers k expert matrices per token)."""
    weights, experts = route(x, router, top_k)
    gate, up = torch.einsum("th,tkih->tki", x, gate_up[experts]).chunk(2, dim=-1)
    out = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, down[experts])
    return (out * weights[..., None]).sum(dim=1)


def moe_grouped(x, router, gate_up, down, top_k: int) -> torch.Tensor:
    """The same sum with the (token, expert) pairs sorted by expert and two grouped matmuls."""
    n_experts = gate_up.shape[0]
    weights, experts = route(x, router, top_k)
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    token = order // top_k
    counts = torch.zeros(n_experts, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))  # not bincount: that syncs on CUDA
    offsets = counts.cumsum(0, dtype=torch.int32)
    gate, up = torch._grouped_mm(x[token], gate_up.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
    out = torch._grouped_mm((F.silu(gate) * up).contiguous(), down.transpose(-2, -1), offs=offsets)
    out = out * weights.flatten()[order, None]
    return torch.zeros_like(x).index_add_(0, token, out)


def grouped_mm_fits(d_model: int, intermediate: int, dtype: torch.dtype) -> bool:
    """``torch._grouped_mm`` needs every row of its operands to be a multiple of 16 bytes."""
    size = torch.empty((), dtype=dtype).element_size()
    return (d_model * size) % 16 == 0 and (intermediate * size) % 16 == 0


class ExpertLinear(nn.Module):
    """One ``[n_experts, out, in]`` weight (applied by :func:`moe_grouped`, not called)."""

    def __init__(self, n_experts: int, d_out: int, d_in: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d_out, d_in, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=d_in ** -0.5)


class Router(nn.Module):
    def __init__(self, d_model: int, n_experts: int, device=None, dtype=None):
        super().__init__()
        self.layer = nn.Linear(d_model, n_experts, bias=False, device=device, dtype=dtype)


class TopKMoE(nn.Module):
    def __init__(self, d_model: int, n_experts: int, top_k: int, intermediate: int, device=None, dtype=None):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_local_experts = {n_experts}], got {top_k}")
        f = dict(device=device, dtype=dtype)
        self.top_k, self.intermediate = top_k, intermediate
        self.router = Router(d_model, n_experts, **f)
        self.input_linear = ExpertLinear(n_experts, 2 * intermediate, d_model, **f)
        self.output_linear = ExpertLinear(n_experts, d_model, intermediate, **f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        args = (flat, self.router.layer.weight, self.input_linear.weight, self.output_linear.weight, self.top_k)
        fits = grouped_mm_fits(x.shape[-1], self.intermediate, x.dtype)
        return (moe_grouped(*args) if fits else moe_reference(*args)).view_as(x)
