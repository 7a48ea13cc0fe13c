"""The decoding loop: autoregressive, chain speculative decoding, and STree (paper 001, Algorithm 1).

One iteration of ``stree`` / ``chain``: the drafter proposes a tree rooted at each row's last
token, the target scores every node in one ``forward_tree``, :func:`stree.verify.verify` picks the
accepted path and the bonus token, ``commit`` replays the accepted path into the cache, and the
accepted drafts plus the bonus are emitted. The bonus becomes the next root.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .drafters.base import DraftContext, Drafter, TargetTop
from .drafters.ngram import NGramDrafter
from .tree import TokenTree, TreeShape
from .verify import check_sampling, process_logits, sample_tokens, verify

__all__ = ["METHODS", "GenerationOutput", "GenerationStats", "generate"]

METHODS = ("stree", "chain", "autoregressive")


@dataclass
class GenerationStats:
    """``target_forwards``: decoding forwards of the target (prefill excluded). ``accepted``: per
    row, the drafts the verifier accepted at each of its steps. ``tau``: tokens emitted per row per
    decoding step, bonus included (1 for autoregressive), after the cuts at EOS and
    ``max_new_tokens``; the first token, which comes from the prefill, counts in ``new_tokens`` but
    not in ``tau``. Times in seconds; ``time_verify`` holds the target's tree forward."""

    target_forwards: int = 0
    new_tokens: list[int] = field(default_factory=list)
    accepted: list[list[int]] = field(default_factory=list)
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_commit: float = 0.0
    time_total: float = 0.0

    @property
    def tau(self) -> float:
        return pooled_tau([self])

    def row_tau(self, row: int) -> float:
        """``tau`` of one row."""
        steps = len(self.accepted[row])
        return (self.new_tokens[row] - 1) / steps if steps else float("nan")

    @property
    def time_other(self) -> float:
        return self.time_total - self.time_prefill - self.time_draft - self.time_verify - self.time_commit

    @property
    def tokens_per_s(self) -> float:
        return sum(self.new_tokens) / self.time_total if self.time_total > 0 else float("nan")

    def summary(self) -> str:
        return (f"tokens {sum(self.new_tokens)} | forwards {self.target_forwards} | tau {self.tau:.2f} | "
                f"{self.tokens_per_s:.1f} tok/s | draft {self.time_draft:.3f}s verify {self.time_verify:.3f}s "
                f"commit {self.time_commit:.3f}s other {self.time_other:.3f}s (prefill {self.time_prefill:.3f}s)")


def pooled_tau(stats: list[GenerationStats]) -> float:
    """``tau`` over the rows of several runs together."""
    steps = sum(len(a) for s in stats for a in s.accepted)
    from_steps = sum(n - 1 for s in stats for n in s.new_tokens if n > 0)  # the first token came from the prefill
    return from_steps / steps if steps else float("nan")


@dataclass
class GenerationOutput:
    """``sequences``: per row, prompt then generated tokens; ``prompt_lengths`` to split them."""

    sequences: list[list[int]]
    prompt_lengths: list[int]
    stats: GenerationStats

    @property
    def new_tokens(self) -> list[list[int]]:
        return [s[n:] for s, n in zip(self.sequences, self.prompt_lengths)]


def _prompts(input_ids) -> list[list[int]]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be an integer tensor [batch, T] or a list of token lists, "
                             f"got {input_ids.dtype} {tuple(input_ids.shape)}")
        prompts = input_ids.tolist()
    else:
        prompts = [list(map(int, p)) for p in input_ids]
    if not prompts:
        raise ValueError("input_ids holds no rows")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"input_ids row {i} is empty: every prompt needs at least one token")
    return prompts


def _resolve_shape(method: str, tree) -> TreeShape | None:
    if method == "autoregressive":
        return None
    if tree is None:
        tree = TreeShape.chain(4) if method == "chain" else TreeShape.paper13()
    if not isinstance(tree, TreeShape):
        raise TypeError(f"tree must be a TreeShape, got {type(tree).__name__}")
    if method == "chain" and tree.parents != TreeShape.chain(tree.n - 1).parents:
        raise ValueError(f"method='chain' needs a chain tree, got parents {list(tree.parents)}")
    return tree


class _Clock:
    """Wall time per phase; waits for the device first so GPU work lands in its own phase."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.t = time.perf_counter()

    def lap(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt


@torch.no_grad()
def generate(model, input_ids, *, drafter: Drafter | None = None, tree: TreeShape | None = None,
             method: str = "stree", max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, eos_token_id: int | list[int] | None = None, seed: int | None = None,
             mode: str = "auto", max_length: int | None = None, on_step=None) -> GenerationOutput:
    """Decode up to ``max_new_tokens`` per row; a row stops after emitting an EOS.

    ``input_ids``: a ``[B, T]`` tensor or a list of token lists (ragged prompts allowed).
    ``method``: ``stree`` (tree drafts, one tree forward; default tree ``paper13``), ``chain``
    (chain drafts through the chain backend; default ``chain(4)``) or ``autoregressive``.
    ``drafter`` defaults to :class:`NGramDrafter`. ``mode="naive"`` verifies by exact-match
    sampling. ``max_length``: the cache size; by default the longest prompt plus
    ``max_new_tokens`` plus the tree depth (the drafter's ``draft_depth`` when deeper). The same
    ``seed`` gives the same output.
    ``on_step(rows, tree, result)``, if given, sees every verify step (row ids, the drafted
    :class:`TokenTree`, the :class:`~stree.verify.VerifyResult`), e.g. to count accepted nodes."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    check_sampling(temperature, top_k, top_p)
    prompts = _prompts(input_ids)
    if tree is None and method == "stree":
        tree = getattr(drafter, "shape", None)  # a drafter built for a tree shape (e.g. STAND's)
    shape = _resolve_shape(method, tree)
    depth = 0 if shape is None else max(shape.max_depth, getattr(drafter, "draft_depth", None) or 0)
    B, longest = len(prompts), max(map(len, prompts))
    need = longest + max_new_tokens + depth
    if max_length is None:
        max_length = need
    elif need > max_length:
        raise ValueError(f"max_length {max_length} is too small: the longest prompt ({longest} tokens) plus "
                         f"max_new_tokens ({max_new_tokens}) plus the tree depth ({depth}) needs {need}")
    eos = torch.tensor([] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id),
                       dtype=torch.long)
    if method == "autoregressive":
        drafter = None
    elif drafter is None:
        drafter = NGramDrafter()
    device = model.device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)

    stats = GenerationStats(new_tokens=[0] * B, accepted=[[] for _ in range(B)])
    clock = _Clock(device)
    start = clock.t
    seq = torch.zeros(B, longest + max_new_tokens, dtype=torch.long)
    lengths = torch.tensor([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        seq[i, : len(p)] = torch.tensor(p)
    cache = model.allocate_cache(B, max_length)
    logits = model.prefill(seq[:, :longest].to(device), cache, lengths=lengths)
    first = sample_tokens(logits, temperature, top_k, top_p, generator).cpu()
    stats.time_prefill += clock.lap()

    active = torch.arange(B)
    produced = torch.zeros(B, dtype=torch.long)

    def emit(tokens: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
        """Append ``tokens[i, :counts[i]]`` (drawn from ``probs[i]``) to active row i, cut at EOS and
        max_new_tokens, and show the drafter what was appended; returns the mask of active rows that
        are now finished."""
        j = torch.arange(tokens.shape[1])
        is_eos = torch.isin(tokens, eos) & (j < counts[:, None])
        hit = is_eos.any(1)
        upto = torch.where(hit, is_eos.float().argmax(1) + 1, counts)  # through the first EOS
        room = max_new_tokens - produced[active]
        n = torch.minimum(upto, room)
        keep = j < n[:, None]
        if drafter is not None:
            _feed(drafter, DraftContext(seq, lengths, active.tolist()), tokens, n, probs)
        rows = active[:, None].expand_as(tokens)[keep]
        seq[rows, (lengths[active][:, None] + j)[keep]] = tokens[keep]
        lengths[active] += n
        produced[active] += n
        return (hit & (upto <= n)) | (n == room)

    if drafter is not None:
        drafter.reset()
    done = emit(first[:, None], torch.ones(B, dtype=torch.long),
                None if drafter is None else _distribution(logits, temperature, top_k, top_p)[:, None])
    stats.time_draft += clock.lap()
    while True:
        if bool(done.any()):
            keep = torch.nonzero(~done).flatten()
            active = active[keep]
            if len(active) == 0:
                break
            cache = cache.select(keep.to(device))
        roots = seq[active, lengths[active] - 1]
        clock.lap()  # bookkeeping: counted in time_other
        if method == "autoregressive":
            logits = model.step(roots.to(device), cache)
            nxt = sample_tokens(logits, temperature, top_k, top_p, generator).cpu()
            stats.time_verify += clock.lap()
            stats.target_forwards += 1
            for r in active.tolist():
                stats.accepted[r].append(0)
            done = emit(nxt[:, None], torch.ones(len(active), dtype=torch.long), None)
            continue
        context = DraftContext(seq, lengths, active.tolist())
        draft = drafter.propose(context, shape)
        _check_draft(draft, roots)
        if draft.valid is not None and not bool(draft.valid[:, 1:].any()):
            draft = TokenTree.from_shape(TreeShape.chain(0), draft.tokens[:, :1])  # nothing drafted: one node
        draft = _to(draft, device)
        stats.time_draft += clock.lap()
        logits, tree_pass = model.forward_tree(draft, cache, backend="chain" if method == "chain" else "tree")
        result = verify(draft, logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator,
                        mode=mode)
        accepted, num, bonus = result.accepted.cpu(), result.num_accepted.cpu(), result.bonus.cpu()
        stats.time_verify += clock.lap()
        stats.target_forwards += 1
        model.commit(cache, tree_pass, result.accepted, result.num_accepted)
        stats.time_commit += clock.lap()
        if on_step is not None:
            on_step(active.tolist(), draft, result)
        # Emitted: the accepted drafts (path nodes after the root), then the bonus.
        path_tokens = draft.tokens.cpu().gather(1, accepted)
        out = torch.cat([path_tokens[:, 1:], torch.zeros(len(active), 1, dtype=torch.long)], 1)
        out.scatter_(1, (num - 1)[:, None], bonus[:, None])
        for r, a in zip(active.tolist(), (num - 1).tolist()):
            stats.accepted[r].append(a)
        at_path = result.accepted[:, :, None].expand(-1, -1, logits.shape[-1])
        if result.probs is not None:
            seen = result.probs.gather(1, at_path)
        else:
            seen = _distribution(logits.gather(1, at_path), temperature, top_k, top_p)
        done = emit(out, num, seen)
        stats.time_draft += clock.lap()  # feeding the drafter is drafting work
    clock.lap()
    stats.time_total = clock.t - start
    stats.new_tokens = produced.tolist()
    sequences = [seq[i, : int(lengths[i])].tolist() for i in range(B)]
    return GenerationOutput(sequences, [len(p) for p in prompts], stats)


def _distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """What emitted tokens were drawn from (at temperature 0: the softmax, for drafters to learn)."""
    if temperature == 0:
        return torch.softmax(logits.float(), -1)
    return process_logits(logits, temperature, top_k, top_p)


def _feed(drafter: Drafter, context: DraftContext, tokens: torch.Tensor, counts: torch.Tensor,
          probs: torch.Tensor) -> None:
    """``drafter.observe`` the emission of ``tokens[i, :counts[i]]``, token t drawn from ``probs[i, t]``."""
    k = min(drafter.target_top_k, probs.shape[-1])
    top_p, top_i = (t.cpu() for t in torch.topk(probs, k, dim=-1))
    token_p = probs.gather(-1, tokens.to(probs.device)[:, :, None])[..., 0].cpu()
    n = counts.tolist()
    drafter.observe(context, [row[:m].tolist() for row, m in zip(tokens, n)],
                    [TargetTop(i[:m], p[:m], q[:m]) for i, p, q, m in zip(top_i, top_p, token_p, n)])


def _check_draft(draft: TokenTree, roots: torch.Tensor) -> None:
    if not isinstance(draft, TokenTree) or draft.batch_size != len(roots):
        raise ValueError(f"the drafter must return a TokenTree with one row per active row ({len(roots)})")
    if not bool((draft.tokens[:, 0].cpu() == roots).all()):
        raise ValueError("the drafter returned a tree whose root token is not the row's last token")


def _to(tree: TokenTree, device: torch.device) -> TokenTree:
    if tree.tokens.device == device:
        return tree
    move = lambda t: None if t is None else t.to(device)
    return TokenTree(tree.parents.to(device), tree.tokens.to(device), move(tree.valid), move(tree.child_ids),
                     move(tree.child_probs), tree.with_replacement)
