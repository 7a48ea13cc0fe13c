"""The two kernels of a Mamba2 decode step on the CPU, compiled with numba: the conv of one new
token and one recurrence step, each one call instead of the PyTorch path's ~6 and ~12 ops (an
eager decode step on a CPU is bound by per-op overhead). Taken by
``backend="auto"`` for CPU tensors (:func:`jit_fits`; half ones as float32 copies); tested against the float64
definitions beside the Triton kernels and the PyTorch path. The conv in float64, stored in the
output's float32; the state update in float32 (see :func:`state_update_rows`).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

__all__ = ["conv_step_rows", "processed_dt", "state_update_rows"]


@njit(cache=True)
def processed_dt(raw, bias, has_bias, softplus, lo, hi):
    """One dt as the kernels use it: + bias, softplus (linear above 20, as mamba_ssm), clamped."""
    d = float(raw)
    if has_bias:
        d += float(bias)
    if softplus and d <= 20.0:
        d = math.log1p(math.exp(d))
    return min(max(d, lo), hi)


@njit(cache=True)
def conv_step_rows(x, state, weight, bias, has_bias, silu, out):
    """x ``[b, dim]``, state ``[b, dim, K]`` (shifted left in place, x entering as column K - 1),
    weight ``[dim, K]``, bias ``[dim]``; out ``[b, dim]``: taps . window (+ bias), then SiLU."""
    batch, dim, K = state.shape
    for b in range(batch):
        for d in range(dim):
            acc = float(bias[d]) if has_bias else 0.0
            for k in range(K - 1):
                v = state[b, d, k + 1]
                state[b, d, k] = v
                acc += float(weight[d, k]) * v
            v = x[b, d]
            state[b, d, K - 1] = v
            acc += float(weight[d, K - 1]) * v
            if silu:
                acc = acc / (1.0 + math.exp(-acc))
            out[b, d] = acc


@njit(cache=True, fastmath={"reassoc"})  # (no contraction: replay multiplies and adds apart)
def state_update_rows(state, x, dt, A, B, C, D, has_D, bias, has_bias, softplus, lo, hi, y):
    """state ``[b, h, p, s]`` advanced in place by one step; x ``[b, h, p]``, dt ``[b, h]`` raw,
    A and bias ``[h]``, B and C ``[b, g, s]``, D ``[h, p]``; y ``[b, h, p]`` = C . state + D x.
    The state's update in float32 with replay's roundings (dt x and the decay rounded from float64,
    then a product, a product and a sum per entry): from the same activations a step and a replay
    of one token leave the same state (:mod:`.replay_jit`); the loops over d_state vectorise.
    B and C come as views of the conv's output, strided across rows where b > 1: their rows are
    copied to contiguous ones first, or the loops stay scalar (3-4 times the time at batch 2)
    and sum in another order than the row's step alone (a row's outputs would depend on the batch)."""
    batch, heads, headdim, dstate = state.shape
    per_group = heads // B.shape[1]
    b_row = np.empty(dstate, dtype=np.float32)
    c_row = np.empty(dstate, dtype=np.float32)
    for b in range(batch):
        for h in range(heads):
            g = h // per_group
            if h % per_group == 0:  # (a group's heads are consecutive)
                for s in range(dstate):
                    b_row[s] = B[b, g, s]
                    c_row[s] = C[b, g, s]
            d = processed_dt(dt[b, h], bias[h], has_bias, softplus, lo, hi)
            decay = np.float32(math.exp(d * float(A[h])))
            for p in range(headdim):
                xv = x[b, h, p]
                dx = np.float32(d * xv)
                acc = np.float32(0.0)
                for s in range(dstate):
                    v = state[b, h, p, s] * decay + dx * b_row[s]
                    state[b, h, p, s] = v
                    acc += v * c_row[s]
                if has_D:
                    acc += D[h, p] * xv
                y[b, h, p] = acc
