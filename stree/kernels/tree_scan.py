"""Mamba2's SSM over a packed token tree (STree): one state in, one output per node.

For head h and node i, with j ranging over i's ancestors-or-self and x0 the committed state::

    dA_j     = dt_j * A_h                       (dt after bias, softplus, clamp)
    Atree_i  = sum_j dA_j
    y_i      = C_i . (exp(Atree_i) x0) + sum_j exp(Atree_i - Atree_j) (C_i . B_j) dt_j x_j + D x_i

which is the recurrence ``h_i = exp(dA_i) h_parent(i) + dt_i x_i B_i^T``, ``y_i = C_i . h_i + D x_i``
along every root-to-node path at once. On a chain it is Mamba2's SSD with an initial state.
"""

from __future__ import annotations

import functools

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
    check_packed,
    check_tensor,
    check_tree,
    dot_precision,
    f32,
    identity_slots,
    jit_takes,
    packed_strides,
    pool_rows,
    pow2_block,
    process_dt,
    process_dt_tl,
    readable,
    resolve_backend,
    slot_rows,
    tree_span,
)
from ..tree import MAX_TREE_NODES, PackedTrees
from .cpu import tree_jit
from .cpu.tree_jit import jit_tree_fits

__all__ = ["tree_scan", "tree_scan_torch", "MAX_TREE_NODES"]


@triton.jit
def _tree_scan_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, x0_ptr, slot_ptr, y_ptr, pre_ptr, last_ptr, cu_ptr,
    n, nheads, headdim, dstate, heads_per_group, dt_lo, dt_hi,
    s_x_b, s_x_n, s_x_h, s_x_p,
    s_dt_b, s_dt_n, s_dt_h,
    s_B_b, s_B_n, s_B_g, s_B_s,
    s_C_b, s_C_n, s_C_g, s_C_s,
    s_D_h, s_D_p,
    s_x0_b, s_x0_h, s_x0_p, s_x0_s,
    s_y_b, s_y_n, s_y_h, s_y_p,
    s_tree_b,
    HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, HAS_X0: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One program per (row, head), block of nodes and block of head dims. Long for a reason: one
    compiled body whose phases (dt, the interval cumsums, the masked products, the state term)
    share registers; split into jit helpers they would not be shorter to read."""
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_p = tl.program_id(2)
    b = pid_bh // nheads
    h = pid_bh % nheads
    g = h // heads_per_group

    start, n = tree_span(cu_ptr, b, n, VARLEN)  # packed trees: tree b's own nodes
    x_ptr += b * s_x_b + start * s_x_n + h * s_x_h
    dt_ptr += b * s_dt_b + start * s_dt_n + h * s_dt_h
    B_ptr += b * s_B_b + start * s_B_n + g * s_B_g
    C_ptr += b * s_C_b + start * s_C_n + g * s_C_g
    y_ptr += b * s_y_b + start * s_y_n + h * s_y_h
    pre_ptr += b * s_tree_b + start
    last_ptr += b * s_tree_b + start

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_s = tl.arange(0, BLOCK_S)
    m_ok = offs_m < n
    p_ok = offs_p < headdim

    A = tl.load(A_ptr + h).to(tl.float32)
    bias = 0.0
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias_ptr + h).to(tl.float32)

    # Ancestors precede their descendants, so rows of this tile only see columns below `hi`.
    # Column tiles are visited last first: `below[r]` accumulates dA over r's ancestors-or-self in
    # the tiles already visited, so exp(Atree_r - Atree_c) = exp(dA summed over the path strictly
    # below c) comes from one reverse cumsum per tile, never from differences of whole-path sums
    # (which would also cost a pass over all earlier columns per tile).
    hi = tl.where(pid_m * BLOCK_M < n, tl.minimum(n, (pid_m + 1) * BLOCK_M), 0)  # 0: a tile past a packed tree
    num_k = tl.cdiv(hi, BLOCK_K)
    pre_m = tl.load(pre_ptr + offs_m, mask=m_ok, other=-1)
    below = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)

    for kk in range(0, num_k):
        offs_k = (num_k - 1 - kk) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < n
        pre_k = tl.load(pre_ptr + offs_k, mask=k_ok, other=n)
        last_k = tl.load(last_ptr + offs_k, mask=k_ok, other=-1)
        dt_k = tl.load(dt_ptr + offs_k * s_dt_n, mask=k_ok, other=0.0).to(tl.float32)
        dt_k = process_dt_tl(dt_k, bias, DT_SOFTPLUS, dt_lo, dt_hi)
        anc = (pre_k[None, :] <= pre_m[:, None]) & (pre_m[:, None] <= last_k[None, :])  # c is r or above it
        path_dA = tl.where(anc, (dt_k * A)[None, :], 0.0)
        # Later columns of r's path are deeper: the reverse cumsum minus the column itself sums
        # the path strictly below c inside this tile; `below` adds the deeper tiles.
        seg = tl.cumsum(path_dA, axis=1, reverse=True) - path_dA + below[:, None]
        decay = tl.exp(tl.where(anc, seg, -float("inf")))  # exp(-inf) = 0, never an overflowing exp
        below += tl.sum(path_dA, axis=1)
        # C B^T over d_state in slices of BLOCK_S: whole [*, d_state] tiles of C and B would
        # not fit in registers next to the accumulators at d_state 128.
        cb = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for s0 in range(0, dstate, BLOCK_S):
            s_ok = s0 + offs_s < dstate
            C_s = tl.load(C_ptr + offs_m[:, None] * s_C_n + (s0 + offs_s)[None, :] * s_C_s,
                          mask=m_ok[:, None] & s_ok[None, :], other=0.0)
            B_s = tl.load(B_ptr + offs_k[:, None] * s_B_n + (s0 + offs_s)[None, :] * s_B_s,
                          mask=k_ok[:, None] & s_ok[None, :], other=0.0)
            cb += tl.dot(C_s, tl.trans(B_s), input_precision=DOT_PRECISION)
        w = cb * decay * dt_k[None, :]
        x_k = tl.load(x_ptr + offs_k[:, None] * s_x_n + offs_p[None, :] * s_x_p,
                      mask=k_ok[:, None] & p_ok[None, :], other=0.0)
        acc += tl.dot(w.to(x_k.dtype), x_k, input_precision=DOT_PRECISION)

    if HAS_X0:
        # The state is fp32; keep its contribution fp32 whatever the activation dtype. The row's
        # state is slot `slot[b]` of the pool (a negative slot: a padding row, zero state).
        slot = tl.load(slot_ptr + b).to(tl.int64) + tl.zeros((BLOCK_S,), dtype=tl.int64)  # (a vector: a mask)
        x0_row = x0_ptr + tl.maximum(slot, 0) * s_x0_b + h * s_x0_h
        cx = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
        for s0 in range(0, dstate, BLOCK_S):
            s_ok = s0 + offs_s < dstate
            C_s = tl.load(C_ptr + offs_m[:, None] * s_C_n + (s0 + offs_s)[None, :] * s_C_s,
                          mask=m_ok[:, None] & s_ok[None, :], other=0.0).to(tl.float32)
            x0 = tl.load(x0_row[:, None] + (s0 + offs_s)[:, None] * s_x0_s + offs_p[None, :] * s_x0_p,
                         mask=(s_ok & (slot >= 0))[:, None] & p_ok[None, :], other=0.0)
            cx += tl.dot(C_s, x0, input_precision="ieee")
        acc += cx * tl.exp(below)[:, None]  # below = Atree of the row after the last tile

    x_m = tl.load(x_ptr + offs_m[:, None] * s_x_n + offs_p[None, :] * s_x_p,
                  mask=m_ok[:, None] & p_ok[None, :], other=0.0).to(tl.float32)
    if HAS_D:
        D = tl.load(D_ptr + h * s_D_h + offs_p * s_D_p, mask=p_ok, other=0.0).to(tl.float32)
        acc += D[None, :] * x_m
    tl.store(y_ptr + offs_m[:, None] * s_y_n + offs_p[None, :] * s_y_p, acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & p_ok[None, :])


def _check_args(x, dt, A, B, C, parents, D, dt_bias, dt_limit, initial_state, state_indices=None):
    batch, n, nheads, headdim = check_layout("x", x, "batch, n, nheads, headdim")
    device = x.device
    trees = check_packed("x", x, parents)
    if n > MAX_TREE_NODES and trees is None:
        raise ValueError(f"tree_scan handles trees of at most {MAX_TREE_NODES} nodes, got n = {n}")
    if n == 0:
        raise ValueError("x has no nodes (n = 0)")
    check_tensor("dt", dt, (batch, n, nheads), device)
    ngroups, dstate = check_layout("B", B, "batch, n, ngroups, dstate")[2:]
    check_tensor("B", B, (batch, n, ngroups, dstate), device, dtype=x.dtype)
    check_tensor("C", C, (batch, n, ngroups, dstate), device, dtype=x.dtype)
    check_groups(nheads, ngroups)
    D = check_ssm_params(nheads, headdim, device, A, D, dt_bias)
    if initial_state is not None or state_indices is not None:
        rows = pool_rows("initial_state", initial_state, "slots, nheads, headdim, dstate", state_indices,
                         trees or batch, device)
        check_tensor("initial_state", initial_state, (rows, nheads, headdim, dstate), device, dtype=torch.float32)
    index = parents if trees is not None else check_tree(parents, batch, n, device)
    return index, D, check_dt_limit(dt_limit)


# A chain longer than this is scanned in blocks of this many nodes (the state carried between them):
# the ancestor masks' work grows with the square of the nodes, a prefill's 256-token chains at
# batch 16 spent most of their time there.
CHAIN_BLOCK = 64
# Inside torch.compile a tree of at most this many nodes multiplies by broadcast products summed
# (:func:`_product`) and sums Atree along its paths (:func:`_path_sums`), which Inductor fuses into its
# loops around them; as batched matmuls each product is a call of its own, and the initial state's read
# a transposed copy first. Measured on the shipped target's fused iteration (docs/kernels.md); at more
# nodes the matmuls' arithmetic wins.
FUSED_NODES = 16
# ... and of at least this many nodes in all its rows sums Atree along each node's path
# (:func:`_path_sums`), where the product summed opens an OpenMP region per row and node (see there).
PATH_SUMS = 12


def tree_scan_torch(x, dt, A, B, C, parents, *, D=None, dt_bias=None, dt_softplus=True,
                  dt_limit=(0.0, INF), initial_state=None):
    """Vectorised PyTorch version of the formula above (fp32, explicit ``n x n`` ancestor mask).
    Heads are grouped as ``[g, h / g]`` so B and C broadcast over their group instead of being
    repeated; the tree's masks are made once per tree (every layer of a pass shares them). A
    chain of more than ``CHAIN_BLOCK`` nodes (a prefill) runs block by block, as Mamba2's chunked
    scan does: each block from the state the blocks before it left."""
    index, D, dt_limit = _check_args(x, dt, A, B, C, parents, D, dt_bias, dt_limit, initial_state)
    return _scan_torch(x, dt, A, B, C, index, D, dt_bias, dt_softplus, dt_limit, initial_state)


def _scan_torch(x, dt, A, B, C, index, D, dt_bias, dt_softplus, dt_limit, initial_state):
    """:func:`tree_scan_torch` on checked arguments (D ``[h, p]`` or None)."""
    batch, n, nheads, headdim = x.shape
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)  # [b, n, h]
    if n > CHAIN_BLOCK and index.is_chain():
        y = _chain_blocks(x, dt, A, B, C, initial_state)
    else:
        y = _block(x, dt, A, B, C, *_masks(index), initial_state)[0]
    y = y.view(batch, nheads, n, headdim).transpose(1, 2)
    if D is not None:
        y = torch.addcmul(y, f32(x), f32(D))
    return y.to(x.dtype).contiguous() if y.dtype != x.dtype else y.contiguous()


def _masks(index):
    """The tree's ancestor mask as floats ``[rows, n, n]``, its complement ``[rows, 1, n, n]`` and,
    for a tree a compiled pass fuses (see :func:`_path_sums`; None otherwise), each node's ancestors
    level by level ``[rows, levels, n]``."""
    paths = None
    if index.n <= FUSED_NODES and index.device.type == "cpu":  # (where Inductor compiles the path: no sync)
        paths = index.memo("ancestors_by_level", lambda: _by_level(index.ancestor_mask(), index.depth.long()))
    return (index.memo("ancestor_mask_f32", lambda: index.ancestor_mask().float()),
            index.memo("not_ancestor", lambda: ~index.ancestor_mask()[:, None]), paths)


def _by_level(mask: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """``[rows, levels, n]``: node i's ancestor-or-self at depth d, or ``n`` (a zero row of
    :func:`_path_sums`) where i is shallower, from the ancestor mask ``[rows, n, n]`` and the
    depths ``[rows, n]``."""
    rows, n = depth.shape
    out = torch.full((rows, int(depth.max()) + 1, n), n, dtype=torch.long, device=depth.device)
    r, i, j = mask.nonzero(as_tuple=True)
    out[r, depth[r, j], i] = j
    return out


def _path_sums(v: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
    """``L @ v`` (``v [b, n, h]``, L the ancestor mask) as each node's sum along its path, root
    first, a gather per level (``paths`` from :func:`_by_level`): elementwise work Inductor fuses
    into its loops. As a product summed Inductor made it a parallel reduction, an OpenMP region
    opened once per row and node inside the loops over them: the layer's fused loop 1.5-2x as
    long at 13-16 nodes, or at 8 and batch 2; a little shorter at up to 8 nodes at batch 1 (the
    regions few; docs/kernels.md)."""
    padded = torch.cat([v, v.new_zeros(v.shape[0], 1, v.shape[2])], 1)
    out = None
    for level in paths.unbind(1):  # [rows, n]
        term = (padded[:, level[0]] if paths.shape[0] == 1
                else padded.gather(1, level[:, :, None].expand(-1, -1, v.shape[2])))
        out = term if out is None else out + term
    return out


def _block(x, dt, A, B, C, L, off, paths, initial_state):
    """The formula over one block of nodes (``dt`` processed, ``[b, n, h]``) under its masks
    (:func:`_masks`): ``y [b, g, h / g, n, p]`` without the D term, and Atree ``[b, h, n]``."""
    batch, n, nheads, headdim = x.shape
    g = B.shape[2]
    r = nheads // g
    # Batched matmuls (eager: on the CPU einsum costs several times as much at these sizes), or
    # what Inductor fuses (FUSED_NODES).
    fused = torch.compiler.is_compiling() and n <= FUSED_NODES
    mm = _product if fused else torch.matmul
    # In-place where autograd does not record (decoding); the training forward needs the graph.
    mul = (lambda a, b: a.mul_(b)) if not torch.is_grad_enabled() else torch.mul
    dA = dt * f32(A)
    summed = fused and paths is not None and batch * n >= PATH_SUMS
    atree = (_path_sums(dA, paths) if summed else mm(L, dA)).transpose(1, 2)  # [b, h, n]
    decay = (atree[..., :, None] - atree[..., None, :]).masked_fill(off, -INF).exp()  # [b, h, i, j]
    Cg = f32(C).transpose(1, 2)  # [b, g, n, s]
    w = mul(decay.view(batch, g, r, n, n), mm(Cg, f32(B).permute(0, 2, 3, 1))[:, :, None])  # * (C_i . B_j)
    w = mul(w, dt.transpose(1, 2).reshape(batch, g, r, 1, n))  # * dt_j
    y = mm(w, f32(x).transpose(1, 2).reshape(batch, g, r, n, headdim))  # [b, g, r, n, p]
    if initial_state is not None:
        state = initial_state.view(batch, g, r, headdim, initial_state.shape[-1]).transpose(-1, -2)
        y = torch.addcmul(y, mm(Cg[:, :, None], state), atree.exp().view(batch, g, r, n, 1))
    return y, atree


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (batch dimensions broadcast) as a broadcast product summed over the shared one."""
    return (a[..., :, :, None] * b[..., None, :, :]).sum(-2)


def _chain_blocks(x, dt, A, B, C, initial_state):
    """A chain's ``y [b, g, h / g, n, p]`` block by block (``CHAIN_BLOCK`` nodes each): a block's
    state after its last node is exp(Atree_last) x0 + sum_j exp(Atree_last - Atree_j) dt_j
    x_j B_j^T, its Atree counted from the block's start."""
    batch, n, nheads, headdim = x.shape
    g, dstate = B.shape[2], B.shape[3]
    r = nheads // g
    state, out = initial_state, []
    for start in range(0, n, CHAIN_BLOCK):
        end = min(n, start + CHAIN_BLOCK)
        xs, dts, Bs = x[:, start:end], dt[:, start:end], B[:, start:end]
        y, atree = _block(xs, dts, A, Bs, C[:, start:end], *_chain_masks(end - start, x.device), state)
        out.append(y)
        if end == n:
            break
        last = atree[..., -1:]  # [b, h, 1]
        w = (last - atree).exp() * dts.transpose(1, 2)  # [b, h, m]: what x_j is worth at the block's end
        xw = (f32(xs).permute(0, 2, 3, 1) * w[:, :, None]).view(batch, g, r, headdim, end - start)
        new = (xw @ f32(Bs).transpose(1, 2)[:, :, None]).view(batch, nheads, headdim, dstate)
        state = new if state is None else torch.addcmul(new, state, last.exp()[..., None])
    return torch.cat(out, dim=3)


@functools.lru_cache(maxsize=32)
def _chain_masks(m: int, device: torch.device):
    """A chain's masks (see :func:`_masks`) for ``m`` nodes, made once per size."""
    lower = torch.ones(m, m, dtype=torch.bool, device=device).tril()
    paths = None
    if m <= FUSED_NODES and device.type == "cpu":
        paths = _by_level(lower[None], torch.arange(m, device=device)[None])
    return lower.float()[None], ~lower[None, None], paths


def launch_config(n, headdim, dstate):
    """Tiles and warps of :func:`_tree_scan_kernel`, chosen with ``python -m stree.tools.aotcheck``:
    16-node tiles, up to 64 channels and d_state in slices of up to 32, on 8 warps, need under
    100 registers and never spill on sm_80 / sm_90, from the test sizes to Mamba2-2.7B and
    MambaInLlama-8B, in fp32 and 16-bit (32-node tiles need up to 254 registers in fp32)."""
    return dict(BLOCK_M=16, BLOCK_K=16, BLOCK_P=min(pow2_block(headdim), 64), BLOCK_S=min(pow2_block(dstate), 32),
                num_warps=8)


def _tree_scan_compiled(x, dt, A, B, C, parents, D, dt_bias, dt_softplus, dt_limit, initial_state):
    index, D, (lo, hi) = _check_args(x, dt, A, B, C, parents, D, dt_bias, dt_limit, initial_state)
    return jit_scan(tree_jit.tree_scan_rows, x, dt, A, B, C, D, dt_bias, dt_softplus, lo, hi, initial_state,
                    index.parents)


def jit_scan(kernel, x, dt, A, B, C, D, dt_bias, dt_softplus, lo, hi, initial_state, *parents, final=None):
    """A numba scan of :mod:`.cpu.tree_jit` on checked arguments (D ``[h, p]`` or None;
    ``parents``: the tree kernel's ``[rows, n]``, none for the chain kernel's; ``final``: a float32
    tensor the chain kernel writes each row's last state into)."""
    y = torch.empty(x.shape, dtype=torch.float32)
    x0 = initial_state if initial_state is not None else y.new_zeros(1, 1, 1, 1)
    kernel(*map(readable, (x, dt, A, B, C, D if D is not None else A[:, None])), D is not None,
           readable(dt_bias if dt_bias is not None else A), dt_bias is not None, bool(dt_softplus), float(lo),
           float(hi), *map(as_numpy, parents), as_numpy(x0), initial_state is not None, as_numpy(y),
           **({} if final is None else dict(final=as_numpy(final))))
    return y.to(x.dtype)


def tree_scan(x, dt, A, B, C, parents, *, D=None, dt_bias=None, dt_softplus=True,
              dt_limit=(0.0, INF), initial_state=None, state_indices=None, backend="auto"):
    """Mamba2 SSM outputs for every node of a packed tree (see the module docstring).

    x ``[b, n, h, p]``; dt ``[b, n, h]`` raw (before bias); A ``[h]``; B, C ``[b, n, g, s]`` in x's
    dtype; D ``[h]`` or ``[h, p]``; dt_bias ``[h]``; initial_state ``[b, h, p, s]`` fp32 (zeros if
    None); parents ``[n]``, ``[b, n]`` or a :class:`~stree.tree.TreeIndex`; n <= MAX_TREE_NODES (1024).
    Returns y ``[b, n, h, p]`` in x's dtype. ``state_indices [b]`` (int): initial_state is a pool
    ``[slots, h, p, s]`` and row b starts from slot ``state_indices[b]`` (negative: a padding row,
    zero state). ``parents`` a :class:`~stree.tree.PackedTrees` of b trees: x, dt, B, C hold their
    nodes back to back, ``[1, total, ...]``, and tree b's state is row (or slot) b. ``"auto"`` on
    CPU tensors of a small or shallow tree or a chain of any length (a prompt; outside autograd and
    ``torch.compile``) runs numba-compiled (:mod:`.tree_jit`).
    """
    check_layout("x", x, "batch, n, nheads, headdim")
    if isinstance(parents, PackedTrees) and resolve_backend(backend, x.device) == "torch":
        _check_args(x, dt, A, B, C, parents, D, dt_bias, dt_limit, initial_state, state_indices)
        x, dt, B, C = map(parents.unpack, (x, dt, B, C))
        return parents.pack(tree_scan(x, dt, A, B, C, parents.padded, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                      dt_limit=dt_limit, initial_state=initial_state, state_indices=state_indices,
                                      backend=backend))
    if state_indices is not None and resolve_backend(backend, x.device) == "torch":
        _check_args(x, dt, A, B, C, parents, D, dt_bias, dt_limit, initial_state, state_indices)
        return tree_scan(x, dt, A, B, C, parents, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                         initial_state=slot_rows(initial_state, state_indices), backend=backend)
    if backend == "auto" and jit_tree_fits(x.shape[1], x, dt, A, B, C, D, dt_bias, initial_state):
        return _tree_scan_compiled(x, dt, A, B, C, parents, D, dt_bias, dt_softplus, dt_limit, initial_state)
    if backend == "auto" and jit_takes(x, dt, A, B, C, D, dt_bias, initial_state):  # a longer tree
        index, D, (lo, hi) = _check_args(x, dt, A, B, C, parents, D, dt_bias, dt_limit, initial_state)
        if index.is_chain():  # a prompt's: its recurrence, compiled
            return jit_scan(tree_jit.chain_scan_rows, x, dt, A, B, C, D, dt_bias, dt_softplus, lo, hi, initial_state)
        if tree_jit.takes_tree(index):  # a shallow tree: the tree kernel (a deep one's masks stay batched products)
            return jit_scan(tree_jit.tree_scan_rows, x, dt, A, B, C, D, dt_bias, dt_softplus, lo, hi, initial_state,
                            index.parents)
        return _scan_torch(x, dt, A, B, C, index, D, dt_bias, dt_softplus, (lo, hi), initial_state)
    if resolve_backend(backend, x.device) == "torch":
        return tree_scan_torch(x, dt, A, B, C, parents, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                             dt_limit=dt_limit, initial_state=initial_state)
    index, D, (lo, hi) = _check_args(x, dt, A, B, C, parents, D, dt_bias, dt_limit, initial_state, state_indices)
    _, n, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    packed = isinstance(index, PackedTrees)
    batch, n = (index.batch, index.max_n) if packed else (x.shape[0], n)
    strides = packed_strides if packed else torch.Tensor.stride
    y = torch.empty_like(x)
    slots = identity_slots(batch, x.device) if state_indices is None else state_indices
    cfg = launch_config(n, headdim, dstate)
    block_m, block_p = cfg["BLOCK_M"], cfg["BLOCK_P"]
    grid = (batch * nheads, triton.cdiv(n, block_m), triton.cdiv(headdim, block_p))
    dummy = x  # never read: the matching HAS_* flag is off
    x0 = initial_state if initial_state is not None else dummy
    x0_strides = initial_state.stride() if initial_state is not None else (0, 0, 0, 0)
    _tree_scan_kernel[grid](
        x, dt, A, B, C, D if D is not None else dummy, dt_bias if dt_bias is not None else dummy, x0, slots, y,
        index.pre, index.last, index.cu_seqlens if packed else slots,
        n, nheads, headdim, dstate, nheads // ngroups, lo, hi,
        *strides(x), *strides(dt), *strides(B), *strides(C),
        *(D.stride() if D is not None else (0, 0)), *x0_strides, *strides(y),
        0 if packed else index.row_stride(),
        HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None, HAS_X0=initial_state is not None,
        DT_SOFTPLUS=bool(dt_softplus), VARLEN=packed, DOT_PRECISION=dot_precision(x.dtype), **cfg,
    )
    return y
