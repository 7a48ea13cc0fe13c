"""CUDA graphs for the two calls a decode loop repeats: the autoregressive step and the verify
pass of one fixed tree shape. At batch 1 both are launch-bound (every layer launches a dozen
small kernels), and a graph replays all of them as one launch.

A graph is captured against one cache and keeps pointing at its tensors, which the step and
commit update in place. A captured call cannot read values back on the host, so the checks that
need to (token range, room left in the cache) run eagerly in ``__call__`` unless the caller turns
them off with ``validate=False``.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from ..tree import TokenTree, TreeShape
from ..models.base import TreeLM
from ..models.cache import ModelCache
from .runners import DecodeRunner, check_tree_tokens

__all__ = ["DecodeGraphs", "GraphedCommit", "GraphedStep", "GraphedTreePass"]


def _recurrent_state(cache: ModelCache) -> list[torch.Tensor]:
    """What a call may advance; K/V slots past ``seqlens`` are scratch, so they need no restore."""
    return [t for t in (cache.conv, cache.ssm) if t is not None] + [cache.seqlens]


def _capture(model: TreeLM, cache: ModelCache, fn, warmup: int):
    """Run ``fn`` ``warmup`` times on a side stream (Triton compiles, the allocator settles),
    restoring the cache after each, then capture one call. Returns ``(graph, output)``."""
    if model.device.type != "cuda":
        raise ValueError(f"CUDA graphs need a model on a CUDA device, got {model.device}")
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1 (the capture must not see a first launch), got {warmup}")
    saved = [t.clone() for t in _recurrent_state(cache)]
    version = cache.version
    stream = torch.cuda.Stream(model.device)
    stream.wait_stream(torch.cuda.current_stream(model.device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
            for t, s in zip(_recurrent_state(cache), saved):
                t.copy_(s)
    torch.cuda.current_stream(model.device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    cache.version = version  # nothing was committed for real
    return graph, out


class GraphedStep:
    """``model.step(tokens, cache)`` replayed from a CUDA graph. The returned logits tensor is the
    graph's own output: the next call overwrites it."""

    def __init__(self, model: TreeLM, cache: ModelCache, warmup: int = 2):
        model.check_cache(cache, cache.batch_size, 1)
        self.model, self.cache = model, cache
        self.tokens = torch.zeros(cache.batch_size, dtype=torch.long, device=model.device)
        self.graph, self.logits = _capture(model, cache, lambda: model.step(self.tokens, cache, validate=False),
                                           warmup)

    def __call__(self, tokens: torch.Tensor, validate: bool = True) -> torch.Tensor:
        self.model.check_tokens("tokens", tokens, values=validate)
        if tokens.shape != self.tokens.shape:
            raise ValueError(f"tokens must have shape {tuple(self.tokens.shape)} (captured), got {tuple(tokens.shape)}")
        self.model.check_cache(self.cache, self.cache.batch_size, 1, lengths=validate)
        self.tokens.copy_(tokens)
        self.graph.replay()
        self.cache.moved()  # host-side bookkeeping the captured step cannot replay
        return self.logits


class GraphedTreePass:
    """``model.forward_tree(tree, cache)`` for trees of one ``shape``, replayed from a CUDA graph.
    Returns the logits and a TreePass like the eager call, so ``model.commit(cache, tree_pass,
    accepted, num_accepted)`` follows it as usual (the pass's scratch lives in the graph's pool
    and is overwritten by the next replay)."""

    def __init__(self, model: TreeLM, cache: ModelCache, shape: TreeShape, warmup: int = 2):
        self.model, self.cache = model, cache
        self.new_tokens = shape.max_depth + 1  # the most a commit can add
        self.tree = TokenTree.from_shape(shape, torch.zeros(cache.batch_size, shape.n, dtype=torch.long,
                                                            device=model.device))
        index, max_depth = model.check_tree(self.tree, cache, "tree")
        kernels = model.kernel_backend
        self.graph, (self.logits, self.tree_pass) = _capture(
            model, cache, lambda: model.tree_pass(self.tree, index, cache, "tree", kernels, max_depth), warmup)

    def __call__(self, tokens: torch.Tensor, validate: bool = True):
        """Logits ``[b, n, V]`` and the TreePass for the tree of this shape carrying ``tokens [b, n]``."""
        check_tree_tokens(self.model, self.cache, tokens, self.tree.tokens.shape, self.new_tokens, validate)
        self.tree.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits, dataclasses.replace(self.tree_pass, cache_ref=weakref.ref(self.cache),
                                                version=self.cache.version)


class GraphedCommit:
    """``model.commit(cache, tree_pass, accepted, num_accepted)`` for the passes of one
    :class:`GraphedTreePass`, replayed from a CUDA graph: the accepted paths go through static
    buffers, the scratch is the tree graph's own output. The path is not validated (the caller's
    verifier produced it)."""

    def __init__(self, model: TreeLM, tree_graph: GraphedTreePass, warmup: int = 2):
        self.model, self.cache, self.tree_graph = model, tree_graph.cache, tree_graph
        batch, depth = self.cache.batch_size, tree_graph.new_tokens
        self.accepted = torch.zeros(batch, depth, dtype=torch.long, device=model.device)
        self.num = torch.ones(batch, dtype=torch.long, device=model.device)
        static = dataclasses.replace(tree_graph.tree_pass, cache_ref=weakref.ref(self.cache),
                                     version=self.cache.version)

        def commit():
            static.version = self.cache.version  # the state each run starts from is the current one
            model.commit(self.cache, static, self.accepted, self.num, validate=False)

        self.graph, _ = _capture(model, self.cache, commit, warmup)

    def __call__(self, tree_pass, accepted: torch.Tensor, num_accepted: torch.Tensor) -> None:
        tree_pass.check_against(self.cache)
        if accepted.shape != self.accepted.shape:
            raise ValueError(f"accepted must have shape {tuple(self.accepted.shape)} (captured), got {tuple(accepted.shape)}")
        self.accepted.copy_(accepted)
        self.num.copy_(num_accepted)
        self.graph.replay()
        self.cache.moved()


class DecodeGraphs(DecodeRunner):
    """The graphs a decode loop replays, for one model, batch size and cache size: the step graph
    and a tree-pass + commit pair per tree shape, all pointing at the pool's cache."""

    def make_step(self) -> GraphedStep:
        return GraphedStep(self.model, self.cache)

    def make_tree(self, shape: TreeShape) -> tuple[GraphedTreePass, GraphedCommit]:
        tree_graph = GraphedTreePass(self.model, self.cache, shape)
        return tree_graph, GraphedCommit(self.model, tree_graph)
