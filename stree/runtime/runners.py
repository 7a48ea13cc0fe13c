"""What a decode loop calls instead of the model's eager ``step``, ``forward_tree`` and ``commit``
when it wants them faster: CUDA graphs (:mod:`.graphs`) or ``torch.compile`` (:mod:`.compiled`).
Both keep one pool per model, batch size and cache size, and build the step and each static tree
shape's pass + commit the first time the loop needs them."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from ..tree import TreeShape
from ..models.base import TreeLM
from ..models.cache import ModelCache

__all__ = ["DecodeRunner", "check_tree_tokens"]


def check_tree_tokens(model: TreeLM, cache: ModelCache, tokens: torch.Tensor, shape: tuple, new_tokens: int,
                      validate: bool) -> None:
    """The checks of a tree pass of one static shape: ``tokens`` of ``shape`` (and, with
    ``validate``, in the vocabulary, with room in the cache for ``new_tokens``)."""
    model.check_tokens("tokens", tokens, values=validate)
    if tuple(tokens.shape) != tuple(shape):
        raise ValueError(f"tokens must have shape {tuple(shape)} (this pass's tree), got {tuple(tokens.shape)}")
    model.check_cache(cache, cache.batch_size, new_tokens, lengths=validate)


class DecodeRunner:
    """A cache the runner's calls all use (reused across ``generate`` calls, zeroed at each
    start), ``step()`` (a callable ``(tokens, validate)`` -> logits, advancing that cache) and
    ``tree(shape)`` (``(tree_pass, commit)``: ``tree_pass(tokens, validate)`` -> ``(logits,
    TreePass)`` and ``commit(tree_pass, accepted, num_accepted)``). Subclasses build them."""

    _pools: "weakref.WeakKeyDictionary[TreeLM, dict]" = weakref.WeakKeyDictionary()

    def __init__(self, model: TreeLM, batch_size: int, max_length: int):
        self.model = model
        self.cache = model.allocate_cache(batch_size, max_length)
        self._step: Callable | None = None
        self._trees: dict[TreeShape, tuple[Callable, Callable]] = {}

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
        for t in (runner.cache.conv, runner.cache.ssm, runner.cache.seqlens):
            if t is not None:
                t.zero_()
        runner.cache.moved()
        return runner

    def step(self) -> Callable:
        if self._step is None:
            self._step = self.make_step()
        return self._step

    def tree(self, shape: TreeShape) -> tuple[Callable, Callable]:
        """The tree pass of ``shape`` and its commit."""
        if shape not in self._trees:
            self._trees[shape] = self.make_tree(shape)
        return self._trees[shape]

    def fused(self, fn, shape: TreeShape, name: str) -> Callable | None:
        """``fn`` run with the tree pass of ``shape`` in one compiled graph, as
        :meth:`CompiledModel.fused` describes (a callable ``(tokens, *extra) -> (TreePass,
        rest)``), or None where the runner has no such path (CUDA graphs: the step's own)."""
        return None

    def make_step(self) -> Callable:
        raise NotImplementedError

    def make_tree(self, shape: TreeShape) -> tuple[Callable, Callable]:
        raise NotImplementedError
