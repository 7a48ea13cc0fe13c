"""Depthwise causal conv1d along each node's ancestor path (Mamba2's conv over xBC, on a tree).

Node i's window is its ``d_conv - 1`` nearest ancestors and itself, oldest first; slots above the
root come from ``conv_state`` (the raw inputs of the last ``d_conv`` committed positions, newest
last). Walking up from a node, positions are numbered: a node index ``>= 0``, then -1 for the
newest conv-state slot, -2 for the one before, ... so "position v" is row ``d_conv + v`` of the
sequence ``[conv_state columns; xBC rows]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tree import PackedTrees
from ._common import (as_numpy, check_layout, check_packed, check_tensor, check_tree, f32, identity_slots, jit_takes,
                      packed_strides, pool_rows, pow2_block, readable, resolve_backend, slot_rows, tree_span)

__all__ = ["tree_conv1d", "tree_conv1d_torch"]

ACTIVATIONS = (None, "silu")


@triton.jit
def _tree_conv1d_kernel(
    xbc_ptr, conv_ptr, slot_ptr, w_ptr, bias_ptr, par_ptr, cu_ptr, out_ptr,
    n, dim,
    s_x_b, s_x_n, s_x_d,
    s_c_b, s_c_d, s_c_k,
    s_w_d, s_w_k,
    s_o_b, s_o_n, s_o_d,
    s_tree_b,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, VARLEN: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_d = tl.program_id(2)
    start, n = tree_span(cu_ptr, b, n, VARLEN)  # packed trees: tree b's own nodes
    xbc_ptr += b * s_x_b + start * s_x_n
    out_ptr += b * s_o_b + start * s_o_n
    par_ptr += b * s_tree_b + start
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    n_ok = offs_n < n
    # the row's conv state is slot `slot[b]` of the pool (negative: a padding row, zeros)
    slot = tl.load(slot_ptr + b).to(tl.int64) + tl.zeros((BLOCK_D,), dtype=tl.int64)  # (a vector: a mask)
    d_ok = offs_d < dim
    state_ok = d_ok & (slot >= 0)
    conv_row = conv_ptr + tl.maximum(slot, 0) * s_c_b + offs_d * s_c_d

    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    pos = offs_n
    for k in tl.static_range(K):
        in_tree = pos >= 0
        ok_tree = (n_ok & in_tree)[:, None] & d_ok[None, :]
        ok_state = (n_ok & ~in_tree)[:, None] & state_ok[None, :]
        v = tl.load(xbc_ptr + tl.maximum(pos, 0)[:, None] * s_x_n + offs_d[None, :] * s_x_d,
                    mask=ok_tree, other=0.0).to(tl.float32)
        v += tl.load(conv_row[None, :] + (K + tl.minimum(pos, -1))[:, None] * s_c_k,
                     mask=ok_state, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_d * s_w_d + (K - 1 - k) * s_w_k, mask=d_ok, other=0.0).to(tl.float32)
        acc += v * w[None, :]
        if k < K - 1:
            up = tl.load(par_ptr + tl.maximum(pos, 0), mask=n_ok & in_tree, other=-1)
            pos = tl.where(in_tree, up, pos - 1)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + offs_n[:, None] * s_o_n + offs_d[None, :] * s_o_d,
             acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & d_ok[None, :])


def _check_args(xBC, parents, conv_state, weight, bias, activation, state_indices=None):
    batch, n, dim = check_layout("xBC", xBC, "batch, n, dim")
    device = xBC.device
    trees = check_packed("xBC", xBC, parents)
    if n == 0:
        raise ValueError("xBC has no nodes (n = 0)")
    if not isinstance(weight, torch.Tensor) or weight.dim() not in (2, 3):
        raise ValueError(f"weight must have shape [dim, d_conv] or [dim, 1, d_conv], got {getattr(weight, 'shape', type(weight))}")
    if weight.dim() == 3:
        check_tensor("weight", weight, (dim, 1, weight.shape[-1]), device)
        weight = weight[:, 0]
    d_conv = weight.shape[-1]
    check_tensor("weight", weight, (dim, d_conv), device)
    if d_conv < 1:
        raise ValueError("weight must have d_conv >= 1 taps")
    rows = pool_rows("conv_state", conv_state, "slots, dim, d_conv", state_indices, trees or batch, device)
    check_tensor("conv_state", conv_state, (rows, dim, d_conv), device)
    if bias is not None:
        check_tensor("bias", bias, (dim,), device)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return (parents if trees is not None else check_tree(parents, batch, n, device)), weight


def window_positions(parents_rows: torch.Tensor, d_conv: int) -> torch.Tensor:
    """``[rows, n]`` parents -> ``[rows, n, d_conv]`` positions (see module docstring), oldest first."""
    pos = torch.arange(parents_rows.shape[1], device=parents_rows.device).expand_as(parents_rows)
    steps = [pos]
    for _ in range(d_conv - 1):
        up = torch.gather(parents_rows, 1, pos.clamp(min=0))
        pos = torch.where(pos >= 0, up, pos - 1)
        steps.append(pos)
    return torch.stack(steps[::-1], dim=-1)


def tree_conv1d_torch(xBC, parents, conv_state, weight, bias=None, activation="silu"):
    """Gather each node's window from ``[conv_state; xBC]`` and apply the taps, in fp32; a chain
    (a prefill) is the plain causal depthwise conv over its window rows (gathered, a 256-token
    chain's windows at batch 16 took most of a prefill's time), except under ``torch.compile``:
    there Inductor fuses the gather, the taps and the SiLU into the loops around them, where the
    conv is an extern oneDNN call between transposes, and a compiled pass of a 2-node tree (always
    a chain) cost more than one of an 8-node tree (docs/kernels.md)."""
    index, weight = _check_args(xBC, parents, conv_state, weight, bias, activation)
    batch, n, dim = xBC.shape
    d_conv = weight.shape[-1]
    # Window rows of [conv_state; xBC], the same for every layer of a pass: made once per tree, eager
    # for a chain too (a compiled pass reads them as a constant: made while tracing, they would fail
    # the graph's guard on its next call and compile it again; runtime.compiled's warm pass is eager).
    pos = index.memo(("conv_window", d_conv), lambda: window_positions(index.parents.long(), d_conv) + d_conv)
    # node i's window: rows i + 1 .. i + d_conv of [conv_state; xBC]
    if not torch.compiler.is_compiling() and index.is_chain():
        seq = torch.cat([f32(conv_state)[:, :, 1:], f32(xBC).transpose(1, 2)], dim=2)  # [b, dim, K - 1 + n]
        out = torch.nn.functional.conv1d(seq, f32(weight)[:, None], None if bias is None else f32(bias), groups=dim)
        out = out.transpose(1, 2).contiguous()
        if activation == "silu":
            out = torch.nn.functional.silu(out, inplace=not torch.is_grad_enabled())
        return out.to(xBC.dtype)
    seq = torch.cat([f32(conv_state).transpose(1, 2), f32(xBC)], dim=1)  # [b, K + n, dim]
    if pos.shape[0] == 1:
        windows = seq.index_select(1, pos.view(-1)).view(batch, n, d_conv, dim)
    else:
        windows = seq[torch.arange(batch, device=seq.device)[:, None, None], pos]
    out = (windows * f32(weight).t()).sum(2)  # a product and a sum: several times faster than einsum on CPU
    if bias is not None:
        out = out + f32(bias)
    if activation == "silu":
        out = torch.nn.functional.silu(out)
    return out if out.dtype == xBC.dtype else out.to(xBC.dtype)


def tree_conv1d(xBC, parents, conv_state, weight, bias=None, activation="silu", state_indices=None,
                backend="auto"):
    """Causal depthwise conv of every tree node over its ancestor path; ``conv_state`` is read only.

    xBC ``[b, n, dim]`` raw inputs; conv_state ``[b, dim, d_conv]``; weight ``[dim, d_conv]`` (or
    nn.Conv1d's ``[dim, 1, d_conv]``), tap ``d_conv - 1`` multiplies the node itself; bias ``[dim]``;
    activation ``"silu"`` or None. Returns ``[b, n, dim]`` in xBC's dtype. ``state_indices [b]``
    (int): conv_state is a pool ``[slots, dim, d_conv]`` and row b reads slot ``state_indices[b]``
    (negative: a padding row, zeros above its root). ``parents`` a :class:`~stree.tree.PackedTrees`
    of b trees: xBC holds their nodes back to back, ``[1, total, dim]``, tree b reading conv state
    row (or slot) b. ``"auto"`` on CPU tensors (outside autograd and ``torch.compile``) runs
    numba-compiled (:mod:`.tree_jit`), at any size: a node's work is its d_conv taps.
    """
    check_layout("xBC", xBC, "batch, n, dim")
    if isinstance(parents, PackedTrees) and resolve_backend(backend, xBC.device) == "torch":
        _check_args(xBC, parents, conv_state, weight, bias, activation, state_indices)
        return parents.pack(tree_conv1d(parents.unpack(xBC), parents.padded, conv_state, weight, bias, activation,
                                        state_indices=state_indices, backend=backend))
    if state_indices is not None and resolve_backend(backend, xBC.device) == "torch":
        _check_args(xBC, parents, conv_state, weight, bias, activation, state_indices)
        return tree_conv1d(xBC, parents, slot_rows(conv_state, state_indices), weight, bias, activation,
                           backend=backend)
    if backend == "auto" and jit_takes(xBC, conv_state, weight, bias):  # (any size: d_conv taps a node)
        from .cpu.tree_jit import tree_conv_rows

        index, taps = _check_args(xBC, parents, conv_state, weight, bias, activation)
        out = torch.empty(xBC.shape, dtype=torch.float32)
        tree_conv_rows(readable(xBC), as_numpy(index.parents), readable(conv_state),
                       readable(weight).reshape(taps.shape), readable(bias if bias is not None else taps[:, 0]),
                       bias is not None, as_numpy(out))
        out = torch.nn.functional.silu(out, inplace=True) if activation == "silu" else out
        return out.to(xBC.dtype)
    if resolve_backend(backend, xBC.device) == "torch":
        return tree_conv1d_torch(xBC, parents, conv_state, weight, bias, activation)
    index, weight = _check_args(xBC, parents, conv_state, weight, bias, activation, state_indices)
    packed = isinstance(index, PackedTrees)
    batch, n, dim = (index.batch, index.max_n, xBC.shape[2]) if packed else xBC.shape
    strides = packed_strides if packed else torch.Tensor.stride
    out = torch.empty_like(xBC)
    slots = identity_slots(batch, xBC.device) if state_indices is None else state_indices
    block_n = min(pow2_block(n), 16)
    block_d = 128
    grid = (batch, triton.cdiv(n, block_n), triton.cdiv(dim, block_d))
    _tree_conv1d_kernel[grid](
        xBC, conv_state, slots, weight, bias if bias is not None else weight, index.parents,
        index.cu_seqlens if packed else slots, out,
        n, dim, *strides(xBC), *conv_state.stride(), *weight.stride(), *strides(out),
        0 if packed else index.row_stride(),
        K=weight.shape[-1], HAS_BIAS=bias is not None, SILU=activation == "silu", VARLEN=packed,
        BLOCK_N=block_n, BLOCK_D=block_d,
    )
    return out
