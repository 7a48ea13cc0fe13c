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

# A path of at least this many tokens (a prompt's commit) is replayed with each head's state
# transposed, the innermost loop along headdim over the whole path; shorter ones (a decoding tree's
# accepted path) channel by channel along d_state, whose state is read and written once per channel
# where the transposing costs more than the path.
LONG_PATH = 16


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
    row = np.empty(dstate, dtype=np.float32)
    rows = np.empty((dstate, headdim), dtype=np.float32)
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
                if m < LONG_PATH:
                    for p in range(headdim):
                        for s in range(dstate):
                            row[s] = state[l, b, h, p, s]
                        for t in range(m):  # the channel loop innermost: contiguous, vectorised
                            for s in range(dstate):
                                row[s] = row[s] * decay[t] + xs[t, p] * Bs[t, s]
                        for s in range(dstate):
                            new_state[l, b, h, p, s] = row[s]
                else:  # a long path: the head's state transposed, the loop along p
                    for p in range(headdim):
                        for s in range(dstate):
                            rows[s, p] = state[l, b, h, p, s]
                    for t in range(m):  # (the same products and sums per entry, in the same order)
                        for s in range(dstate):
                            c = Bs[t, s]
                            for p in range(headdim):
                                rows[s, p] = rows[s, p] * decay[t] + xs[t, p] * c
                    for p in range(headdim):
                        for s in range(dstate):
                            new_state[l, b, h, p, s] = rows[s, p]
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
