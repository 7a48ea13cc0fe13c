"""The RMS norms of a decoding pass on the CPU, compiled with numba: each norm one call instead of
the PyTorch path's several ops (a step of a small model on a CPU is bound by per-op overhead, and
a Mamba2 layer has two norms). Taken by ``backend="auto"`` for CPU float32 tensors; tested against
the float64 definitions beside the Triton kernel and the PyTorch path
(:mod:`stree.kernels.gated_norm`). The mean square in float64, every row on its own (so a row's
result does not depend on the rows beside it: a step and a tree pass norm a token alike), the
output rounded once to float32. The gate's SiLU comes computed (one vectorised op: a scalar exp
per channel here cost more than the rest of the norm).
"""

from __future__ import annotations

import math

from numba import njit

__all__ = ["gated_rms_norm_rows", "rms_norm_rows"]


@njit(cache=True, fastmath={"reassoc"})  # (the sums vectorise; a row's order never depends on the others)
def rms_norm_rows(x, weight, has_weight, eps, out):
    """x, out ``[rows, dim]``, weight ``[dim]``: ``x / sqrt(mean(x^2) + eps) * weight``."""
    rows, dim = x.shape
    for r in range(rows):
        acc = 0.0
        for d in range(dim):
            v = float(x[r, d])
            acc += v * v
        scale = 1.0 / math.sqrt(acc / dim + eps)
        for d in range(dim):
            v = float(x[r, d]) * scale
            if has_weight:
                v *= float(weight[d])
            out[r, d] = v


@njit(cache=True, fastmath={"reassoc"})
def gated_rms_norm_rows(y, gate, weight, has_weight, eps, gate_first, out):
    """y, gate (``silu(z)``), out ``[rows, group]``, each row one group of a token's channels;
    weight ``[groups, group]``, row r's being ``weight[r % groups]``. ``norm(y * gate) * weight``
    (``gate_first``; the product in y's float32, as the other paths hold it), else
    ``norm(y) * weight * gate``. (Loops of a fixed bound over whole rows: they vectorise.)"""
    rows, group = y.shape
    groups = weight.shape[0]
    for r in range(rows):
        w = r % groups
        acc = 0.0
        if gate_first:
            for d in range(group):
                v = float(y[r, d] * gate[r, d])
                acc += v * v
        else:
            for d in range(group):
                v = float(y[r, d])
                acc += v * v
        scale = 1.0 / math.sqrt(acc / group + eps)
        if gate_first:
            for d in range(group):
                v = float(y[r, d] * gate[r, d]) * scale
                out[r, d] = v * float(weight[w, d]) if has_weight else v
        else:
            for d in range(group):
                v = float(y[r, d]) * scale
                if has_weight:
                    v *= float(weight[w, d])
                out[r, d] = v * float(gate[r, d])
