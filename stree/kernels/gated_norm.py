"""The norms of a decoding pass. The gated RMSNorm after the Mamba2 scan, in one launch: silu(z)
as a gate before the norm (mamba_ssm's norm_before_gate=False) or after it (Falcon-H1), the mean
square per group of ``group_size`` channels, the weight, fp32 arithmetic rounded once to y's dtype
(or, with ``round_before_weight``, rounded before the weight multiply as transformers' hybrids
compute it). And the plain RMSNorm every block and the final norm apply (:func:`rms_norm`).

Eager PyTorch spends four to eight launches on the gated norm per Mamba2 layer and token batch; on
CUDA this kernel spends one: a program per (row, group) holds the group in registers. On the CPU
both norms run numba-compiled under ``backend="auto"`` (:mod:`.cpu.norm_jit`) where nothing needs
their gradient and nothing is being compiled: one call each instead of PyTorch's several ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, as_numpy, check_tensor, f32, jit_takes, readable, resolve_backend

__all__ = ["gated_rms_norm", "gated_rms_norm_torch", "rms_norm"]

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
    if backend == "auto" and jit_takes(y, z, weight) and not (round_before_weight and y.dtype != torch.float32):
        _check_args(y, z, weight, group_size, eps)
        from .cpu.norm_jit import gated_rms_norm_rows

        rows = _rows(y, group_size)
        out = torch.empty(rows.shape, dtype=torch.float32)
        gate = F.silu(f32(z)).reshape(rows.shape)  # (one vectorised op; contiguous, as silu's output is)
        gated_rms_norm_rows(readable(rows), as_numpy(gate), readable(weight).reshape(-1, group_size), True, float(eps),
                            gate_first, as_numpy(out))
        return out.view(y.shape).to(y.dtype)
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


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` as contiguous rows of ``width`` channels (a copy only where its layout needs one)."""
    rows = x.reshape(-1, width)
    return rows if rows.is_contiguous() else rows.contiguous()


def rms_norm(x, weight=None, eps: float = 1e-6, backend: str = "auto"):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension of ``x [..., dim]``
    (``weight [dim]``, or None for none), in fp32 arithmetic, output in x's dtype. ``"auto"`` on
    CPU tensors runs numba-compiled (:mod:`.cpu.norm_jit`) where nothing needs its gradient; else
    (and ``"torch"``, ``"triton"``) ``F.rms_norm``, already one fused op on CUDA."""
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be a float32, float16 or bfloat16 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() < 1:
        raise ValueError(f"x must have shape [..., dim], got {tuple(x.shape)}")
    dim = x.shape[-1]
    if weight is not None:
        check_tensor("weight", weight, (dim,), x.device)
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps!r}")
    if backend == "auto" and jit_takes(x, weight):
        from .cpu.norm_jit import rms_norm_rows

        rows = _rows(x, dim)
        out = torch.empty(rows.shape, dtype=torch.float32)
        rms_norm_rows(readable(rows), readable(weight) if weight is not None else as_numpy(out[0]),
                      weight is not None, float(eps), as_numpy(out))
        return out.view(x.shape).to(x.dtype)
    resolve_backend(backend, x.device)
    return F.rms_norm(f32(x), (dim,), f32(weight), eps).to(x.dtype)
