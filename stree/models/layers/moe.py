"""Sparse mixture-of-experts feed-forward layers: Granite 4.0-H's (a linear router, softmax over
each token's top-k router logits, SwiGLU experts with gate and up fused) and Nemotron-H's
(DeepSeek-V3 routing: sigmoid scores plus a correction bias, the best ``topk_group`` of
``n_group`` expert groups, weights renormalised and scaled; squared-ReLU experts, optionally in
a latent width; a shared expert beside them). Parameter names are the checkpoints'.

The fast path groups the (token, expert) pairs by expert and runs each projection as one grouped
matmul (``torch._grouped_mm``) with offsets computed on the device: every expert's weights are
read once, whatever the number of tokens (a tree verify routes dozens), and nothing syncs with
the host. :func:`experts_reference`, each token through its own k experts, is what it is tested
against and what runs where the grouped matmul cannot (see :func:`grouped_mm_fits`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .mlp import ReluSquaredMLP
from .linear import Linear

ACTIVATIONS = {"silu_gated": None, "relu2": lambda h: F.relu(h).square()}


def route_softmax(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Granite: each token's top-k experts ``[T, k]`` and their weights (softmax over the k fp32
    router logits, in the model dtype)."""
    top, experts = F.linear(x, router).float().topk(top_k, dim=-1)
    return top.softmax(dim=-1).to(x.dtype), experts


def route_grouped_sigmoid(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                          topk_group: int, normalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Nemotron-H (DeepSeek-V3's router), in fp32: sigmoid scores; experts chosen by score plus
    ``bias`` among the ``topk_group`` groups whose two best biased scores sum highest; weights
    are the chosen unbiased scores, renormalised when ``normalize``, times ``scale``."""
    scores = F.linear(x.float(), router.float()).sigmoid()
    choice = scores + bias.float()
    T, E = scores.shape
    groups = choice.view(T, n_group, E // n_group).topk(min(2, E // n_group), dim=-1).values.sum(-1)
    keep = torch.zeros_like(groups).scatter_(1, groups.topk(topk_group, dim=-1).indices, 1.0).bool()
    choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    experts = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale, experts


def _hidden(h: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu_gated":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return ACTIVATIONS[act](h)


def experts_reference(x, weights, experts, up, down, act: str) -> torch.Tensor:
    """The definition: ``sum_j w_j * down[e_j] act(up[e_j] x)`` over each token's k experts e_j
    (gathers k expert matrices per token), summed in the weights' dtype."""
    h = _hidden(torch.einsum("th,tkih->tki", x, up[experts]), act)
    out = torch.einsum("tki,tkhi->tkh", h, down[experts])
    return (out.to(weights.dtype) * weights[..., None]).sum(dim=1).to(x.dtype)


def experts_grouped(x, weights, experts, up, down, act: str) -> torch.Tensor:
    """The same sum with the (token, expert) pairs sorted by expert and two grouped matmuls."""
    n_experts, top_k = up.shape[0], experts.shape[1]
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    token = order // top_k
    counts = torch.zeros(n_experts, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))  # not bincount: that syncs on CUDA
    offsets = counts.cumsum(0, dtype=torch.int32)
    h = _hidden(torch._grouped_mm(x[token], up.transpose(-2, -1), offs=offsets), act)
    out = torch._grouped_mm(h.contiguous(), down.transpose(-2, -1), offs=offsets)
    out = out.to(weights.dtype) * weights.flatten()[order, None]
    return torch.zeros(x.shape, dtype=weights.dtype, device=x.device).index_add_(0, token, out).to(x.dtype)


def grouped_mm_fits(d_model: int, intermediate: int, dtype: torch.dtype, device=None) -> bool:
    """``torch._grouped_mm`` needs every row of its operands to be a multiple of 16 bytes, and on
    CUDA bf16 operands on a Hopper-or-newer GPU (elsewhere it runs on the CPU, any float dtype)."""
    size = torch.empty((), dtype=dtype).element_size()
    if (d_model * size) % 16 or (intermediate * size) % 16:
        return False
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
    return device.type == "cpu"


def run_experts(x, weights, experts, up, down, act: str, intermediate: int) -> torch.Tensor:
    fits = grouped_mm_fits(x.shape[-1], intermediate, x.dtype, x.device)
    return (experts_grouped if fits else experts_reference)(x, weights, experts, up, down, act)


class ExpertLinear(nn.Module):
    """One ``[n_experts, out, in]`` weight (applied by :func:`run_experts`, not called)."""

    def __init__(self, n_experts: int, d_out: int, d_in: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d_out, d_in, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=d_in ** -0.5)


class Router(nn.Module):
    def __init__(self, d_model: int, n_experts: int, device=None, dtype=None):
        super().__init__()
        self.layer = Linear(d_model, n_experts, bias=False, device=device, dtype=dtype)


def check_top_k(top_k: int, n_experts: int) -> None:
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"num_experts_per_tok must be in [1, {n_experts} experts], got {top_k}")


def check_group_routing(n_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    check_top_k(top_k, n_experts)
    if n_experts % n_group or not 1 <= topk_group <= n_group or top_k > topk_group * (n_experts // n_group):
        raise ValueError(f"n_group {n_group} must divide {n_experts} experts and topk_group {topk_group} groups "
                         f"(<= n_group) must hold num_experts_per_tok {top_k} experts")


class TopKMoE(nn.Module):
    """Granite 4.0-H's experts: ``router.layer.weight``, ``input_linear.weight [E, 2I, d]`` (gate
    and up), ``output_linear.weight [E, d, I]`` (transformers 5 renames them in memory to
    ``router.weight``, ``experts.gate_up_proj``, ``experts.down_proj`` but still writes these)."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, intermediate: int, device=None, dtype=None):
        super().__init__()
        check_top_k(top_k, n_experts)
        f = dict(device=device, dtype=dtype)
        self.top_k, self.intermediate = top_k, intermediate
        self.router = Router(d_model, n_experts, **f)
        self.input_linear = ExpertLinear(n_experts, 2 * intermediate, d_model, **f)
        self.output_linear = ExpertLinear(n_experts, d_model, intermediate, **f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = route_softmax(flat, self.router.layer.weight, self.top_k)
        return run_experts(flat, weights, experts, self.input_linear.weight, self.output_linear.weight,
                           "silu_gated", self.intermediate).view_as(x)


class StackedExperts(nn.Module):
    """Non-gated experts kept stacked (``up [E, I, d]``, ``down [E, d, I]``) for the grouped
    matmuls, read and written as the checkpoints name them: ``{e}.up_proj.weight`` and
    ``{e}.down_proj.weight`` per expert."""

    def __init__(self, n_experts: int, d_in: int, intermediate: int, device=None, dtype=None):
        super().__init__()
        self.n_experts = n_experts
        self.up = nn.Parameter(torch.empty(n_experts, intermediate, d_in, device=device, dtype=dtype))
        self.down = nn.Parameter(torch.empty(n_experts, d_in, intermediate, device=device, dtype=dtype))
        for p in (self.up, self.down):
            nn.init.normal_(p, std=p.shape[-1] ** -0.5)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for e in range(self.n_experts):
            for name, p in (("up_proj", self.up), ("down_proj", self.down)):
                destination[f"{prefix}{e}.{name}.weight"] = p[e] if keep_vars else p.detach()[e]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for name, p in (("up_proj", self.up), ("down_proj", self.down)):
            keys = [f"{prefix}{e}.{name}.weight" for e in range(self.n_experts)]
            missing_keys.extend(k for k in keys if k not in state_dict)
            if any(k not in state_dict for k in keys):
                continue
            parts = [state_dict[k] for k in keys]
            stacked = _stacked_base(parts)
            if local_metadata.get("assign_to_params_buffers", False):
                setattr(self, "up" if name == "up_proj" else "down",
                        nn.Parameter(stacked if stacked is not None else torch.stack(parts), requires_grad=p.requires_grad))
            else:
                with torch.no_grad():
                    p.copy_(stacked if stacked is not None else torch.stack(parts))


def _stacked_base(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The ``[E, ...]`` tensor whose rows ``parts`` are, when they are its views (transformers'
    stacked experts, split by name): sharing it keeps from_transformers copy-free."""
    base = parts[0]._base
    if base is None or base.shape[0] != len(parts) or tuple(base.shape[1:]) != tuple(parts[0].shape):
        return None
    same = all(p._base is base and p.data_ptr() == base[e].data_ptr() for e, p in enumerate(parts))
    return base if same else None


class GroupedMoE(nn.Module):
    """Nemotron-H's MoE layer (``mixer`` of an "E" layer): ``gate.weight``,
    ``gate.e_score_correction_bias``, ``experts.{e}.up_proj / down_proj``, ``shared_experts.up_proj
    / down_proj``, and ``fc1_latent_proj`` / ``fc2_latent_proj`` when the experts work in a latent
    width. Routed outputs are summed in fp32, as transformers sums them."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, intermediate: int, shared_intermediate: int, *,
                 n_group: int = 1, topk_group: int = 1, normalize: bool = True, scale: float = 1.0,
                 latent: int | None = None, bias: bool = False, device=None, dtype=None):
        super().__init__()
        check_group_routing(n_experts, top_k, n_group, topk_group)
        f = dict(device=device, dtype=dtype)
        self.top_k, self.intermediate, self.n_group, self.topk_group = top_k, intermediate, n_group, topk_group
        self.normalize, self.scale = normalize, scale
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(n_experts, d_model, **f))
        nn.init.normal_(self.gate.weight, std=d_model ** -0.5)
        self.gate.register_buffer("e_score_correction_bias", torch.zeros(n_experts, device=device,
                                                                         dtype=torch.float32))
        self.experts = StackedExperts(n_experts, latent or d_model, intermediate, **f)
        self.shared_experts = ReluSquaredMLP(d_model, shared_intermediate, bias=bias, **f)
        if latent is not None:
            self.fc1_latent_proj = Linear(d_model, latent, bias=bias, **f)
            self.fc2_latent_proj = Linear(latent, d_model, bias=bias, **f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = route_grouped_sigmoid(flat, self.gate.weight, self.gate.e_score_correction_bias,
                                                 self.top_k, self.n_group, self.topk_group, self.normalize,
                                                 self.scale)
        latent = hasattr(self, "fc1_latent_proj")
        h = self.fc1_latent_proj(flat) if latent else flat
        h = run_experts(h, weights, experts, self.experts.up, self.experts.down, "relu2", self.intermediate)
        routed = (self.fc2_latent_proj(h) if latent else h).view_as(x)
        return routed + self.shared_experts(x)
