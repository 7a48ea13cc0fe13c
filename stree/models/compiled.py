"""``torch.compile`` for the calls a decode loop repeats, on the CPU: the step, the tree pass of a
static shape and its commit. At the sizes where speculation pays on a CPU the loop is bound by
per-op overhead (a step is ~20 small ops per layer); Inductor fuses the elementwise work into a
few C++ loops. On CUDA the loop replays CUDA graphs instead (:mod:`.graphs`).

The compiled functions are the eager ones (``step_pass``, ``tree_layers``, ``commit_state``),
which stay the reference: tests compare the two. Compiling costs seconds per function and shape,
once per process; shapes are static (``dynamic=False``) and each new shape or batch size is a new
compilation (after torch's recompile limit, 8 per function, dynamo runs the eager code)."""

from __future__ import annotations

import functools
import weakref

import torch

from ..tree import TokenTree, TreeShape
from .base import TreeLM
from .cache import ModelCache, TreePass
from .runners import DecodeRunner, check_tree_tokens

__all__ = ["CompiledDecode", "CompiledStep", "CompiledTreePass", "CompiledCommit", "compiled_step"]

KERNELS = "torch"  # the PyTorch path is what Inductor fuses; Triton kernels are for CUDA


def _step(model: TreeLM, tokens, cache: ModelCache):
    logits = model.step_pass(tokens, cache)
    cache.seqlens += 1
    return logits


def _tree(model: TreeLM, tokens, index, cache: ModelCache):
    return model.tree_layers(tokens, index, cache, "tree", KERNELS)


def _commit(model: TreeLM, cache: ModelCache, ssm, attn, accepted, num_accepted):
    model.commit_state(cache, ssm, attn, accepted, num_accepted, KERNELS)


@functools.cache
def _compiled(fn):
    """One compiled wrapper per function, made on first use (compiling happens at its first call)."""
    return torch.compile(fn, dynamic=False)


@torch.no_grad()  # what is traced is inference: no autograd graph around the parameters
def _call(fn, *args):
    return _compiled(fn)(*args)


def _check_model(model: TreeLM) -> None:
    if not isinstance(model, TreeLM) or model.device.type != "cpu":
        raise ValueError(f"the compiled decode path is for stree models on the CPU (CUDA replays graphs), got "
                         f"{type(model).__name__} on {getattr(model, 'device', None)}")


def compiled_step(model: TreeLM):
    """``model.step`` compiled, as a callable ``(tokens, cache, validate=True) -> logits`` for any
    cache of the model (each batch size compiles once), e.g. for a drafter model's steps."""
    _check_model(model)

    def step(tokens: torch.Tensor, cache: ModelCache, validate: bool = True) -> torch.Tensor:
        model.check_step(tokens, cache, validate)
        logits = _call(_step, model, tokens, cache)
        cache.moved()
        return logits

    return step


class CompiledStep:
    """``model.step(tokens, cache)``, compiled, for one cache."""

    def __init__(self, model: TreeLM, cache: ModelCache):
        self.cache, self._step = cache, compiled_step(model)

    def __call__(self, tokens: torch.Tensor, validate: bool = True) -> torch.Tensor:
        return self._step(tokens, self.cache, validate)


class CompiledTreePass:
    """``model.forward_tree(tree, cache)`` for trees of one ``shape``, compiled; returns the logits
    and a :class:`TreePass` like the eager call."""

    def __init__(self, model: TreeLM, cache: ModelCache, shape: TreeShape):
        _check_model(model)
        self.model, self.cache, self.shape = model, cache, shape
        self.index = shape.index(model.device)
        self.new_tokens = shape.max_depth + 1  # the most a commit can add
        # One eager pass first (it changes no state): it fills the masks the index memoises, which
        # the compiled graph then reads as constants; filling them while tracing would fail the
        # graph's own guards on the next call and compile it twice.
        with torch.no_grad():
            model.tree_layers(torch.zeros(cache.batch_size, shape.n, dtype=torch.long), self.index, cache, "tree", KERNELS)

    def __call__(self, tokens: torch.Tensor, validate: bool = True):
        check_tree_tokens(self.model, self.cache, tokens, (self.cache.batch_size, self.shape.n), self.new_tokens,
                          validate)
        logits, ssm, attn = _call(_tree, self.model, tokens, self.index, self.cache)
        tree = TokenTree.from_shape(self.shape, tokens)
        return logits, TreePass(tree, self.index, self.shape.max_depth, ssm, attn, weakref.ref(self.cache),
                                self.cache.version)


class CompiledCommit:
    """``model.commit(cache, tree_pass, accepted, num_accepted, validate=False)``, compiled."""

    def __init__(self, model: TreeLM, cache: ModelCache):
        _check_model(model)
        self.model, self.cache = model, cache

    def __call__(self, tree_pass: TreePass, accepted: torch.Tensor, num_accepted: torch.Tensor) -> None:
        tree_pass.check_against(self.cache)
        _call(_commit, self.model, self.cache, tree_pass.ssm, tree_pass.attn, accepted, num_accepted)
        self.cache.moved()


class CompiledDecode(DecodeRunner):
    """The compiled step, and tree pass + commit per tree shape, for one model, batch size and
    cache size, all on the pool's cache."""

    def __init__(self, model: TreeLM, batch_size: int, max_length: int):
        _check_model(model)
        super().__init__(model, batch_size, max_length)

    def make_step(self) -> CompiledStep:
        return CompiledStep(self.model, self.cache)

    def make_tree(self, shape: TreeShape) -> tuple[CompiledTreePass, CompiledCommit]:
        return CompiledTreePass(self.model, self.cache, shape), CompiledCommit(self.model, self.cache)
