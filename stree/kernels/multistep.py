"""Fused multi-step selective state update: T recurrence steps with the state kept on chip.

Per head h and step t::

    h_t = exp(dt_t A_h) h_{t-1} + dt_t x_t B_t^T        y_t = C_t . h_t + D x_t

Used for chains (vanilla speculative decoding), unrolled tree paths (the baseline STree beats)
and the single autoregressive step (T = 1). The same program, reading the steps through an index
table with a per-row length and writing no outputs, is the SSM half of activation replay.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    INF,
    as_numpy,
    check_dt_limit,
    check_groups,
    check_layout,
    check_ssm_params,
    check_tensor,
    f32,
    heads_view,
    identity_slots,
    jit_fits,
    jit_takes,
    pool_rows,
    pow2_block,
    process_dt,
    process_dt_tl,
    put_slot_rows,
    readable,
    resolve_backend,
    slot_rows,
)

__all__ = ["multistep_update", "multistep_update_torch", "selective_state_update", "selective_state_update_torch"]


@triton.jit
def ssm_recurrence_program(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, y_ptr, out_ptr, idx_ptr, len_ptr,
    b, h, pid_p, T, headdim, dstate, heads_per_group, dt_lo, dt_hi,
    s_st_b, s_st_h, s_st_p, s_st_s,
    s_x_b, s_x_t, s_x_h, s_x_p,
    s_dt_b, s_dt_t, s_dt_h,
    s_B_b, s_B_t, s_B_g, s_B_s,
    s_C_b, s_C_t, s_C_g, s_C_s,
    s_D_h, s_D_p,
    s_y_b, s_y_t, s_y_h, s_y_p,
    s_out_b, s_out_h, s_out_p, s_out_s,
    s_idx_b, s_idx_t,
    HAS_INDEX: tl.constexpr, HAS_Y: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Steps t < length(b) of the recurrence for head h, channels of block pid_p; step t reads
    position ``idx[b, t]`` (or t). Shared by the multistep launch and the all-layer replay."""
    g = h // heads_per_group
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_s = tl.arange(0, BLOCK_S)
    p_ok = offs_p < headdim
    s_ok = offs_s < dstate
    ps_ok = p_ok[:, None] & s_ok[None, :]

    state = tl.load(state_ptr + b * s_st_b + h * s_st_h + offs_p[:, None] * s_st_p + offs_s[None, :] * s_st_s,
                    mask=ps_ok, other=0.0).to(tl.float32)
    A = tl.load(A_ptr + h).to(tl.float32)
    bias = 0.0
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    if HAS_D:
        D = tl.load(D_ptr + h * s_D_h + offs_p * s_D_p, mask=p_ok, other=0.0).to(tl.float32)
    length = T
    if HAS_INDEX:
        length = tl.load(len_ptr + b)

    for t in range(0, length):
        pos = t
        if HAS_INDEX:
            pos = tl.load(idx_ptr + b * s_idx_b + t * s_idx_t)
        x_t = tl.load(x_ptr + b * s_x_b + pos * s_x_t + h * s_x_h + offs_p * s_x_p, mask=p_ok, other=0.0).to(tl.float32)
        dt_t = tl.load(dt_ptr + b * s_dt_b + pos * s_dt_t + h * s_dt_h).to(tl.float32)
        dt_t = process_dt_tl(dt_t, bias, DT_SOFTPLUS, dt_lo, dt_hi)
        B_t = tl.load(B_ptr + b * s_B_b + pos * s_B_t + g * s_B_g + offs_s * s_B_s, mask=s_ok, other=0.0).to(tl.float32)
        state = state * tl.exp(dt_t * A) + (dt_t * x_t)[:, None] * B_t[None, :]
        if HAS_Y:
            C_t = tl.load(C_ptr + b * s_C_b + pos * s_C_t + g * s_C_g + offs_s * s_C_s, mask=s_ok, other=0.0).to(tl.float32)
            y_t = tl.sum(state * C_t[None, :], axis=1)
            if HAS_D:
                y_t += D * x_t
            tl.store(y_ptr + b * s_y_b + t * s_y_t + h * s_y_h + offs_p * s_y_p, y_t.to(y_ptr.dtype.element_ty), mask=p_ok)

    tl.store(out_ptr + b * s_out_b + h * s_out_h + offs_p[:, None] * s_out_p + offs_s[None, :] * s_out_s,
             state, mask=ps_ok)


@triton.jit
def ssm_recurrence_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, y_ptr, out_ptr, slot_ptr,
    T, nheads, headdim, dstate, heads_per_group, dt_lo, dt_hi,
    s_st_b, s_st_h, s_st_p, s_st_s,
    s_x_b, s_x_t, s_x_h, s_x_p,
    s_dt_b, s_dt_t, s_dt_h,
    s_B_b, s_B_t, s_B_g, s_B_s,
    s_C_b, s_C_t, s_C_g, s_C_s,
    s_D_h, s_D_p,
    s_y_b, s_y_t, s_y_h, s_y_p,
    s_out_b, s_out_h, s_out_p, s_out_s,
    HAS_Y: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """T recurrence steps per (row, head) from ``state``; outputs y and the final state. Row b's
    state (and final state) is slot ``slot[b]`` of theirs (b where the caller has no pool); a
    negative slot is a padding row, left alone."""
    pid_bh = tl.program_id(0)
    b = pid_bh // nheads
    slot = tl.load(slot_ptr + b).to(tl.int64)
    if slot >= 0:
        # (the program indexes states by b: the slot's offset moves the bases instead)
        ssm_recurrence_program(
            state_ptr + (slot - b) * s_st_b, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, y_ptr,
            out_ptr + (slot - b) * s_out_b, state_ptr, state_ptr,
            b, pid_bh % nheads, tl.program_id(1), T, headdim, dstate, heads_per_group, dt_lo, dt_hi,
            s_st_b, s_st_h, s_st_p, s_st_s, s_x_b, s_x_t, s_x_h, s_x_p, s_dt_b, s_dt_t, s_dt_h,
            s_B_b, s_B_t, s_B_g, s_B_s, s_C_b, s_C_t, s_C_g, s_C_s, s_D_h, s_D_p, s_y_b, s_y_t, s_y_h, s_y_p,
            s_out_b, s_out_h, s_out_p, s_out_s, 0, 0,
            False, HAS_Y, HAS_D, HAS_DT_BIAS, DT_SOFTPLUS, BLOCK_P, BLOCK_S,
        )


def recurrence_block_p(headdim: int) -> int:
    return min(pow2_block(headdim), 32)


def launch_ssm_recurrence(state, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, y, out=None, slots=None):
    """Launch :func:`ssm_recurrence_kernel`; returns the new fp32 state, written to ``out`` (which
    may be ``state`` itself: every program reads its block of the state before writing it).
    ``slots``: state (and out) are pools, row b's slot ``slots[b]`` (see the kernel)."""
    batch, (nheads, headdim, dstate) = x.shape[0], state.shape[1:]
    ngroups = B.shape[2]
    if out is None:
        out = torch.empty(batch, nheads, headdim, dstate, dtype=torch.float32, device=state.device)
    block_p = recurrence_block_p(headdim)
    grid = (batch * nheads, triton.cdiv(headdim, block_p))
    dummy = state
    ssm_recurrence_kernel[grid](
        state, x, dt, A, B, C if C is not None else dummy, D if D is not None else dummy,
        dt_bias if dt_bias is not None else dummy, y if y is not None else dummy, out,
        identity_slots(batch, x.device) if slots is None else slots,
        x.shape[1], nheads, headdim, dstate, nheads // ngroups, dt_limit[0], dt_limit[1],
        *state.stride(), *x.stride(), *dt.stride(), *B.stride(),
        *(C.stride() if C is not None else (0, 0, 0, 0)), *(D.stride() if D is not None else (0, 0)),
        *(y.stride() if y is not None else (0, 0, 0, 0)), *out.stride(),
        HAS_Y=y is not None, HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=bool(dt_softplus), BLOCK_P=block_p, BLOCK_S=pow2_block(dstate),
    )
    return out


def ssm_recurrence_torch(state, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, lengths=None):
    """The recurrence step by step in fp32; rows stop advancing after ``lengths[b]`` steps."""
    nheads = x.shape[2]
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)  # [b, T, h]
    decay = torch.exp(dt * A.float())
    Bh = heads_view(B.float(), nheads)
    Ch = heads_view(C.float(), nheads) if C is not None else None
    xf = x.float()
    h = state.float().clone()
    ys = []
    for t in range(x.shape[1]):
        new = h * decay[:, t, :, None, None] + (dt[:, t, :, None] * xf[:, t])[..., None] * Bh[:, t, :, None, :]
        h = new if lengths is None else torch.where((t < lengths).view(-1, 1, 1, 1), new, h)
        if Ch is not None:
            y = torch.einsum("bhps,bhs->bhp", h, Ch[:, t])
            ys.append(y + xf[:, t] * D.float() if D is not None else y)
    y = torch.stack(ys, dim=1).to(x.dtype) if ys else None
    return y, h


def _check_args(state, x, dt, A, B, C, D, dt_bias, dt_limit):
    batch, T, nheads, headdim = check_layout("x", x, "batch, T, nheads, headdim")
    device = x.device
    if T == 0:
        raise ValueError("x has no steps (T = 0)")
    ngroups, dstate = check_layout("B", B, "batch, T, ngroups, dstate")[2:]
    check_tensor("state", state, (batch, nheads, headdim, dstate), device, dtype=torch.float32)
    check_tensor("dt", dt, (batch, T, nheads), device)
    check_tensor("B", B, (batch, T, ngroups, dstate), device, dtype=x.dtype)
    check_tensor("C", C, (batch, T, ngroups, dstate), device, dtype=x.dtype)
    check_groups(nheads, ngroups)
    D = check_ssm_params(nheads, headdim, device, A, D, dt_bias)
    return D, check_dt_limit(dt_limit)


def multistep_update_torch(state, x, dt, A, B, C, *, D=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, INF)):
    D, dt_limit = _check_args(state, x, dt, A, B, C, D, dt_bias, dt_limit)
    return ssm_recurrence_torch(state, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit)


def multistep_update(state, x, dt, A, B, C, *, D=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, INF),
                     backend="auto"):
    """T fused recurrence steps from ``state``; returns ``(y, final_state)``.

    state ``[b, h, p, s]`` fp32 (not modified); x ``[b, T, h, p]``; dt ``[b, T, h]`` raw; A ``[h]``;
    B, C ``[b, T, g, s]`` in x's dtype; D ``[h]`` or ``[h, p]``; dt_bias ``[h]``.
    y ``[b, T, h, p]`` is in x's dtype, final_state ``[b, h, p, s]`` fp32. ``"auto"`` on CPU
    tensors (outside autograd and ``torch.compile``) runs numba-compiled: the chain kernel of
    :mod:`.cpu.tree_jit` (a chain draft verified under ``method="chain"``; the PyTorch path's
    steps one by one, a dozen small ops each, had made a 16-node chain's iteration cost three
    times a tree's).
    """
    check_layout("x", x, "batch, T, nheads, headdim")
    if backend == "auto" and jit_takes(state, x, dt, A, B, C, D, dt_bias):
        from .cpu.tree_jit import chain_scan_rows
        from .tree_scan import jit_scan

        D, (lo, hi) = _check_args(state, x, dt, A, B, C, D, dt_bias, dt_limit)
        final = torch.empty(state.shape, dtype=torch.float32)
        y = jit_scan(chain_scan_rows, x, dt, A, B, C, D, dt_bias, dt_softplus, lo, hi, state, final=final)
        return y, final
    if resolve_backend(backend, x.device) == "torch":
        return multistep_update_torch(state, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                    dt_limit=dt_limit)
    D, dt_limit = _check_args(state, x, dt, A, B, C, D, dt_bias, dt_limit)
    y = torch.empty_like(x)
    final = launch_ssm_recurrence(state, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, y)
    return y, final


def _check_step_args(state, x, dt, A, B, C, D, dt_bias, dt_limit, state_indices=None):
    batch, nheads, headdim = check_layout("x", x, "batch, nheads, headdim")
    device = x.device
    ngroups, dstate = check_layout("B", B, "batch, ngroups, dstate")[1:]
    rows = pool_rows("state", state, "slots, nheads, headdim, dstate", state_indices, batch, device)
    check_tensor("state", state, (rows, nheads, headdim, dstate), device, dtype=torch.float32)
    if not state.is_contiguous():
        raise ValueError("state must be contiguous: it is updated in place")
    check_tensor("dt", dt, (batch, nheads), device)
    check_tensor("B", B, (batch, ngroups, dstate), device, dtype=x.dtype)
    check_tensor("C", C, (batch, ngroups, dstate), device, dtype=x.dtype)
    check_groups(nheads, ngroups)
    D = check_ssm_params(nheads, headdim, device, A, D, dt_bias)
    return D, check_dt_limit(dt_limit)


def selective_state_update_torch(state, x, dt, A, B, C, *, D=None, dt_bias=None, dt_softplus=True,
                               dt_limit=(0.0, INF)):
    """One step for all heads at once, the state updated in place: heads are grouped as
    ``[g, h / g]`` so B and C broadcast over their group's heads instead of being repeated."""
    D, dt_limit = _check_step_args(state, x, dt, A, B, C, D, dt_bias, dt_limit)
    batch, nheads, headdim, dstate = state.shape
    g = B.shape[1]
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit).view(batch, g, nheads // g)
    xg = f32(x).view(batch, g, nheads // g, headdim)
    st = state.view(batch, g, nheads // g, headdim, dstate)
    st.mul_(torch.exp(dt * f32(A).view(g, -1))[..., None, None])
    st.add_(torch.einsum("bgr,bgrp,bgs->bgrps", dt, xg, f32(B)))
    y = torch.einsum("bgrps,bgs->bgrp", st, f32(C)).view(batch, nheads, headdim)
    if D is not None:
        y = torch.addcmul(y, f32(x), f32(D))
    return y if y.dtype == x.dtype else y.to(x.dtype)


def selective_state_update(state, x, dt, A, B, C, *, D=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, INF),
                           state_indices=None, backend="auto"):
    """One recurrence step (the autoregressive decode step), ``state`` advanced in place; returns y.

    state ``[b, h, p, s]`` fp32; x ``[b, h, p]``; dt ``[b, h]`` raw; A ``[h]``; B, C ``[b, g, s]`` in
    x's dtype; D ``[h]`` or ``[h, p]``; dt_bias ``[h]``. y ``[b, h, p]`` in x's dtype.
    ``state_indices [b]`` (int): state is a pool ``[slots, h, p, s]``, row b's slot
    ``state_indices[b]`` advanced in place (negative: a padding row, y zero, no slot touched).
    ``"auto"`` on CPU tensors runs numba-compiled (:mod:`.step_jit`).
    """
    check_layout("x", x, "batch, nheads, headdim")
    if state_indices is not None and resolve_backend(backend, x.device) == "torch":
        _check_step_args(state, x, dt, A, B, C, D, dt_bias, dt_limit, state_indices)
        rows = slot_rows(state, state_indices)
        y = selective_state_update(rows, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                   dt_limit=dt_limit, backend=backend)
        put_slot_rows(state, state_indices, rows)
        return y.masked_fill((state_indices < 0).view(-1, 1, 1), 0)
    if backend == "auto" and jit_fits(state, x, dt, A, B, C, D, dt_bias):
        from .cpu.step_jit import state_update_rows

        D, (lo, hi) = _check_step_args(state, x, dt, A, B, C, D, dt_bias, dt_limit)
        y = torch.empty(x.shape, dtype=torch.float32)
        state_update_rows(as_numpy(state), *map(readable, (x, dt, A, B, C, D if D is not None else A[:, None])),
                          D is not None, readable(dt_bias if dt_bias is not None else A), dt_bias is not None,
                          bool(dt_softplus), float(lo), float(hi), as_numpy(y))
        return y.to(x.dtype)
    if resolve_backend(backend, x.device) == "torch":
        return selective_state_update_torch(state, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                          dt_limit=dt_limit)
    D, dt_limit = _check_step_args(state, x, dt, A, B, C, D, dt_bias, dt_limit, state_indices)
    y = torch.empty_like(x) if state_indices is None else torch.zeros_like(x)  # (padding rows: not written)
    launch_ssm_recurrence(state, x[:, None], dt[:, None], A, B[:, None], C[:, None], D, dt_bias, dt_softplus, dt_limit,
                          y[:, None], out=state, slots=state_indices)
    return y
