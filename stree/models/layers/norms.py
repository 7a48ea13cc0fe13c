"""The norms the families share: RMSNorm in fp32 arithmetic (rounding before or after the weight,
as each reference does), the gated RMSNorm of the Mamba2 mixer norm(y * silu(z)) per group (one
Triton launch on CUDA), and the plain SiLU gate of mixers without a norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import gated_rms_norm, gated_rms_norm_torch, rms_norm
from ...kernels._common import FLOAT_DTYPES
from ...kernels.cpu.bound import RMSNormJit
from ..base import derived, value_key


def fp32(param: torch.Tensor) -> torch.Tensor:
    """``param`` in fp32, converted once per value of the parameter (not once per call)."""
    if param.dtype == torch.float32:
        return param
    return derived(param, "fp32", lambda: param.float())


class RMSNorm(nn.Module):
    """fp32 arithmetic (numba-compiled on the CPU, :func:`~stree.kernels.rms_norm`).
    ``round_before_weight``: HF LlamaRMSNorm rounds to the output dtype before the weight multiply;
    mamba_ssm's Triton norm multiplies in fp32 and rounds once."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None, round_before_weight: bool = False):
        super().__init__()
        self.eps = eps
        self.round_before_weight = round_before_weight
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        xf = x if x.dtype == torch.float32 else x.float()
        bound = self.bound(xf, out_dtype)
        if bound is not None:
            y = bound(xf)
            return y if out_dtype == torch.float32 else y.to(out_dtype)
        if self.round_before_weight and out_dtype != torch.float32:
            return self.weight * rms_norm(xf, None, self.eps).to(out_dtype)
        y = rms_norm(xf, fp32(self.weight), self.eps)
        return y if out_dtype == torch.float32 else y.to(out_dtype)

    def bound(self, x: torch.Tensor, out_dtype: torch.dtype) -> RMSNormJit | None:
        """The numba kernel bound to the weight (:class:`~stree.kernels.cpu.bound.RMSNormJit`: the
        public kernel's result without its per-call checks), where a decoding pass may call it
        directly: CPU float32 in and a float32 or half weight (bound widened: a half model's), no
        gradient, no graph being compiled, and no rounding before the weight into a half output;
        else None. The caller rounds its float32 output to ``out_dtype``, as the public path does."""
        if (x.dtype != torch.float32 or not x.is_cpu or torch.is_grad_enabled() or torch.compiler.is_compiling()
                or (self.round_before_weight and out_dtype != torch.float32)):
            return None
        weight = self._parameters.get("weight")  # (cheaper than the attribute: a norm per block and step)
        return derived(self, "bound", self._bind, key=(value_key(self.weight if weight is None else weight), self.eps))

    def _bind(self) -> RMSNormJit | None:
        weight = self.weight
        ok = weight.is_cpu and weight.dtype in FLOAT_DTYPES
        return RMSNormJit(weight.float(), self.eps) if ok else None  # (exact; itself where it is float32)


class GatedRMSNorm(RMSNorm):
    """norm(y * silu(z)) per group of ``group_size`` channels (mamba_ssm, norm_before_gate=False);
    ``gate_first=False``: norm(y) * silu(z) (Falcon-H1's mamba_norm_before_gate). One Triton launch
    on CUDA (:func:`~stree.kernels.gated_rms_norm`). ``tp``: the ranks one group spans (a
    tensor-parallel model of one group; set by its plan), over which the mean square is summed."""

    tp = None

    def __init__(self, dim: int, group_size: int, eps: float, device=None, dtype=None,
                 round_before_weight: bool = False, gate_first: bool = True):
        super().__init__(dim, eps, device, dtype, round_before_weight)
        self.group_size, self.gate_first = group_size, gate_first

    def forward(self, y: torch.Tensor, z: torch.Tensor, backend: str = "auto") -> torch.Tensor:
        weight = self.weight if self.round_before_weight and y.dtype != torch.float32 else fp32(self.weight)
        if self.tp is not None:
            return gated_rms_norm_torch(y, z, weight, self.group_size, self.eps, self.gate_first,
                                      self.round_before_weight, sum_squares=self.tp.all_reduce)
        return gated_rms_norm(y, z, weight, self.group_size, self.eps, self.gate_first, self.round_before_weight,
                              backend=backend)


class SiluGate(nn.Module):
    """y * silu(z) without a norm (Falcon-H1's mamba_rms_norm=False), in fp32, rounded once."""

    def forward(self, y: torch.Tensor, z: torch.Tensor, backend: str = "auto") -> torch.Tensor:
        if y.dtype == torch.float32:
            return y * F.silu(z.float())
        return (y.float() * F.silu(z.float())).to(y.dtype)
