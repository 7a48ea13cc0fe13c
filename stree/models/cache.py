"""Committed decoding state of a model, and the handle of one tree verify pass.

The cache holds committed state only. ``forward_tree`` returns a :class:`TreePass` carrying the
per-node activations that ``commit`` replays; it remembers which cache and which state version it
was computed against, so committing it anywhere else, or after the state moved on, is an error.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from ..tree import PackedTrees, TokenTree, TreeIndex


@dataclass
class SSMLayerState:
    """One Mamba2 layer's view of the cache (writes go to the stacked tensors)."""

    conv: torch.Tensor  # [b, conv_dim, d_conv], raw inputs, newest last
    ssm: torch.Tensor  # [b, h, p, s] fp32
    index: int = 0  # its place among the cache's stacked Mamba2 layers (and a pass's stacked scratch)
    _arrays: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def arrays(self) -> tuple:
        """``conv`` and ``ssm`` as NumPy views (:func:`_views`)."""
        if self._arrays is None:
            self._arrays = _views(self.conv, self.ssm)
        return self._arrays


def _views(*tensors) -> tuple:
    """Each tensor's memory as a NumPy array, for the CPU's bound kernels (None where it is not a
    float32 CPU tensor without grad: a half conv state is read through a float32 copy anyway). Made
    once per cache: converting each state on every call cost a step four dispatcher ops a layer,
    about a sixth of its ops, and 2-3% of its time on the Intel Xeon."""
    return tuple(t.numpy() if t is not None and t.device.type == "cpu" and t.dtype == torch.float32
                 and not t.requires_grad else None for t in tensors)


@dataclass
class AttnLayerState:
    """One attention layer's view of the cache."""

    k: torch.Tensor  # [b, max_length, hkv, d]
    v: torch.Tensor


@dataclass
class ModelCache:
    """Per-row committed state. SSM layers: ``conv`` ``[ssm_layers, b, conv_dim, d_conv]`` (model
    dtype, raw inputs, newest last) and ``ssm`` ``[ssm_layers, b, h, p, s]`` fp32. Attention layers:
    ``k``, ``v`` ``[attn_layers, b, max_length, hkv, d]``. ``seqlens`` ``[b]``: tokens committed.
    ``kinds`` names each layer's mixer kind ("ssm" / "attn") in order; ``layers[i]`` is layer i's
    view of its kind's stacked tensors. ``version`` counts the changes of the committed state (a
    :class:`TreePass` records it)."""

    conv: torch.Tensor | None
    ssm: torch.Tensor | None
    k: torch.Tensor | None
    v: torch.Tensor | None
    seqlens: torch.Tensor
    max_length: int
    kinds: list
    version: int = 0
    layers: list = field(init=False, repr=False)
    _arrays: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        # Per-layer views made once: a step indexes no stacked tensor.
        slot = {"ssm": 0, "attn": 0, "mlp": 0}
        self.layers = []
        for kind in self.kinds:
            i = slot[kind]
            slot[kind] += 1
            self.layers.append(SSMLayerState(self.conv[i], self.ssm[i], i) if kind == "ssm"
                               else AttnLayerState(self.k[i], self.v[i]) if kind == "attn" else None)

    @property
    def batch_size(self) -> int:
        return self.seqlens.shape[0]

    @property
    def arrays(self) -> tuple:
        """The stacked ``conv`` and ``ssm`` as NumPy views (:func:`_views`), for a commit's replay."""
        if self._arrays is None:
            self._arrays = _views(self.conv, self.ssm)
        return self._arrays

    def moved(self) -> None:
        """Record a change of the committed state: earlier tree passes can no longer be committed."""
        self.version += 1

    def select(self, rows: torch.Tensor) -> "ModelCache":
        """A copy of the committed state of ``rows`` (a LongTensor of row indices)."""
        take = lambda t: t.index_select(1, rows) if t is not None else None  # a copy, measured cheaper than t[:, rows]
        return ModelCache(take(self.conv), take(self.ssm), take(self.k), take(self.v),
                          self.seqlens.index_select(0, rows), self.max_length, self.kinds)

    def assign(self, rows: torch.Tensor, other: "ModelCache") -> None:
        """Write ``other``'s committed state (from :meth:`select`) back into ``rows``."""
        for name in ("conv", "ssm", "k", "v"):
            mine = getattr(self, name)
            if mine is not None:
                mine.index_copy_(1, rows, getattr(other, name))
        self.seqlens.index_copy_(0, rows, other.seqlens)
        self.moved()

    def clone(self) -> "ModelCache":
        return self.select(torch.arange(self.batch_size, device=self.seqlens.device))


@dataclass
class SSMScratch:
    """Per-node activations of every Mamba2 layer of one tree pass, stacked over those layers:
    what activation replay needs."""

    xBC: torch.Tensor  # [L, b, n, conv_dim] raw, before the conv
    x: torch.Tensor  # [L, b, n, h, p] after conv and SiLU (repeated to heads)
    dt: torch.Tensor  # [L, b, n, h] raw, before bias
    B: torch.Tensor  # [L, b, n, g, s] after conv and SiLU
    # The layers' A and dt_bias [L, h] (float32) as the pass computed them from the parameters, where it
    # returned its activations (a compiled pass's, a GPU's): commit replays with them, reading no
    # parameter again (keyed on the eight parameters' versions, a compiled tree iteration's commit
    # cost a batch-1 step a sixth more on the 2-core EPYC)
    A: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    # Where the layers' bound CPU kernels wrote it in place (stree.kernels.cpu.bound): the four as
    # the NumPy arrays they wrote, and each layer's kernels (None: a layer that took another path),
    # whose parameters commit replays with, without converting them again
    arrays: tuple | None = field(default=None, init=False, repr=False, compare=False)
    kernels: list | None = field(default=None, init=False, repr=False, compare=False)

    def parts(self) -> tuple[torch.Tensor, ...]:
        return self.xBC, self.x, self.dt, self.B


@dataclass
class AttnScratch:
    """The tree nodes' keys (after RoPE) and values of every attention layer, stacked."""

    k: torch.Tensor  # [L, b, n, hkv, d]
    v: torch.Tensor


@dataclass
class TreePass:
    """What ``forward_tree`` leaves for ``commit``: the tree, its deepest level, the stacked
    per-node activations, and the cache state it was computed against."""

    tree: TokenTree | None  # None for a packed pass (forward_packed): its trees are ``index``
    index: TreeIndex | PackedTrees
    max_depth: int
    ssm: SSMScratch | None
    attn: AttnScratch | None
    cache_ref: weakref.ref
    version: int
    prefill: bool = False  # computed by prefill: commit replays with prefill's dt clamp

    def check_against(self, cache: ModelCache) -> None:
        if self.cache_ref() is not cache:
            raise ValueError("tree_pass was computed on another cache: commit it to the cache forward_tree read")
        if self.version != cache.version:
            raise ValueError("tree_pass is stale: the cache's committed state changed after forward_tree "
                             "(a step, commit or prefill in between); run forward_tree again")


def chain_chunks(cache, lengths: torch.Tensor, total: int, chunk: int):
    """Feeding row r ``lengths[r]`` tokens (of ``total`` positions) as chains of at most ``chunk``:
    yields, per chunk, ``(start, end, rows, counts, sub)``: the rows that still feed (a LongTensor
    on the cache's device), how many tokens each feeds in ``[start, end)``, and ``sub``, their cache
    (the cache itself when every row feeds, else a copy of their rows, written back into ``cache``
    when the generator resumes: the caller commits to ``sub`` in between). What a prompt's prefill
    and a branch's chains share."""
    lengths = lengths.cpu()
    for start in range(0, total, chunk):
        end = min(total, start + chunk)
        counts = (lengths - start).clamp(0, end - start)
        rows = torch.nonzero(counts > 0).flatten().to(cache.seqlens.device)
        sub = cache if len(rows) == len(lengths) else cache.select(rows)
        yield start, end, rows, counts[counts > 0], sub
        if sub is not cache:
            cache.assign(rows, sub)
