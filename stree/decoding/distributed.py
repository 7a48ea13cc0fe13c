"""Decoding on a tensor-parallel model (see :mod:`stree.models.parallel`): every rank runs the
same loop on its slice of the model, and rank 0 decides. Rank 0 drafts and its tree is broadcast
(:func:`share_tree`); every rank runs its slice of ``forward_tree`` and holds the gathered logits;
rank 0's verification (accepted path, bonus) and every sampled token are broadcast
(:func:`agree`) before any rank commits, so the ranks' states never part, whatever their random
generators hold.
"""

from __future__ import annotations

import torch

from ..tree import TokenTree, TreeShape


def tensor_parallel(model):
    """The model's :class:`~stree.models.parallel.TensorParallel` (None: one process)."""
    return getattr(model, "tp", None)


def drafts_here(model) -> bool:
    """Whether this process drafts: the only one, or rank 0 of a tensor-parallel model."""
    tp = tensor_parallel(model)
    return tp is None or tp.rank == 0


def agree(model, *tensors: torch.Tensor):
    """``tensors`` (integer, on the model's device) as rank 0 holds them, packed into one
    broadcast; unchanged without tensor parallelism. Returns a tuple in the same order."""
    tp = tensor_parallel(model)
    if tp is None:
        return tensors
    flat = tp.broadcast(torch.cat([t.reshape(-1).long() for t in tensors]))
    out, at = [], 0
    for t in tensors:
        out.append(flat[at: at + t.numel()].view(t.shape).to(t.dtype))
        at += t.numel()
    return tuple(out)


_HEADER = 8  # batch, nodes, K, valid?, children's laws?, with_replacement, static shape?, per-row parents?


def share_tree(model, tree: TokenTree | None, device, shapes: dict) -> TokenTree:
    """Rank 0's draft ``tree`` (already on ``device``) on every rank; the other ranks pass None.
    A static shape is rebuilt from ``shapes`` (parents -> TreeShape, kept by the caller across
    steps) so that its cached index (and everything keyed on the shape) is reused."""
    tp = tensor_parallel(model)
    if tp is None:
        return tree
    if tp.rank == 0:
        t = tree
        head = [t.batch_size, t.n, 0 if t.child_ids is None else t.child_ids.shape[-1], t.valid is not None,
                t.child_ids is not None, t.with_replacement, t.static_shape is not None, t.parents.dim() == 2]
        header = torch.tensor(head, dtype=torch.long, device=device)
    else:
        header = torch.zeros(_HEADER, dtype=torch.long, device=device)
    B, n, K, has_valid, has_laws, with_replacement, static, per_row = tp.broadcast(header).tolist()
    sizes = [B * n if per_row else n, B * n, B * n if has_valid else 0, B * n * K if has_laws else 0]
    if tp.rank == 0:
        parts = [t.parents, t.tokens] + ([t.valid] if has_valid else []) + ([t.child_ids] if has_laws else [])
        ints = torch.cat([p.reshape(-1).long() for p in parts])
        probs = t.child_probs.float() if has_laws else None
    else:
        ints = torch.empty(sum(sizes), dtype=torch.long, device=device)
        probs = torch.empty(B, n, K, dtype=torch.float32, device=device) if has_laws else None
    tp.broadcast(ints)
    if has_laws:
        tp.broadcast(probs)
    if tp.rank == 0:
        return tree
    parents, tokens, valid, child_ids = ints.split(sizes)
    parents = parents.view(B, n) if per_row else parents
    extra = dict(valid=valid.view(B, n).bool() if has_valid else None, with_replacement=bool(with_replacement))
    if has_laws:
        extra.update(child_ids=child_ids.view(B, n, K), child_probs=probs)
    tokens = tokens.view(B, n)
    if static:
        key = tuple(parents.tolist())
        shape = shapes.get(key)
        if shape is None:
            shape = shapes[key] = TreeShape(key)
        return TokenTree.from_shape(shape, tokens, **extra)
    return TokenTree(parents, tokens, **extra)
