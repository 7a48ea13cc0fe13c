"""The decoding loop: autoregressive, chain speculative decoding, and STree (paper 001, Algorithm 1).

One iteration of ``stree`` / ``chain``: the drafter proposes a tree rooted at each row's last
token, the target scores every node in one ``forward_tree``, :func:`stree.sampling.verify.verify` picks the
accepted path and the bonus token, ``commit`` replays the accepted path into the cache, and the
accepted drafts plus the bonus are emitted. The bonus becomes the next root.

The loop is thin: :func:`prefill_rows`, :func:`autoregressive_step` and :func:`speculative_step`
do the device work, each ending in ONE device-to-host transfer of everything the host needs (the
emitted tokens, their counts, and what the drafter learns from); :class:`Rows` keeps the host-side
bookkeeping. The batch keeps its size: a finished row leaves through the ``active`` mask (it rides
along with a root-only tree, its cache never copied), so shapes stay fixed.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from .args import integer
from .autotree import AutoTree, PathRates, auto_tree
from .distributed import drafts_here, share_tree, tensor_parallel
from ..drafters.base import DraftContext, Drafter, TargetTop, check_budget
from ..drafters.ngram import NGramDrafter
from ..models.base import TreeLM
from ..runtime.compiled import CompiledDecode
from ..runtime.graphs import DecodeGraphs
from ..models.linear import following, leading
from .steps import HostStep, autoregressive_step, check_draft, prefill_rows, speculative_step
from .stops import check_stop_sequences, token_stop
from ..tree import TokenTree, TreeBudget, TreeShape
from ..runtime.unrolled import UnrolledTarget
from ..sampling.verify import SamplingParams

__all__ = ["METHODS", "GenerationOutput", "GenerationStats", "HostStep", "Rows", "autoregressive_step", "decode",
           "generate",
           "prefill_rows", "speculative_step"]

METHODS = ("stree", "chain", "autoregressive", "unrolled")


@dataclass
class GenerationStats:
    """``target_forwards``: decoding forwards of the target (prefill excluded). ``accepted``: per
    row, the drafts the verifier accepted at each of its steps. ``tau``: tokens emitted per row per
    decoding step, bonus included (1 for autoregressive), after the cuts at EOS and
    ``max_new_tokens``; the first token, which comes from the prefill, counts in ``new_tokens`` but
    not in ``tau``. Times in seconds; ``time_verify`` holds the target's tree forward and the
    verification, ``time_commit`` the commit and the step's transfer to the host."""

    target_forwards: int = 0
    new_tokens: list[int] = field(default_factory=list)
    accepted: list[list[int]] = field(default_factory=list)
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_commit: float = 0.0
    time_total: float = 0.0
    prefilled: bool = True  # the first token of each row came from a prefill (not from a decoding step)
    trees: dict[int, int] = field(default_factory=dict)  # tree nodes -> decoding steps (1: a plain step)
    time_setup: float = 0.0  # measuring this machine's costs for tree="auto" (once per process), not in time_total

    @property
    def tau(self) -> float:
        return pooled_tau([self])

    def row_tau(self, row: int) -> float:
        """``tau`` of one row."""
        steps = len(self.accepted[row])
        return (self.new_tokens[row] - self.prefilled) / steps if steps else float("nan")

    @property
    def time_other(self) -> float:
        return self.time_total - self.time_prefill - self.time_draft - self.time_verify - self.time_commit

    @property
    def tokens_per_s(self) -> float:
        return sum(self.new_tokens) / self.time_total if self.time_total > 0 else float("nan")

    def trees_chosen(self) -> str:
        """``trees`` in a few words: the share of plain steps and the tree sizes taken."""
        return trees_chosen(self.trees)

    def summary(self) -> str:
        return (f"tokens {sum(self.new_tokens)} | forwards {self.target_forwards} | tau {self.tau:.2f} | "
                f"{self.tokens_per_s:.1f} tok/s | steps: {self.trees_chosen()} | draft {self.time_draft:.3f}s "
                f"verify {self.time_verify:.3f}s commit {self.time_commit:.3f}s other {self.time_other:.3f}s "
                f"(prefill {self.time_prefill:.3f}s)")


def merged_trees(stats: list[GenerationStats]) -> dict[int, int]:
    """The ``trees`` of several runs together, by size."""
    out: dict[int, int] = {}
    for s in stats:
        for n, k in s.trees.items():
            out[n] = out.get(n, 0) + k
    return dict(sorted(out.items()))


def trees_chosen(trees: dict[int, int]) -> str:
    """Steps per tree size (1: a plain step) in a few words: the share of plain steps and the
    tree sizes taken."""
    steps = sum(trees.values())
    sizes = sorted(n for n in trees if n > 1)
    plain = f"{trees.get(1, 0) / steps:.0%} plain" if steps else "-"
    return plain if not sizes else f"{plain}, trees {sizes[0]}-{sizes[-1]}"


def pooled_tau(stats: list[GenerationStats]) -> float:
    """``tau`` over the rows of several runs together."""
    steps = sum(len(a) for s in stats for a in s.accepted)
    from_steps = sum(n - s.prefilled for s in stats for n in s.new_tokens if n > 0)
    return from_steps / steps if steps else float("nan")


@dataclass
class GenerationOutput:
    """``sequences``: per row, prompt then generated tokens; ``prompt_lengths`` to split them.
    ``exact``: per row, whether the cache holds the row's state after all its tokens but the last
    (False where the row was cut inside a step's accepted path, by an EOS, its budget or a stop,
    or rode along after it finished): what continuing from that cache needs."""

    sequences: list[list[int]]
    prompt_lengths: list[int]
    stats: GenerationStats
    exact: list[bool] = field(default_factory=list)

    @property
    def new_tokens(self) -> list[list[int]]:
        return [s[n:] for s, n in zip(self.sequences, self.prompt_lengths)]


def _top_k(drafter: Drafter | None) -> int | None:
    """How many target entries the drafter learns from per token (None: it learns nothing)."""
    return None if drafter is None else drafter.target_top_k


class Rows:
    """Host-side state of a batch: every row's tokens so far (prompt, then generated), its length,
    the tokens produced, and whether it still decodes; rows finish at an EOS or their
    ``max_new_tokens`` (an int, or one per row). ``exact``: see :class:`GenerationOutput`."""

    def __init__(self, prompts: list[list[int]], max_new_tokens: list[int], eos: list[int]):
        B, longest = len(prompts), max(map(len, prompts))
        # grown as tokens come (doubling): max_new_tokens is a limit, not an allocation
        self.seq = torch.zeros(B, longest + min(max(max_new_tokens), 256), dtype=torch.long)
        self.limit = max(len(p) + m for p, m in zip(prompts, max_new_tokens))
        self.lengths = torch.tensor([len(p) for p in prompts])
        for i, p in enumerate(prompts):
            self.seq[i, : len(p)] = torch.tensor(p)
        self.prompt_lengths = self.lengths.clone()
        self.produced = torch.zeros(B, dtype=torch.long)
        self.active = torch.ones(B, dtype=torch.bool)
        self.eos = torch.tensor(eos, dtype=torch.long)
        self.max_new_tokens = torch.tensor(max_new_tokens, dtype=torch.long)
        self.exact = torch.ones(B, dtype=torch.bool)
        self.accepted: list[list[int]] = [[] for _ in range(B)]

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def active_ids(self) -> list[int]:
        return np.flatnonzero(self.active.numpy()).tolist()

    def context(self) -> DraftContext:
        return DraftContext(self.seq, self.lengths, self.active_ids())

    def roots(self) -> torch.Tensor:
        """Every row's last token (a finished row's too: it rides along)."""
        return torch.from_numpy(self.seq.numpy()[np.arange(self.batch_size), self.lengths.numpy() - 1])

    def critical(self, live: list[int]) -> np.ndarray:
        """Over the rows ``live`` (active), a mask of those expected to finish last: within a step
        of the most steps left (tokens left at the tokens per step the row's own steps have
        brought so far). The batch decodes until its last row is done, so a tree is worth what it
        brings the one of them that gains least: tokens it brings a row that will finish early
        anyway buy nothing (at batch 8, trees chosen for the rows' summed tokens ran slower than
        plain steps while every row's own tau was high), nor do tokens for one of several rows
        level at the end (at batch 16, trees chosen for one of them ran slower too)."""
        ids = np.asarray(live)
        produced = self.produced.numpy()[ids]
        steps = np.fromiter((len(self.accepted[r]) for r in live), dtype=np.float64, count=len(live))
        rate = np.maximum(produced, 1) / np.maximum(steps, 1)
        left = (self.max_new_tokens.numpy()[ids] - produced) / rate
        return left >= left.max() - 1.0

    def emit(self, step: HostStep, drafter: Drafter | None) -> None:
        """Append ``step.tokens[b, :counts[b]]`` to each active row, cut after its first EOS and at
        ``max_new_tokens``; show the drafter what was appended; retire the finished rows. (In
        numpy, on views of the rows' tensors: a dozen small torch ops cost several times more here.)"""
        lengths, produced, active = self.lengths.numpy(), self.produced.numpy(), self.active.numpy()
        ids = np.flatnonzero(active)
        tokens, counts = step.tokens.numpy()[ids], step.counts.numpy()[ids]
        j = np.arange(tokens.shape[1])
        is_eos = (tokens[..., None] == self.eos.numpy()).any(-1) & (j < counts[:, None])  # np.isin: measured several times slower
        hit = is_eos.any(1)
        upto = np.where(hit, is_eos.argmax(1) + 1, counts)  # through the first EOS
        room = self.max_new_tokens.numpy()[ids] - produced[ids]
        n = np.minimum(upto, room)
        if drafter is not None:
            n_list, id_list = n.tolist(), ids.tolist()
            target = None
            if step.top_ids is not None:
                target = [TargetTop(step.top_ids[i, :m], step.top_probs[i, :m], step.token_probs[i, :m])
                          for i, m in zip(id_list, n_list)]
            drafter.observe(DraftContext(self.seq, self.lengths, id_list),
                            [row[:m].tolist() for row, m in zip(tokens, n_list)], target)
        keep = j < n[:, None]
        self._reserve(int((lengths[ids] + n).max()) if len(ids) else 0)
        self.seq.numpy()[np.broadcast_to(ids[:, None], tokens.shape)[keep], (lengths[ids][:, None] + j)[keep]] = \
            tokens[keep]
        lengths[ids] += n
        produced[ids] += n
        active[ids[(hit & (upto <= n)) | (n == room)]] = False
        self.exact.numpy()[ids[n < counts]] = False  # the cache took tokens the row drops

    def _reserve(self, length: int) -> None:
        if length > self.seq.shape[1]:
            grown = torch.zeros(self.seq.shape[0], min(self.limit, max(length, 2 * self.seq.shape[1])),
                                dtype=torch.long)
            grown[:, : self.seq.shape[1]] = self.seq
            self.seq = grown

    def generated(self, row: int) -> list[int]:
        """The tokens row ``row`` generated so far."""
        return self.seq[row, int(self.prompt_lengths[row]): int(self.lengths[row])].tolist()

    def finish(self, row: int, keep: int) -> None:
        """End row ``row`` after its first ``keep`` generated tokens (the later ones are dropped)."""
        if not 0 <= keep <= int(self.produced[row]):
            raise ValueError(f"keep must be in [0, {int(self.produced[row])}], got {keep}")
        if keep < int(self.produced[row]):
            self.exact[row] = False
        self.lengths[row] = self.prompt_lengths[row] + keep
        self.produced[row] = keep
        self.active[row] = False


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


def _full_batch(draft: TokenTree, active: torch.Tensor, roots: torch.Tensor) -> TokenTree:
    """The drafted rows in their batch positions; a finished row gets its root alone (its other
    nodes invalid, so nothing of it is accepted)."""
    B, n = len(active), draft.n
    ids = torch.nonzero(active).flatten()
    tokens = roots[:, None].repeat(1, n)
    tokens[ids] = draft.tokens
    valid = torch.zeros(B, n, dtype=torch.bool)
    valid[:, 0] = True
    valid[ids] = True if draft.valid is None else draft.valid
    extra = dict(valid=valid, with_replacement=draft.with_replacement)
    if draft.child_ids is not None:
        K = draft.child_ids.shape[-1]
        extra.update(child_ids=torch.zeros(B, n, K, dtype=draft.child_ids.dtype),
                     child_probs=torch.zeros(B, n, K, dtype=draft.child_probs.dtype))
        extra["child_ids"][ids], extra["child_probs"][ids] = draft.child_ids, draft.child_probs
    if draft.static_shape is not None:  # keep the static shape (and its cached index, and its graphs)
        return TokenTree.from_shape(draft.static_shape, tokens, **extra)
    parents = draft.parents
    if parents.dim() == 2:
        parents = parents[:1].repeat(B, 1)
        parents[ids] = draft.parents
    return TokenTree(parents, tokens, **extra)


class _Clock:
    """Wall time per phase. On CUDA the phases are timed only with ``detailed`` (a device sync
    per lap: it would cost the loop its single sync per step); the total always is."""

    def __init__(self, device: torch.device, detailed: bool):
        self.sync = device.type == "cuda" and detailed
        self.t = time.perf_counter()

    def lap(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt


def drain(steps, each=None):
    """Run a :func:`decode` generator to its end, calling ``each`` (if given) on every batch of
    rows it yields; returns its :class:`GenerationOutput`."""
    while True:
        try:
            batch = next(steps)
        except StopIteration as end:
            return end.value
        if each is not None:
            each(batch)


def generate(model, input_ids, **kwargs) -> GenerationOutput:
    """Decode to the end (every argument as :func:`decode` takes it) and return the output."""
    return drain(decode(model, input_ids, **kwargs))


class _Setup(NamedTuple):
    """What :func:`decode` resolves from its arguments (see :func:`_setup`)."""

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
    generator: torch.Generator | None
    top_k: int | None
    stops: list[tuple[int, ...]]
    speculative: bool  # whether the loop drafts (on this rank or rank 0)
    shape: TreeShape | TreeBudget | None  # an explicit tree, drafted as given
    scan: str
    target: object  # the model, or its unrolled baseline


def _setup(model, input_ids, drafter, tree, method, max_new_tokens, temperature, top_k, top_p, eos_token_id, seed,
           mode, max_length, sampling, cuda_graph, torch_compile, cache, stop_sequences) -> _Setup:
    """Every check and choice :func:`decode` makes from its arguments, each with its error, before
    anything is allocated (a cache, a drafter's state, compiled graphs)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    prompts = _prompts(input_ids)
    if isinstance(max_new_tokens, (list, tuple)):
        if len(max_new_tokens) != len(prompts):
            raise ValueError(f"max_new_tokens holds {len(max_new_tokens)} values for {len(prompts)} rows")
        budgets = [integer(f"max_new_tokens[{i}]", m, low=1) for i, m in enumerate(max_new_tokens)]
    else:
        budgets = [integer("max_new_tokens", max_new_tokens, low=1)] * len(prompts)
    seed = None if seed is None else integer("seed", seed, low=0, high=2**63 - 1)
    max_length = None if max_length is None else integer("max_length", max_length, low=1)
    params = sampling if sampling is not None else SamplingParams(temperature, top_k, top_p, mode)
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(params).__name__}")
    stops = check_stop_sequences(stop_sequences, model.vocab_size)
    tp = tensor_parallel(model)
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
    shape = None if auto else _resolve_shape(method, tree)
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
    if eos_token_id is None:
        eos = []
    elif isinstance(eos_token_id, (list, tuple)):
        eos = [integer("eos_token_id", e, low=0, high=model.vocab_size - 1) for e in eos_token_id]
    else:
        eos = [integer("eos_token_id", eos_token_id, low=0, high=model.vocab_size - 1)]
    if method == "autoregressive" or auto and depth == 0:  # no room for a tree: plain steps
        drafter = None
    elif drafter is None:
        drafter = NGramDrafter()
    if drafter is not None and not auto:
        check_budget(drafter, shape)
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
    generator = None
    if seed is not None:  # two independent streams from one seed: the verifier's and the drafter's
        verify_seed, draft_seed = (int(s.generate_state(1, np.uint64)[0] >> 1)
                                   for s in np.random.SeedSequence(seed).spawn(2))
        generator = torch.Generator(device=device).manual_seed(verify_seed)
        if drafter is not None:
            drafter.reseed(draft_seed)
    scan = "chain" if method == "chain" else "tree"
    target = UnrolledTarget(model) if method == "unrolled" else model
    speculative = drafter is not None
    if not drafts_here(model):
        drafter = None  # rank 0 drafts and learns; this rank receives its trees
    return _Setup(prompts, budgets, eos, auto, drafter, chooser, depth, cuda_graph, torch_compile, params, device,
                  max_length, generator, _top_k(drafter), stops, speculative, shape, scan, target)


@torch.no_grad()  # a generator: torch enters the mode at every resumption, so callers need none
def decode(model, input_ids, *, drafter: Drafter | None = None, tree: TreeShape | TreeBudget | str | None = "auto",
           method: str = "stree", max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0, eos_token_id: int | list[int] | None = None, seed: int | None = None,
           mode: str = "auto", max_length: int | None = None, on_step=None,
           sampling: SamplingParams | None = None, time_phases: bool = False,
           cuda_graph: bool | None = None, torch_compile: bool = False, cache=None, stop_sequences=None):
    """:func:`generate` step by step: a generator that yields the batch's :class:`Rows` after the
    prefill and after every decoding step (a consumer may end rows there, :meth:`Rows.finish`:
    stop strings, streaming) and returns the :class:`GenerationOutput`. The arguments are checked
    when the first step is asked for.

    Decodes up to ``max_new_tokens`` per row (an int, or a list with one per row); a row stops
    after emitting an EOS, or after the first occurrence of one of ``stop_sequences`` (token-id
    lists; the row keeps the sequence, drops the drafts accepted past it).

    ``cache``: continue from it instead of prefilling: it holds, for every row of ``input_ids``
    (then the rows' whole contexts), the state after all but the last token, which the first step
    feeds. It is advanced in place; the output's ``exact`` says which rows it holds exactly.

    ``input_ids``: a ``[B, T]`` tensor or a list of token lists (ragged prompts allowed).
    ``method``: ``stree`` (tree drafts, one tree forward), ``chain`` (chain drafts through the
    chain scan), ``autoregressive``, or ``unrolled`` (the paper's baseline: every root-to-leaf
    path its own sequence through the whole model, see :mod:`stree.runtime.unrolled`; same outputs as
    ``stree``, slower). ``tree``: ``"auto"`` (the default; None means the same) chooses every
    step's tree, or a plain autoregressive step, by expected tokens per second from this
    machine's measured costs and the acceptance learned so far (:mod:`stree.decoding.autotree`; chains
    only under ``method="chain"``; an :class:`~stree.decoding.autotree.AutoTree` passed here makes the
    choice with its own costs and rates, and keeps what it learns); a
    :class:`~stree.tree.TreeShape` is drafted as given every step, and a
    :class:`~stree.tree.TreeBudget` lets a drafter that can grow each step's tree per row. A
    drafter built for a shape of its own (its ``shape``, e.g. ``STANDDrafter(store, shape)``)
    drafts that shape where ``tree`` is left "auto" (the named drafters of
    :func:`~stree.drafters.registry.make_drafter` have none). Tensor-parallel models and
    ``method="unrolled"`` take ``paper13`` (``chain(4)`` for chains) for "auto";
    ``method="autoregressive"`` ignores ``tree``.
    ``drafter`` defaults to :class:`NGramDrafter`. ``sampling`` (a :class:`SamplingParams`), or
    ``temperature`` / ``top_k`` / ``top_p`` / ``mode``, say how tokens are chosen; ``mode="naive"``
    verifies by exact-match sampling. ``max_length``: the cache size; by default the longest
    prompt plus ``max_new_tokens`` plus the tree depth (the drafter's ``draft_depth`` when deeper).
    The same ``seed`` gives the same output (under ``tree="auto"``, on a machine with the same
    cached cost profile, :mod:`stree.decoding.cost`: the trees chosen follow it; without a seed, and in
    greedy decoding, where the trees cannot change the output, they also follow the clock).
    ``time_phases``: on CUDA, time draft / verify /
    commit apart (a device sync per phase; off, only the total is timed there). ``cuda_graph``:
    replay the step, and the tree pass and commit of static tree shapes, from CUDA graphs (by
    default on for a model on CUDA; the graphs and their cache are kept per model, batch size and
    cache size, and reused by later calls). ``torch_compile``: on the CPU, run the step and the
    tree pass of static tree shapes through ``torch.compile`` (the commit is the model's own;
    seconds of compiling per shape, once per process: for long runs; outputs as the eager path's).
    ``on_step(rows, tree, result)``, if given, sees every verify step (row ids, the drafted
    :class:`TokenTree`, the :class:`~stree.sampling.verify.VerifyResult`), e.g. to count accepted nodes.

    A tensor-parallel ``model`` (``stree.models.load(..., tensor_parallel=...)``; every rank
    calls ``decode`` with the same arguments): rank 0 drafts (the other ranks' ``drafter`` is
    not used), verifies and samples, and the ranks follow it (:mod:`stree.decoding.distributed`);
    ``on_step`` is called on rank 0; eager only."""
    (prompts, budgets, eos, auto, drafter, chooser, depth, cuda_graph, torch_compile, params, device, max_length,
     generator, top_k, stops, speculative, shape, scan, target) = _setup(
        model, input_ids, drafter, tree, method, max_new_tokens, temperature, top_k, top_p, eos_token_id, seed, mode,
        max_length, sampling, cuda_graph, torch_compile, cache, stop_sequences)
    shapes: dict = {}  # the static shapes of received trees (tensor parallelism)

    rows = Rows(prompts, budgets, eos)
    stats = GenerationStats(new_tokens=[0] * rows.batch_size, prefilled=cache is None)
    if auto and drafter is not None and chooser is None:
        t0 = time.perf_counter()
        chooser = auto_tree(model, drafter, rows.batch_size, chain=method == "chain", depth=depth,
                            mode="cuda_graph" if cuda_graph else "compiled" if torch_compile else "eager",
                            sampled=not params.greedy,
                            adaptive=params.greedy or seed is None)  # where the trees cannot change the output
        stats.time_setup = time.perf_counter() - t0
    clock = _Clock(device, detailed=time_phases)
    start = clock.t

    def lap(phase: str) -> None:
        setattr(stats, f"time_{phase}", getattr(stats, f"time_{phase}") + clock.lap())

    kind = DecodeGraphs if cuda_graph else CompiledDecode if torch_compile else None
    runner = kind.for_model(model, rows.batch_size, max_length) if kind is not None else None
    if drafter is not None:
        drafter.reset()
    if cache is None:
        cache = runner.cache if runner is not None else model.allocate_cache(rows.batch_size, max_length)
        first = prefill_rows(model, rows, cache, params, generator, top_k)
        _check_finite(first, rows, "the prefill")
        stats.time_prefill += clock.lap()
        rows.emit(first, drafter)
        stats.time_draft += clock.lap()
    seen = [0] * rows.batch_size
    _stop_at_sequences(rows, stops, seen)
    # A run of plain steps the chooser has decided ahead, where the drafter needs no target laws
    # after them: the loop neither plans nor drafts, and hands the drafter the run's tokens at its end.
    run: _PlainRun | None = None
    # a speculative loop's plain steps read the weight copies its tree passes use (models.linear)
    plain_scope, tree_scope = (following, leading) if speculative else (contextlib.nullcontext,) * 2
    yield rows
    while bool(rows.active.any()):
        if not bool(rows.active.all()):
            # Finished rows ride along, one token a step: parked at length 0 they never run out of room.
            rows.exact &= rows.active
            cache.seqlens.masked_fill_((~rows.active).to(device, non_blocking=True), 0)
        began = time.perf_counter()
        roots = rows.roots()
        live = rows.active_ids()
        draft = full = None
        if speculative:
            if run is not None:
                run.left -= 1
            elif drafter is not None:
                draft = _draft(drafter, chooser, rows, shape, roots, live, model.vocab_size, runner is None)
                if draft is not None:
                    full = draft if len(live) == rows.batch_size else _full_batch(draft, rows.active, roots)
                    full = full.to(device)
            full = share_tree(model, full, device, shapes)
            stats.time_draft += clock.lap()
        if full is None:  # autoregressive, or a plain step chosen over the tree
            with plain_scope():
                host = autoregressive_step(model, cache, roots.to(device, non_blocking=True), params, generator,
                                           runner, None if drafter is None else drafter.plain_top_k)
            for r in live:
                rows.accepted[r].append(0)
            stats.time_verify += clock.lap()
        else:
            with tree_scope():
                host, result = speculative_step(target, cache, full, params, generator, scan, top_k, lap=lap,
                                                runner=runner)
            for r in live:
                rows.accepted[r].append(int(host.counts[r]) - 1)
            if on_step is not None and drafter is not None:  # tensor parallelism: on rank 0, which drafts
                on_step(live, draft, _rows_of(result, live) if len(live) < rows.batch_size else result)
        n = 1 if full is None else full.n
        stats.trees[n] = stats.trees.get(n, 0) + 1
        stats.target_forwards += 1
        _check_finite(host, rows, f"decoding step {stats.target_forwards}")
        rows.emit(host, drafter if run is None else None)
        _stop_at_sequences(rows, stops, seen)
        if chooser is not None:
            elapsed = (time.perf_counter() - began) * 1e3
            if run is not None:
                run.steps += 1
                if run.left == 0:
                    run.end(rows, drafter, chooser)
                    run = None
            elif full is None:
                chooser.record(None, elapsed_ms=elapsed)
                ahead = chooser.plain_ahead() if drafter is not None and drafter.plain_top_k is None else 0
                if ahead:
                    run = _PlainRun(ahead, rows)
            else:
                at = np.asarray(live)
                chooser.record(draft, host.tokens.numpy()[at], host.counts.numpy()[at], np.arange(len(live)), elapsed,
                               ids=at)
        stats.time_draft += clock.lap()  # feeding the drafter is drafting work
        yield rows
    if run is not None:
        run.end(rows, drafter, chooser)
    clock.lap()
    stats.time_total = clock.t - start
    stats.new_tokens = rows.produced.tolist()
    stats.accepted = rows.accepted
    sequences = [rows.seq[i, : int(rows.lengths[i])].tolist() for i in range(rows.batch_size)]
    return GenerationOutput(sequences, [len(p) for p in prompts], stats, rows.exact.tolist())


class _PlainRun:
    """``left`` more plain steps decided ahead (:meth:`AutoTree.plain_ahead`) from the rows as
    they stood before them; ``steps`` taken so far."""

    def __init__(self, left: int, rows: Rows):
        self.left, self.steps = left, 0
        self.lengths, self.rows = rows.lengths.clone(), rows.active_ids()

    def end(self, rows: Rows, drafter: Drafter, chooser: AutoTree) -> None:
        """Show the drafter the run's tokens (as one emission per row: no target laws) and let the
        chooser record its steps."""
        if self.steps:
            ends = rows.lengths.tolist()
            drafter.observe(DraftContext(rows.seq, self.lengths, self.rows),
                            [rows.seq[r, int(self.lengths[r]): ends[r]].tolist() for r in self.rows], None)
            chooser.plain_steps(self.steps)


def _draft(drafter: Drafter, chooser: AutoTree | None, rows: Rows, shape, roots: torch.Tensor, live: list[int],
           vocab_size: int, eager: bool) -> TokenTree | None:
    """This step's checked draft for the live rows, or None for a plain step: ``shape`` drafted
    as given (a draft with nothing in it is one node where the loop runs eager), or the
    ``chooser``'s plan, cut to its best prefix (:mod:`stree.decoding.autotree`)."""
    plan = shape if chooser is None else chooser.plan(lambda: drafter.behind(rows.context()))
    if plan is None:
        return None
    draft = drafter.propose(rows.context(), None if plan == "own" else plan)
    check_draft(draft, roots[live], vocab_size)
    if chooser is not None:
        return chooser.choose(draft, rows.critical(live), np.asarray(live))
    if eager and draft.valid is not None and not bool(draft.valid[:, 1:].any()):
        return TokenTree.from_shape(TreeShape.chain(0), draft.tokens[:, :1])  # nothing drafted: one node
    return draft


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


def _stop_at_sequences(rows: Rows, stops: list[tuple[int, ...]], seen: list[int]) -> None:
    """End every row whose new tokens complete a stop sequence, through its end (``seen[r]``: how
    many of row r's generated tokens were checked before)."""
    if not stops:
        return
    for r in range(rows.batch_size):
        produced = int(rows.produced[r])
        if seen[r] < 0 or produced == seen[r]:
            continue
        keep = token_stop(rows.generated(r), stops, seen[r])
        if keep is None:
            seen[r] = produced
        else:
            rows.finish(r, keep)
            seen[r] = -1  # done


def _check_finite(host: HostStep, rows: Rows, where: str) -> None:
    bad = torch.nonzero(~host.finite & rows.active).flatten().tolist()
    if bad:
        raise ValueError(f"the target's logits hold NaN or +inf at {where} (rows {bad}): its weights or activations "
                         "are not finite (stree.models.load checks the weights; fp16 may overflow where bf16 or "
                         "fp32 does not)")


def _rows_of(result, rows: list[int]):
    """A VerifyResult restricted to ``rows``."""
    from ..sampling.verify import VerifyResult

    idx = torch.tensor(rows, device=result.accepted.device)
    return VerifyResult(result.accepted[idx], result.num_accepted[idx], result.bonus[idx],
                        None if result.probs is None else result.probs[idx])


generate.__signature__ = inspect.signature(decode).replace(return_annotation="GenerationOutput")  # help(generate)
