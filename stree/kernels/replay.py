"""Activation replay: the committed SSM and conv states at the accepted node, from the verify
pass's cached per-node activations, touching only the accepted path of each row, for every
Mamba2 layer of a model in one launch.

``accepted [b, L]`` lists node indices root-first, of which the first ``num_accepted[b] >= 1``
count (the root always does: it was fed to the model for the first time in the verify pass).
SSM state: the recurrence over those nodes from the old state. Conv state: the last ``d_conv`` raw
inputs along ``[old conv_state columns; accepted nodes' xBC]``.

Every tensor may carry a leading layer dimension (``[layers, b, ...]``, A and dt_bias
``[layers, h]``); layer l replays with its own A and dt_bias.

Engines keep states in a pool of slots, one per request, and pass each row's slot
(``state_indices``, a negative id such as ``_common.PAD_SLOT_ID`` for a padding row to skip): the states
are then read from the row's slot and the new ones written back there, in place.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from ..tree import check_cu_seqlens
from ._common import (
    INF,
    check_slots,
    identity_slots,
    put_slot_rows,
    slot_rows,
    as_numpy,
    check_dt_limit,
    check_groups,
    check_layout,
    check_tensor,
    f32,
    jit_fits,
    readable,
    pow2_block,
    process_dt,
    resolve_backend,
)
from .multistep import recurrence_block_p, ssm_recurrence_program

__all__ = ["replay", "replay_torch", "check_accepted"]


@triton.jit
def _replay_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, dt_bias_ptr, new_state_ptr, acc_ptr, num_ptr,
    xbc_ptr, conv_ptr, new_conv_ptr, slot_ptr,
    batch, nheads, headdim, dstate, heads_per_group, dim, dt_lo, dt_hi, ssm_programs, p_blocks, d_blocks,
    s_st_l, s_st_b, s_st_h, s_st_p, s_st_s,
    s_x_l, s_x_b, s_x_n, s_x_h, s_x_p,
    s_dt_l, s_dt_b, s_dt_n, s_dt_h,
    s_B_l, s_B_b, s_B_n, s_B_g, s_B_s,
    s_A_l, s_bias_l,
    s_ns_l, s_ns_b, s_ns_h, s_ns_p, s_ns_s,
    s_a_b, s_a_l,
    s_xbc_l, s_xbc_b, s_xbc_n, s_xbc_d,
    s_c_l, s_c_b, s_c_d, s_c_k,
    s_nc_l, s_nc_b, s_nc_d, s_nc_k,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, K: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Programs below ``ssm_programs`` run the SSM recurrence of one (layer, row, head, channel
    block); the rest rebuild the conv state of one (layer, row, channel block). Row b's states are
    slot ``slot[b]`` of the state tensors (b itself where the caller has no pool); a negative
    slot is a padding row, left alone."""
    pid = tl.program_id(0)
    if pid < ssm_programs:
        pid_p = pid % p_blocks
        rest = pid // p_blocks
        h = rest % nheads
        rest = rest // nheads
        b = rest % batch
        layer = rest // batch
        slot = tl.load(slot_ptr + b).to(tl.int64)
        if slot >= 0:
            # (the program indexes states by b: the slot's offset moves the base instead)
            ssm_recurrence_program(
                state_ptr + layer * s_st_l + (slot - b) * s_st_b, x_ptr + layer * s_x_l, dt_ptr + layer * s_dt_l,
                A_ptr + layer * s_A_l, B_ptr + layer * s_B_l, state_ptr, state_ptr, dt_bias_ptr + layer * s_bias_l,
                state_ptr, new_state_ptr + layer * s_ns_l + (slot - b) * s_ns_b, acc_ptr, num_ptr,
                b, h, pid_p, 0, headdim, dstate, heads_per_group, dt_lo, dt_hi,
                s_st_b, s_st_h, s_st_p, s_st_s, s_x_b, s_x_n, s_x_h, s_x_p, s_dt_b, s_dt_n, s_dt_h,
                s_B_b, s_B_n, s_B_g, s_B_s, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                s_ns_b, s_ns_h, s_ns_p, s_ns_s, s_a_b, s_a_l,
                True, False, False, HAS_DT_BIAS, DT_SOFTPLUS, BLOCK_P, BLOCK_S,
            )
    else:
        c = pid - ssm_programs
        offs_d = (c % d_blocks) * BLOCK_D + tl.arange(0, BLOCK_D)
        b = (c // d_blocks) % batch
        layer = c // d_blocks // batch
        # (a vector, to join the masks; not `slot`: a name both branches bind must keep one type)
        row_slot = tl.load(slot_ptr + b).to(tl.int64) + tl.zeros((BLOCK_D,), dtype=tl.int64)
        d_ok = (offs_d < dim) & (row_slot >= 0)
        row_slot = tl.maximum(row_slot, 0)
        num = tl.load(num_ptr + b)
        xbc = xbc_ptr + layer * s_xbc_l + b * s_xbc_b
        old = conv_ptr + layer * s_c_l + row_slot * s_c_b + offs_d * s_c_d
        new = new_conv_ptr + layer * s_nc_l + row_slot * s_nc_b + offs_d * s_nc_d
        # Output slot j takes path position q = num - K + j; a negative q reaches back to old slot
        # K + q = j + num > j. Filling slots in ascending order therefore never reads a slot this
        # program already wrote, so `new` may be the conv state itself (an in-place commit).
        for j in tl.static_range(K):
            q = num - K + j + tl.zeros((BLOCK_D,), dtype=tl.int32)  # a vector, to join the channel mask
            node = tl.load(acc_ptr + b * s_a_b + tl.maximum(q, 0) * s_a_l, mask=d_ok & (q >= 0), other=0)
            v = tl.load(xbc + node * s_xbc_n + offs_d * s_xbc_d, mask=d_ok & (q >= 0), other=0.0)
            v_old = tl.load(old + (K + tl.minimum(q, -1)) * s_c_k, mask=d_ok & (q < 0), other=0.0)
            v = tl.where(q >= 0, v.to(new_conv_ptr.dtype.element_ty), v_old.to(new_conv_ptr.dtype.element_ty))
            tl.store(new + j * s_nc_k, v, mask=d_ok)


def _as_layers(t, single: bool):
    return t.unsqueeze(0) if single and t is not None else t


def _check_args(ssm_state, conv_state, xBC, x, dt, B, A, accepted, num_accepted, dt_bias, dt_limit, validate, out,
                state_indices=None):
    """Checks; returns (layer-stacked views of every tensor, dt_limit, single-layer flag). With
    ``state_indices`` the states are pools of slots (their own count, checked), the ids checked
    by :func:`check_slots` (with ``validate``) and ``out`` refused (the pools are the output)."""
    if not isinstance(x, torch.Tensor) or x.dim() not in (4, 5):
        raise ValueError(f"x must have shape [b, n, h, p] or [layers, b, n, h, p], got {getattr(x, 'shape', type(x))}")
    single = x.dim() == 4
    lead = () if single else (x.shape[0],)
    layout = lambda s: ("" if single else "layers, ") + s
    batch, n, nheads, headdim = x.shape[-4:]
    device = x.device
    check_layout("x", x, layout("batch, n, nheads, headdim"))
    ngroups, dstate = check_layout("B", B, layout("batch, n, ngroups, dstate"))[-2:]
    check_tensor("B", B, (*lead, batch, n, ngroups, dstate), device, dtype=x.dtype)
    check_groups(nheads, ngroups)
    slots = batch
    if state_indices is not None:
        if out is not None:
            raise ValueError("with state_indices the states are updated in their slots: out must be None")
        if not isinstance(ssm_state, torch.Tensor) or ssm_state.dim() != len(lead) + 4:
            raise ValueError(f"ssm_state must have shape [{layout('slots, nheads, headdim, dstate')}], "
                             f"got {getattr(ssm_state, 'shape', type(ssm_state))}")
        slots = ssm_state.shape[-4]
        check_slots(state_indices, batch, slots, device, validate)
    check_tensor("ssm_state", ssm_state, (*lead, slots, nheads, headdim, dstate), device, dtype=torch.float32)
    check_tensor("dt", dt, (*lead, batch, n, nheads), device)
    check_tensor("A", A, (*lead, nheads), device)
    if dt_bias is not None:
        check_tensor("dt_bias", dt_bias, (*lead, nheads), device)
    dim = check_layout("xBC", xBC, layout("batch, n, dim"))[-1]
    check_tensor("xBC", xBC, (*lead, batch, n, dim), device)
    if not isinstance(conv_state, torch.Tensor) or conv_state.dim() != len(lead) + 3:
        raise ValueError(f"conv_state must have shape [{layout('batch, dim, d_conv')}], "
                         f"got {getattr(conv_state, 'shape', type(conv_state))}")
    check_tensor("conv_state", conv_state, (*lead, slots, dim, conv_state.shape[-1]), device)
    if not isinstance(accepted, torch.Tensor) or accepted.dim() != 2:
        raise ValueError(f"accepted must have shape [batch, L], got {getattr(accepted, 'shape', type(accepted))}")
    check_tensor("accepted", accepted, (batch, accepted.shape[1]), device, kind="int")
    check_tensor("num_accepted", num_accepted, (batch,), device, kind="int")
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError("out must be a pair (ssm_out, conv_out)")
        check_tensor("out[0]", out[0], ssm_state.shape, device, dtype=torch.float32)
        check_tensor("out[1]", out[1], conv_state.shape, device, dtype=conv_state.dtype)
    if validate:
        check_accepted(accepted, num_accepted, n)
    stacked = [_as_layers(t, single) for t in (ssm_state, conv_state, xBC, x, dt, B, A, dt_bias)]
    outs = None if out is None else tuple(_as_layers(t, single) for t in out)
    return stacked, outs, check_dt_limit(dt_limit), single


def check_accepted(accepted, num_accepted, n):
    """ValueError unless every row accepts 1..L nodes, all valid indices in [0, n) (``n`` an int,
    or a tensor ``[b]`` of each row's tree size). One device sync."""
    L = accepted.shape[1]
    bad_num = (num_accepted < 1) | (num_accepted > L)
    used = torch.arange(L, device=accepted.device) < num_accepted[:, None]
    sizes = n[:, None] if isinstance(n, torch.Tensor) else n
    bad = used & ((accepted < 0) | (accepted >= sizes))
    if bool(bad_num.any() | bad.any()):
        if bool(bad_num.any()):
            row = int(torch.nonzero(bad_num)[0])
            raise ValueError(f"num_accepted[{row}] = {int(num_accepted[row])} must be in [1, {L}] (the root always counts)")
        row, t = (int(v) for v in torch.nonzero(bad)[0])
        size = int(n[row]) if isinstance(n, torch.Tensor) else n
        raise ValueError(f"accepted[{row}, {t}] = {int(accepted[row, t])} is not a node index in [0, {size})")


def _from_packed(cu_seqlens, accepted, num_accepted, validate, xBC, x, dt, B):
    """Packed trees' activations as the padded call reads them: every row sees all the packed
    nodes (a batch stride of 0: no copy) and its accepted indices move to its tree's first node."""
    if not isinstance(x, torch.Tensor) or x.dim() not in (4, 5) or x.shape[-4] != 1:
        raise ValueError(f"with cu_seqlens x must have shape [(layers,) 1, total, h, p], got {getattr(x, 'shape', x)}")
    if not isinstance(accepted, torch.Tensor) or accepted.dim() != 2:
        raise ValueError(f"accepted must have shape [batch, L], got {getattr(accepted, 'shape', type(accepted))}")
    check_tensor("cu_seqlens", cu_seqlens, (accepted.shape[0] + 1,), x.device, kind="int")
    check_tensor("num_accepted", num_accepted, (accepted.shape[0],), x.device, kind="int")
    if validate:  # (each tree's size on the tensors' device: a host tensor beside CUDA ones is refused)
        check_cu_seqlens(cu_seqlens, x.shape[-3])
        check_accepted(accepted, num_accepted, cu_seqlens.diff())
    batch = accepted.shape[0]
    rows = lambda t, rank: t.expand(*t.shape[:t.dim() - rank], batch, *t.shape[t.dim() - rank + 1:])
    moved = accepted + cu_seqlens[:-1, None].to(accepted.dtype)
    return moved, rows(xBC, 3), rows(x, 4), rows(dt, 3), rows(B, 4)


def _in_slots(run, ssm_state, conv_state, state_indices, single):
    """``run(ssm, conv)`` (a path taking one state row per batch row) over the rows' slots of the
    pools, its results written back into them; padding rows start from zeros and write nothing."""
    dim = 0 if single else 1
    new_ssm, new_conv = run(slot_rows(ssm_state, state_indices, dim), slot_rows(conv_state, state_indices, dim))
    put_slot_rows(ssm_state, state_indices, new_ssm, dim)
    put_slot_rows(conv_state, state_indices, new_conv, dim)
    return ssm_state, conv_state


def _finish(new_ssm, new_conv, outs, single):
    if outs is not None:
        outs[0].copy_(new_ssm)
        outs[1].copy_(new_conv)
        new_ssm, new_conv = outs
    return (new_ssm[0], new_conv[0]) if single else (new_ssm, new_conv)


def replay_torch(ssm_state, conv_state, xBC, x, dt, B, A, accepted, num_accepted, *, dt_bias=None,
               dt_softplus=True, dt_limit=(0.0, INF), validate=True, out=None):
    """All layers and path steps at once, in closed form: with the path's dA_t = dt_t A,
    ``state' = exp(sum_t dA_t) state + sum_t exp(sum_{t' > t} dA_t') dt_t x_t B_t^T``. Steps past
    ``num_accepted`` read the root (always on the path) and get dt = 0, which makes them no-ops."""
    stacked, outs, dt_limit, single = _check_args(ssm_state, conv_state, xBC, x, dt, B, A, accepted, num_accepted,
                                                  dt_bias, dt_limit, validate, out)
    ssm_state, conv_state, xBC, x, dt, B, A, dt_bias = stacked
    layers, batch, _, nheads, headdim = x.shape
    g, dstate = B.shape[-2:]
    L = accepted.shape[1]
    used = torch.arange(L, device=x.device) < num_accepted[:, None]
    path = torch.where(used, accepted, 0).long()
    rows = torch.arange(batch, device=x.device)[:, None]
    bias = None if dt_bias is None else dt_bias[:, None, None]
    dtp = process_dt(dt[:, rows, path], bias, dt_softplus, dt_limit) * used[..., None]  # [layers, b, L, h]
    dA = dtp * f32(A)[:, None, None]
    total = dA.sum(2)
    weight = (total[:, :, None] - dA.cumsum(2)).exp_().mul_(dtp)  # exp(dA after step t) dt_t
    upd = torch.einsum("lbtgr,lbtgrp,lbtgs->lbgrps", weight.view(layers, batch, L, g, nheads // g),
                       f32(x[:, rows, path]).view(layers, batch, L, g, nheads // g, headdim), f32(B[:, rows, path]))
    new_ssm = upd.view_as(ssm_state).addcmul_(ssm_state, total.exp_()[..., None, None])
    d_conv = conv_state.shape[-1]
    seq = torch.cat([conv_state.transpose(-1, -2), xBC.to(conv_state.dtype)], dim=-2)  # [layers, b, K + n, dim]
    q = num_accepted[:, None] - d_conv + torch.arange(d_conv, device=x.device)  # oldest slot first
    pos = d_conv + torch.where(q >= 0, torch.gather(path, 1, q.clamp(min=0)), q)
    new_conv = seq[:, rows, pos].transpose(-1, -2)
    return _finish(new_ssm, new_conv, outs, single)


def _replay_compiled(ssm_state, conv_state, xBC, x, dt, B, A, accepted, num_accepted, dt_bias, dt_softplus,
                     dt_limit, validate, out):
    from .cpu.replay_jit import replay_layers

    stacked, outs, (lo, hi), single = _check_args(ssm_state, conv_state, xBC, x, dt, B, A, accepted, num_accepted,
                                                  dt_bias, dt_limit, validate, out)
    ssm_state, conv_state, xBC, x, dt, B, A, dt_bias = stacked
    new_ssm, new_conv = outs if outs is not None else (torch.empty_like(ssm_state), torch.empty_like(conv_state))
    # a half conv state is written in float32, then copied over (exact: it holds copies of half values)
    wide_conv = new_conv if new_conv.dtype == torch.float32 else torch.empty(new_conv.shape, dtype=torch.float32)
    # (the accepted paths may be a strided slice: C order always, so numba compiles one layout, not two)
    replay_layers(as_numpy(ssm_state), *map(readable, (conv_state, xBC, x, dt, B, A)),
                  readable(dt_bias if dt_bias is not None else A), dt_bias is not None, bool(dt_softplus), float(lo),
                  float(hi), np.ascontiguousarray(as_numpy(accepted.long())), as_numpy(num_accepted.long()),
                  as_numpy(new_ssm), as_numpy(wide_conv))
    if wide_conv is not new_conv:
        new_conv.copy_(wide_conv)
    if out is not None:
        return tuple(out)
    return (new_ssm[0], new_conv[0]) if single else (new_ssm, new_conv)


def replay(ssm_state, conv_state, xBC, x, dt, B, A, accepted, num_accepted, *, dt_bias=None,
           dt_softplus=True, dt_limit=(0.0, INF), validate=True, out=None, state_indices=None, cu_seqlens=None,
           backend="auto"):
    """New ``(ssm_state, conv_state)`` after the accepted path, for one layer or a stack of them.

    ssm_state ``[(layers,) b, h, p, s]`` fp32 and conv_state ``[(layers,) b, dim, d_conv]``: the
    states before the verify pass. xBC ``[.., b, n, dim]`` raw pre-conv, x ``[.., b, n, h, p]``
    post-conv, dt ``[.., b, n, h]`` raw, B ``[.., b, n, g, s]``: the verify pass's per-node
    activations; A and dt_bias ``[(layers,) h]``. accepted ``[b, L]`` and num_accepted ``[b]`` as
    in the module docstring. The inputs are not modified, unless ``out=(ssm_out, conv_out)``
    names them: the results are written there (the states themselves for an in-place commit) and
    returned. ``state_indices [b]`` (int): the states are pools ``[(layers,) slots, ...]``, row b's
    in slot ``state_indices[b]`` (negative: a padding row, skipped); the new states are written
    into those slots in place and the pools returned. ``cu_seqlens [b + 1]`` (int): the verify pass
    ran packed trees (:class:`~stree.tree.PackedTrees`), xBC, x, dt, B hold their nodes back to
    back (``[.., 1, total, ...]``) and row b's ``accepted`` count inside tree b, from its root.
    ``validate=False`` skips the index checks, a device-to-host sync. ``backend="auto"`` runs CPU
    tensors compiled (stree.kernels.cpu.replay_jit), ``"torch"`` the PyTorch path.
    """
    if cu_seqlens is not None:
        accepted, xBC, x, dt, B = _from_packed(cu_seqlens, accepted, num_accepted, validate, xBC, x, dt, B)
    if state_indices is not None and resolve_backend(backend, getattr(x, "device", torch.device("cpu"))) == "torch":
        _check_args(ssm_state, conv_state, xBC, x, dt, B, A, accepted, num_accepted, dt_bias, dt_limit, validate,
                    out, state_indices)
        run = functools.partial(replay, xBC=xBC, x=x, dt=dt, B=B, A=A, accepted=accepted, num_accepted=num_accepted,
                                dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, validate=False,
                                backend=backend)
        return _in_slots(run, ssm_state, conv_state, state_indices, x.dim() == 4)
    if backend == "auto" and jit_fits(ssm_state, conv_state, xBC, x, dt, B, A, dt_bias):
        return _replay_compiled(ssm_state, conv_state, xBC, x, dt, B, A, accepted, num_accepted, dt_bias,
                                dt_softplus, dt_limit, validate, out)
    if resolve_backend(backend, getattr(x, "device", torch.device("cpu"))) == "torch":
        return replay_torch(ssm_state, conv_state, xBC, x, dt, B, A, accepted, num_accepted, dt_bias=dt_bias,
                          dt_softplus=dt_softplus, dt_limit=dt_limit, validate=validate, out=out)
    stacked, outs, (lo, hi), single = _check_args(ssm_state, conv_state, xBC, x, dt, B, A, accepted, num_accepted,
                                                  dt_bias, dt_limit, validate, out, state_indices)
    pools = ssm_state, conv_state
    ssm_state, conv_state, xBC, x, dt, B, A, dt_bias = stacked
    layers, batch, _, nheads, headdim = x.shape
    dstate, dim, d_conv = B.shape[-1], xBC.shape[-1], conv_state.shape[-1]
    if state_indices is not None:  # in place: each program reads its slot's state before writing it
        outs = (ssm_state, conv_state)
    new_ssm, new_conv = outs if outs is not None else (torch.empty_like(ssm_state), torch.empty_like(conv_state))
    slots = identity_slots(batch, x.device) if state_indices is None else state_indices
    block_p, block_d = recurrence_block_p(headdim), 256
    p_blocks, d_blocks = triton.cdiv(headdim, block_p), triton.cdiv(dim, block_d)
    ssm_programs = layers * batch * nheads * p_blocks
    bias = dt_bias if dt_bias is not None else A
    _replay_kernel[(ssm_programs + layers * batch * d_blocks,)](
        ssm_state, x, dt, A, B, bias, new_ssm, accepted, num_accepted, xBC, conv_state, new_conv, slots,
        batch, nheads, headdim, dstate, nheads // B.shape[-2], dim, lo, hi, ssm_programs, p_blocks, d_blocks,
        *ssm_state.stride(), *x.stride(), *dt.stride(), *B.stride(), A.stride(0), bias.stride(0),
        *new_ssm.stride(), *accepted.stride(), *xBC.stride(), *conv_state.stride(), *new_conv.stride(),
        HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus), K=d_conv,
        BLOCK_P=block_p, BLOCK_S=pow2_block(dstate), BLOCK_D=block_d,
    )
    if state_indices is not None:
        return pools
    return (new_ssm[0], new_conv[0]) if single else (new_ssm, new_conv)
