"""The tree conv1d and the tree scan on the CPU, compiled with numba: what
:func:`stree.kernels.tree_conv1d.tree_conv1d` and :func:`stree.kernels.tree_scan.tree_scan` compute,
each in one call instead of the PyTorch path's ~10 and ~25 ops (a tree pass of a few nodes on a
CPU is bound by per-op overhead, as a decode step is: :mod:`.step_jit`). Taken by
``backend="auto"`` for CPU tensors (half ones as float32 copies) outside autograd and
``torch.compile``: the conv at any size (a node's work is its d_conv taps); the scan of a small
or shallow tree (:func:`jit_tree_fits`, :func:`takes_tree`), whose work here grows with each
node's depth, the PyTorch path's with the square of the node count but in multi-threaded batched
products, and of a chain of any length (a prompt, :func:`chain_scan_rows`: its recurrence).
Tested against the float64 definitions beside the Triton kernels and the PyTorch path.
Products and sums in float32, as the Triton kernels' (a vector holds 8 lanes, not 4), the sums of
dA along a path in float64.
Each kernel is one row's loops (:func:`scan_row`, :func:`conv_row`, :func:`chain_row`; also called by
:mod:`.layer_jit`) under two drivers: several rows with
enough work between them (``PARALLEL_WORK``) run in parallel on numba's threading layer (OpenMP or
TBB where installed, both thread-safe; numba's fallback, workqueue, is not: several Python threads
decoding at once, as a threaded server would, need one of the two); a single row, or a few with
little work, run on their own, so that a process decoding one row never compiles the parallel
driver, whose compile (parfor analysis, then the row's loops optimised again inside it) is the
dearest of any numba function here, several times the serial one's.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange

from .._common import jit_takes
from . import gemm
from .step_jit import processed_dt

__all__ = ["JIT_MAX_NODES", "NOT_MADE", "SHALLOW", "aligned_empty", "chain_row", "chain_scan_rows", "conv_row",
           "jit_tree_fits", "parallel_rows", "scan_row", "state_terms", "takes_tree", "tiled_state", "tree_conv_rows",
           "tree_scan_rows"]

# A scan of a tree of at most this many nodes a row takes the compiled tree kernel (decoding
# trees); a longer chain (a prompt) the chain kernel, a longer tree the tree kernel where it is
# shallow (SHALLOW), else the batched products.
JIT_MAX_NODES = 64
# Past the state's term, which both paths compute alike, the tree kernel's work is each node's path
# to the root (its depth), the batched products' the square of the node count, shared by the
# threads. So a tree of more than JIT_MAX_NODES nodes takes the kernel where the nodes' mean depth
# is below SHALLOW / threads of the node count. Tree passes of the shipped target on the 2-core
# EPYC (float32, one row): on two threads the kernel took 3-41% less time than the products up to
# a mean depth of 0.4 of the nodes (trees of 128-512 nodes), and up to 15% more past it (a chain
# with one fork, 200-500 nodes); on one thread less at every depth tried, up to half the nodes;
# random trees of 65-1000 nodes (parents among the 8 or 16 nodes before) took 25-63% less, so a
# pass now grows by about as much a node past 64 nodes as below (benchmarks/results/cost_cpu_large.json).
SHALLOW = 0.8
# A call runs its rows in parallel only where it visits at least this many elements (rows x nodes x
# channels x taps for the conv, x d_state for the scans): a parallel region costs tens of
# microseconds to start, and numba's threads (a pool apart from PyTorch's) spin a while after it.
# On a 2-core EPYC a batch-2 tree pass of the shipped target (426k elements a scan) ran no faster in
# parallel, and the commit after it took 2-4 times as long; at batch 8 (1.7M) parallel saved a tenth
# of the pass.
PARALLEL_WORK = 1 << 20
# The scan's state term (C_i . x0 for every node) is the tiled product's (gemm.state_term_unchecked)
# for trees of at least this many nodes a row, else the scan's own dot products along d_state. The
# product reads each block of the state once, packed on the fly, into a tile of up to 14 nodes; the
# dot products cost each node the state again, but no call and no packing. On the project's Intel
# Xeon, in one process taking turns (the shipped target, float32), the product made a pass cost, in
# steps: at batch 1 +0.025 at 8 nodes, +0.02 at 10, -0.02 at 12, the same at 13, -0.03 at 16 and
# -0.09 at 24; at batch 2 -0.01 to +0.02 at 4-8 nodes a row, -0.03 at 10, -0.10 to -0.15 at 13.
# A row count (the rows' nodes in all) would have taken batch 2's smaller trees too, but a row's
# values would then depend on the rows beside it (the two sum d_state in other orders); by the
# nodes of a row they do not, as the products' do not.
STATE_NODES = 12
# Reassociation and fused multiply-adds let LLVM vectorise the dot products; no assumption that
# values are finite (a NaN or inf must reach the logits, where decoding checks for them).
_FAST = {"reassoc", "contract"}
NOT_MADE = np.empty((1, 1, 1, 1), dtype=np.float32)  # (an argument not read: the state term where scan_row makes it)


def jit_tree_fits(n: int, *tensors) -> bool:
    """Whether the compiled path takes a tree of ``n`` nodes over ``tensors`` (None allowed):
    :func:`~._common.jit_takes` (outside autograd and ``torch.compile``) and a small tree."""
    return n <= JIT_MAX_NODES and jit_takes(*tensors)


def takes_tree(index) -> bool:
    """Whether the tree kernel takes the tree of ``index`` (a :class:`~stree.tree.TreeIndex`): one
    of at most ``JIT_MAX_NODES`` nodes, or a larger one that is no chain and whose nodes' mean depth
    is below ``SHALLOW / torch.get_num_threads()`` of its node count (a chain is the chain kernel's,
    a deep tree the batched products')."""
    n = index.n
    if n <= JIT_MAX_NODES:
        return True
    if index.is_chain():
        return False
    mean = index.memo("mean_depth", lambda: float(index.depth.float().mean()))
    return mean < SHALLOW / torch.get_num_threads() * n


def parallel_rows(rows: int, work: int) -> bool:
    """Whether a call of ``rows`` rows visiting ``work`` elements runs them in parallel."""
    return rows > 1 and work >= PARALLEL_WORK


@njit(cache=True)
def aligned_empty(n):
    """A float32 array of ``n`` elements starting on a 64-byte boundary, as torch's memory does:
    NumPy aligns to 16 bytes only, and the tree scan, adding into its output's rows in place, ran at
    about half speed on an output off a 32-byte boundary (the shipped target's sizes:
    docs/kernels.md). Compiled, because the address read from Python (``__array_interface__``, a
    few microseconds hot) cost a tree pass's layer several times that between its products."""
    buf = np.empty(n + 16, dtype=np.float32)
    start = (-buf.ctypes.data % 64) // 4
    return buf[start: start + n]


def tree_conv_rows(xBC, parents, state, weight, bias, has_bias, out):
    """xBC ``[b, n, dim]``, parents ``[rows, n]`` (rows 1 or b; parents before children), state
    ``[b, dim, K]`` (newest last), weight ``[dim, K]``, bias ``[dim]``; out ``[b, n, dim]``: node
    i's taps over its path (itself at tap K - 1, its parent at K - 2, ..., then the state's newest
    columns), + bias; the activation is the caller's (a vectorised SiLU: numba's exp is scalar)."""
    # (a view of the in_proj output made contiguous: the loops over dim vectorise)
    (_conv_parallel if parallel_rows(len(xBC), xBC.size * weight.shape[1]) else _conv_serial)(
        np.ascontiguousarray(xBC), parents, state, weight, bias, has_bias, out)


@njit(cache=True, fastmath=_FAST)
def conv_row(b, xBC, parents, state, weight, bias, has_bias, out):
    """Row ``b`` of :func:`tree_conv_rows`."""
    n, dim = xBC.shape[1], xBC.shape[2]
    K = weight.shape[1]
    # [K, dim], the loops below run along dim; made per row on purpose: handed in by the driver, the
    # array may alias out for all LLVM knows, and the loop over dim ran slower
    taps = np.ascontiguousarray(weight.T)
    r = b if parents.shape[0] > 1 else 0
    past = np.empty((K, dim), dtype=np.float32)  # the state's columns, as rows
    for c in range(dim):
        for k in range(K):
            past[k, c] = state[b, c, k]
    for i in range(n):
        o = out[b, i]  # (1-d rows: indexed out[b, i, c] in the row's own function, the loop over dim stayed scalar)
        for c in range(dim):
            o[c] = bias[c] if has_bias else np.float32(0.0)
        pos = i
        for k in range(K - 1, -1, -1):  # tap k reads the node K - 1 - k steps up its path
            tap = taps[k]
            src = xBC[b, pos] if pos >= 0 else past[K + pos]
            for c in range(dim):
                o[c] += tap[c] * src[c]
            pos = parents[r, pos] if pos >= 0 else pos - 1


@njit(cache=True)
def _conv_serial(xBC, parents, state, weight, bias, has_bias, out):
    for b in range(xBC.shape[0]):
        conv_row(b, xBC, parents, state, weight, bias, has_bias, out)


@njit(cache=True, parallel=True)
def _conv_parallel(xBC, parents, state, weight, bias, has_bias, out):
    for b in prange(xBC.shape[0]):
        conv_row(np.int64(b), xBC, parents, state, weight, bias, has_bias, out)  # (prange's index is unsigned)


def tree_scan_rows(x, dt, A, B, C, D, has_D, bias, has_bias, softplus, lo, hi, parents, x0, has_x0, y):
    """x ``[b, n, h, p]``, dt ``[b, n, h]`` raw, A and bias ``[h]``, B and C ``[b, n, g, s]``, D
    ``[h, p]``, parents ``[rows, n]`` (parents before children), x0 ``[b, h, p, s]``; y ``[b, n, h,
    p]`` = C_i . (exp(Atree_i) x0) + sum over i's ancestors-or-self j of exp(Atree_i - Atree_j)
    (C_i . B_j) dt_j x_j, + D x_i (the tree scan's definition, walked along each node's path)."""
    # (views of one conv output, and D a head's value broadcast: contiguous copies let the loops
    # over d_state and headdim vectorise)
    x, B, C, D = map(np.ascontiguousarray, (x, B, C, D))
    xs = state_terms(C, x0, x.shape[2], x.shape[3]) if has_x0 else None
    (_scan_parallel if parallel_rows(len(x), x.size * B.shape[3]) else _scan_serial)(
        x, dt, A, B, C, D, has_D, bias, has_bias, softplus, lo, hi, parents, x0, has_x0,
        NOT_MADE if xs is None else xs, xs is not None, y)


def tiled_state(nodes: int, d_state: int) -> bool:
    """Whether the scan's state term of trees of ``nodes`` nodes is the tiled product's
    (:func:`state_terms`): ``STATE_NODES`` or more, where it is built and takes d_state."""
    return nodes >= STATE_NODES and gemm.takes_state(d_state)


def state_terms(C: np.ndarray, x0: np.ndarray, heads: int, headdim: int) -> np.ndarray | None:
    """The tree scan's state term before its decay, ``C_i . x0`` ``[b, n, h, p]`` for C ``[b, n, g,
    s]`` (contiguous) and x0 ``[b, h, p, s]``, by the tiled product where :func:`tiled_state`
    says so, else None (:func:`scan_row` then makes it itself)."""
    batch, n, groups, dstate = C.shape
    if not tiled_state(n, dstate):
        return None
    x0 = np.ascontiguousarray(x0)
    out = np.empty((batch, n, heads, headdim), dtype=np.float32)
    gemm.state_term_unchecked(C.ctypes.data, batch, n, groups, dstate, groups * dstate, n * groups * dstate,
                              x0.ctypes.data, heads, headdim, out.ctypes.data)
    return out


@njit(cache=True, fastmath=_FAST)
def scan_row(b, x, dt, A, B, C, D, has_D, bias, has_bias, softplus, lo, hi, parents, x0, has_x0, xs, has_xs, y):
    """Row ``b`` of :func:`tree_scan_rows`."""
    n, heads, headdim = x.shape[1], x.shape[2], x.shape[3]
    groups, dstate = B.shape[2], B.shape[3]
    per_group = heads // groups
    r = b if parents.shape[0] > 1 else 0
    d = np.empty((n, heads), dtype=np.float32)  # dt after bias, softplus and clamp
    at = np.empty((n, heads))  # Atree: dA summed over the node's path (float64: differences of sums)
    decay = np.empty((n, heads), dtype=np.float32)  # exp(Atree), the state's decay (exp is scalar here)
    cb = np.empty(groups, dtype=np.float32)
    acc = y[b]  # (float32, made by the caller: the sums accumulate in place)
    for i in range(n):
        q = parents[r, i]
        for h in range(heads):
            v = processed_dt(dt[b, i, h], bias[h], has_bias, softplus, lo, hi)
            d[i, h] = v
            at[i, h] = v * float(A[h]) + (at[q, h] if q >= 0 else 0.0)
            decay[i, h] = math.exp(at[i, h])
    for i in range(n):
        for h in range(heads):
            for p in range(headdim):
                acc[i, h, p] = D[h, p] * x[b, i, h, p] if has_D else np.float32(0.0)
    if has_xs:  # the state's term, exp(Atree_i) (C_i . x0), its products made by the caller
        for i in range(n):
            for h in range(heads):
                dec, row, made = decay[i, h], acc[i, h], xs[b, i, h]
                for p in range(headdim):
                    row[p] += dec * made[p]
    elif has_x0:  # the same, a dot product along d_state per (node, head, channel), where x0's rows
        # lie contiguous (no copy of the state transposed, read cold as a pass reads it)
        for h in range(heads):
            g = h // per_group
            state = x0[b, h]
            for i in range(n):
                c, dec, row = C[b, i, g], decay[i, h], acc[i, h]
                for p in range(headdim):
                    sp = state[p]
                    v = np.float32(0.0)
                    for s in range(dstate):
                        v += c[s] * sp[s]
                    row[p] += dec * v
    for i in range(n):
        j = i
        while j >= 0:
            for g in range(groups):
                s0 = np.float32(0.0)
                for s in range(dstate):
                    s0 += C[b, i, g, s] * B[b, j, g, s]
                cb[g] = s0
            for h in range(heads):
                coef = np.float32(math.exp(at[i, h] - at[j, h])) * cb[h // per_group] * d[j, h]
                for p in range(headdim):
                    acc[i, h, p] += coef * x[b, j, h, p]
            j = parents[r, j]


@njit(cache=True)
def _scan_serial(x, dt, A, B, C, D, has_D, bias, has_bias, softplus, lo, hi, parents, x0, has_x0, xs, has_xs, y):
    for b in range(x.shape[0]):
        scan_row(b, x, dt, A, B, C, D, has_D, bias, has_bias, softplus, lo, hi, parents, x0, has_x0, xs, has_xs, y)


@njit(cache=True, parallel=True)
def _scan_parallel(x, dt, A, B, C, D, has_D, bias, has_bias, softplus, lo, hi, parents, x0, has_x0, xs, has_xs, y):
    for b in prange(x.shape[0]):
        scan_row(np.int64(b), x, dt, A, B, C, D, has_D, bias, has_bias, softplus, lo, hi, parents, x0, has_x0, xs,
                 has_xs, y)


def chain_scan_rows(x, dt, A, B, C, D, has_D, bias, has_bias, softplus, lo, hi, x0, has_x0, y, final=None):
    """:func:`tree_scan_rows` for chains (node i the child of node i - 1) of any length, a prompt's
    or a chain draft's: the recurrence ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = C_t
    . h_t + D x_t``, one state per (row, head) carried along the tokens, where the tree kernel's
    work grows with each node's depth (the square of a chain's length). ``final`` ``[b, h, p, s]``,
    where given, gets each row's state after its last token (:func:`~stree.kernels.multistep_update`)."""
    x, B, C, D = map(np.ascontiguousarray, (x, B, C, D))
    keep = final is not None
    # (in parallel by (row, head): a prompt's prefill is one row, whose heads are independent chains)
    (_chain_parallel if parallel_rows(len(x) * x.shape[2], x.size * B.shape[3]) else _chain_serial)(
        x, dt, A, B, C, D, has_D, bias, has_bias, softplus, lo, hi, x0, has_x0, y,
        final if keep else np.empty((1, 1, 1, 1), dtype=np.float32), keep)


@njit(cache=True, fastmath={"reassoc"})  # (no contraction: the state rounds as a step's does)
def chain_head(b, h, x, dt, A, B, C, D, has_D, bias, has_bias, softplus, lo, hi, x0, has_x0, y, final, keep):
    """Head ``h`` of row ``b`` of :func:`chain_scan_rows`; the state rounds as the step kernel's does
    (:func:`~.step_jit.state_update_rows`: the decay and dt x rounded from float64, then a
    product, a product and a sum per entry)."""
    n, headdim, dstate = x.shape[1], x.shape[3], B.shape[3]
    g = h // (x.shape[2] // B.shape[2])
    state = np.empty((headdim, dstate), dtype=np.float32)  # the head's, carried along the tokens
    for p in range(headdim):
        for s in range(dstate):
            state[p, s] = x0[b, h, p, s] if has_x0 else np.float32(0.0)
    for t in range(n):
        d = processed_dt(dt[b, t, h], bias[h], has_bias, softplus, lo, hi)
        decay = np.float32(math.exp(d * float(A[h])))
        for p in range(headdim):
            xv = x[b, t, h, p]
            dx = np.float32(d * xv)
            acc = np.float32(0.0)
            for s in range(dstate):
                v = state[p, s] * decay + dx * B[b, t, g, s]
                state[p, s] = v
                acc += v * C[b, t, g, s]
            if has_D:
                acc += D[h, p] * xv
            y[b, t, h, p] = acc
    if keep:
        final[b, h] = state


@njit(cache=True)
def chain_row(b, x, dt, A, B, C, D, has_D, bias, has_bias, softplus, lo, hi, x0, has_x0, y, final, keep):
    """Row ``b`` of :func:`chain_scan_rows`, head by head."""
    for h in range(x.shape[2]):
        chain_head(b, h, x, dt, A, B, C, D, has_D, bias, has_bias, softplus, lo, hi, x0, has_x0, y, final, keep)


@njit(cache=True)
def _chain_serial(x, dt, A, B, C, D, has_D, bias, has_bias, softplus, lo, hi, x0, has_x0, y, final, keep):
    for b in range(x.shape[0]):
        chain_row(b, x, dt, A, B, C, D, has_D, bias, has_bias, softplus, lo, hi, x0, has_x0, y, final, keep)


@njit(cache=True, parallel=True)
def _chain_parallel(x, dt, A, B, C, D, has_D, bias, has_bias, softplus, lo, hi, x0, has_x0, y, final, keep):
    heads = x.shape[2]
    for i in prange(x.shape[0] * heads):
        chain_head(np.int64(i // heads), np.int64(i % heads), x, dt, A, B, C, D, has_D, bias, has_bias, softplus, lo,
                   hi, x0, has_x0, y, final, keep)
