"""The kernels' definitions, written as plainly as possible: float64, one node and one step at a
time, walking the parent array directly. Slow on purpose; the kernels and their vectorised
references are both judged against these.
"""

from __future__ import annotations

import math

import torch


def _dt64(dt, dt_bias, dt_softplus, dt_limit):
    dt = dt.double()
    if dt_bias is not None:
        dt = dt + dt_bias.double()
    if dt_softplus:
        dt = torch.where(dt > 20, dt, torch.log1p(torch.exp(dt)))
    return dt.clamp(dt_limit[0], dt_limit[1])


def _row_parents(parents, b):
    p = torch.as_tensor(parents)
    return (p if p.dim() == 1 else p[b]).tolist()


def root_path(parents, i):
    """Root-first node list from the root to i."""
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def _step(state, x, dt, A, B, group_of_head):
    """One recurrence step for all heads: state ``[h, p, s]``, x ``[h, p]``, dt ``[h]``, B ``[g, s]``."""
    Bh = B[group_of_head]
    return torch.exp(dt * A)[:, None, None] * state + dt[:, None, None] * x[:, :, None] * Bh[:, None, :]


def _out(state, x, C, D, group_of_head):
    y = (state * C[group_of_head][:, None, :]).sum(-1)
    if D is not None:
        y = y + (D[:, None] if D.dim() == 1 else D) * x
    return y


def tree_scan_def(x, dt, A, B, C, parents, *, D=None, dt_bias=None, dt_softplus=True,
                  dt_limit=(0.0, math.inf), initial_state=None):
    """y_i = C_i . h_i + D x_i with h run along the root-to-i path from initial_state (float64)."""
    batch, n, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2:]
    goh = torch.arange(nheads) // (nheads // ngroups)
    dt = _dt64(dt, dt_bias, dt_softplus, dt_limit).cpu()
    x, A, B, C = (t.double().cpu() for t in (x, A, B, C))
    D = D.double().cpu() if D is not None else None
    y = torch.zeros(batch, n, nheads, headdim, dtype=torch.float64)
    for b in range(batch):
        par = _row_parents(parents, b)
        for i in range(n):
            h = (initial_state[b].double().cpu() if initial_state is not None
                 else torch.zeros(nheads, headdim, dstate, dtype=torch.float64))
            for j in root_path(par, i):
                h = _step(h, x[b, j], dt[b, j], A, B[b, j], goh)
            y[b, i] = _out(h, x[b, i], C[b, i], D, goh)
    return y


def multistep_def(state, x, dt, A, B, C, *, D=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, math.inf)):
    """(y, final_state) of T sequential steps (float64)."""
    batch, T, nheads, headdim = x.shape
    goh = torch.arange(nheads) // (nheads // B.shape[2])
    dt = _dt64(dt, dt_bias, dt_softplus, dt_limit).cpu()
    x, A, B, C = (t.double().cpu() for t in (x, A, B, C))
    D = D.double().cpu() if D is not None else None
    y = torch.zeros(batch, T, nheads, headdim, dtype=torch.float64)
    final = state.double().cpu().clone()
    for b in range(batch):
        for t in range(T):
            final[b] = _step(final[b], x[b, t], dt[b, t], A, B[b, t], goh)
            y[b, t] = _out(final[b], x[b, t], C[b, t], D, goh)
    return y, final


def _window(parents, conv_state_b, xbc_b, i, d_conv):
    """Raw inputs of node i's window, oldest first: ancestors, then conv-state columns above the root."""
    path = root_path(parents, i)
    cols = [conv_state_b[:, k] for k in range(conv_state_b.shape[1])] + [xbc_b[j] for j in path]
    return cols[-d_conv:]


def tree_conv1d_def(xBC, parents, conv_state, weight, bias=None, activation="silu"):
    batch, n, dim = xBC.shape
    w = weight.double().cpu().reshape(dim, -1)
    d_conv = w.shape[1]
    xBC, conv_state = xBC.double().cpu(), conv_state.double().cpu()
    out = torch.zeros(batch, n, dim, dtype=torch.float64)
    for b in range(batch):
        par = _row_parents(parents, b)
        for i in range(n):
            window = _window(par, conv_state[b], xBC[b], i, d_conv)
            v = sum(w[:, k] * window[k] for k in range(d_conv))
            if bias is not None:
                v = v + bias.double().cpu()
            out[b, i] = v * torch.sigmoid(v) if activation == "silu" else v
    return out


def replay_def(ssm_state, conv_state, xBC, x, dt, B, A, accepted, num_accepted, *, dt_bias=None,
               dt_softplus=True, dt_limit=(0.0, math.inf)):
    """(ssm_state, conv_state) after feeding the accepted nodes one by one (float64)."""
    batch, n, nheads, _ = x.shape
    goh = torch.arange(nheads) // (nheads // B.shape[2])
    d_conv = conv_state.shape[2]
    dt = _dt64(dt, dt_bias, dt_softplus, dt_limit).cpu()
    x, A, B, xBC = (t.double().cpu() for t in (x, A, B, xBC))
    new_ssm = ssm_state.double().cpu().clone()
    new_conv = conv_state.double().cpu().clone()
    for b in range(batch):
        path = accepted[b, : int(num_accepted[b])].tolist()
        cols = [new_conv[b, :, k] for k in range(d_conv)]
        for j in path:
            new_ssm[b] = _step(new_ssm[b], x[b, j], dt[b, j], A, B[b, j], goh)
            cols.append(xBC[b, j])
        new_conv[b] = torch.stack(cols[-d_conv:], dim=1)
    return new_ssm, new_conv


def tree_attention_def(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, parents, *, softmax_scale=None):
    """Per node and query head: softmax over the visible prefix keys and the node's ancestors-or-self."""
    batch, n, hq, d = q.shape
    hkv = k_cache.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    q, k_cache, v_cache, k_tree, v_tree = (t.double().cpu() for t in (q, k_cache, v_cache, k_tree, v_tree))
    out = torch.zeros(batch, n, hq, d, dtype=torch.float64)
    for b in range(batch):
        par = _row_parents(parents, b)
        length = int(cache_seqlens[b])
        for i in range(n):
            path = root_path(par, i)
            for h in range(hq):
                kv = h // (hq // hkv)
                keys = torch.cat([k_cache[b, :length, kv], k_tree[b, path, kv]])
                values = torch.cat([v_cache[b, :length, kv], v_tree[b, path, kv]])
                out[b, i, h] = torch.softmax(keys @ q[b, i, h] * scale, dim=0) @ values
    return out


def rms_norm_def(x, weight, eps):
    """x / sqrt(mean(x^2) + eps) * weight (None: no weight) over the last dimension, in float64."""
    x = x.double()
    v = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)
    return v if weight is None else v * weight.double()


def gated_rms_norm_def(y, z, weight, group_size, eps, gate_first=True):
    """norm(y * silu(z)) * weight (``gate_first=False``: norm(y) * weight * silu(z)), the norm over
    each group of ``group_size`` channels: v / sqrt(mean(v^2) + eps), in float64."""
    y, z, w = y.double(), z.double(), weight.double()
    gate = z * torch.sigmoid(z)
    v = (y * gate if gate_first else y).unflatten(-1, (-1, group_size))
    v = (v / torch.sqrt(v.square().mean(-1, keepdim=True) + eps)).flatten(-2) * w
    return v if gate_first else v * gate


def max_rel_error(out, ref) -> float:
    """max |out - ref| / max |ref| (the whole tensor's scale, so tiny entries cannot blow it up)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    if not bool(torch.isfinite(out).all()):
        return math.inf
    scale = ref.abs().max().item()
    return (out - ref).abs().max().item() / (scale if scale > 0 else 1.0)


def random_ssm_inputs(batch, n, nheads, headdim, dstate, ngroups, *, dtype=torch.float32, device="cpu",
                      generator=None, D_per_dim=False):
    """Inputs in Mamba2's ranges: dt_bias = inverse softplus of dt in [1e-3, 0.1], A in [-16, -1]."""
    g = generator

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    dt_target = torch.exp(torch.rand(nheads, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    return dict(
        x=rnd(batch, n, nheads, headdim).to(dtype),
        dt=rnd(batch, n, nheads, scale=0.5),
        A=-(1 + 15 * torch.rand(nheads, generator=g)).to(device),
        B=rnd(batch, n, ngroups, dstate).to(dtype),
        C=rnd(batch, n, ngroups, dstate).to(dtype),
        D=rnd(nheads, headdim) if D_per_dim else rnd(nheads),
        dt_bias=(dt_target + torch.log(-torch.expm1(-dt_target))).to(device),
        initial_state=rnd(batch, nheads, headdim, dstate),
    )
