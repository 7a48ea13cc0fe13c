"""Lossless verification of a drafted token tree against the target's logits at every node.

Every rule is a *one-node* rule applied top-down (DRAFTING_AND_VERIFICATION.md §3): at the current
node the children are tried in draw order (index order); the first accepted child becomes the
current node; when all are rejected, or the node has no children, the emitted token is drawn from
the node's residual distribution. :func:`acceptance_tables` computes, for every node at once, the
probability that a child is accepted given that its parent was reached and its earlier siblings
were rejected, and each node's residual; :func:`verify` then needs one uniform per node and one
draw from the residual of the last accepted node. Rules, chosen from what the tree carries:

- ``greedy`` (temperature 0): accept the child equal to the argmax; the bonus is the argmax.
- ``one_hot`` (no ``child_probs``: deterministic drafts): accept x with p(x); on rejection zero x
  in p and renormalise.
- ``iid`` (``with_replacement``; SpecInfer multi-step): accept x with min(1, p(x)/q(x)); on rejection
  p <- norm(max(0, p - q)) with the same q.
- ``without_replacement`` (recursive rejection sampling): as ``iid`` but with the conditional q_i,
  i.e. q with the earlier siblings' tokens zeroed and renormalised, in the residual as well.
- ``naive`` (``mode="naive"``): one target draw per node; follow the child equal to it, emit the
  draw at the first node where no child matches. At keyed draws (``generator`` a
  :class:`~stree.sampling.keyed.Placed`) deterministic drafts take it in place of ``one_hot`` (the
  same law), each node drawing at its depth's position: it emits what plain steps draw there.

Chain speculative sampling is the one-child case of ``iid`` / ``without_replacement`` (the two are
the same rule for one child). Invalid (padding) nodes are never accepted and change no residual.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from ..tree import TokenTree, host_tensor
from .keyed import Placed, draw_at, inverse_cdf_tensors
from .verify_jit import greedy_rows, greedy_walk

__all__ = ["RULES", "SamplingParams", "VerifyResult", "acceptance_tables", "choose_rule", "draw", "follow_choices",
           "process_logits", "sample_tokens", "verify"]

RULES = ("greedy", "one_hot", "iid", "without_replacement", "naive")
MODES = ("auto", "naive")
# On the CPU the rules walk compiled (stree.sampling.verify_jit) and greedy verification reads the
# logits where they are (:func:`greedy_on_host`); the tables below are the reference, and what runs
# on other devices.
COMPILED_ON_CPU = True


@dataclass
class VerifyResult:
    """``accepted`` ``[B, D+1]``: accepted node indices root first (entries past ``num_accepted``
    are 0); ``num_accepted`` ``[B]`` counts the root; ``bonus`` ``[B]``: the correction or bonus
    token. ``probs`` ``[B, N, V]``: the processed target distributions (None for greedy)."""

    accepted: torch.Tensor
    num_accepted: torch.Tensor
    bonus: torch.Tensor
    probs: torch.Tensor | None = None


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if not math.isfinite(temperature):  # inf would sample uniformly, silently
        raise ValueError(f"temperature must be finite, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {top_k!r}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen, validated once: ``temperature`` 0 is greedy decoding (argmax), else
    draws from softmax(logits / temperature) restricted to the ``top_k`` most likely tokens (0:
    all) and then to the smallest set reaching mass ``top_p``. ``mode`` "naive" verifies drafts by
    exact-match sampling instead of the lossless rejection rules. Sampling, verification and the
    distributions drafters learn from all read it, so "temperature 0" means one thing.

    A batch whose rows sample with different values takes one per row (:meth:`stack`):
    ``temperature``, ``top_k`` and ``top_p`` as tuples of one value per row; each row's law is then
    exactly what its own values give alone. A greedy row among them (temperature 0) has the argmax's
    one-hot law, which every rule verifies as greedy decoding does: the child equal to the argmax is
    accepted (with chance 1), any other rejected, and the argmax emitted where none is."""

    temperature: float | tuple[float, ...] = 0.0
    top_k: int | tuple[int, ...] = 0
    top_p: float | tuple[float, ...] = 1.0
    mode: str = "auto"

    def __post_init__(self):
        values = (self.temperature, self.top_k, self.top_p)
        if not any(isinstance(v, tuple) for v in values):
            check_sampling(*values)
        elif not all(isinstance(v, tuple) for v in values) or len({len(v) for v in values}) != 1 or not values[0]:
            raise ValueError("temperature, top_k and top_p must be numbers, or tuples of one value per row each, "
                             f"of one length: got {values!r}")
        else:
            for i, row in enumerate(zip(*values)):
                try:
                    check_sampling(*row)
                except ValueError as exc:
                    raise ValueError(f"row {i}: {exc}") from None
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")

    @classmethod
    def stack(cls, params) -> "SamplingParams":
        """The values of a batch whose row i samples as ``params[i]``: the one they share where all
        are equal (or all greedy), else one per row (of one ``mode``; greedy rows among them)."""
        params = list(params)
        if not params or not all(isinstance(p, SamplingParams) and p.rows is None for p in params):
            raise TypeError(f"params must be a non-empty sequence of SamplingParams of one row each, got {params!r}")
        first = params[0]
        if len({p.mode for p in params}) > 1:
            raise ValueError(f"the rows' modes differ: {sorted({p.mode for p in params})}")
        if all(p == first for p in params) or all(p.greedy for p in params):
            return first
        return cls(tuple(p.temperature for p in params), tuple(p.top_k for p in params),
                   tuple(p.top_p for p in params), first.mode)

    @property
    def rows(self) -> int | None:
        """The rows of per-row values, None for values every row shares."""
        return len(self.temperature) if isinstance(self.temperature, tuple) else None

    def select(self, rows) -> "SamplingParams":
        """The values of rows ``rows`` (a sequence of row indices) of a batch, in that order."""
        if self.rows is None:
            return self
        return SamplingParams.stack([SamplingParams(self.temperature[i], self.top_k[i], self.top_p[i], self.mode)
                                     for i in rows])

    @property
    def greedy(self) -> bool:
        return self.rows is None and self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampling distribution (a ValueError at temperature 0: greedy has none; a greedy row
        among rows of their own values: the one-hot of its argmax)."""
        if self.rows is not None:
            return _process_rows(logits, self)
        return process_logits(logits, self.temperature, self.top_k, self.top_p)

    def sample(self, logits: torch.Tensor, generator: "torch.Generator | Placed | None" = None) -> torch.Tensor:
        """One token per row of ``logits [B, V]`` (``generator`` a :class:`~stree.sampling.keyed.Placed`:
        each row's by the inverse CDF at its next position's keyed uniform)."""
        if isinstance(generator, Placed):
            if self.greedy:
                return logits.float().argmax(-1)
            return draw_at(self.probs(logits), generator.depths(1, logits.device)[:, 0])
        if self.rows is not None:
            drawn = draw(self.probs(logits), generator)
            if not self.some_greedy:
                return drawn
            return torch.where(self._greedy_rows(logits), logits.float().argmax(-1), drawn)
        return sample_tokens(logits, self.temperature, self.top_k, self.top_p, generator)

    def observed(self, logits: torch.Tensor) -> torch.Tensor:
        """What emitted tokens were drawn from, for drafters to learn: at temperature 0 the plain
        softmax (the argmax law would teach them nothing about the runners-up), as for a greedy row
        among rows of their own values."""
        if self.some_greedy:
            shape = (self.rows,) + (1,) * (logits.dim() - 1)
            return torch.where(self._greedy_rows(logits).view(shape), torch.softmax(logits.float(), -1),
                               self.probs(logits))
        return torch.softmax(logits.float(), -1) if self.greedy else self.probs(logits)

    def greedy_mask(self, batch: int) -> np.ndarray | None:
        """``[batch]`` bool: the rows that decode greedily (None where none does)."""
        if self.greedy:
            return np.ones(batch, dtype=bool)
        return np.array([t == 0 for t in self.temperature]) if self.some_greedy else None

    @property
    def some_greedy(self) -> bool:
        """Whether some rows of per-row values are greedy."""
        return self.rows is not None and 0 in self.temperature

    def _greedy_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """``[rows]``: which rows of per-row values are greedy."""
        return torch.from_numpy(self.greedy_mask(self.rows)).to(logits.device)


def _process_rows(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """:func:`process_logits` of each row of ``logits`` ``[B, ..., V]`` with that row's values of
    ``params``: the same operations, each row's values broadcast over the rest of its axes (a row
    whose top-k or top-p is off is left as its own call leaves it); a greedy row's law is the
    one-hot of its argmax."""
    if logits.shape[0] != params.rows:
        raise ValueError(f"logits have {logits.shape[0]} rows but the sampling values {params.rows}")
    device, V = logits.device, logits.shape[-1]
    shape = (params.rows,) + (1,) * (logits.dim() - 1)
    sampled = [t > 0 for t in params.temperature]
    temperature = [t if s else 1.0 for t, s in zip(params.temperature, sampled)]
    x = logits.float() / torch.tensor(temperature, dtype=torch.float32, device=device).view(shape)
    cut = [0 < k < V and s for k, s in zip(params.top_k, sampled)]
    if any(cut):
        top = torch.topk(x, max(k for k, c in zip(params.top_k, cut) if c), dim=-1).values
        at = torch.tensor([k - 1 if c else 0 for k, c in zip(params.top_k, cut)], device=device).view(shape)
        kth = top.gather(-1, at.expand(*x.shape[:-1], 1))
        x = x.masked_fill(torch.tensor(cut, device=device).view(shape) & (x < kth), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if any(p < 1 and s for p, s in zip(params.top_p, sampled)):
        top_p = torch.tensor([p if s else 1.0 for p, s in zip(params.top_p, sampled)], dtype=torch.float32,
                             device=device).view(shape)
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        sorted_p = sorted_p.masked_fill(mass_before >= top_p, 0.0)
        kept = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = torch.where(top_p < 1, kept / kept.sum(-1, keepdim=True), probs)
    if not all(sampled):
        argmax = torch.zeros_like(probs).scatter_(-1, logits.float().argmax(-1, keepdim=True), 1.0)
        probs = torch.where(torch.tensor(sampled, device=device).view(shape), probs, argmax)
    return probs


def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The target's sampling distribution, in fp32: logits / temperature, then top-k, then top-p
    (the smallest set of most likely tokens whose mass reaches ``top_p``)."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        raise ValueError("temperature 0 is greedy decoding: there is no distribution to process")
    x = logits.float() / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p < 1:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        sorted_p = sorted_p.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_tokens(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``logits`` ``[B, V]``: the argmax at temperature 0, else a draw from
    :func:`process_logits`."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.float().argmax(-1)
    return draw(process_logits(logits, temperature, top_k, top_p), generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row of ``probs [R, V]`` (entries >= 0, a positive total per row), each drawn
    with probability proportional to its entry; an entry of 0 is never drawn. On the CPU by the
    inverse of the float64 cumulative sums at one uniform per row: ``torch.multinomial`` draws a
    random number per entry there (an exponential race), and for a vocabulary of thousands the
    CPU generator's numbers outweighed the rest of a sampled step's sampling work. Elsewhere
    ``torch.multinomial``."""
    if probs.device.type != "cpu":
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    return inverse_cdf_tensors(probs, torch.rand((probs.shape[0],), generator=generator, dtype=torch.float64))


def choose_rule(tree: TokenTree, temperature: float, mode: str = "auto") -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be 'auto' or 'naive', got {mode!r}")
    if temperature == 0:
        return "greedy"
    if mode == "naive":
        return "naive"
    if tree.child_probs is None:
        return "one_hot"
    return "iid" if tree.with_replacement else "without_replacement"


def _normalize(t: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """``t`` rescaled to sum 1 over the last axis; ``fallback`` where it has no mass (a rejection
    that had probability 0, so the value is never used)."""
    s = t.sum(-1, keepdim=True)
    return torch.where(s > 0, t / s.clamp_min(torch.finfo(t.dtype).tiny), fallback)


def _sibling_rank(parents: torch.Tensor) -> torch.Tensor:
    """``[B, N]``: how many lower-indexed siblings each node has (its position in draw order)."""
    n = parents.shape[-1]
    earlier = torch.ones(n, n, dtype=torch.bool, device=parents.device).tril(-1)
    return ((parents[:, :, None] == parents[:, None, :]) & earlier).sum(-1)


def _draft_law(tree: TokenTree, V: int, dtype: torch.dtype, validate: bool = True) -> torch.Tensor:
    """Dense ``[B, N, V]`` law each node's children were drawn from, renormalised over the stored
    entries (a truncated top-K store is sampled from its renormalised entries)."""
    ids, pr = tree.child_ids.long(), tree.child_probs.to(dtype).clamp_min(0)
    if validate and bool(((ids < 0) | (ids >= V)).any()):
        raise ValueError(f"tree.child_ids holds ids outside the vocabulary [0, {V})")
    q = torch.zeros(*ids.shape[:2], V, dtype=dtype, device=pr.device).scatter_add_(2, ids, pr)
    return _normalize(q, torch.zeros_like(q))


def acceptance_tables(tree: TokenTree, probs: torch.Tensor, rule: str, validate: bool = True):
    """For the stochastic rules ``one_hot`` / ``iid`` / ``without_replacement``: ``accept`` ``[B, N]``
    (node c's acceptance probability given its parent was reached and c's earlier siblings were
    rejected; 0 for the root and invalid nodes) and ``residual`` ``[B, N, V]`` (the law emitted at a
    node whose children were all rejected; p itself at a node without children).

    Works in the dtype of ``probs``, so float64 inputs give the exact law (tests enumerate it)."""
    if rule not in ("one_hot", "iid", "without_replacement"):
        raise ValueError(f"acceptance_tables handles one_hot, iid and without_replacement, got {rule!r}")
    B, N, V = probs.shape
    parents = tree.parents.to(probs.device).expand(B, N)
    valid = torch.ones(B, N, dtype=torch.bool, device=probs.device) if tree.valid is None else tree.valid.clone()
    valid[:, 0] = False  # the root is never a candidate
    rank = _sibling_rank(parents)
    slot = torch.where(valid, parents, N)  # a child's parent, or a dummy column N for non-candidates
    tokens = tree.tokens.long()
    q = _draft_law(tree, V, probs.dtype, validate) if rule != "one_hot" else None
    p = probs.clone()
    accept = torch.zeros(B, N + 1, dtype=probs.dtype, device=probs.device)
    node = torch.arange(N, device=probs.device).expand(B, N)
    index = tree.index
    for r in range(index.memo("max_sibling_rank", lambda: int(rank.max())) + 1):
        # child_at[b, v]: v's child of draw rank r, or N; each parent has at most one per rank.
        at_r = rank == r
        child_at = torch.full((B, N + 1), N, dtype=torch.long, device=probs.device)
        child_at.scatter_(1, torch.where(at_r, slot, N), torch.where(at_r, node, N))
        child_at = child_at[:, :N]
        has = child_at < N
        x = torch.where(has, tokens.gather(1, child_at.clamp(max=N - 1)), 0)[..., None]
        px = p.gather(2, x)[..., 0]
        if rule == "one_hot":
            drafted, a = has, px
            rejected = _normalize(p.scatter(2, x, 0.0), p)
        else:
            qx = q.gather(2, x)[..., 0]
            drafted = has & (qx > 0)  # a token its law could not produce is never accepted
            a = torch.where(drafted, (px / qx.clamp_min(torch.finfo(qx.dtype).tiny)).clamp(max=1), 0)
            rejected = _normalize((p - q).clamp_min(0), p)
        accept.scatter_(1, torch.where(drafted, child_at, N), torch.where(drafted, a, 0))
        p = torch.where(drafted[..., None], rejected, p)
        if rule == "without_replacement":
            q = torch.where(drafted[..., None], _normalize(q.scatter(2, x, 0.0), torch.zeros_like(q)), q)
    return accept[:, :N], p


def _walk(parents: torch.Tensor, accepted_edge: torch.Tensor, max_depth: int):
    """Follow, from the root, the lowest-indexed child whose edge is accepted; returns the path
    ``[B, max_depth + 1]`` (entries past its length 0), its length and its last node."""
    B, N = accepted_edge.shape
    node = torch.arange(N, device=parents.device).expand(B, N)
    # first[b, v]: v's lowest accepted child, or N; column N (no node) points to itself, so a
    # walk that ran out of accepted children stays there.
    first = torch.full((B, N + 1), N, dtype=torch.long, device=parents.device)
    first.scatter_reduce_(1, torch.where(accepted_edge, parents, N), torch.where(accepted_edge, node, N), "amin")
    cur = torch.zeros(B, 1, dtype=torch.long, device=parents.device)
    steps = [cur]
    for _ in range(max_depth):
        cur = first.gather(1, cur)
        steps.append(cur)
    path = torch.cat(steps, 1)
    real = path < N
    num = real.sum(1)
    accepted = path.masked_fill_(~real, 0)
    return accepted, num, accepted.gather(1, (num - 1)[:, None])[:, 0]


def _max_depth(tree: TokenTree) -> int:
    index = tree.index
    return index.memo("max_depth", lambda: int(index.depth.max()))


def follow_choices(tree: TokenTree, choice: torch.Tensor):
    """Greedy and naive verification: ``choice`` ``[B, N]`` is the token each node emits (the
    argmax, or one target draw per node). Follow the first child equal to its parent's choice;
    the bonus is the choice at the last node reached. Returns ``(accepted, num_accepted, bonus)``.
    On the CPU the walk runs compiled (:func:`stree.sampling.verify_jit.follow`)."""
    if COMPILED_ON_CPU and choice.device.type == "cpu":
        return _follow_compiled(tree, choice)
    return greedy_path(tree.parents.to(choice.device), tree.tokens, tree.valid, choice, _max_depth(tree))


def _follow_compiled(tree: TokenTree, choice: torch.Tensor):
    from .verify_jit import follow

    B, N = choice.shape
    index = tree.index
    kids = index.memo("children_by_rank", lambda: _children_by_rank(index))
    valid = np.ones((B, N), dtype=np.bool_) if tree.valid is None else tree.valid.numpy()
    path = np.empty((B, _max_depth(tree) + 1), dtype=np.int64)
    num = np.empty(B, dtype=np.int64)
    picks = choice.numpy()
    # (C order always: a strided tree and a contiguous one would each cost numba a compile)
    follow(picks, np.ascontiguousarray(tree.tokens.numpy()), np.ascontiguousarray(valid), kids, path, num)
    bonus = picks[np.arange(B), path[np.arange(B), num - 1]]
    return torch.from_numpy(path), torch.from_numpy(num), torch.from_numpy(bonus)


def _keyed_compiled(tree: TokenTree, probs: torch.Tensor, u: torch.Tensor):
    """The keyed naive walk on the CPU (:func:`stree.sampling.verify_jit.keyed_walk`): each node's
    choice drawn only where the walk stands. Returns ``(accepted, num_accepted, bonus)``."""
    from .verify_jit import keyed_walk

    B, N, V = probs.shape
    index = tree.index
    kids = index.memo("children_by_rank", lambda: _children_by_rank(index))
    valid = np.ones((B, N), dtype=np.bool_) if tree.valid is None else np.ascontiguousarray(tree.valid.numpy())
    L = _max_depth(tree) + 1
    path, num, emitted = np.empty((B, L), dtype=np.int64), np.empty(B, dtype=np.int64), np.empty((B, L), dtype=np.int64)
    keyed_walk(np.ascontiguousarray(probs.detach().numpy()), np.ascontiguousarray(tree.tokens.long().numpy()), valid,
               kids, np.ascontiguousarray(u.numpy()), path, num, emitted)
    return torch.from_numpy(path), torch.from_numpy(num), torch.from_numpy(emitted[np.arange(B), num - 1])


def greedy_on_host(params: "SamplingParams", logits: torch.Tensor) -> bool:
    """Whether :func:`verify_greedy_host` takes these logits: greedy, on the CPU (where the compiled
    paths run), not wanting a gradient."""
    return params.greedy and COMPILED_ON_CPU and logits.device.type == "cpu" and not logits.requires_grad


def verify_greedy_host(tree: TokenTree, logits: torch.Tensor) -> tuple[VerifyResult, torch.Tensor, torch.Tensor]:
    """Greedy :func:`verify` of CPU ``logits [B, N, V]`` as one compiled pass
    (:func:`stree.sampling.verify_jit.greedy_walk`): the argmax of the nodes on the accepted path
    alone (the tensor path takes every node's), with what a decoding step also needs of the
    logits. Returns ``(result, emitted [B, D+1], finite [B])``: the accepted drafts then the bonus
    (the root's token past them) and whether each row's logits are free of NaN and +inf. The same
    path, bonus and flags as verification and the step's check on tensors (tested equal); a half
    precision model's logits are widened first (exactly)."""
    B, N, V = logits.shape
    index = tree.index
    kids = index.memo("children_by_rank", lambda: _children_by_rank(index))
    tokens, valid = tree.arrays()
    valid = np.ones((B, N), dtype=np.bool_) if valid is None else np.ascontiguousarray(valid)
    L = _max_depth(tree) + 1
    path, emitted = np.empty((B, L), dtype=np.int64), np.empty((B, L), dtype=np.int64)
    num, bonus, finite = np.empty(B, dtype=np.int64), np.empty(B, dtype=np.int64), np.empty(B, dtype=np.bool_)
    wide = logits if logits.dtype == torch.float32 else logits.float()
    greedy_walk(wide.numpy(), np.ascontiguousarray(tokens), valid, kids, path, num, emitted, bonus, finite)
    # (host tensors: the commit's replay and the rows' bookkeeping read them as these arrays)
    result = VerifyResult(host_tensor(path), host_tensor(num), torch.from_numpy(bonus))
    return result, host_tensor(emitted), torch.from_numpy(finite)


def greedy_rows_host(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain greedy step's :func:`verify_greedy_host`: the argmax of each row of CPU ``logits
    [B, V]`` and whether the row is free of NaN and +inf, in one compiled pass. Returns
    ``(tokens [B, 1], finite [B])``."""
    B = logits.shape[0]
    wide = logits if logits.dtype == torch.float32 else logits.float()
    tokens, finite = np.empty((B, 1), dtype=np.int64), np.empty(B, dtype=np.bool_)
    greedy_rows(wide.numpy(), tokens, finite)
    return torch.from_numpy(tokens), torch.from_numpy(finite)


def greedy_path(parents: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor | None, choice: torch.Tensor,
                max_depth: int):
    """:func:`follow_choices` on tensors (``parents`` ``[N]`` or ``[B, N]``; ``valid`` None: all),
    static in shape for a given ``max_depth``: what a compiled pass can run itself."""
    B, N = choice.shape
    parents = parents.expand(B, N)
    edge = tokens.long() == choice.gather(1, parents.clamp(min=0))
    if valid is not None:
        edge = edge & valid
    edge[:, 0] = False
    accepted, num, end = _walk(parents, edge, max_depth)
    return accepted, num, choice.gather(1, end[:, None])[:, 0]


def _children_by_rank(index) -> np.ndarray:
    """``[rows, N, R]``: each node's children in draw (index) order, -1 past the last."""
    parents = index.parents.cpu().numpy()
    rows, n = parents.shape
    counts = np.zeros((rows, n), dtype=np.int64)
    for r in range(rows):
        np.add.at(counts[r], parents[r, 1:], 1)
    kids = np.full((rows, n, max(1, int(counts.max()))), -1, dtype=np.int64)
    fill = np.zeros((rows, n), dtype=np.int64)
    for r in range(rows):
        for c in range(1, n):
            v = parents[r, c]
            kids[r, v, fill[r, v]] = c
            fill[r, v] += 1
    return kids


def _walk_compiled(tree: TokenTree, probs: torch.Tensor, rule: str, coins: torch.Tensor):
    """The compiled CPU walk (stree.sampling.verify_jit): the accepted path, its length, the last node's
    residual; what the tables and :func:`_walk` give."""
    from .verify_jit import RULE_CODES, walk

    B, N, V = probs.shape
    index = tree.index
    kids = index.memo("children_by_rank", lambda: _children_by_rank(index))
    if tree.child_ids is not None and rule != "one_hot":
        ids, law = tree.child_ids.long(), tree.child_probs
        if bool(((ids < 0) | (ids >= V)).any()):  # always checked: the compiled walk indexes with them
            raise ValueError(f"tree.child_ids holds ids outside the vocabulary [0, {V})")
    else:
        ids, law = torch.zeros(B, N, 1, dtype=torch.long), torch.zeros(B, N, 1)
    valid = tree.valid if tree.valid is not None else torch.ones(B, N, dtype=torch.bool)
    path = np.zeros((B, _max_depth(tree) + 1), dtype=np.int64)
    num = np.zeros(B, dtype=np.int64)
    residual = np.empty((B, V), dtype=np.float32)
    walk(probs.detach().numpy(), tree.tokens.long().numpy(), valid.numpy(), kids, ids.numpy(),
         law.float().numpy(), RULE_CODES[rule], coins.double().numpy(), path, num, residual)
    return torch.from_numpy(path), torch.from_numpy(num), torch.from_numpy(residual)


def verify(tree: TokenTree, logits: torch.Tensor, params: SamplingParams | None = None, *,
           temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           generator: "torch.Generator | Placed | None" = None, mode: str = "auto",
           validate: bool = True) -> VerifyResult:
    """Accept the longest valid path of ``tree`` under the target ``logits`` ``[B, N, V]``.

    ``params`` (a :class:`SamplingParams`) or the keyword arguments say how the target samples.
    The emitted tokens (accepted drafts then ``bonus``) are distributed exactly as sampling from the
    processed target distribution token by token, provided the tree's drafts were drawn from the
    law it declares (``child_probs``, draw order = index order) independently of this call's
    randomness; at temperature 0 they are exactly greedy decoding. ``generator``: a torch
    generator, or keyed draws placed at the rows' positions (:mod:`stree.sampling.keyed`; random
    drafts' rules then draw from its sequential stream). ``validate=False`` skips the
    vocabulary checks of the drafted ids (device-to-host syncs), for callers that checked them."""
    if params is None:
        params = SamplingParams(temperature, top_k, top_p, mode)
    elif not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if logits.dim() != 3 or tuple(logits.shape[:2]) != (tree.batch_size, tree.n):
        raise ValueError(f"logits must have shape [{tree.batch_size}, {tree.n}, V], got {tuple(logits.shape)}")
    B, N, V = logits.shape
    if tree.tokens.device != logits.device:
        raise ValueError(f"tree is on {tree.tokens.device} but logits are on {logits.device}")
    tokens = tree.tokens
    if validate and bool(((tokens < 0) | (tokens >= V)).any()):
        pos = tuple(int(v) for v in torch.nonzero((tokens < 0) | (tokens >= V))[0])
        raise ValueError(f"tree.tokens{list(pos)} = {int(tokens[pos])} is outside the vocabulary [0, {V})")
    rule = choose_rule(tree, params.temperature, params.mode)
    keyed = isinstance(generator, Placed)
    if keyed:
        # deterministic drafts: the naive rule (the one-hot rule's law) at the keyed uniforms, which
        # emits what plain steps draw; random drafts: the rejection rules, on the sequential stream
        rule = "naive" if rule == "one_hot" else rule
        generator = generator if rule == "naive" else generator.generator
    probs = None
    if rule in ("greedy", "naive"):
        if rule == "greedy":
            # a half argmax in float32: the same choice (widening is exact), and a half one is slow on CPUs
            choice = (logits if logits.dtype == torch.float32 else logits.float()).argmax(-1)
        elif keyed:  # node n of row b at depth d draws with the uniform of the row's position d ahead
            probs = params.probs(logits)
            u = generator.depths(_max_depth(tree) + 1, logits.device)
            if COMPILED_ON_CPU and probs.device.type == "cpu":
                return VerifyResult(*_keyed_compiled(tree, probs, u), probs)
            depth = tree.index.depth.to(logits.device).long().expand(B, N)
            choice = draw_at(probs.reshape(B * N, V), u.gather(1, depth).reshape(-1)).reshape(B, N)
        else:
            probs = params.probs(logits)
            choice = draw(probs.reshape(B * N, V), generator).reshape(B, N)
        accepted, num, bonus = follow_choices(tree, choice)
    else:
        probs = params.probs(logits)
        if COMPILED_ON_CPU and probs.device.type == "cpu":
            coins = torch.rand(B, N, generator=generator, device=logits.device)
            accepted, num, last = _walk_compiled(tree, probs, rule, coins)
        else:
            accept, residual = acceptance_tables(tree, probs, rule, validate)
            coins = torch.rand(B, N, generator=generator, device=logits.device)
            accepted, num, end = _walk(tree.parents.to(logits.device).expand(B, N), coins < accept, _max_depth(tree))
            last = residual.gather(1, end[:, None, None].expand(B, 1, V))[:, 0]
        bonus = draw(last, generator)
    return VerifyResult(accepted, num, bonus, probs)
