"""Every argument of :func:`~stree.decoding.loop.decode` checked and resolved once, before anything
is allocated (a cache, a drafter's state, compiled graphs), into a :class:`DecodeConfig` the loop
reads: each check with its own error."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..drafters.base import Drafter, check_budget
from ..drafters.ngram import NGramDrafter
from ..models.base import TreeLM
from ..runtime.unrolled import UnrolledTarget
from ..sampling.keyed import KeyedDraws
from ..sampling.verify import SamplingParams
from ..tree import TreeBudget, TreeShape
from .args import integer
from .acceptance import PathRates
from .autotree import AutoTree
from .distributed import drafts_here, tensor_parallel
from .stops import check_stop_sequences

METHODS = ("stree", "chain", "autoregressive", "unrolled")


class DecodeConfig(NamedTuple):
    """What :func:`resolve` makes of :func:`~stree.decoding.loop.decode`'s arguments."""

    prompts: list[list[int]]
    budgets: list[int]
    eos: list[int]
    auto: bool  # tree="auto": each step's tree chosen (by ``chooser``, or one made for the call)
    drafter: Drafter | None  # None: plain steps only, or a rank that receives its trees
    chooser: AutoTree | None
    depth: int  # the deepest tree the cache has room for
    cuda_graph: bool
    torch_compile: bool
    params: SamplingParams
    device: torch.device
    max_length: int
    generator: KeyedDraws | None  # the sampling draws (None: greedy)
    top_k: int | None  # the target's entries packed per emitted token (None: no laws): the drafter's and logprobs'
    drafter_k: int | None  # how many of them the drafter learns from
    logprobs: int | None
    stops: list[tuple[int, ...]]
    speculative: bool  # whether the loop drafts (on this rank or rank 0)
    shape: TreeShape | TreeBudget | None  # an explicit tree, drafted as given
    scan: str
    target: object  # the model, or its unrolled baseline


def resolve(model, input_ids, drafter, tree, method, max_new_tokens, temperature, top_k, top_p, eos_token_id, seed,
            mode, max_length, sampling, cuda_graph, torch_compile, cache, stop_sequences,
            logprobs=None) -> DecodeConfig:
    """Every check and choice :func:`~stree.decoding.loop.decode` makes from its arguments, each with
    its error, before anything is allocated (a cache, a drafter's state, compiled graphs)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    prompts = _prompts(input_ids)
    budgets = _budgets(max_new_tokens, len(prompts))
    seed = _seed(seed, len(prompts))
    max_length = None if max_length is None else integer("max_length", max_length, low=1)
    params = sampling if sampling is not None else SamplingParams(temperature, top_k, top_p, mode)
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(params).__name__}")
    if params.rows is not None and params.rows != len(prompts):
        raise ValueError(f"sampling holds values for {params.rows} rows, but there are {len(prompts)} prompts")
    stops = check_stop_sequences(stop_sequences, model.vocab_size)
    if logprobs is not None:
        logprobs = integer("logprobs", logprobs, low=0, high=model.vocab_size)
    tp = tensor_parallel(model)
    auto, chooser, shape = _tree_choice(drafter, tree, method, tp)
    depth, max_length = _room(model, cache, prompts, budgets, max_length, auto, chooser, drafter, shape)
    eos = _eos_ids(eos_token_id, model.vocab_size)
    if method == "autoregressive" or auto and depth == 0:  # no room for a tree: plain steps
        drafter = None
    elif drafter is None:
        drafter = NGramDrafter()
    if drafter is not None and not auto:
        check_budget(drafter, shape)
    cuda_graph = _execution(model, method, cache, tp, cuda_graph, torch_compile)
    generator = _generator(seed, model.device, drafter, params.greedy)
    speculative = drafter is not None
    if not drafts_here(model):
        drafter = None  # rank 0 drafts and learns; this rank receives its trees
    return DecodeConfig(prompts, budgets, eos, auto, drafter, chooser, depth, cuda_graph, torch_compile, params,
                        model.device, max_length, generator, laws(_top_k(drafter), logprobs), _top_k(drafter),
                        logprobs, stops, speculative, shape,
                        "chain" if method == "chain" else "tree",
                        UnrolledTarget(model) if method == "unrolled" else model)


def _budgets(max_new_tokens, rows: int) -> list[int]:
    if isinstance(max_new_tokens, (list, tuple)):
        if len(max_new_tokens) != rows:
            raise ValueError(f"max_new_tokens holds {len(max_new_tokens)} values for {rows} rows")
        return [integer(f"max_new_tokens[{i}]", m, low=1) for i, m in enumerate(max_new_tokens)]
    return [integer("max_new_tokens", max_new_tokens, low=1)] * rows


def _tree_choice(drafter, tree, method: str, tp) -> tuple[bool, AutoTree | None, TreeShape | TreeBudget | None]:
    """Whether each step's tree is chosen (``auto``), by which chooser, or the one shape drafted."""
    own_shape = getattr(drafter, "shape", None)
    if (tree is None or tree == "auto") and method in ("stree", "unrolled") and own_shape is not None:
        tree = own_shape  # a drafter built for a tree of its own drafts it: an explicit choice
    chooser = tree if isinstance(tree, AutoTree) else None
    auto = method in ("stree", "chain") and (tree is None or tree == "auto" or chooser is not None)
    if auto and tp is not None:
        auto, chooser, tree = False, None, None
    elif not auto and (tree is None or tree == "auto" or chooser is not None):
        tree, chooser = None, None
    if chooser is not None and chooser.chain != (method == "chain"):
        raise ValueError(f"this AutoTree drafts {'chains' if chooser.chain else 'trees'}, but method={method!r}")
    return auto, chooser, None if auto else _resolve_shape(method, tree)


def _room(model, cache, prompts, budgets, max_length, auto: bool, chooser, drafter, shape) -> tuple[int, int]:
    """The deepest tree drafted and the cache size: a given cache's, or the longest prompt plus its
    budget plus that depth."""
    longest = max(len(p) + m for p, m in zip(prompts, budgets)) - 1  # the longest prompt and budget, bar one
    if cache is not None:
        if max_length is not None:
            raise ValueError("max_length is the size of a new cache: leave it out when passing a cache")
        max_length = cache.max_length
        _check_continued(model, cache, prompts)
    own = getattr(drafter, "draft_depth", None) or 0  # a drafter drafting trees of its own depth
    if auto and not own:  # the choice plans trees within the room the cache leaves (a given one, its own)
        room = PathRates.DEPTH if max_length is None else max_length - longest - 1
        depth = chooser.depth if chooser is not None else max(0, min(PathRates.DEPTH, room))
    else:
        depth = own if auto else 0 if shape is None else max(shape.max_depth, own)
    need = longest + 1 + depth
    if max_length is None:
        max_length = need
    elif need > max_length:
        raise ValueError(f"max_length {max_length} is too small: the longest prompt plus its max_new_tokens "
                         f"({longest + 1} tokens) plus the tree depth ({depth}) needs {need}")
    return depth, max_length


def _eos_ids(eos_token_id, vocab_size: int) -> list[int]:
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, (list, tuple)):
        return [integer("eos_token_id", e, low=0, high=vocab_size - 1) for e in eos_token_id]
    return [integer("eos_token_id", eos_token_id, low=0, high=vocab_size - 1)]


def _execution(model, method: str, cache, tp, cuda_graph, torch_compile) -> bool:
    """Whether the loop replays CUDA graphs (by default where it can), after the checks of both modes."""
    device = model.device
    if tp is not None and (cuda_graph or torch_compile or method == "unrolled"):
        raise ValueError("a tensor-parallel model decodes eager: cuda_graph, torch_compile and method='unrolled' "
                         "are not supported with it")
    if cuda_graph is None:
        cuda_graph = (device.type == "cuda" and isinstance(model, TreeLM) and method != "unrolled" and cache is None
                      and tp is None)
    if cache is not None and (cuda_graph or torch_compile):
        raise ValueError("decoding from a given cache runs eager: cuda_graph and torch_compile own their cache")
    if method == "unrolled" and (cuda_graph or torch_compile):
        raise ValueError("method='unrolled' (the paper's baseline) runs eager: cuda_graph and torch_compile are off")
    if cuda_graph and (device.type != "cuda" or not isinstance(model, TreeLM)):
        raise ValueError(f"cuda_graph=True needs a stree model on a CUDA device, got {type(model).__name__} on {device}")
    if not isinstance(torch_compile, bool):
        raise TypeError(f"torch_compile must be a bool, got {torch_compile!r}")
    if torch_compile and (device.type != "cpu" or not isinstance(model, TreeLM)):
        raise ValueError(f"torch_compile=True is for stree models on the CPU (on CUDA: cuda_graph), got "
                         f"{type(model).__name__} on {device}")
    return cuda_graph


def _seed(seed, rows: int) -> int | list[int] | KeyedDraws | None:
    """``seed`` checked: None, an int, a list or tuple of one int per row, or the rows' own
    :class:`~stree.sampling.keyed.KeyedDraws` (a caller continuing rows: the serving engine)."""
    if isinstance(seed, KeyedDraws):
        if seed.rows != rows:
            raise ValueError(f"seed holds the draws of {seed.rows or 'any number of'} rows, not one per row of {rows}")
        return seed
    if seed is None or not isinstance(seed, (list, tuple)):
        return None if seed is None else integer("seed", seed, low=0, high=2**63 - 1)
    if len(seed) != rows:
        raise ValueError(f"seed holds {len(seed)} values for {rows} rows")
    return [integer(f"seed[{i}]", s, low=0, high=2**63 - 1) for i, s in enumerate(seed)]


def seed_streams(entropy) -> tuple[int, int]:
    """Two independent seeds from ``entropy`` (an int or a list of them): the verifier's and the drafter's."""
    return tuple(int(s.generate_state(1, np.uint64)[0] >> 1) for s in np.random.SeedSequence(entropy).spawn(2))


def _generator(seed: int | list[int] | KeyedDraws | None, device, drafter, greedy: bool) -> KeyedDraws | None:
    """The verifier's draws, keyed by row and position (:mod:`stree.sampling.keyed`; None where
    greedy decoding draws nothing): from one ``seed``, two independent streams, the verifier's and
    the drafter's; from one seed per row, each row's draws its seed's alone (what that row alone
    draws with it), the drafter's stream from them all; without one, keyed by a number from torch's
    global stream (``torch.manual_seed`` still repeats a call), the drafter keeping its own stream."""
    if seed is None:
        return None if greedy else KeyedDraws(int(torch.randint(0, 2**62, (1,))), device)
    if isinstance(seed, KeyedDraws):  # (its caller answers for the drafter's stream)
        return seed
    if drafter is not None:
        drafter.reseed(seed_streams(seed)[1])
    return KeyedDraws([seed_streams(s)[0] for s in seed] if isinstance(seed, list) else seed_streams(seed)[0], device)


def laws(drafter_k: int | None, logprobs: int | None) -> int | None:
    """How many target entries a step packs per emitted token: the more of what the drafter
    learns from and what ``logprobs`` keeps (None: neither wants any)."""
    if drafter_k is None or logprobs is None:
        return logprobs if drafter_k is None else drafter_k
    return max(drafter_k, logprobs)


def _top_k(drafter: Drafter | None) -> int | None:
    """How many target entries the drafter learns from per token (None: it learns nothing)."""
    return None if drafter is None else drafter.target_top_k


def _prompts(input_ids) -> list[list[int]]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be an integer tensor [batch, T] or a list of token lists, "
                             f"got {input_ids.dtype} {tuple(input_ids.shape)}")
        prompts = input_ids.tolist()
    else:
        try:
            prompts = [list(p) for p in input_ids]
        except TypeError:
            raise TypeError(f"input_ids must be an integer tensor [batch, T] or a list of token lists, got "
                            f"{type(input_ids).__name__}") from None
        for i, p in enumerate(prompts):
            for j, t in enumerate(p):
                if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                    raise TypeError(f"input_ids[{i}][{j}] must be an integer token id, got {t!r}")
        prompts = [[int(t) for t in p] for p in prompts]
    if not prompts:
        raise ValueError("input_ids holds no rows")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"input_ids row {i} is empty: every prompt needs at least one token")
    return prompts


def _resolve_shape(method: str, tree) -> TreeShape | TreeBudget | None:
    if method == "autoregressive":
        return None
    if tree is None:
        tree = TreeShape.chain(4) if method == "chain" else TreeShape.paper13()
    if isinstance(tree, TreeBudget):
        if method != "stree":
            raise ValueError(f"a TreeBudget (a tree grown per step) is for method='stree', got method={method!r}")
        return tree
    if isinstance(tree, str):
        raise ValueError(f"tree must be 'auto', a TreeShape or a TreeBudget, got {tree!r} (a spec such as "
                         "'paper13' or 'dynamic:20': stree.tree.tree_spec)")
    if not isinstance(tree, TreeShape):
        raise TypeError(f"tree must be 'auto', a TreeShape or a TreeBudget, got {type(tree).__name__}")
    if method == "chain" and tree.parents != TreeShape.chain(tree.n - 1).parents:
        raise ValueError(f"method='chain' needs a chain tree, got parents {list(tree.parents)}")
    return tree


def _check_continued(model, cache, prompts: list[list[int]]) -> None:
    """A cache to continue from: one row per context, each holding all of it but the last token."""
    if isinstance(model, TreeLM):
        model.check_cache(cache, len(prompts), 0)
    elif cache.batch_size != len(prompts):
        raise ValueError(f"the cache holds {cache.batch_size} rows but the input has batch {len(prompts)}")
    held = cache.seqlens.tolist()
    for i, (p, n) in enumerate(zip(prompts, held)):
        if n != len(p) - 1:
            raise ValueError(f"cache row {i} holds {n} tokens; continuing a context of {len(p)} tokens needs "
                             f"{len(p) - 1} (all but the last)")
