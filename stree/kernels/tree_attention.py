"""Attention of packed-tree queries over a committed KV prefix plus the tree's own keys.

Query node i of row b attends to every committed position ``t < cache_seqlens[b]`` and to the
tree nodes that are i or its ancestors (the tree mask). Flash-style: one pass over the prefix and
one over the tree block with an online softmax, so the two parts merge exactly as one softmax.
GQA is native: query head h reads KV head ``h // (hq / hkv)``; K/V are never repeated in memory.
RoPE is the caller's job (positions ``prefix_len + depth``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..tree import PackedTrees
from ._common import (as_numpy, check_layout, check_packed, check_tensor, check_tree, dot_precision, identity_slots,
                      packed_strides, pool_rows, pow2_block, resolve_backend, slot_rows, tree_span)

__all__ = ["tree_attention", "tree_attention_torch"]

LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold a block of base-2 scores ``s`` [M, N] (-inf = masked) and values ``v`` [N, D] in."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _tree_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, lens_ptr, slot_ptr, kt_ptr, vt_ptr, pre_ptr, last_ptr, cu_ptr, out_ptr,
    n, hq, head_dim, q_per_kv, scale_log2,
    s_q_b, s_q_n, s_q_h, s_q_d,
    s_kc_b, s_kc_t, s_kc_h, s_kc_d,
    s_vc_b, s_vc_t, s_vc_h, s_vc_d,
    s_kt_b, s_kt_n, s_kt_h, s_kt_d,
    s_vt_b, s_vt_n, s_vt_h, s_vt_d,
    s_o_b, s_o_n, s_o_h, s_o_d,
    s_tree_b,
    VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = pid_bh // hq
    h = pid_bh % hq
    kvh = h // q_per_kv
    start, n = tree_span(cu_ptr, b, n, VARLEN)  # packed trees: tree b's own nodes
    q_ptr += b * s_q_b + start * s_q_n + h * s_q_h
    kt_ptr += b * s_kt_b + start * s_kt_n + kvh * s_kt_h
    vt_ptr += b * s_vt_b + start * s_vt_n + kvh * s_vt_h
    out_ptr += b * s_o_b + start * s_o_n + h * s_o_h
    pre_ptr += b * s_tree_b + start
    last_ptr += b * s_tree_b + start
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < n
    d_ok = offs_d < head_dim

    q = tl.load(q_ptr + offs_m[:, None] * s_q_n + offs_d[None, :] * s_q_d,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    # Finite floor instead of -inf: fully masked (padding) rows then give alpha = 1 and p = 0, not NaN.
    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    # the row's KV prefix is slot `slot[b]` of the caches (a negative slot: a padding row, no prefix)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    seqlen = tl.where(slot >= 0, tl.load(lens_ptr + b), 0)
    kc_row = kc_ptr + tl.maximum(slot, 0) * s_kc_b + kvh * s_kc_h
    vc_row = vc_ptr + tl.maximum(slot, 0) * s_vc_b + kvh * s_vc_h
    for t0 in range(0, seqlen, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        t_ok = offs_t < seqlen
        k = tl.load(kc_row + offs_t[:, None] * s_kc_t + offs_d[None, :] * s_kc_d,
                    mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(vc_row + offs_t[:, None] * s_vc_t + offs_d[None, :] * s_vc_d,
                    mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(t_ok[None, :], s, -float("inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)

    pre_m = tl.load(pre_ptr + offs_m, mask=m_ok, other=-1)
    # ancestors precede their descendants; a tile past a packed tree has no keys
    hi = tl.where(pid_m * BLOCK_M < n, tl.minimum(n, (pid_m + 1) * BLOCK_M), 0)
    for k0 in range(0, hi, BLOCK_N):
        offs_k = k0 + tl.arange(0, BLOCK_N)
        k_ok = offs_k < n
        k = tl.load(kt_ptr + offs_k[:, None] * s_kt_n + offs_d[None, :] * s_kt_d,
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(vt_ptr + offs_k[:, None] * s_vt_n + offs_d[None, :] * s_vt_d,
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        pre_k = tl.load(pre_ptr + offs_k, mask=k_ok, other=n)
        last_k = tl.load(last_ptr + offs_k, mask=k_ok, other=-1)
        anc = (pre_k[None, :] <= pre_m[:, None]) & (pre_m[:, None] <= last_k[None, :])
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(anc, s, -float("inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + offs_m[:, None] * s_o_n + offs_d[None, :] * s_o_d,
             out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def _check_args(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, parents, softmax_scale, validate,
                state_indices=None):
    batch, n, hq, head_dim = check_layout("q", q, "batch, n, q_heads, head_dim")
    device = q.device
    if n == 0:
        raise ValueError("q has no nodes (n = 0)")
    trees = check_packed("q", q, parents)
    rows = pool_rows("k_cache", k_cache, "slots, t_max, kv_heads, head_dim", state_indices, trees or batch, device)
    t_max, hkv = check_layout("k_cache", k_cache, "batch, t_max, kv_heads, head_dim")[1:3]
    if hkv < 1 or hq % hkv:
        raise ValueError(f"q_heads ({hq}) must be a multiple of kv_heads ({hkv})")
    check_tensor("k_cache", k_cache, (rows, t_max, hkv, head_dim), device, dtype=q.dtype)
    check_tensor("v_cache", v_cache, (rows, t_max, hkv, head_dim), device, dtype=q.dtype)
    check_tensor("k_tree", k_tree, (batch, n, hkv, head_dim), device, dtype=q.dtype)
    check_tensor("v_tree", v_tree, (batch, n, hkv, head_dim), device, dtype=q.dtype)
    check_tensor("cache_seqlens", cache_seqlens, (trees or batch,), device, kind="int")
    bad = (cache_seqlens < 0) | (cache_seqlens > t_max)
    if validate and bool(bad.any()):
        row = int(torch.nonzero(bad)[0])
        raise ValueError(f"cache_seqlens[{row}] = {int(cache_seqlens[row])} must be in [0, t_max = {t_max}]")
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    return (parents if trees is not None else check_tree(parents, batch, n, device)), scale


def tree_attention_torch(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, parents, *, softmax_scale=None,
                       validate=True):
    """SDPA over ``[prefix; tree]`` keys with an explicit mask (prefix length per row, tree mask).
    On the CPU the prefix is cut to the longest row's (:func:`_visible`)."""
    index, scale = _check_args(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, parents, softmax_scale, validate)
    k_cache, v_cache = _visible(k_cache, cache_seqlens), _visible(v_cache, cache_seqlens)
    batch, n, hq, _ = q.shape
    t_max, hkv = k_cache.shape[1:3]
    keys = torch.cat([k_cache, k_tree], dim=1).float().repeat_interleave(hq // hkv, dim=2)
    values = torch.cat([v_cache, v_tree], dim=1).float().repeat_interleave(hq // hkv, dim=2)
    prefix = torch.arange(t_max, device=q.device) < cache_seqlens[:, None]  # [b, t_max]
    mask = torch.cat([prefix[:, None, :].expand(batch, n, t_max), index.ancestor_mask().expand(batch, n, n)], dim=2)
    out = F.scaled_dot_product_attention(q.float().transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2).to(q.dtype)


def _visible(cache: torch.Tensor, seqlens: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """``cache`` cut along ``dim`` (its positions) to the longest prefix ``seqlens`` holds, on the
    CPU (where reading the lengths waits on nothing): the PyTorch path copies and masks every
    position it is given, and a cache is sized for the longest sequence it may hold (a serving
    slot for its whole ``max_length``), not for what it holds now. Elsewhere, and in a graph being
    compiled (whose shapes must not hang on the lengths' values), the cache as it is."""
    if cache.device.type != "cpu" or not seqlens.numel() or torch.compiler.is_compiling():
        return cache
    longest = int(as_numpy(seqlens).max())  # (the lengths' own memory, read on the host as the numba kernels do)
    return cache.narrow(dim, 0, min(max(longest, 0), cache.shape[dim]))


def launch_config(n, head_dim, dtype):
    """Tiles and warps of :func:`_tree_attention_kernel`, chosen with ``python -m stree.tools.aotcheck``
    to keep head_dim 128 free of spills on sm_80 / sm_90: up to 32 queries x 64 keys in 16-bit; fp32
    dots have no tensor-core path at full precision, so 16 x 16 on 8 warps there. A 16-query tile
    (a step, or a tree of up to 16 nodes) takes 8 warps: on 4, Triton 3.6 (the H200 image's, on
    2026-12-04) spilled on sm_80 where 3.8 did not."""
    if dtype == torch.float32:
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_D=pow2_block(head_dim), num_warps=8)
    block_m = min(pow2_block(n), 32)
    return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_D=pow2_block(head_dim), num_warps=8 if block_m == 16 else 4)


def tree_attention(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, parents, *, softmax_scale=None,
                   validate=True, state_indices=None, backend="auto"):
    """Tree-masked attention over a KV prefix and the tree's own K/V.

    q ``[b, n, hq, d]``; k_cache, v_cache ``[b, t_max, hkv, d]`` of which the first
    ``cache_seqlens[b]`` positions are visible; k_tree, v_tree ``[b, n, hkv, d]``; parents ``[n]``,
    ``[b, n]`` or a TreeIndex. Returns ``[b, n, hq, d]`` in q's dtype. ``validate=False`` skips
    the range check of ``cache_seqlens`` (a device-to-host sync): for callers that checked the
    lengths already, and for CUDA-graph capture. ``state_indices [b]`` (int): k_cache and v_cache
    are pools ``[slots, t_max, hkv, d]``, row b's prefix in slot ``state_indices[b]`` (negative: a
    padding row, no prefix); ``cache_seqlens`` stays per row. ``parents`` a
    :class:`~stree.tree.PackedTrees` of b trees: q, k_tree, v_tree hold their nodes back to back,
    ``[1, total, ...]``, and tree b attends to prefix row (or slot) b.
    """
    check_layout("q", q, "batch, n, q_heads, head_dim")
    if isinstance(parents, PackedTrees) and resolve_backend(backend, q.device) == "torch":
        _check_args(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, parents, softmax_scale, validate,
                    state_indices)
        q, k_tree, v_tree = map(parents.unpack, (q, k_tree, v_tree))
        return parents.pack(tree_attention(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, parents.padded,
                                           softmax_scale=softmax_scale, validate=False, state_indices=state_indices,
                                           backend=backend))
    if state_indices is not None and resolve_backend(backend, q.device) == "torch":
        _check_args(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, parents, softmax_scale, validate,
                    state_indices)
        lens = torch.where(state_indices >= 0, cache_seqlens, 0)
        k_cache, v_cache = _visible(k_cache, lens), _visible(v_cache, lens)  # (before the rows' copies)
        return tree_attention(q, slot_rows(k_cache, state_indices), slot_rows(v_cache, state_indices), lens, k_tree,
                              v_tree, parents, softmax_scale=softmax_scale, validate=False, backend=backend)
    if resolve_backend(backend, q.device) == "torch":
        return tree_attention_torch(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, parents,
                                  softmax_scale=softmax_scale, validate=validate)
    index, scale = _check_args(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, parents, softmax_scale, validate,
                               state_indices)
    batch, n, hq, head_dim = q.shape
    packed = isinstance(index, PackedTrees)
    if packed:
        batch, n = index.batch, index.max_n
    strides = packed_strides if packed else torch.Tensor.stride
    hkv = k_cache.shape[2]
    out = torch.empty_like(q)
    slots = identity_slots(batch, q.device) if state_indices is None else state_indices
    cfg = launch_config(n, head_dim, q.dtype)
    grid = (batch * hq, triton.cdiv(n, cfg["BLOCK_M"]))
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, cache_seqlens, slots, k_tree, v_tree, index.pre, index.last,
        index.cu_seqlens if packed else slots, out,
        n, hq, head_dim, hq // hkv, scale * LOG2E,
        *strides(q), *k_cache.stride(), *v_cache.stride(), *strides(k_tree), *strides(v_tree), *strides(out),
        0 if packed else index.row_stride(),
        VARLEN=packed, DOT_PRECISION=dot_precision(q.dtype), **cfg,
    )
    return out
