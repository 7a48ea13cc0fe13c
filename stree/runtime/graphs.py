"""CUDA graphs for the calls a decode loop repeats: the autoregressive step, and per fixed tree
shape the verify pass and its commit, or, greedy, the whole iteration (:class:`GraphedIteration`:
the pass, verification and what the host reads in one graph, the commit in a second). At batch 1
every call is launch-bound (every layer launches a dozen small kernels), and a graph replays all
of them as one launch.

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
from ..models.cache import ModelCache, TreePass
from .runners import DecodeRunner, check_tree_tokens

__all__ = ["DecodeGraphs", "GraphedCommit", "GraphedIteration", "GraphedStep", "GraphedTreePass"]


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
    """``model.step(tokens, cache)`` replayed from a CUDA graph, or ``fn(model, tokens, cache,
    *extra)``, a step and what a decoding step does after it (:meth:`DecodeRunner.fused_step`),
    ``extra`` Python constants of the graph. The returned tensor (the logits, or ``fn``'s output)
    is the graph's own: the next call overwrites it."""

    @torch.no_grad()  # (inference: no autograd graph is captured around the parameters)
    def __init__(self, model: TreeLM, cache: ModelCache, warmup: int = 2, fn=None, extra: tuple = ()):
        model.check_cache(cache, cache.batch_size, 1)
        self.model, self.cache = model, cache
        self.tokens = torch.zeros(cache.batch_size, dtype=torch.long, device=model.device)
        fn = fn or (lambda model, tokens, cache: model.step(tokens, cache, validate=False))
        self.graph, self.logits = _capture(model, cache, lambda: fn(model, self.tokens, cache, *extra), warmup)

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
    :class:`GraphedTreePass` (or :class:`GraphedIteration`), replayed from a CUDA graph: the
    accepted paths go through static buffers (``accepted`` and ``num``, where given: a graph's own
    outputs, which then need no copy), the scratch is the tree graph's own output. The path is not
    validated (the caller's verifier produced it)."""

    def __init__(self, model: TreeLM, tree_graph, warmup: int = 2, accepted: torch.Tensor | None = None,
                 num: torch.Tensor | None = None):
        self.model, self.cache, self.tree_graph = model, tree_graph.cache, tree_graph
        batch, depth = self.cache.batch_size, tree_graph.new_tokens
        self.accepted = torch.zeros(batch, depth, dtype=torch.long, device=model.device) if accepted is None else accepted
        self.num = torch.ones(batch, dtype=torch.long, device=model.device) if num is None else num
        static = dataclasses.replace(tree_graph.tree_pass, cache_ref=weakref.ref(self.cache),
                                     version=self.cache.version)

        def commit():
            static.version = self.cache.version  # the state each run starts from is the current one
            model.commit(self.cache, static, self.accepted, self.num, validate=False)

        self.graph, _ = _capture(model, self.cache, commit, warmup)

    def __call__(self, tree_pass, accepted: torch.Tensor, num_accepted: torch.Tensor) -> None:
        tree_pass.check_against(self.cache)
        if accepted is not self.accepted:
            if accepted.shape != self.accepted.shape:
                raise ValueError(f"accepted must have shape {tuple(self.accepted.shape)} (captured), got "
                                 f"{tuple(accepted.shape)}")
            self.accepted.copy_(accepted)
        if num_accepted is not self.num:
            self.num.copy_(num_accepted)
        self.graph.replay()
        self.cache.moved()


class GraphedIteration:
    """A decoding iteration around the tree pass of one ``shape``, replayed from a CUDA graph:
    ``fn(model, tokens, index, cache, kernels, *extra)`` runs the pass (``tree_layers``) and what
    the step does around it (greedy verification, the host's outputs packed into one tensor) and
    returns ``(ssm, attn, rest)``, ``rest`` beginning with the accepted paths and their lengths;
    ``extra``: tensors (copied into the graph's own each call) and Python constants (of the graph:
    another value is another :class:`GraphedIteration`). :attr:`commit` replays the commit of the
    pass as a second graph reading the paths where the first wrote them. So a greedy iteration
    launches two graphs and its copies: run eager around a graphed pass, the verification and the
    packing were three dozen launches, as much host time as the pass's graph (an H200, batch 1)."""

    @torch.no_grad()  # (inference: no autograd graph is captured around the parameters)
    def __init__(self, model: TreeLM, cache: ModelCache, shape: TreeShape, fn, extra: tuple, warmup: int = 2):
        self.model, self.cache = model, cache
        self.new_tokens = shape.max_depth + 1  # the most a commit can add
        self.tree = TokenTree.from_shape(shape, torch.zeros(cache.batch_size, shape.n, dtype=torch.long,
                                                            device=model.device))
        index, max_depth = model.check_tree(self.tree, cache, "tree")
        self.extra = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in extra)
        kernels = model.kernel_backend
        self.graph, (ssm, attn, self.rest) = _capture(
            model, cache, lambda: fn(model, self.tree.tokens, index, cache, kernels, *self.extra), warmup)
        self.tree_pass = TreePass(self.tree, index, max_depth, ssm, attn, weakref.ref(cache), cache.version)
        # (a captured graph has run nothing: its outputs hold whatever their memory held, and the
        # commit's warm-up reads the paths: the root alone, as a commit's own buffers start)
        self.rest[0].zero_()
        self.rest[1].fill_(1)
        self.commit = GraphedCommit(model, self, warmup, accepted=self.rest[0], num=self.rest[1])

    def __call__(self, tokens: torch.Tensor, *extra):
        """The TreePass (for :attr:`commit`) and ``rest``: the graph's own outputs, which the next
        replay overwrites."""
        check_tree_tokens(self.model, self.cache, tokens, self.tree.tokens.shape, self.new_tokens, False)
        self.tree.tokens.copy_(tokens)
        for mine, given in zip(self.extra, extra):
            if isinstance(mine, torch.Tensor):
                mine.copy_(given)
        self.graph.replay()
        return dataclasses.replace(self.tree_pass, version=self.cache.version), self.rest


class _FusedGraphs:
    """:meth:`DecodeGraphs.fused`: a :class:`GraphedIteration` per value of the call's constants,
    and the commit of the last one run."""

    def __init__(self, runner: "DecodeGraphs", fn, shape: TreeShape):
        self.runner, self.fn, self.shape = runner, fn, shape
        self.graphs: dict[tuple, GraphedIteration] = {}
        self.last: GraphedIteration | None = None

    def __call__(self, tokens: torch.Tensor, *extra):
        constants = tuple(x for x in extra if not isinstance(x, torch.Tensor))
        graph = self.graphs.get(constants)
        if graph is None:
            graph = self.graphs[constants] = GraphedIteration(self.runner.model, self.runner.cache, self.shape,
                                                              self.fn, extra)
        self.last = graph
        return graph(tokens, *extra)

    def commit(self, tree_pass, accepted: torch.Tensor, num_accepted: torch.Tensor) -> None:
        self.last.commit(tree_pass, accepted, num_accepted)


class DecodeGraphs(DecodeRunner):
    """The graphs a decode loop replays, for one model, batch size and cache size: the step graph
    and a tree-pass + commit pair per tree shape (and, greedy, a step with its token's choice, and
    an iteration + commit pair per shape), all pointing at the pool's cache."""

    def __init__(self, model: TreeLM, batch_size: int, max_length: int):
        super().__init__(model, batch_size, max_length)
        self._fused: dict = {}  # (shape, name) -> its iterations (fused)
        self._steps: dict = {}  # name -> its steps (fused_step)

    def fused(self, fn, shape: TreeShape, name: str):
        """See :meth:`DecodeRunner.fused`: the iteration as CUDA graphs (:class:`GraphedIteration`),
        its outputs the device's (the host's part packed into one tensor)."""
        if (shape, name) not in self._fused:
            self._fused[(shape, name)] = _FusedGraphs(self, fn, shape)
        return self._fused[(shape, name)]

    def fused_step(self, fn, name: str):
        """See :meth:`DecodeRunner.fused_step`: a :class:`GraphedStep` of ``fn`` per value of its constants."""
        if name not in self._steps:
            graphs: dict[tuple, GraphedStep] = {}

            def run(tokens: torch.Tensor, *extra):
                graph = graphs.get(extra)
                if graph is None:
                    graph = graphs[extra] = GraphedStep(self.model, self.cache, fn=fn, extra=extra)
                return graph(tokens, validate=False)
            self._steps[name] = run
        return self._steps[name]

    def make_step(self) -> GraphedStep:
        return GraphedStep(self.model, self.cache)

    def make_tree(self, shape: TreeShape) -> tuple[GraphedTreePass, GraphedCommit]:
        tree_graph = GraphedTreePass(self.model, self.cache, shape)
        return tree_graph, GraphedCommit(self.model, tree_graph)
