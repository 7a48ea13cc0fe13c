"""Activation replay: the committed SSM and conv states at the accepted node, from the verify
pass's cached per-node activations, touching only the accepted path of each row.

``accepted [b, L]`` lists node indices root-first, of which the first ``num_accepted[b] >= 1``
count (the root always does: it was fed to the model for the first time in the verify pass).
SSM state: the recurrence over those nodes from the old state. Conv state: the last ``d_conv`` raw
inputs along ``[old conv_state columns; accepted nodes' xBC]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INF, check_dt_limit, check_groups, check_layout, check_ssm_params, check_tensor, resolve_backend
from .multistep import launch_ssm_recurrence, ssm_recurrence_ref

__all__ = ["replay", "replay_ref", "check_accepted"]


@triton.jit
def _replay_conv_kernel(
    xbc_ptr, conv_ptr, acc_ptr, num_ptr, out_ptr, dim,
    s_x_b, s_x_n, s_x_d,
    s_c_b, s_c_d, s_c_k,
    s_a_b, s_a_l,
    s_o_b, s_o_d, s_o_k,
    K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < dim
    num = tl.load(num_ptr + b)
    for k in tl.static_range(K):
        # Path position feeding output slot K-1-k, as a vector so it can join the channel mask;
        # a negative position reaches back into the old conv state.
        q = num - 1 - k + tl.zeros((BLOCK_D,), dtype=tl.int32)
        node = tl.load(acc_ptr + b * s_a_b + tl.maximum(q, 0) * s_a_l)
        v = tl.load(xbc_ptr + b * s_x_b + node * s_x_n + offs_d * s_x_d, mask=d_ok & (q >= 0), other=0.0)
        v_old = tl.load(conv_ptr + b * s_c_b + offs_d * s_c_d + (K + tl.minimum(q, -1)) * s_c_k,
                        mask=d_ok & (q < 0), other=0.0)
        v = tl.where(q >= 0, v.to(out_ptr.dtype.element_ty), v_old.to(out_ptr.dtype.element_ty))
        tl.store(out_ptr + b * s_o_b + offs_d * s_o_d + (K - 1 - k) * s_o_k, v, mask=d_ok)


def _check_args(ssm_state, conv_state, xBC, x, dt, B, A, accepted, num_accepted, dt_bias, dt_limit, validate):
    batch, n, nheads, headdim = check_layout("x", x, "batch, n, nheads, headdim")
    device = x.device
    ngroups, dstate = check_layout("B", B, "batch, n, ngroups, dstate")[2:]
    check_tensor("B", B, (batch, n, ngroups, dstate), device, dtype=x.dtype)
    check_groups(nheads, ngroups)
    check_tensor("ssm_state", ssm_state, (batch, nheads, headdim, dstate), device, dtype=torch.float32)
    check_tensor("dt", dt, (batch, n, nheads), device)
    check_ssm_params(nheads, headdim, device, A, None, dt_bias)
    dim = check_layout("xBC", xBC, "batch, n, dim")[2]
    check_tensor("xBC", xBC, (batch, n, dim), device)
    if not isinstance(conv_state, torch.Tensor) or conv_state.dim() != 3:
        raise ValueError(f"conv_state must have shape [batch, dim, d_conv], got {getattr(conv_state, 'shape', type(conv_state))}")
    check_tensor("conv_state", conv_state, (batch, dim, conv_state.shape[2]), device)
    if not isinstance(accepted, torch.Tensor) or accepted.dim() != 2:
        raise ValueError(f"accepted must have shape [batch, L], got {getattr(accepted, 'shape', type(accepted))}")
    check_tensor("accepted", accepted, (batch, accepted.shape[1]), device, kind="int")
    check_tensor("num_accepted", num_accepted, (batch,), device, kind="int")
    if validate:
        check_accepted(accepted, num_accepted, n)
    return check_dt_limit(dt_limit)


def check_accepted(accepted, num_accepted, n):
    """ValueError unless every row accepts 1..L nodes, all valid indices in [0, n). One device sync."""
    L = accepted.shape[1]
    bad_num = (num_accepted < 1) | (num_accepted > L)
    used = torch.arange(L, device=accepted.device) < num_accepted[:, None]
    bad = used & ((accepted < 0) | (accepted >= n))
    if bool(bad_num.any() | bad.any()):
        if bool(bad_num.any()):
            row = int(torch.nonzero(bad_num)[0])
            raise ValueError(f"num_accepted[{row}] = {int(num_accepted[row])} must be in [1, {L}] (the root always counts)")
        row, t = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(f"accepted[{row}, {t}] = {int(accepted[row, t])} is not a node index in [0, {n})")


def _gather_rows(t, index):
    """``t[b, index[b, l], ...]`` for an index table ``[b, L]``."""
    idx = index.long().view(*index.shape, *([1] * (t.dim() - 2))).expand(*index.shape, *t.shape[2:])
    return torch.gather(t, 1, idx)


def replay_ref(ssm_state, conv_state, xBC, x, dt, B, A, accepted, num_accepted, *, dt_bias=None,
               dt_softplus=True, dt_limit=(0.0, INF), validate=True):
    dt_limit = _check_args(ssm_state, conv_state, xBC, x, dt, B, A, accepted, num_accepted, dt_bias, dt_limit,
                           validate)
    L = accepted.shape[1]
    used = torch.arange(L, device=x.device) < num_accepted[:, None]
    path = torch.where(used, accepted, 0)
    _, new_ssm = ssm_recurrence_ref(ssm_state, _gather_rows(x, path), _gather_rows(dt, path), A,
                                    _gather_rows(B, path), None, None, dt_bias, dt_softplus, dt_limit,
                                    lengths=num_accepted)
    d_conv = conv_state.shape[2]
    seq = torch.cat([conv_state.transpose(1, 2), xBC.to(conv_state.dtype)], dim=1)  # [b, K + n, dim]
    q = num_accepted[:, None] - d_conv + torch.arange(d_conv, device=x.device)  # oldest slot first
    pos = d_conv + torch.where(q >= 0, torch.gather(path, 1, q.clamp(min=0)), q)
    new_conv = _gather_rows(seq, pos).transpose(1, 2).contiguous()
    return new_ssm, new_conv


def replay(ssm_state, conv_state, xBC, x, dt, B, A, accepted, num_accepted, *, dt_bias=None,
           dt_softplus=True, dt_limit=(0.0, INF), validate=True, backend="auto"):
    """New ``(ssm_state, conv_state)`` after the accepted path; the inputs are not modified.

    ssm_state ``[b, h, p, s]`` fp32 and conv_state ``[b, dim, d_conv]``: the states before the
    verify pass. xBC ``[b, n, dim]`` raw pre-conv, x ``[b, n, h, p]`` post-conv, dt ``[b, n, h]``
    raw, B ``[b, n, g, s]``: the verify pass's per-node activations. accepted ``[b, L]`` and
    num_accepted ``[b]`` as in the module docstring.
    """
    check_layout("x", x, "batch, n, nheads, headdim")
    if resolve_backend(backend, x.device) == "torch":
        return replay_ref(ssm_state, conv_state, xBC, x, dt, B, A, accepted, num_accepted, dt_bias=dt_bias,
                          dt_softplus=dt_softplus, dt_limit=dt_limit, validate=validate)
    dt_limit = _check_args(ssm_state, conv_state, xBC, x, dt, B, A, accepted, num_accepted, dt_bias, dt_limit,
                           validate)
    new_ssm = launch_ssm_recurrence(ssm_state, x, dt, A, B, None, None, dt_bias, dt_softplus, dt_limit, None,
                                    index=accepted, lengths=num_accepted)
    batch, dim, d_conv = conv_state.shape
    new_conv = torch.empty_like(conv_state)
    block_d = 256
    _replay_conv_kernel[(batch, triton.cdiv(dim, block_d))](
        xBC, conv_state, accepted, num_accepted, new_conv, dim,
        *xBC.stride(), *conv_state.stride(), *accepted.stride(), *new_conv.stride(),
        K=d_conv, BLOCK_D=block_d,
    )
    return new_ssm, new_conv
