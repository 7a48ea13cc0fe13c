"""How a decode loop runs a model's ``step``, ``forward_tree`` and ``commit``, behind one protocol:
:class:`EagerRunner` calls the model's own (or, for trees, the unrolled baseline's); the
:class:`DecodeRunner` kinds replay CUDA graphs (:mod:`.graphs`) or run ``torch.compile``d calls
(:mod:`.compiled`) for static tree shapes, keeping one pool per model, batch size and cache size and
building the step and each shape's pass + commit the first time the loop needs them.

Every runner has ``cache``, ``eager``, ``step()`` (a callable ``(tokens, validate)`` -> logits,
advancing the cache), ``tree_calls(draft, scan)`` (``(tree_pass, commit)``: ``tree_pass(draft)``
-> ``(logits, TreePass)``, ``commit(tree_pass, accepted, num_accepted)``) and ``fused(fn, shape,
name)`` (a compiled iteration, or None)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from ..tree import TreeShape
from ..models.base import TreeLM
from ..models.cache import ModelCache

__all__ = ["DecodeRunner", "EagerRunner", "check_tree_tokens"]


def check_tree_tokens(model: TreeLM, cache: ModelCache, tokens: torch.Tensor, shape: tuple, new_tokens: int,
                      validate: bool) -> None:
    """The checks of a tree pass of one static shape: ``tokens`` of ``shape`` (and, with
    ``validate``, in the vocabulary, with room in the cache for ``new_tokens``)."""
    model.check_tokens("tokens", tokens, values=validate)
    if tuple(tokens.shape) != tuple(shape):
        raise ValueError(f"tokens must have shape {tuple(shape)} (this pass's tree), got {tuple(tokens.shape)}")
    model.check_cache(cache, cache.batch_size, new_tokens, lengths=validate)


class EagerRunner:
    """The model's own calls on ``cache``, unchecked (the loop checked the draft); tree passes by
    ``target`` where it is another (the unrolled baseline), any tree shape and scan."""

    eager = True

    def __init__(self, model, cache: ModelCache, target=None):
        target = model if target is None else target
        self.cache = cache
        # The model's step as one call on this cache, looked up once: each lookup checks every parameter
        # (a model trained or reloaded between steps), and the steps, greedy steps and greedy trees of a
        # call then take it as it is (the parameters as they stand when the call begins), writing their
        # logits into outputs kept for the runner's calls (MambaStep.reused: the loop reads a step's
        # outputs before the next). None: the model steps block by block, or has no such call (a hybrid,
        # a model on CUDA without graphs), and a greedy step is a plain one (asked each time, a greedy
        # step checked its tokens and cache, and looked for the one call, twice).
        greedy_step, fused = getattr(model, "greedy_step", None), getattr(model, "fused_step", None)
        with torch.no_grad():
            one = None if greedy_step is None or fused is None else \
                fused(cache, None, getattr(model, "kernel_backend", "auto"))
        if one is not None and hasattr(one, "reused"):
            one = one.reused()
        if one is None:
            self._step = lambda tokens, validate: model.step(tokens, cache, validate=validate)
            self._greedy_step = lambda tokens, top_k: None
        else:
            self._step = lambda tokens, validate: model.step(tokens, cache, validate=validate, one_call=one)
            self._greedy_step = lambda tokens, top_k: greedy_step(tokens, cache, validate=False, one_call=one,
                                                                  top_k=top_k)
        self._commit = lambda tree_pass, accepted, num: target.commit(cache, tree_pass, accepted, num, validate=False)
        self._passes = {scan: (lambda draft, scan=scan: target.forward_tree(draft, cache, scan=scan, validate=False))
                        for scan in ("tree", "chain", "unrolled")}
        self._packed = lambda draft: _packed_pass(target, draft, cache)
        greedy = getattr(target, "greedy_tree", None)  # (a stand-in target may have none)
        pinned = {} if one is None or target is not model else {"one_call": one}
        self._greedy = (lambda draft, top_k: None) if greedy is None else \
            (lambda draft, top_k: greedy(draft, cache, validate=False, top_k=top_k, **pinned))

    def step(self) -> Callable:
        return self._step

    def greedy_tree(self, draft, top_k: int | None = None):
        """The draft's tree pass, greedy verification and commit as one call (with the target's
        laws along the paths for ``top_k``: :meth:`~stree.models.base.TreeLM.greedy_tree`), or
        None where the model has none."""
        return self._greedy(draft, top_k)

    def greedy_step(self, tokens: torch.Tensor, top_k: int | None = None):
        """The model's step with each row's greedy choice made in the same call (and the target's laws
        at the choices for ``top_k``: :meth:`~stree.models.base.TreeLM.greedy_step`), or None where
        the model has none."""
        return self._greedy_step(tokens, top_k)

    def tree_calls(self, draft, scan: str) -> tuple[Callable, Callable]:
        """A draft with ``row_sizes`` under the tree scan is scored packed, without padding."""
        if draft.row_sizes is not None and scan == "tree":
            return self._packed, self._commit
        return self._passes[scan], self._commit

    def fused(self, fn, shape: TreeShape, name: str) -> Callable | None:
        return None

    def fused_step(self, fn, name: str) -> Callable | None:
        return None


def _packed_pass(model: TreeLM, draft, cache: ModelCache):
    """``draft``'s rows scored as the packed trees of its ``row_sizes``
    (:meth:`~stree.models.base.TreeLM.forward_packed`): logits padded back to ``[B, N, V]`` (zero
    past a row's size: those nodes are invalid) and the pass ``commit`` takes, whose paths,
    counted inside each row's tree, are the padded draft's node indices (its trees are prefixes)."""
    tokens, trees = draft.packed()
    logits, tree_pass = model.forward_packed(tokens, trees, cache, validate=False)
    return trees.unpack(logits), tree_pass


class DecodeRunner:
    """A cache the runner's calls all use (reused across ``generate`` calls, zeroed at each
    start), ``step()`` and, per static shape, ``tree(shape)`` (``(tree_pass, commit)``:
    ``tree_pass(tokens, validate)`` -> ``(logits, TreePass)`` and ``commit(tree_pass, accepted,
    num_accepted)``), which subclasses build; other trees and scans run eager on the same cache."""

    eager = False
    # whether fused()'s outputs are the host's own tensors (compiled on the CPU), else the device's, the
    # host's part packed into one tensor for one transfer, and overwritten by the next call (CUDA graphs)
    fused_on_host = False
    _pools: "weakref.WeakKeyDictionary[TreeLM, dict]" = weakref.WeakKeyDictionary()

    def __init__(self, model: TreeLM, batch_size: int, max_length: int):
        self.model = model
        self.cache = model.allocate_cache(batch_size, max_length)
        self._step: Callable | None = None
        self._trees: dict[TreeShape, tuple[Callable, Callable]] = {}
        self._calls: dict[TreeShape, tuple[Callable, Callable]] = {}
        self._eager = EagerRunner(model, self.cache)
        self.built: set = set()  # what has run on this runner (stree.decoding.steps.build_calls: once each)

    @classmethod
    def for_model(cls, model: TreeLM, batch_size: int, max_length: int) -> "DecodeRunner":
        """The pool for this batch size and a cache of at least ``max_length`` (rounded up to a
        multiple of 256, so that nearby lengths share it), its state zeroed."""
        size = -(-max_length // 256) * 256
        pools = DecodeRunner._pools.setdefault(model, {})
        key = (cls, batch_size, size)
        if key not in pools:
            pools[key] = cls(model, batch_size, size)
        runner = pools[key]
        runner.zero()
        # a call's own eager runner: it looks the model's one call up as the call begins (the pool outlives
        # calls, and the parameters may have changed since the last)
        runner._eager = EagerRunner(model, runner.cache)
        return runner

    def zero(self) -> None:
        """Empty the cache: its state zeroed, every row at length 0."""
        for t in (self.cache.conv, self.cache.ssm, self.cache.seqlens):
            if t is not None:
                t.zero_()
        self.cache.moved()

    def step(self) -> Callable:
        if self._step is None:
            self._step = self.make_step()
        return self._step

    def tree(self, shape: TreeShape) -> tuple[Callable, Callable]:
        """The tree pass of ``shape`` and its commit."""
        if shape not in self._trees:
            self._trees[shape] = self.make_tree(shape)
        return self._trees[shape]

    def tree_calls(self, draft, scan: str) -> tuple[Callable, Callable]:
        """The tree pass of ``draft`` (taking the draft) and its commit: the built ones for a static
        shape under the tree scan, else the model's own on this cache."""
        shape = draft.static_shape
        if scan != "tree" or shape is None:
            return self._eager.tree_calls(draft, scan)
        if shape not in self._calls:
            tree_pass, commit = self.tree(shape)
            self._calls[shape] = (lambda d: tree_pass(d.tokens, validate=False)), commit
        return self._calls[shape]

    def greedy_step(self, tokens: torch.Tensor, top_k: int | None = None):
        """As :meth:`EagerRunner.greedy_step` (the model's own call: where it has one, the runner's
        step is that call too)."""
        return self._eager.greedy_step(tokens, top_k)

    def greedy_tree(self, draft, top_k: int | None = None):
        """As :meth:`EagerRunner.greedy_tree`, the model's own call on the runner's cache, for the drafts
        :meth:`fused` does not take (``speculative_step`` asks it first): no static shape, or one whose
        pass is one call of the model's own, which compiled runners build nothing for (there the pass
        alone, verified on the host and committed apart, had cost a tree's iteration about a sixth of a
        plain step more)."""
        return self._eager.greedy_tree(draft, top_k)

    def fused(self, fn, shape: TreeShape, name: str) -> Callable | None:
        """``fn`` run with the tree pass of ``shape`` as one graph, compiled
        (:meth:`CompiledModel.fused`) or captured (:class:`~stree.runtime.graphs.GraphedIteration`):
        a callable ``(tokens, *extra) -> (TreePass, rest)`` whose ``commit(tree_pass, accepted,
        num_accepted)`` commits the pass, ``rest`` beginning with the accepted paths and their
        lengths; or None where the runner has no such path."""
        return None

    def fused_step(self, fn, name: str) -> Callable | None:
        """``fn(model, tokens, cache, *extra)``, a step and what follows it, as one graph: a callable
        ``(tokens, *extra) -> fn's output`` (``extra``: Python constants of the graph), or None
        where the runner has no such path."""
        return None

    def make_step(self) -> Callable:
        raise NotImplementedError

    def make_tree(self, shape: TreeShape) -> tuple[Callable, Callable]:
        raise NotImplementedError
