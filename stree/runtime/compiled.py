"""``torch.compile`` for the calls a decode loop repeats, on the CPU: ``step`` and ``forward_tree``
of static tree shapes. At the sizes where speculation pays on a CPU the loop is bound by per-op
overhead (a step is ~20 small ops per layer); Inductor fuses the elementwise work into a few C++
loops. ``commit`` is the model's own: a few gathers and one replay, which on the CPU runs compiled
by numba (``stree.kernels.cpu.replay_jit``); the Inductor-compiled PyTorch replay measured slower
(the shipped target, 13-node tree, batch 1 and 4), its guards alone a large part of it. On CUDA the loop replays CUDA graphs instead (:mod:`.graphs`),
the commit included. :meth:`CompiledModel.fused` compiles a decoding step's own work around the
tree pass into the pass's graph (greedy verification and the tensors the host reads,
``stree.decoding.steps``): run eager, a small iteration's verification and packing for the host
measured almost as long as a step.

The compiled functions are the eager ones (``step_pass``, ``tree_layers``), which stay the
reference: tests compare the two. Compiling costs seconds per function and shape, once per process
and model; shapes are static (``dynamic=False``). Each batch size and tree shape gets its own copy
of the function to compile: dynamo counts recompilations per code object, and past its limit (8)
runs the eager code, which one shared copy reached as soon as a process decoded two batch sizes
(tree passes then ran eager inside a compiled loop). A copy recompiles only for another size of the
cache's tensors (the attention layers' keys and values; an SSM's state has one size). Tokens are
passed as dense copies: guards check strides too, and a draft cut to a prefix, or the roots read
from the context, are views whose strides would compile the function again inside decoding."""

from __future__ import annotations

import re
import types
import weakref

import torch

from ..kernels.cpu.tree_jit import JIT_MAX_NODES
from ..tree import TokenTree, TreeShape
from ..models.base import TreeLM
from ..models.cache import ModelCache, TreePass
from .runners import DecodeRunner, check_tree_tokens

__all__ = ["CompiledModel", "CompiledDecode"]

KERNELS = "torch"  # the PyTorch path is what Inductor fuses (not numba's CPU kernels, nor Triton's for CUDA)


def _step(model: TreeLM, tokens, cache: ModelCache, heads=None):
    logits = model.step_pass(tokens, cache, KERNELS, heads=heads)
    cache.seqlens += 1
    return logits


def _tree(model: TreeLM, tokens, index, cache: ModelCache):
    return model.tree_layers(tokens, index, cache, "tree", KERNELS)


# a guard's source that reads the model, a module global or a class's attributes (methods,
# properties: code, not inputs), also where nested (``dict(type(model).__mro__[1].__dict__)[...]``)
_READS_CODE = re.compile(r"\bmodel\b|G\[|\btype\(")


def _inputs_only(entries) -> list[bool]:
    """Which of a compiled call's guards it keeps: every tensor's own (``TENSOR_MATCH``: dtype,
    device, sizes and strides, checked in C++), the model's parameters' too, and the rest of those
    on its arguments other than the model (the tokens, the cache's tensors, the tree index, Python
    constants) and on the global state (grad mode, default device, ...). Dropped: the rest of those
    reading the model (its modules' attributes and hooks), module globals (stree's and torch's
    functions and constants) and classes' attributes (the methods and properties of the model's and
    the tree index's classes), most of a call's guard work.
    Safe here because every CompiledModel compiles its own copies of the functions (no guard has
    to tell models apart), refuses a model whose dtype or device changed, and hands the graph the
    parameters afresh each call (their values; a parameter of other sizes or strides fails its
    guard and compiles again); a model given new modules or hooks, a module global rebound or a
    class patched needs a new CompiledModel."""
    return [entry.guard_type == "TENSOR_MATCH" or _READS_CODE.search(entry.name) is None for entry in entries]


# (the torch releases that take guard filters are those that ship torch's own) Without Inductor's
# size asserts: every input's sizes and strides are guarded (above), and the asserts, a Python call
# per input of every call, had cost a compiled step of the shipped target about a twentieth of its time.
_OPTIONS = dict({"guard_filter_fn": _inputs_only} if hasattr(torch.compiler, "skip_guard_on_inbuilt_nn_modules_unsafe")
                else {}, size_asserts=False)


def _dense(tokens: torch.Tensor) -> torch.Tensor:
    """A copy with row-major strides (``contiguous`` keeps a view's stride along a dimension of
    size 1, which the guards would still see)."""
    return tokens.clone(memory_format=torch.contiguous_format)


def _own_compiled(fn):
    """``fn`` compiled from its own copy of the code: dynamo keeps graphs per code object, so the
    copy has its own graphs and its own recompile count."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)
    # (a copy of the options: torch.compile pops the guard filter out of the dict it is handed, and
    # every function compiled after the first kept all its guards, the model's and globals' too)
    return torch.compile(copy, dynamic=False, options=dict(_OPTIONS))


class CompiledModel:
    """``model`` with ``step`` and ``forward_tree`` compiled (``commit`` is the model's own, and so is
    ``step`` and a draft's tree pass where the model makes them one call: :meth:`TreeLM.fused_step`,
    :meth:`TreeLM.fused_tree`), same signatures and checks; everything else (``prefill``,
    ``allocate_cache``, ...) is the model's own. A tree without a static shape (or another scan than
    "tree") takes the eager pass: its index is new every call, and each would compile anew. Works
    with any cache of the model, so a drafter model can be handed over in its place.
    ``CompiledModel.of(model)`` shares one per model.

    The model's parameters may change in value, not in dtype, device or shape (a changed dtype or
    device is refused: wrap the model again). Modules with a ``compile_layout`` method (Mamba2
    mixers) lay their parameters out as the compiled loops read them fastest, when wrapped and
    again before each call (a checkpoint loaded in place may have brought another layout back)."""

    _shared: "weakref.WeakKeyDictionary[TreeLM, CompiledModel]" = weakref.WeakKeyDictionary()

    def __init__(self, model: TreeLM):
        if not isinstance(model, TreeLM) or model.device.type != "cpu":
            raise ValueError(f"the compiled decode path is for stree models on the CPU (CUDA replays graphs), got "
                             f"{type(model).__name__} on {getattr(model, 'device', None)}")
        self.model = model
        self._laid = [m for m in model.modules() if hasattr(m, "compile_layout")]
        self._lay_out()
        self._made_for = (model.dtype, model.device)
        self._fns: dict = {}  # (function, batch size, tree shape) -> its own compiled copy
        self._warm: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()

    @classmethod
    def of(cls, model: TreeLM) -> "CompiledModel":
        if model not in cls._shared:
            cls._shared[model] = cls(model)
        return cls._shared[model]

    def __getattr__(self, name):
        return getattr(self.model, name)

    def _lay_out(self) -> None:
        for module in self._laid:
            module.compile_layout()

    @torch.no_grad()  # what is traced is inference: no autograd graph around the parameters
    def _call(self, fn, key, *args):
        if (self.model.dtype, self.model.device) != self._made_for:
            raise ValueError(f"the model is now {self.model.dtype} on {self.model.device} but was compiled for "
                             f"{self._made_for[0]} on {self._made_for[1]}: make a new CompiledModel")
        self._lay_out()  # (a graph compiled for one layout asserts it: Inductor checks its inputs' strides)
        compiled = self._fns.get((fn, key))
        if compiled is None:
            compiled = self._fns[(fn, key)] = _own_compiled(fn)
        return compiled(self.model, *args)

    def step(self, tokens: torch.Tensor, cache: ModelCache, validate: bool = True,
             heads: torch.Tensor | None = None, one_call=None) -> torch.Tensor:
        """The model's step (``one_call``: as :meth:`TreeLM.step` takes it), compiled where it is not one call."""
        if one_call is None:
            with torch.no_grad():
                one_call = self.model.fused_step(cache, tokens, self.model.kernel_backend)
        if one_call is not None:  # (the model's whole step as one call of its own: faster than Inductor's graph of it)
            return self.model.step(tokens, cache, validate, heads, one_call=one_call)
        self.model.check_step(tokens, cache, validate, heads)
        if heads is None:
            logits = self._call(_step, (cache.batch_size,), _dense(tokens), cache)
        else:  # (a function of its own per count of heads: their values are an input)
            logits = self._call(_step, (cache.batch_size, len(heads)), _dense(tokens), cache, _dense(heads))
        cache.moved()
        return logits

    def forward_tree(self, tree: TokenTree, cache: ModelCache, scan: str = "tree", validate: bool = True):
        index, max_depth = self.model.check_tree(tree, cache, scan, validate)
        with torch.no_grad():
            one_call = None if scan != "tree" else self.model.fused_tree(cache, tree.tokens, index,
                                                                          self.model.kernel_backend)
        if one_call is not None:  # (the model's own pass as one call, as its step: faster than Inductor's)
            return one_call[0], TreePass(tree, index, max_depth, one_call[1], None, weakref.ref(cache), cache.version)
        if scan != "tree" or tree.static_shape is None:
            return self.model.tree_pass(tree, index, cache, scan, KERNELS, max_depth)
        self.warm(tree, index, cache)
        logits, ssm, attn = self._call(_tree, (cache.batch_size, tree.static_shape), _dense(tree.tokens), index, cache)
        return logits, TreePass(tree, index, max_depth, ssm, attn, weakref.ref(cache), cache.version)

    def warm(self, tree: TokenTree, index, cache: ModelCache) -> None:
        """Before a static shape's first compiled pass, one eager pass (it changes no state): it
        fills the masks the index memoises, which the compiled graph then reads as constants;
        filling them while tracing would fail the graph's own guards on the next call and compile
        it twice."""
        if self._warm.get(id(index)) is not index:
            with torch.no_grad():
                self.model.tree_layers(tree.tokens, index, cache, "tree", KERNELS)
            self._warm[id(index)] = index

    def fused(self, fn, tree: TokenTree, cache: ModelCache, name: str, *extra):
        """``fn(model, tokens, index, cache, kernels, *extra)``, which runs the tree pass of a static
        shape (``tree_layers``) and returns ``(ssm, attn, rest)``, compiled as one graph per batch
        size, shape and ``name`` (``extra``, Python values, are constants of it): the work a
        decoding step does around the pass, in the pass's graph. Returns ``(TreePass, rest)``."""
        index, max_depth = self.model.check_tree(tree, cache, "tree", validate=False)
        self.warm(tree, index, cache)
        constants = tuple(x for x in extra if not isinstance(x, torch.Tensor))  # a copy of its own for each
        extra = tuple(_dense(x) if isinstance(x, torch.Tensor) else x for x in extra)
        ssm, attn, rest = self._call(fn, (cache.batch_size, tree.static_shape, name, constants), _dense(tree.tokens), index,
                                     cache, KERNELS, *extra)
        return TreePass(tree, index, max_depth, ssm, attn, weakref.ref(cache), cache.version), rest

    def commit(self, cache: ModelCache, tree_pass: TreePass, accepted: torch.Tensor, num_accepted: torch.Tensor,
               validate: bool = True) -> None:
        self.model.commit(cache, tree_pass, accepted, num_accepted, validate)  # eager: see the module docstring


class CompiledDecode(DecodeRunner):
    """The compiled step, and tree pass + commit per tree shape, for one model, batch size and
    cache size, all on the pool's cache."""

    fused_on_host = True

    def __init__(self, model: TreeLM, batch_size: int, max_length: int):
        self.compiled = CompiledModel.of(model)
        self._fused: dict = {}  # (shape, name) -> its fused pass (see fused)
        super().__init__(model, batch_size, max_length)

    def make_step(self):
        return lambda tokens, validate=True: self.compiled.step(tokens, self.cache, validate)

    def make_tree(self, shape: TreeShape):
        new_tokens = shape.max_depth + 1  # the most a commit can add

        def tree_pass(tokens: torch.Tensor, validate: bool = True):
            check_tree_tokens(self.model, self.cache, tokens, (self.cache.batch_size, shape.n), new_tokens, validate)
            return self.compiled.forward_tree(TokenTree.from_shape(shape, tokens), self.cache, validate=False)

        def commit(tree_pass: TreePass, accepted: torch.Tensor, num_accepted: torch.Tensor) -> None:
            self.compiled.commit(self.cache, tree_pass, accepted, num_accepted, validate=False)

        return tree_pass, commit

    def fused(self, fn, shape: TreeShape, name: str):
        """See :meth:`DecodeRunner.fused`: compiled by :meth:`CompiledModel.fused`; None where the
        model makes its step one call of its own (its tree passes are then one call too: its greedy
        iterations, :meth:`DecodeRunner.greedy_tree`; other passes, :meth:`CompiledModel.forward_tree`)."""
        with torch.no_grad():
            if shape.n <= JIT_MAX_NODES and self.model.fused_step(self.cache, None, self.model.kernel_backend):
                return None
        if (shape, name) not in self._fused:
            def run(tokens: torch.Tensor, *extra):
                check_tree_tokens(self.model, self.cache, tokens, (self.cache.batch_size, shape.n),
                                  shape.max_depth + 1, False)
                return self.compiled.fused(fn, TokenTree.from_shape(shape, tokens), self.cache, name, *extra)
            run.commit = self.tree(shape)[1]  # (the model's own, as for the shape's unfused pass)
            self._fused[(shape, name)] = run
        return self._fused[(shape, name)]
