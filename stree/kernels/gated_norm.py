"""The gated RMSNorm after the Mamba2 scan, in one launch: silu(z) as a gate before the norm
(mamba_ssm's norm_before_gate=False) or after it (Falcon-H1), the mean square per group of
``group_size`` channels, the weight, fp32 arithmetic rounded once to y's dtype (or, with
``round_before_weight``, rounded before the weight multiply as transformers' hybrids compute it).

Eager PyTorch spends four to eight launches on it per Mamba2 layer and token batch; on CUDA this
kernel spends one: a program per (row, group) holds the group in registers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_tensor, resolve_backend

__all__ = ["gated_rms_norm", "gated_rms_norm_torch"]

MAX_GROUP = 16384  # channels one program holds (Bamba-9B's one group is 8192)


@triton.jit
def _gated_rms_norm_kernel(
    y_ptr, z_ptr, w_ptr, out_ptr, group_size, eps,
    s_y_m, s_z_m, s_o_m,
    GATE_FIRST: tl.constexpr, ROUNDED: tl.constexpr, BLOCK: tl.constexpr,
):
    m = tl.program_id(0)
    offs = tl.program_id(1) * group_size + tl.arange(0, BLOCK)
    ok = tl.arange(0, BLOCK) < group_size
    v = tl.load(y_ptr + m * s_y_m + offs, mask=ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + m * s_z_m + offs, mask=ok, other=0.0).to(tl.float32)
    gate = z * tl.sigmoid(z)
    if GATE_FIRST:
        v = v * gate
    v = v * tl.rsqrt(tl.sum(v * v, axis=0) / group_size + eps)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    if not ROUNDED:
        v = v * w.to(tl.float32)
    if not GATE_FIRST:
        v = v * gate
    if ROUNDED:  # round, then the weight multiply in the output dtype (computed in fp32, rounded)
        v = v.to(out_ptr.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + m * s_o_m + offs, v.to(out_ptr.dtype.element_ty), mask=ok)


def _check_args(y, z, weight, group_size, eps):
    if not isinstance(y, torch.Tensor) or y.dtype not in FLOAT_DTYPES:
        raise TypeError(f"y must be a float32, float16 or bfloat16 tensor, got {getattr(y, 'dtype', type(y))}")
    if y.dim() < 1:
        raise ValueError(f"y must have shape [..., dim], got {tuple(y.shape)}")
    dim = y.shape[-1]
    check_tensor("z", z, y.shape, y.device)
    check_tensor("weight", weight, (dim,), y.device)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or dim % group_size:
        raise ValueError(f"group_size must be a positive int dividing dim = {dim}, got {group_size!r}")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps!r}")


def gated_rms_norm_torch(y, z, weight, group_size: int, eps: float, gate_first: bool = True,
                       round_before_weight: bool = False, sum_squares=None):
    """The PyTorch path: F.rms_norm per group. ``sum_squares``: applied to each group's sum of
    squares (a tensor-parallel model's all-reduce, where one group of ``group_size`` channels
    spans the ranks and ``y`` holds this rank's part of it)."""
    _check_args(y, z, weight, min(group_size, y.shape[-1]), eps)
    gate = F.silu(z.float()) if z.dtype != torch.float32 else F.silu(z)
    v = y.float() if y.dtype != torch.float32 else y
    if gate_first:
        v = v * gate
    rounded = round_before_weight and y.dtype != torch.float32
    w = None if rounded else (weight if weight.dtype == torch.float32 else weight.float())
    if sum_squares is not None:
        v = v * torch.rsqrt(sum_squares(v.square().sum(-1, keepdim=True)) / group_size + eps)
        v = v if w is None else v * w
    elif group_size == v.shape[-1]:
        v = F.rms_norm(v, v.shape[-1:], w, eps)
    else:
        v = F.rms_norm(v.unflatten(-1, (-1, group_size)), (group_size,), None, eps).flatten(-2)
        v = v if w is None else v * w
    if not gate_first:
        v = v * gate
    if rounded:
        return weight * v.to(y.dtype)
    return v if y.dtype == torch.float32 else v.to(y.dtype)


def gated_rms_norm(y, z, weight, group_size: int, eps: float, gate_first: bool = True,
                   round_before_weight: bool = False, backend: str = "auto"):
    """``norm(y * silu(z)) * weight`` per group of ``group_size`` channels (``gate_first=False``:
    ``norm(y) * weight * silu(z)``) for ``y, z [..., dim]``, ``weight [dim]``; output in y's
    dtype. ``backend``: "auto" (Triton on CUDA), "triton", "torch"."""
    if resolve_backend(backend, y.device) == "torch" or group_size > MAX_GROUP:
        return gated_rms_norm_torch(y, z, weight, group_size, eps, gate_first, round_before_weight)
    _check_args(y, z, weight, group_size, eps)
    dim = y.shape[-1]
    y2, z2 = y.reshape(-1, dim), z.reshape(-1, dim)
    if y2.stride(-1) != 1:
        y2 = y2.contiguous()
    if z2.stride(-1) != 1:
        z2 = z2.contiguous()
    out = torch.empty(y2.shape, dtype=y.dtype, device=y.device)
    rows = y2.shape[0]
    if rows:
        block = triton.next_power_of_2(group_size)
        _gated_rms_norm_kernel[(rows, dim // group_size)](
            y2, z2, weight.contiguous(), out, group_size, float(eps), y2.stride(0), z2.stride(0), out.stride(0),
            GATE_FIRST=gate_first, ROUNDED=round_before_weight and y.dtype != torch.float32, BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
        )
    return out.view(y.shape)
