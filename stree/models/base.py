"""What every target model shares: the block loop, the cache layout, the tree pass and its commit,
the single-token step, chunked prefill, the training forward, and the input checks.

A model is an embedding, a list of :class:`Block` (pre-norm token mixer, optional pre-norm MLP,
residual stream in fp32 or the model dtype), a final norm and a head. Mixers of one ``kind``
("ssm", "attn") share an interface: ``tree(h, ctx, state)`` (outputs for every tree node and the
per-node activations commit needs), ``step(h, state, kernel_backend)`` (one token, state advanced
in place), and the static ``stack_scratch`` / ``commit_layers`` that commit every layer of the
kind in one call. Families differ only in their block list and config reader.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..kernels import MAX_TREE_NODES
from ..kernels.cpu.mamba_step import DRAFT_MAX_CHILDREN
from ..kernels._common import version
from ..tree import PackedTrees, TokenTree, TreeIndex, TreeShape
from .cache import AttnLayerState, ModelCache, SSMLayerState, SSMScratch, TreePass, chain_chunks
from .layers.linear import Linear

SCANS = ("tree", "chain", "unrolled")  # how the SSM layers walk a draft (forward_tree's scan)


def _index(tree: TokenTree) -> tuple[TreeIndex, int]:
    """The tree's index and deepest level (kept in the index)."""
    index = tree.index
    return index, index.memo("max_depth", lambda: int(index.depth.max()))


def value_key(*tensors) -> tuple:
    """What identifies the values of ``tensors`` without reading them: each one's version counter
    and storage (a model moved to another device or dtype has new storages, its counters restart)."""
    return tuple((version(t), t.data_ptr(), t.device) for t in tensors)


def derived(owner, name: str, fn, key=None):
    """``fn()`` computed once per value of ``owner`` (a tensor: :func:`value_key`) or of ``key``,
    and cached on ``owner``; recomputed every call while autograd records, so training keeps its
    graph. For parameters-derived constants (fp32 copies, A = -exp(A_log))."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return fn()  # a compiled graph computes it in place (fused), and may not write to owner
    if key is None:
        key = value_key(owner)
    store = owner.__dict__.setdefault("_stree_derived", {})
    hit = store.get(name)
    if hit is None or hit[0] != key:
        hit = store[name] = (key, fn())
    return hit[1]


@dataclass(eq=False)
class Block:
    """One layer: ``x += out_scale * mixer(in_scale * norm(x))`` when there is a token mixer, then
    ``x += mlp_scale * mlp(mlp_norm(x))`` when there is an MLP (Nemotron-H has MLP-only layers,
    kind "mlp", holding no state). A ``parallel`` block (Falcon-H1's attention beside its Mamba2)
    has no norm of its own: its mixer reads the previous block's normed input and the two outputs
    are summed before the one residual add; the previous block then has no MLP. The scales are
    the µP multipliers of Granite 4.0 and Falcon-H1 (1.0: no op)."""

    norm: nn.Module | None
    mixer: nn.Module | None
    mlp_norm: nn.Module | None = None
    mlp: nn.Module | None = None
    in_scale: float = 1.0
    out_scale: float = 1.0
    mlp_scale: float = 1.0
    parallel: bool = False


def scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x if scale == 1.0 else x * scale


@dataclass
class TreeContext:
    """What every layer of one tree pass shares."""

    index: TreeIndex | PackedTrees
    # [b, n] RoPE positions: committed length + depth ([1, total] when packed); None without attention layers
    positions: torch.Tensor | None
    seqlens: torch.Tensor
    scan: str  # SCANS: the SSM layers' algorithm
    kernel_backend: str
    prefill: bool = False  # the prompt, not a draft: families whose dt clamp is prefill-only apply it
    ssm_layers: int = 0  # the Mamba2 layers the cache stacks
    # The pass's stacked SSM scratch where its layers write theirs in place (made by the first that
    # does); None: each layer returns its own, stacked after them.
    ssm_scratch: SSMScratch | None = None


class TreeLM(nn.Module):
    """Subclasses set ``cfg``, ``lm_head`` (``make_head``), ``residual_fp32``, ``blocks`` (a list of
    :class:`Block`, not registered as modules), and name their embedding's weight (``embed_key``,
    as in the state dict) and final norm (``final_norm_name``)."""

    kernel_backend = "auto"  # "triton" forces the Triton kernels (tests: under the interpreter)
    embed_scale = 1.0  # µP multipliers of the embedding output and the logits (Granite, Falcon-H1)
    logits_scale = 1.0
    embed_key: str
    final_norm_name: str
    # Set by stree.models.parallel.plan on a rank's slice of a model: the ranks' TensorParallel
    # (the block loop all-reduces each block's partial sums, the head gathers the vocabulary)
    # and the full vocabulary size.
    tp = None
    full_vocab: int

    @property
    def embed(self) -> nn.Embedding:
        return self.get_submodule(self.embed_key.rsplit(".", 1)[0])

    @property
    def final_norm(self) -> nn.Module:
        return self.get_submodule(self.final_norm_name)

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0] if self.tp is None else self.full_vocab

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def kinds(self) -> list[str]:
        return [blk.mixer.kind if blk.mixer is not None else "mlp" for blk in self.blocks]

    def mixer_types(self) -> dict:
        """The mixer class of each stateful kind ("ssm", "attn") the model has."""
        return {blk.mixer.kind: type(blk.mixer) for blk in self.blocks if blk.mixer is not None}

    def make_head(self, d_model: int, vocab_size: int, tie: bool, device=None, dtype=None) -> None:
        """``lm_head``, sharing the embedding's weight when ``tie`` (set ``embed`` first)."""
        self.lm_head = Linear(d_model, vocab_size, bias=False, device=device, dtype=dtype)
        if tie:
            self.lm_head.weight = self.embed.weight

    # ---- the block loop -------------------------------------------------------------------
    def _run(self, tokens: torch.Tensor, mix, at: torch.Tensor | None = None,
             heads: torch.Tensor | None = None) -> torch.Tensor:
        """Embedding, blocks and head; ``mix(i, block, h)`` is block i's token mixer on ``h``.
        ``at [b]``: the head only at node ``at[b]`` of each row (logits ``[b, V]``: a prompt needs
        its last position's alone, and the head is most of a small model's work); ``heads [k]``
        (a step's ``[b, d]`` hidden states): the head only on those rows (logits ``[k, V]``)."""
        tp = self.tp
        x = scaled(self.embed(tokens) if tp is None else tp.embed(self.embed.weight, tokens), self.embed_scale)
        if self.residual_fp32:
            x = x.float()
        dtype, blocks = self.dtype, self.blocks
        for i, blk in enumerate(blocks):
            if blk.mixer is not None:
                if not blk.parallel:
                    h, branch = blk.norm(x, dtype), None
                out = scaled(mix(i, blk, scaled(h, blk.in_scale)), blk.out_scale)
                branch = out if branch is None else branch + out
                if i + 1 == len(blocks) or not blocks[i + 1].parallel:
                    x = x + (branch if tp is None else tp.all_reduce(branch))
            if blk.mlp is not None:
                out = scaled(blk.mlp(blk.mlp_norm(x, dtype)), blk.mlp_scale)
                x = x + (out if tp is None else tp.all_reduce(out))
        if at is not None:
            x = x[torch.arange(x.shape[0], device=x.device), at]
        if heads is not None:
            x = x.index_select(0, heads)
        logits = self.lm_head(self.final_norm(x, dtype))
        return scaled(logits if tp is None else tp.gather_vocab(logits, self.full_vocab), self.logits_scale)

    # ---- cache ----------------------------------------------------------------------------
    def allocate_cache(self, batch_size: int, max_length: int) -> ModelCache:
        """Zero state for ``batch_size`` rows of up to ``max_length`` tokens."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length must be an int >= 1, got {max_length!r}")
        kinds = self.kinds()
        f = dict(device=self.device)
        ssm = [blk.mixer for blk, kind in zip(self.blocks, kinds) if kind == "ssm"]
        attn = [blk.mixer for blk, kind in zip(self.blocks, kinds) if kind == "attn"]
        conv = state = k = v = None
        if ssm:
            c = ssm[0].cfg
            conv = torch.zeros(len(ssm), batch_size, c.conv_dim, c.d_conv, dtype=self.dtype, **f)
            state = torch.zeros(len(ssm), batch_size, c.nheads, c.headdim, c.d_state, dtype=torch.float32, **f)
        if attn:
            a = attn[0]
            k = torch.zeros(len(attn), batch_size, max_length, a.num_kv_heads, a.head_dim, dtype=self.dtype, **f)
            v = torch.zeros_like(k)
        return ModelCache(conv, state, k, v, torch.zeros(batch_size, dtype=torch.long, **f), max_length, kinds=kinds)

    # ---- checks ---------------------------------------------------------------------------
    def check_tokens(self, name, tokens, values: bool = True):
        """dtype and device; with ``values`` also the vocabulary range (a device-to-host sync)."""
        if not isinstance(tokens, torch.Tensor) or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {getattr(tokens, 'dtype', type(tokens))}")
        if tokens.device != self.device:
            raise ValueError(f"{name} is on {tokens.device} but the model is on {self.device}")
        if not values:
            return
        bad = (tokens < 0) | (tokens >= self.vocab_size)
        if bool(bad.any()):
            pos = tuple(int(v) for v in torch.nonzero(bad)[0])
            raise ValueError(f"{name}{list(pos)} = {int(tokens[pos])} is outside the vocabulary [0, {self.vocab_size})")

    def check_cache(self, cache: ModelCache, batch: int, new_tokens: int, lengths: bool = True):
        """Batch size; with ``lengths`` also the room left (a device-to-host sync)."""
        if not isinstance(cache, ModelCache) or cache.kinds != self.kinds():
            raise TypeError("cache must be a ModelCache this model allocated (allocate_cache)")
        if cache.batch_size != batch:
            raise ValueError(f"the cache holds {cache.batch_size} rows but the input has batch {batch}")
        if not lengths:
            return
        longest = int(cache.seqlens.max()) + new_tokens
        if longest > cache.max_length:
            raise ValueError(f"sequence would reach {longest} tokens, past the cache's max_length {cache.max_length}")

    def check_tree(self, tree: TokenTree, cache: ModelCache, scan: str,
                   validate: bool = True) -> tuple[TreeIndex, int]:
        """The tree's index and deepest level, after the checks; ``validate=False`` skips the
        token range and cache room (device-to-host syncs). The deepest level of a tree that is
        not a static shape's costs one sync, once per tree."""
        if scan not in SCANS:
            raise ValueError(f"scan must be one of {SCANS}, got {scan!r}")
        if not isinstance(tree, TokenTree):
            raise TypeError(f"tree must be a TokenTree, got {type(tree).__name__}")
        self.check_tokens("tree.tokens", tree.tokens, values=validate)
        index, max_depth = _index(tree)
        self.check_cache(cache, tree.batch_size, max_depth + 1, lengths=validate)
        if scan == "chain" and max_depth != tree.n - 1:
            raise ValueError("scan='chain' needs a chain tree (parents[i] == i - 1)")
        return index, max_depth

    # ---- the protocol ---------------------------------------------------------------------
    @torch.no_grad()
    def forward_tree(self, tree: TokenTree, cache: ModelCache, scan: str = "tree", validate: bool = True):
        """Logits ``[b, n, V]`` at every tree node and the :class:`TreePass` ``commit`` takes; the
        committed state is not changed. ``scan`` ("tree", "chain", "unrolled") chooses the SSM
        layers' algorithm. ``validate=False`` skips the checks that read device values (token
        range, room in the cache); the caller answers for both."""
        index, max_depth = self.check_tree(tree, cache, scan, validate)
        return self.tree_pass(tree, index, cache, scan, self.kernel_backend, max_depth)

    @torch.no_grad()
    def forward_packed(self, tokens: torch.Tensor, trees: PackedTrees, cache: ModelCache, validate: bool = True):
        """Logits ``[1, total, V]`` at every node of a batch of trees of different sizes, packed
        without padding (:class:`~stree.tree.PackedTrees`: tree r is row r of ``cache``), and the
        :class:`TreePass` ``commit`` takes (each row's ``accepted`` counted inside its own tree).
        ``tokens`` ``[1, total]``. The SSM layers scan the trees; as :meth:`forward_tree` otherwise."""
        if not isinstance(trees, PackedTrees):
            raise TypeError(f"trees must be PackedTrees (stree.tree.pack_trees), got {type(trees).__name__}")
        self.check_tokens("tokens", tokens, values=validate)
        if tokens.dim() != 2 or tuple(tokens.shape) != (1, trees.total):
            raise ValueError(f"tokens must have shape [1, {trees.total}] (the packed nodes), got {tuple(tokens.shape)}")
        if trees.device != tokens.device:
            raise ValueError(f"trees are on {trees.device} but tokens are on {tokens.device}")
        max_depth = trees.memo("max_depth", lambda: int(trees.depth.max()))
        self.check_cache(cache, trees.batch, max_depth + 1, lengths=validate)
        logits, ssm, attn = self.tree_layers(tokens, trees, cache, "tree", self.kernel_backend)
        return logits, TreePass(None, trees, max_depth, ssm, attn, weakref.ref(cache), cache.version)

    def tree_pass(self, tree: TokenTree, index: TreeIndex, cache: ModelCache, scan: str, kernel_backend: str,
                  max_depth: int, prefill: bool = False, at: torch.Tensor | None = None):
        """The layers over a checked tree (no host sync of its own); ``prefill``: the tree is a
        chain of prompt tokens (see :class:`TreeContext`); ``at``: logits at those nodes only
        (see :meth:`_run`)."""
        fused = None if prefill or at is not None or scan != "tree" else \
            self.fused_tree(cache, tree.tokens, index, kernel_backend)
        if fused is not None:
            return fused[0], TreePass(tree, index, max_depth, fused[1], None, weakref.ref(cache), cache.version)
        logits, ssm, attn = self.tree_layers(tree.tokens, index, cache, scan, kernel_backend, prefill, at)
        return logits, TreePass(tree, index, max_depth, ssm, attn, weakref.ref(cache), cache.version, prefill)

    def tree_layers(self, tokens: torch.Tensor, index: TreeIndex | PackedTrees, cache: ModelCache, scan: str,
                    kernel_backend: str, prefill: bool = False, at: torch.Tensor | None = None):
        """Logits of a checked tree's nodes and the stacked scratch of its SSM and attention layers
        (None where the model has none): tensors only, so that it can be compiled."""
        if cache.k is None:  # (no attention layer reads them)
            positions = None
        elif isinstance(index, PackedTrees):
            positions = (cache.seqlens[index.tree_ids] + index.depth)[None]
        else:
            positions = cache.seqlens[:, None] + index.depth
        ctx = TreeContext(index, positions, cache.seqlens, scan, kernel_backend, prefill,
                          0 if cache.ssm is None else cache.ssm.shape[0])
        per_kind: dict[str, list] = {}

        def mix(i, blk, h):
            out, scratch = blk.mixer.tree(h, ctx, cache.layers[i])
            per_kind.setdefault(blk.mixer.kind, []).append(scratch)
            return out

        logits = self._run(tokens, mix, at)
        mixers = self.mixer_types()
        stacked = {kind: mixers[kind].stack_scratch(parts) for kind, parts in per_kind.items()
                   if kind != "ssm" or ctx.ssm_scratch is None}
        if ctx.ssm_scratch is not None:  # the layers wrote theirs in place, but for any that returned it
            for k, parts in enumerate(per_kind["ssm"]):
                for dst, src in zip(ctx.ssm_scratch.parts(), parts or ()):
                    dst[k].copy_(src)
            stacked["ssm"] = ctx.ssm_scratch
        return logits, stacked.get("ssm"), stacked.get("attn")

    @torch.no_grad()
    def commit(self, cache: ModelCache, tree_pass: TreePass, accepted: torch.Tensor, num_accepted: torch.Tensor,
               validate: bool = True):
        """Advance each row by its accepted path: ``accepted [b, L]`` node indices root first, the
        first ``num_accepted[b] >= 1`` of them real, each the parent of the next. ``validate=False``
        skips the path check (the one device-to-host sync); the caller answers for the path."""
        check_commit(cache, tree_pass, accepted, num_accepted, validate)
        packed = tree_pass.index if isinstance(tree_pass.index, PackedTrees) else None
        self.commit_state(cache, tree_pass.ssm, tree_pass.attn, accepted, num_accepted, self.kernel_backend,
                          tree_pass.prefill, None if packed is None else packed.cu_seqlens)
        cache.moved()

    def commit_state(self, cache: ModelCache, ssm, attn, accepted: torch.Tensor, num_accepted: torch.Tensor,
                     kernel_backend: str, prefill: bool = False, cu_seqlens: torch.Tensor | None = None) -> None:
        """Every layer's state and ``seqlens`` advanced along checked paths, from a pass's
        scratch (``prefill``: the pass's own flag; ``cu_seqlens``: a packed pass's offsets):
        tensors only, no bookkeeping, so that it can be compiled."""
        by_kind = self.mixer_types()
        for kind, scratch in (("ssm", ssm), ("attn", attn)):
            if scratch is not None:
                by_kind[kind].commit_layers(self, cache, scratch, accepted, num_accepted, kernel_backend, prefill,
                                            cu_seqlens)
        cache.seqlens += num_accepted

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, cache: ModelCache, validate: bool = True,
             heads: torch.Tensor | None = None, one_call=None) -> torch.Tensor:
        """Feed one token per row (``[b]``); returns next-token logits ``[b, V]``. The fast path:
        no tree, no scratch, each layer's state advanced in place by one token.

        ``heads``: a ``[k]`` int64 tensor of row indices: every row is fed, but only those rows'
        logits are made (``[k, V]``, in that order). A drafter feeds the leaves of a tree level for
        their states alone, and the head is most of a small model's step.

        ``validate=False`` skips the vocabulary-range and cache-room checks (and ``heads``'
        range), the only device-to-host syncs of a step, so that it can be captured in a CUDA
        graph; the caller then answers for both (see :class:`stree.runtime.graphs.GraphedStep`).

        ``one_call``: the step as one call that :meth:`fused_step` gave for this cache, looked up
        once by the caller (a decoding call's runner, :class:`~stree.runtime.runners.EagerRunner`)
        and taken as it is: not looked up again, so not checked against the parameters again (a
        decoding call reads them as they stand when it begins; each lookup checks every one of
        them, a twentieth of a plain step of the shipped target, float32 on the CPU)."""
        self.check_step(tokens, cache, validate, heads)
        logits = self.step_pass(tokens, cache, heads=heads, one_call=one_call)
        cache.seqlens += 1
        cache.moved()
        return logits

    @torch.no_grad()
    def greedy_step(self, tokens: torch.Tensor, cache: ModelCache, validate: bool = True, one_call=None,
                    top_k: int | None = None):
        """:meth:`step` with each row's greedy choice made in the same call, where the family's step
        is one call (:mod:`stree.models.fused_step`): the logits ``[b, V]``, the choices ``[b, 1]``
        (the first of equal maxima, as ``torch.argmax``), ones ``[b]`` and whether each row's logits
        are free of NaN and +inf ``[b]``, the last three host tensors, the cache advanced; last, with
        ``top_k`` (cut to the vocabulary), the target's law at each choice a drafter learns from, as
        :meth:`greedy_tree`'s along a path (``[b, 1, top_k]`` ids and probabilities, ``[b, 1]`` the
        choice's own), else None. None, the cache untouched, where there is no such call.
        ``validate`` as :meth:`step`'s; with ``one_call`` (as :meth:`step`'s) the caller also vouches
        for the tokens and cache, as a decoding call's runner does for its own rows: they are not
        checked again."""
        if one_call is None:
            self.check_step(tokens, cache, validate)
        greedy = getattr(self._one_call(one_call, tokens, cache), "greedy", None)
        if greedy is None:
            return None
        out = greedy(tokens.contiguous(), cache.conv, cache.ssm, top_k, cache.seqlens)  # (the lengths advanced in it)
        cache.moved()
        return out

    def check_step(self, tokens, cache: ModelCache, validate: bool = True, heads: torch.Tensor | None = None) -> None:
        """The checks of :meth:`step` (``validate``: also the token range, the room left and the
        range of ``heads``)."""
        self.check_tokens("tokens", tokens, values=validate)
        if tokens.dim() != 1:
            raise ValueError(f"tokens must have shape [batch], got {tuple(tokens.shape)}")
        self.check_cache(cache, tokens.shape[0], 1, lengths=validate)
        if heads is not None:
            if not isinstance(heads, torch.Tensor) or heads.dim() != 1 or heads.dtype != torch.long:
                raise TypeError(f"heads must be a 1-D int64 tensor of row indices, got "
                                f"{heads.dtype if isinstance(heads, torch.Tensor) else type(heads).__name__} "
                                f"of shape {tuple(getattr(heads, 'shape', ()))}")
            if heads.device != tokens.device:
                raise ValueError(f"heads must be on {tokens.device} with the tokens, got {heads.device}")
            if validate and len(heads) and not bool(((heads >= 0) & (heads < tokens.shape[0])).all()):
                raise ValueError(f"heads must index the {tokens.shape[0]} rows, got {heads.tolist()}")

    def fused_step(self, cache: ModelCache, tokens: torch.Tensor | None, kernel_backend: str):
        """The whole step as one call, ``(tokens, conv, ssm, heads) -> logits``, where the family has
        one for this cache and these tokens (None: int64 ones to come; :mod:`stree.models.fused_step`);
        None: block by block."""
        return None

    def fused_prefill(self, cache: ModelCache, tokens: torch.Tensor, counts: torch.Tensor, kernel_backend: str):
        """A prefill's chunk as one call, where the family has one for this cache and these tokens
        (:mod:`stree.models.fused_step`): row r's first ``counts[r]`` of ``tokens [b, T]`` fed into
        the cache's states (not ``seqlens``), the logits after each row's last ``[b, V]``; None: none."""
        return None

    def fused_tree(self, cache: ModelCache, tokens: torch.Tensor, index, kernel_backend: str):
        """A draft's tree pass as one call, ``(logits, SSMScratch)``, where the family has one for
        this cache, tree and these tokens (:mod:`stree.models.fused_step`); None: layer by layer."""
        return None

    def fused_tree_greedy(self, cache: ModelCache, tree: TokenTree, index, max_depth: int, kernel_backend: str,
                          top_k: int | None = None, step=None):
        """:meth:`greedy_tree`'s one call, where the family has one for this cache and tree
        (:mod:`stree.models.fused_step`; ``step``: the model's step as one call, :meth:`fused_step`'s,
        where the caller has it): the cache advanced, its states and ``seqlens``; None: none."""
        return None

    def _one_call(self, one_call, tokens: torch.Tensor, cache: ModelCache):
        """The step as one call for these tokens: ``one_call`` where the caller looked it up (for
        int64 tokens, as every lookup asks), else :meth:`fused_step`'s."""
        if one_call is not None and tokens.dtype == torch.int64:
            return one_call
        return self.fused_step(cache, tokens, self.kernel_backend)

    def fused_draft(self, cache: ModelCache, tokens: torch.Tensor, counts, parents, nodes: ModelCache,
                    head_ids: torch.Tensor | None, restore, before: ModelCache | None, kernel_backend: str):
        """:meth:`draft_greedy`'s one call, where the family has one for these caches
        (:mod:`stree.models.fused_step`): ``(tokens [b, n], slots [n])``, the states advanced, not
        ``seqlens``; None: none."""
        return None

    @torch.no_grad()
    def draft_greedy(self, tokens: torch.Tensor, counts: np.ndarray, shape: TreeShape, cache: ModelCache,
                     nodes: ModelCache, head_ids: torch.Tensor | None = None, restore: np.ndarray | None = None,
                     before: ModelCache | None = None, validate: bool = True):
        """A drafter's whole greedy draft of ``shape`` as one call, where the family has one: row r's
        first ``counts[r]`` (int64 ``[b]``) of ``tokens [b, T]`` fed into ``cache`` (the last of them
        the root), then every node's children its most likely next tokens in order (among
        ``head_ids`` alone, where given: a cut of the head, its ids in the order ties go), each node
        above the deepest level stepped from its parent's state into its slot of ``nodes`` (a cache
        of ``shape.n * b`` rows: slot s of row r is its row s * b + r, ``seqlens`` set to the
        node's). First, with ``restore`` (int64 ``[b]``), row r takes the state of row
        ``restore[r]`` of ``before`` (an earlier draft's ``nodes``) where that is >= 0: the state
        after a node its new tokens followed. Returns the draft's tokens ``[b, n]`` (the root's 0)
        and each node's slot ``[n]`` (numpy, -1: not stepped), the cache advanced; None, both caches
        untouched, where there is no such call (nor where a node has more children than
        ``DRAFT_MAX_CHILDREN`` or than ``head_ids``). ``validate=False`` skips the checks of the
        counts and the room (a drafter that checked them)."""
        b, T = tokens.shape
        if validate:
            self.check_tokens("tokens", tokens, values=False)
            if counts.shape != (b,) or counts.dtype != np.int64 or not ((counts >= 1) & (counts <= T)).all():
                raise ValueError(f"counts must be int64 [{b}] in [1, {T}], got {counts}")
            if nodes.batch_size != shape.n * b or (restore is not None and (before is None or restore.shape != (b,))):
                raise ValueError(f"need nodes of {shape.n * b} rows (got {nodes.batch_size}) and, to restore, an "
                                 f"earlier draft's nodes and [{b}] rows")
            self.check_cache(cache, b, int(counts.max()) + shape.max_depth)
        parents, slots, depth, widest = _shape_arrays(shape)
        if widest > min(DRAFT_MAX_CHILDREN, self.vocab_size if head_ids is None else len(head_ids)):
            return None  # (more children than the call draws, or than the cut's tokens)
        out = self.fused_draft(cache, tokens, counts, parents, nodes, head_ids, restore, before, self.kernel_backend)
        if out is None:
            return None
        # (numpy, and Python over the few rows: as torch ops these took longer than the draft's head)
        lengths = cache.seqlens.numpy()
        if restore is not None:
            earlier = before.seqlens.numpy()
            for r, at in enumerate(restore.tolist()):
                if at >= 0:
                    lengths[r] = earlier[at]
        lengths += counts
        cache.moved()
        if len(slots):
            nodes.seqlens.numpy().reshape(-1, b)[slots] = lengths + depth[:, None]
            nodes.moved()
        return out

    @torch.no_grad()
    def greedy_tree(self, tree: TokenTree, cache: ModelCache, validate: bool = True, top_k: int | None = None,
                    one_call=None):
        """A draft's tree pass, greedy verification and the commit of the accepted paths as one call,
        where the family has one (the model's step is one call, the tree is not packed): returns the
        logits ``[b, n, V]`` and, per row, the accepted path ``[b, D + 1]`` (root first, 0 past
        it), its length, the bonus, the emitted tokens ``[b, D + 1]`` (the accepted drafts, then
        the bonus) and whether every logit of the row is free of NaN and +inf, as CPU tensors, with
        the cache advanced; the path :meth:`forward_tree`, greedy verification and :meth:`commit`
        take (tested equal); last, with ``top_k`` (cut to the vocabulary), the target's laws a
        drafter learns from along the paths (the softmax's top ids and probabilities ``[b, D + 1,
        top_k]``, the emitted tokens' own ``[b, D + 1]``), else None. None, the cache untouched,
        where there is no such call. ``validate`` as :meth:`forward_tree`'s, ``one_call`` as
        :meth:`greedy_step`'s (a decoding call's drafts are checked as they are drafted). A packed
        draft (``row_sizes``) scores each row's own prefix alone, its logits past that left as they
        were."""
        if one_call is None:
            index, max_depth = self.check_tree(tree, cache, "tree", validate)
        else:
            index, max_depth = _index(tree)
        out = self.fused_tree_greedy(cache, tree, index, max_depth, self.kernel_backend, top_k,
                                     self._one_call(one_call, tree.tokens, cache))
        if out is None:
            return None
        cache.moved()
        return out

    def step_pass(self, tokens: torch.Tensor, cache: ModelCache, kernel_backend: str | None = None,
                  heads: torch.Tensor | None = None, one_call=None) -> torch.Tensor:
        """One token per row through every layer (states advanced in place, ``seqlens`` not), with
        the model's kernels unless ``kernel_backend`` names others; the head on rows ``heads``
        only, where given; ``one_call`` as :meth:`step`'s."""
        backend = kernel_backend or self.kernel_backend
        fused = self.fused_step(cache, tokens, backend) if kernel_backend else self._one_call(one_call, tokens, cache)
        if fused is not None:  # (it reads raw memory: the roots are often a column of the context)
            return fused(tokens.contiguous(), cache.conv, cache.ssm, None if heads is None else heads.contiguous())
        ctx = StepContext(cache.seqlens, backend)
        return self._run(tokens, lambda i, blk, h: blk.mixer.step(h, cache.layers[i], ctx), heads=heads)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, cache: ModelCache, lengths: torch.Tensor | None = None,
                chunk: int = MAX_TREE_NODES, every: bool = False) -> torch.Tensor:
        """Feed right-padded prompts ``[b, T]`` (row b's first ``lengths[b] >= 1`` tokens) as chains
        of at most ``chunk`` tokens, continuing from what the cache holds (empty: a prompt's
        prefill; else new tokens appended, as a drafter catching up does); returns the logits
        after each row's last token ``[b, V]``, or with ``every`` after each of its tokens
        ``[b, T, V]`` (a prompt's log-probabilities; a row's entries past its length unspecified)."""
        self.check_tokens("input_ids", input_ids)
        batch, T = input_ids.shape
        lengths = torch.full((batch,), T) if lengths is None else lengths.cpu()
        if tuple(lengths.shape) != (batch,) or bool(((lengths < 1) | (lengths > T)).any()):
            raise ValueError(f"lengths must be [batch] with 1 <= lengths <= {T}, got {lengths.tolist()}")
        if not 1 <= chunk <= MAX_TREE_NODES:
            raise ValueError(f"chunk must be in [1, {MAX_TREE_NODES}], got {chunk}")
        self.check_cache(cache, batch, int(lengths.max()))
        out = (torch.zeros if every else torch.empty)(batch, *(T,) * every, self.vocab_size, device=self.device,
                                                      dtype=self.dtype)
        for start, end, rows, counts, sub in chain_chunks(cache, lengths, T, chunk):
            n = counts.to(self.device)
            # (one call where the family has it: the step's arithmetic token by token, the products over the
            # chunk's tokens; the chain pass and its replay had taken about twice as long, docs/kernels.md)
            logits = None if every else \
                self.fused_prefill(sub, input_ids[rows, start:end], counts, self.kernel_backend)
            if logits is not None:
                sub.seqlens += n.to(sub.seqlens.dtype)
                sub.moved()
            else:
                tree = TokenTree.from_shape(TreeShape.chain(end - start - 1), input_ids[rows, start:end])
                logits, tree_pass = self.tree_pass(tree, tree.index, sub, "tree", self.kernel_backend,
                                                   end - start - 1, prefill=True, at=None if every else n - 1)
                self.commit(sub, tree_pass, torch.arange(end - start, device=self.device).expand(len(rows), -1), n,
                            validate=False)
            if every:
                out[rows, start:end] = logits
                continue
            pick = torch.nonzero((lengths[lengths > start] <= end).to(self.device)).flatten()
            out[rows[pick]] = logits[pick].to(out.dtype)  # (a half model's one call: float32 of its values)
        return out

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Differentiable logits ``[b, T, V]`` at every position of ``input_ids [b, T]`` from an
        empty state (training): one chain through the PyTorch reference kernels, since the Triton
        kernels have no backward."""
        self.check_tokens("input_ids", input_ids)
        if input_ids.dim() != 2 or not 1 <= input_ids.shape[1] <= MAX_TREE_NODES:
            raise ValueError(f"input_ids must be [batch, T] with 1 <= T <= {MAX_TREE_NODES}, got {tuple(input_ids.shape)}")
        batch, T = input_ids.shape
        tree = TokenTree.from_shape(TreeShape.chain(T - 1), input_ids)
        return self.tree_pass(tree, tree.index, self.allocate_cache(batch, T), "tree", "torch", T - 1, prefill=True)[0]


class StepContext:
    """What every layer of one step shares; the one-node tree index is made on first use."""

    def __init__(self, seqlens: torch.Tensor, kernel_backend: str):
        self.seqlens, self.kernel_backend, self._root = seqlens, kernel_backend, None

    @property
    def root(self) -> TreeIndex:
        if self._root is None:
            self._root = TreeIndex.root_only(self.seqlens.device)
        return self._root


def check_commit(cache: ModelCache, tree_pass: TreePass, accepted, num_accepted, validate: bool) -> None:
    """The checks of ``commit``: a handle of this cache's current state, and (see :func:`check_path`) the paths."""
    if not isinstance(tree_pass, TreePass):
        raise TypeError(f"tree_pass must be the TreePass forward_tree returned, got {type(tree_pass).__name__}")
    tree_pass.check_against(cache)
    check_path(tree_pass, accepted, num_accepted, validate)


def check_path(tree_pass: TreePass, accepted, num_accepted, validate: bool) -> None:
    """Shapes always; with ``validate`` also that every row's first ``num_accepted`` entries walk
    down from the root of the tree (one device-to-host sync for everything)."""
    index = tree_pass.index
    packed = isinstance(index, PackedTrees)
    batch = index.batch if packed else tree_pass.tree.batch_size
    if not isinstance(accepted, torch.Tensor) or accepted.dim() != 2 or accepted.shape[0] != batch:
        raise ValueError(f"accepted must have shape [{batch}, L], got {getattr(accepted, 'shape', type(accepted))}")
    if accepted.shape[1] > tree_pass.max_depth + 1:
        raise ValueError(f"accepted has {accepted.shape[1]} columns but the tree is only {tree_pass.max_depth + 1} "
                         "levels deep")
    if not isinstance(num_accepted, torch.Tensor) or tuple(num_accepted.shape) != (batch,):
        raise ValueError(f"num_accepted must have shape [{batch}], got {getattr(num_accepted, 'shape', type(num_accepted))}")
    for name, t in (("accepted", accepted), ("num_accepted", num_accepted)):
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise TypeError(f"{name} must have an integer dtype, got {t.dtype}")
        if t.device != index.device:
            raise ValueError(f"{name} is on {t.device} but the tree pass is on {index.device}")
    if not validate:
        return
    L, acc = accepted.shape[1], accepted.long()
    if packed:  # each row's nodes are its own tree's, numbered from its root
        n, sizes, index = index.max_n, index.cu_seqlens.diff()[:, None], index.padded
    else:
        n = sizes = tree_pass.tree.n
    used = torch.arange(L, device=acc.device) < num_accepted[:, None]
    bad_num = (num_accepted < 1) | (num_accepted > L)
    bad_node = used & ((acc < 0) | (acc >= sizes))
    up = index.parents.long().expand(batch, -1).gather(1, acc[:, 1:].clamp(0, n - 1))
    broken = used[:, 1:] & ~bad_node[:, 1:] & (up != acc[:, :-1])
    not_root = acc[:, 0] != 0
    if not bool(bad_num.any() | bad_node.any() | broken.any() | not_root.any()):  # the one sync
        return
    if bool(bad_num.any()):
        row = int(torch.nonzero(bad_num)[0])
        raise ValueError(f"num_accepted[{row}] = {int(num_accepted[row])} must be in [1, {L}] (the root always counts)")
    if bool(bad_node.any()):
        row, t = (int(v) for v in torch.nonzero(bad_node)[0])
        size = int(sizes[row]) if packed else n
        raise ValueError(f"accepted[{row}, {t}] = {int(accepted[row, t])} is not a node index in [0, {size})")
    if bool(not_root.any()):
        row = int(torch.nonzero(not_root)[0])
        raise ValueError(f"accepted[{row}, 0] = {int(accepted[row, 0])}: a path starts at the root, node 0")
    row, t = (int(v) for v in torch.nonzero(broken)[0])
    raise ValueError(f"accepted[{row}] is not a root path: node {int(accepted[row, t + 1])} is not a child of "
                     f"node {int(accepted[row, t])}")


__all__ = ["Block", "scaled", "TreeLM", "TreeContext", "StepContext", "derived", "check_commit", "check_path", "AttnLayerState", "SSMLayerState"]


@functools.lru_cache(maxsize=256)
def _shape_arrays(shape: TreeShape) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A shape's parents (int64, contiguous), the slots a one-call draft steps its nodes into
    (those above the deepest level, level by level, in index order within a level) with those nodes'
    depths, and the most children a node has; made once per shape."""
    depth = shape.depth
    stepped = sorted((d, v) for v, d in enumerate(depth) if 0 < d < shape.max_depth)
    return (np.array(shape.parents, dtype=np.int64), np.arange(len(stepped)),
            np.array([d for d, _ in stepped], dtype=np.int64), max(map(len, shape.children())))
