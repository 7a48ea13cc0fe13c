"""A Mamba2 layer's tree pass on the CPU in two compiled calls around the SiLU of the conv's output
and of the gate: the copies replay keeps, the gate's and the tree conv (:func:`tree_layer_in`),
then x and B taken apart from the conv's
output, the scan and the gated norm (:func:`tree_layer_out`). The same row functions as the
separate kernels (:mod:`.tree_jit`, :mod:`.norm_jit`), on the same contiguous arrays, so the same
results bit for bit (tests/kernels/test_bound.py).

Why: :class:`~.bound.Mamba2LayerJit` made a tree pass's layer from about twenty host operations
(four copies, the conv, the scan, the norm, the views and arrays between them), each a microsecond
or several, where a step's layer takes half as many; on the shipped target at batch 1 the two calls
took a quarter off a layer's tree work at 2 nodes and an eighth at 12, timed alone (docs/kernels.md). Serial only: a call whose
rows have enough work to run in parallel (:func:`.tree_jit.parallel_rows`) takes the separate
kernels, whose drivers split the rows over threads.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .norm_jit import gated_rms_norm_rows
from .round_jit import round_half
from .tree_jit import aligned_empty, chain_row, conv_row, scan_row

__all__ = ["tree_layer_in", "tree_layer_out"]

@njit(cache=True)
def tree_layer_in(proj, d_inner, parents, state, weight, bias, has_bias, xBC, dt, conv, gate):
    """proj ``[b, n, d_inner + dim + h]`` (float32, the in_proj output: z, xBC, dt side by side):
    writes xBC ``[b, n, dim]`` and dt ``[b, n, h]`` (contiguous copies, what replay reads), conv
    ``[b, n, dim]``, the tree conv of xBC over parents ``[rows, n]`` from state ``[b, dim, K]``
    with weight ``[dim, K]`` (+ bias), and gate ``[b, n, d_inner]``, a copy of z; the SiLU of
    conv and gate is the caller's (vectorised, one call where the two lie in one buffer)."""
    batch, n, dim, heads = xBC.shape[0], xBC.shape[1], xBC.shape[2], dt.shape[2]
    for b in range(batch):
        for i in range(n):
            for c in range(d_inner):
                gate[b, i, c] = proj[b, i, c]
            for c in range(dim):
                xBC[b, i, c] = proj[b, i, d_inner + c]
            for h in range(heads):
                dt[b, i, h] = proj[b, i, d_inner + dim + h]
        conv_row(b, xBC, parents, state, weight, bias, has_bias, conv)


@njit(cache=True)
def tree_layer_out(conv, x_dim, B_dim, dt, A, D, bias, lo, hi, parents, x0, xs, has_xs, chain, rounding, x, B, gate,
                   norm_weight, eps, gate_first, out):
    """From the conv's output ``[b, n, dim]`` (after its SiLU): writes x ``[b, n, h, p]`` and B
    ``[b, n, g, s]`` (x's first ``x_dim`` channels in heads, B's next ``B_dim`` in groups, each
    repeated to h heads / C's g groups where narrower: MambaInLlama's d_xb variant), the scan
    into y (made here, aligned: :func:`.tree_jit.aligned_empty`; with D, dt_bias, softplus and
    the clamp ``lo``, ``hi``; the tree's over parents, or with ``chain`` the chain recurrence),
    rounded where ``rounding`` says (-1 none, 0 float16, 1 bfloat16), and ``out`` ``[b, n, h *
    p]``, the gated RMS norm of y by ``gate`` (silu(z)) with norm_weight ``[groups, group]``."""
    batch, n, heads, headdim = x.shape
    groups, dstate = B.shape[2], B.shape[3]
    x_rep, b_rep = heads // (x_dim // headdim), groups // (B_dim // dstate)
    c_at = x_dim + B_dim
    C = np.empty((batch, n, groups, dstate), dtype=np.float32)
    y = aligned_empty(x.size).reshape(x.shape)
    no_final = np.empty((1, 1, 1, 1), dtype=np.float32)  # (the chain's final state: not kept here)
    for b in range(batch):
        for i in range(n):
            row = conv[b, i]
            for h in range(heads):
                at = (h // x_rep) * headdim
                for p in range(headdim):
                    x[b, i, h, p] = row[at + p]
            for g in range(groups):
                at = x_dim + (g // b_rep) * dstate
                for s in range(dstate):
                    B[b, i, g, s] = row[at + s]
                    C[b, i, g, s] = row[c_at + g * dstate + s]
    for b in range(batch):
        if chain:
            chain_row(b, x, dt, A, B, C, D, True, bias, True, True, lo, hi, x0, True, y, no_final, False)
        else:
            scan_row(b, x, dt, A, B, C, D, True, bias, True, True, lo, hi, parents, x0, True, xs, has_xs, y)
    if rounding >= 0:
        round_half(y, rounding == 1)
    group = norm_weight.shape[1]
    gated_rms_norm_rows(y.reshape(-1, group), gate.reshape(-1, group), norm_weight, True, eps, gate_first,
                        out.reshape(-1, group))
