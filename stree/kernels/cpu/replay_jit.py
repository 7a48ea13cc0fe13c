"""Activation replay on the CPU, compiled with numba: what :func:`stree.kernels.replay.replay`
computes (every layer of a stack in one call, in place when the outputs are the states), in one
call instead of the PyTorch path's two dozen ops. Taken by ``backend="auto"`` for CPU tensors (half
ones as float32 copies); tested against the float64 definition beside the Triton kernel and the PyTorch path.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from .step_jit import processed_dt

__all__ = ["replay_layers"]

# Tokens one sweep along a head's state applies: each entry read and written once per sweep, the
# path's products and sums in its order (bit-identical to a token a sweep). Token by token (and each
# channel copied to a buffer and back), an accepted path of four cost a batch-2 commit of the shipped
# target twice the time: a loop along d_state (32 entries, one vectorised pass) is mostly its own entry.
# Sweeping a prompt's path four tokens at a time also beat replaying it on each head's state
# transposed (the loop along headdim), at every length (docs/kernels.md).
SWEEP = 4


@njit(cache=True)
def replay_layers(state, conv, xBC, x, dt, B, A, bias, has_bias, softplus, lo, hi, accepted, num, new_state,
                  new_conv):
    """state ``[L, b, h, p, s]``, conv ``[L, b, dim, K]``, xBC ``[L, b, n, dim]``, x ``[L, b, n, h,
    p]``, dt ``[L, b, n, h]``, B ``[L, b, n, g, s]``, A and bias ``[L, h]``, accepted ``[b, D]``,
    num ``[b]`` (each >= 1). ``new_state`` / ``new_conv`` may be ``state`` / ``conv``: every element
    is read before it is written, and conv slot j only reads older slots past j."""
    layers, batch, _, heads, headdim = x.shape
    groups, dstate = B.shape[3], B.shape[4]
    per_group = heads // groups
    dim, K = conv.shape[2], conv.shape[3]
    L = accepted.shape[1]
    decay = np.empty(L, dtype=np.float32)
    xs = np.empty((L, headdim), dtype=np.float32)  # dt_t x_t for the path's nodes, contiguous
    Bs = np.empty((L, dstate), dtype=np.float32)
    # (the sweeps update new_state in place, read and written through the one array: read from one
    # array and written to another, the vectoriser's check that the two do not overlap would send an
    # in-place commit, where they are the same memory, down its scalar loop)
    in_place = new_state.ctypes.data == state.ctypes.data
    for l in range(layers):
        for b in range(batch):
            m = num[b]
            for h in range(heads):
                g = h // per_group
                for t in range(m):
                    node = accepted[b, t]
                    d = processed_dt(dt[l, b, node, h], bias[l, h], has_bias, softplus, lo, hi)
                    decay[t] = math.exp(d * float(A[l, h]))
                    for p in range(headdim):
                        xs[t, p] = d * x[l, b, node, h, p]
                    for s in range(dstate):
                        Bs[t, s] = B[l, b, node, g, s]
                out = new_state[l, b, h]
                if not in_place:
                    out[:] = state[l, b, h]
                for t in range(0, m, SWEEP):
                    _sweep(out, decay, xs, Bs, t, min(m - t, SWEEP))
            # the window slot by slot, each a row's column (an activation row, or an older slot): a
            # loop over the channels per slot, not over the slots per channel, which took three
            # times as long (a four-wide inner loop with a branch in it)
            for j in range(K):
                q = m - K + j
                if q >= 0:
                    src = xBC[l, b, accepted[b, q]]
                    for d in range(dim):
                        new_conv[l, b, d, j] = src[d]
                else:
                    for d in range(dim):
                        new_conv[l, b, d, j] = conv[l, b, d, K + q]


@njit(cache=True, inline="always")
def _sweep(out, decay, xs, Bs, t, k):
    """``out [p, s]`` (a head's state) advanced in place by the path's tokens t .. t + k - 1 (k <=
    ``SWEEP``) in one pass: per entry, token by token, a product, a product and a sum."""
    headdim, dstate = out.shape
    d0, d1, d2, d3 = decay[t], decay[t + min(1, k - 1)], decay[t + min(2, k - 1)], decay[t + k - 1]
    for p in range(headdim):
        x0 = xs[t, p]
        if k == 1:
            for s in range(dstate):
                out[p, s] = out[p, s] * d0 + x0 * Bs[t, s]
        elif k == 2:
            x1 = xs[t + 1, p]
            for s in range(dstate):
                out[p, s] = (out[p, s] * d0 + x0 * Bs[t, s]) * d1 + x1 * Bs[t + 1, s]
        elif k == 3:
            x1, x2 = xs[t + 1, p], xs[t + 2, p]
            for s in range(dstate):
                out[p, s] = ((out[p, s] * d0 + x0 * Bs[t, s]) * d1 + x1 * Bs[t + 1, s]) * d2 + x2 * Bs[t + 2, s]
        else:
            x1, x2, x3 = xs[t + 1, p], xs[t + 2, p], xs[t + 3, p]
            for s in range(dstate):
                out[p, s] = ((((out[p, s] * d0 + x0 * Bs[t, s]) * d1 + x1 * Bs[t + 1, s]) * d2
                              + x2 * Bs[t + 2, s]) * d3 + x3 * Bs[t + 3, s])
