"""The depthwise causal conv of one new token per row (the decode step), conv state advanced in
place: the state's columns shift left by one, the new raw input enters as the newest column, and
the output is the taps applied to that window (plus bias, then the activation)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import (as_numpy, check_layout, check_tensor, f32, identity_slots, jit_fits, pool_rows, put_slot_rows,
                      readable, resolve_backend, slot_rows)

__all__ = ["conv_step", "conv_step_torch"]

ACTIVATIONS = (None, "silu")


@triton.jit
def _conv_step_kernel(
    x_ptr, conv_ptr, slot_ptr, w_ptr, bias_ptr, out_ptr, dim,
    s_x_b, s_x_d, s_c_b, s_c_d, s_c_k, s_w_d, s_w_k, s_o_b, s_o_d,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < dim
    # the row's state is slot `slot[b]` (negative: a padding row, a zero state neither read nor written)
    slot = tl.load(slot_ptr + b).to(tl.int64) + tl.zeros((BLOCK_D,), dtype=tl.int64)  # (a vector: a mask)
    s_ok = d_ok & (slot >= 0)
    state = conv_ptr + tl.maximum(slot, 0) * s_c_b + offs_d * s_c_d
    x = tl.load(x_ptr + b * s_x_b + offs_d * s_x_d, mask=d_ok, other=0.0)
    acc = x.to(tl.float32) * tl.load(w_ptr + offs_d * s_w_d + (K - 1) * s_w_k, mask=d_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    # Column k + 1 moves to column k after it is read; this program owns its channels, so the
    # in-place shift races with nobody.
    for k in tl.static_range(K - 1):
        v = tl.load(state + (k + 1) * s_c_k, mask=s_ok, other=0.0)
        acc += v.to(tl.float32) * tl.load(w_ptr + offs_d * s_w_d + k * s_w_k, mask=d_ok, other=0.0).to(tl.float32)
        tl.store(state + k * s_c_k, v, mask=s_ok)
    tl.store(state + (K - 1) * s_c_k, x.to(conv_ptr.dtype.element_ty), mask=s_ok)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + b * s_o_b + offs_d * s_o_d, acc.to(out_ptr.dtype.element_ty), mask=d_ok)


def _check_args(x, conv_state, weight, bias, activation, state_indices=None):
    batch, dim = check_layout("x", x, "batch, dim")
    device = x.device
    if not isinstance(weight, torch.Tensor) or weight.dim() not in (2, 3):
        raise ValueError(f"weight must have shape [dim, d_conv] or [dim, 1, d_conv], got {getattr(weight, 'shape', type(weight))}")
    d_conv = weight.shape[-1]
    check_tensor("weight", weight, (dim, 1, d_conv) if weight.dim() == 3 else (dim, d_conv), device)
    rows = pool_rows("conv_state", conv_state, "slots, dim, d_conv", state_indices, batch, device)
    check_tensor("conv_state", conv_state, (rows, dim, d_conv), device)
    if bias is not None:
        check_tensor("bias", bias, (dim,), device)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return weight.view(dim, d_conv)


def conv_step_torch(x, conv_state, weight, bias=None, activation="silu"):
    """The window as one tensor, times the taps, summed (in fp32). Under ``torch.compile`` Inductor
    fuses these into one loop with what reads the output; a batched product over the channels
    (one op, as a grouped conv1d would be) is a call of its own there, and its ``[dim, b]`` output
    left the loops after it (the step's state update, its norm) reading strided, mostly one
    element at a time. Eager on the CPU the product measured the slower too (docs/benchmarks.md)."""
    weight = _check_args(x, conv_state, weight, bias, activation)
    window = torch.cat([conv_state[..., 1:], x[..., None].to(conv_state.dtype)], dim=-1)
    conv_state.copy_(window)
    out = (f32(window) * f32(weight)).sum(-1)  # [b, dim, K] * [dim, K] -> [b, dim]
    if bias is not None:
        out = out + f32(bias)
    if activation == "silu":
        out = F.silu(out)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def conv_step(x, conv_state, weight, bias=None, activation="silu", state_indices=None, backend="auto"):
    """Conv output ``[b, dim]`` for the new raw inputs ``x [b, dim]``; ``conv_state [b, dim, d_conv]``
    (newest last) is advanced in place. weight ``[dim, d_conv]`` or ``[dim, 1, d_conv]``, bias
    ``[dim]``, activation ``"silu"`` or None; fp32 arithmetic, output in x's dtype.
    ``state_indices [b]`` (int): conv_state is a pool ``[slots, dim, d_conv]``, row b's state slot
    ``state_indices[b]`` (negative: a padding row, whose output comes from a zero state and whose
    slot is none). ``"auto"`` on CPU tensors runs numba-compiled (:mod:`.step_jit`)."""
    check_layout("x", x, "batch, dim")
    if state_indices is not None and resolve_backend(backend, x.device) == "torch":
        _check_args(x, conv_state, weight, bias, activation, state_indices)
        rows = slot_rows(conv_state, state_indices)
        out = conv_step(x, rows, weight, bias, activation, backend=backend)
        put_slot_rows(conv_state, state_indices, rows)
        return out
    if backend == "auto" and jit_fits(x, conv_state, weight, bias):
        from .cpu.step_jit import conv_step_rows

        taps = _check_args(x, conv_state, weight, bias, activation)
        state = f32(conv_state)  # a half state advances in a float32 copy, copied back (exact: a shift)
        out = torch.empty(x.shape, dtype=torch.float32)
        conv_step_rows(readable(x), as_numpy(state), readable(weight).reshape(taps.shape),
                       readable(bias if bias is not None else taps[:, 0]), bias is not None, activation == "silu",
                       as_numpy(out))
        if state is not conv_state:
            conv_state.copy_(state)
        return out.to(x.dtype)
    if resolve_backend(backend, x.device) == "torch":
        return conv_step_torch(x, conv_state, weight, bias, activation)
    weight = _check_args(x, conv_state, weight, bias, activation, state_indices)
    batch, dim = x.shape
    out = torch.empty_like(x)
    slots = identity_slots(batch, x.device) if state_indices is None else state_indices
    block_d = 256
    _conv_step_kernel[(batch, triton.cdiv(dim, block_d))](
        x, conv_state, slots, weight, bias if bias is not None else weight, out, dim,
        *x.stride(), *conv_state.stride(), *weight.stride(), *out.stride(),
        K=weight.shape[-1], HAS_BIAS=bias is not None, SILU=activation == "silu", BLOCK_D=block_d,
    )
    return out
