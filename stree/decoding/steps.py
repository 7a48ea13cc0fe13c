"""One decoding step's device work, each ending in ONE device-to-host transfer of everything the
host needs (the emitted tokens, their counts, and what the drafter learns from): the prefill's
first token (:func:`prefill_rows`), an autoregressive step (:func:`autoregressive_step`) and a
speculative step (:func:`speculative_step`: tree pass, verification, commit). The decoding loop
(:mod:`stree.decoding.loop`) and the cost model (:mod:`stree.decoding.cost`) both run them."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch
from numba import njit

from .distributed import agree, tensor_parallel
from ..runtime.runners import DecodeRunner, EagerRunner
from ..sampling import verify as _verify
from ..tree import TokenTree, host_array, host_tensor
from ..sampling.verify import (SamplingParams, VerifyResult, greedy_on_host, greedy_path, greedy_rows_host, verify,
                               verify_greedy_host)

__all__ = ["HostStep", "autoregressive_step", "build_calls", "check_draft", "prefill_rows", "speculative_step"]


@dataclass
class HostStep:
    """What one decoding step hands the host, from one device-to-host transfer: per row the
    ``tokens [B, L]`` emitted (the first ``counts[b]``) and, when ``top_k`` was asked for, the
    target distributions they came from (``TargetTop`` parts ``[B, L, k]`` and ``[B, L]``)."""

    tokens: torch.Tensor
    counts: torch.Tensor
    finite: torch.Tensor  # [B] bool: every logit of the row was finite
    top_ids: torch.Tensor | None = None
    top_probs: torch.Tensor | None = None
    token_probs: torch.Tensor | None = None
    _arrays: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``tokens`` and ``counts`` as NumPy arrays (their memory, not to be written to), made once:
        the rows' bookkeeping and the tree's choice both read them, and each ``.numpy()`` is four
        dispatcher calls, microseconds each right after a model pass."""
        hit = self._arrays
        if hit is None or hit[0] is not self.tokens or hit[1] is not self.counts:
            hit = self._arrays = (self.tokens, self.counts, host_array(self.tokens), host_array(self.counts))
        return hit[2], hit[3]


def _finite(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether each position's logits are free of NaN and +inf (one sum, one compare: both survive
    the sum; -inf, a token ruled out, is allowed), and the logits with the bad positions zeroed
    when sampling, so that no NaN reaches a draw (a crash on the CPU, a device assert on CUDA)
    before the host sees the flag."""
    finite = _finite_rows(logits)
    # (on the CPU, where reading the flags costs no transfer, finite logits go as they are: for a 4-node
    # tree's logits, reading the flags took less than half the time of the masked copy, timed warm)
    if params.greedy or _verify.COMPILED_ON_CPU and logits.device.type == "cpu" and bool(finite.all()):
        return finite, logits
    return finite, logits.where(finite[..., None], 0.0)


def _finite_rows(logits: torch.Tensor) -> torch.Tensor:
    return logits.sum(-1) < float("inf")


def _emitted(tokens: torch.Tensor, accepted: torch.Tensor, num: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """Each row's emitted tokens ``[B, L]``: the accepted drafts below the root, then the bonus."""
    path = tokens.gather(1, accepted)
    return torch.cat([path[:, 1:], path[:, :1]], 1).scatter(1, (num - 1)[:, None], bonus[:, None])


def _along(x: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """``x [B, N, V]`` at each row's accepted path ``[B, L]``: ``[B, L, V]``."""
    return x.gather(1, accepted[:, :, None].expand(-1, -1, x.shape[-1]))


def _to_host(tokens: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor | None, top_k: int,
             finite: torch.Tensor) -> HostStep:
    """Pack everything into one fp32 tensor, move it once, unpack on the host (:func:`pack`). On
    the CPU, where the compiled paths run, the parts are the host's already: no packing."""
    if _verify.COMPILED_ON_CPU and tokens.device.type == "cpu":
        B = tokens.shape[0]
        out = HostStep(tokens, counts, finite if finite.dim() == 1 else finite.reshape(B, -1).all(1))
        k = packed_k(probs, top_k)
        if k is not None:
            top_ids, top_probs, token_probs = _laws(tokens, probs, k)
            out.top_ids, out.top_probs, out.token_probs = top_ids, top_probs.float(), token_probs.float()
        return out
    packed = pack(tokens, counts, probs, top_k, finite)
    return unpack(packed.cpu(), tokens.shape[1], finite[0].numel(), packed_k(probs, top_k))  # the one sync


def _path_laws(x: torch.Tensor, accepted: torch.Tensor, num: torch.Tensor, tokens: torch.Tensor, k: int, law=None):
    """:func:`_laws` of the host's step (CPU tensors) at the real nodes of each row's accepted path
    alone (the first ``num[b]`` of ``accepted [B, L]``): ``law`` (None: as they are) of the rows of
    ``x [B, N, V]`` at those nodes, their top ``k`` and the emitted ``tokens [B, L]``' own
    probabilities, in ``[B, L, k]`` and ``[B, L]`` arrays whose entries past a row's count are 0.
    Picking those rows by index took a tenth of what gathering every padded position of every path
    cost, and the top-k of the paths' padding was most of the rest (a drafter reads ``counts[b]``
    entries). The rows' indices, and the top entries with the arrays' filling, are one compiled
    call each (:func:`_top_laws`: two dozen small NumPy and torch ops, ``torch.topk`` among them,
    had cost a STAND tree's iteration a quarter of a plain step)."""
    B, N, V = x.shape
    L = accepted.shape[1]
    acc, counts = np.ascontiguousarray(accepted.numpy()), num.numpy()
    rows = np.empty(int(counts.sum()), dtype=np.int64)
    _path_rows(acc, counts, N, rows)
    picked = x.reshape(B * N, V).index_select(0, torch.from_numpy(rows))
    picked = picked if law is None else law(picked)
    k = min(k, V)
    ids, probs, own = np.zeros((B, L, k), dtype=np.int64), np.zeros((B, L, k), dtype=np.float32), \
        np.zeros((B, L), dtype=np.float32)
    _top_laws(counts, (picked if picked.dtype == torch.float32 else picked.float()).numpy(),  # (a half law's, exactly)
              np.ascontiguousarray(tokens.numpy()), ids, probs, own)
    return host_tensor(ids), host_tensor(probs), host_tensor(own)  # (a drafter reads them as arrays)


@njit(cache=True)
def _path_rows(accepted, num, n, rows):
    """The flat row (b * n + node) of each row's real path nodes, row by row, root first."""
    r = 0
    for b in range(accepted.shape[0]):
        for t in range(num[b]):
            rows[r] = b * n + accepted[b, t]
            r += 1


@njit(cache=True)
def _top_laws(num, picked, tokens, ids, probs, own):
    """:func:`_path_laws`' arrays from the picked laws (in :func:`_path_rows`' order): entry t of
    row b its ``k`` most likely ids and their probabilities, most likely first (as
    ``torch.topk``; among equal probabilities the lower id first, where torch's order is its own),
    and the emitted token's own probability."""
    k = ids.shape[2]
    r = 0
    for b in range(ids.shape[0]):
        for t in range(num[b]):
            top_i, top_p = ids[b, t], probs[b, t]
            top_p[:] = -np.inf
            law = picked[r]
            for i in range(len(law) if k else 0):  # (k 0: the tokens' own alone)
                p = law[i]
                if p > top_p[k - 1]:  # (strictly: an equal one after the ids before it)
                    j = k - 1
                    while j > 0 and top_p[j - 1] < p:
                        top_p[j], top_i[j] = top_p[j - 1], top_i[j - 1]
                        j -= 1
                    top_p[j], top_i[j] = p, i
            own[b, t] = law[tokens[b, t]]
            r += 1


def packed_k(probs: torch.Tensor | None, top_k: int) -> int | None:
    """How many target entries per token :func:`pack` stores (None: no laws at all)."""
    return None if probs is None else min(top_k, probs.shape[-1])


def pack(tokens: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor | None, top_k: int,
         finite: torch.Tensor) -> torch.Tensor:
    """Everything the host needs from a step in one fp32 tensor ``[B, ...]`` (cat promotes the
    ids; vocabularies stay below 2^24, where fp32 holds integers exactly): the emitted ``tokens
    [B, L]``, their ``counts``, ``finite [B, ...]`` (:func:`_finite`) and, with ``probs [B, L,
    V]`` (the law each emitted token was drawn from; None: no drafter learns), its top-``top_k``
    and each emitted token's probability."""
    return _pack(tokens, counts, finite, None if probs is None else _laws(tokens, probs, packed_k(probs, top_k)))


def _pack(tokens: torch.Tensor, counts: torch.Tensor, finite: torch.Tensor, laws: tuple | None) -> torch.Tensor:
    """:func:`pack` of the laws' parts as :func:`_laws` gives them (None: none)."""
    B = tokens.shape[0]
    parts = [tokens, counts[:, None], finite.reshape(B, -1)]
    if laws is not None:
        top_i, top_p, token_p = laws
        parts += [top_i.flatten(1), top_p.flatten(1), token_p]
    return torch.cat(parts, 1).float()


def _laws(tokens: torch.Tensor, probs: torch.Tensor, k: int):
    """What a drafter learns of each emitted token's law ``probs [B, L, V]``: its top ``k`` ids
    and probabilities, and the token's own probability."""
    top_p, top_i = torch.topk(probs, k, dim=-1)
    return top_i, top_p, probs.gather(-1, tokens[..., None])[..., 0]


def unpack(host: torch.Tensor, L: int, m: int, k: int | None) -> HostStep:
    """The :class:`HostStep` in a packed host tensor of ``L`` tokens a row, ``m`` finiteness flags
    and ``k`` target entries per token (None: no laws packed)."""
    a = host.numpy()  # (NumPy slices and casts: a torch op on these few numbers costs several times as much)
    B = a.shape[0]
    out = HostStep(torch.from_numpy(a[:, :L].astype(np.int64)), torch.from_numpy(a[:, L].astype(np.int64)),
                   torch.from_numpy(a[:, L + 1: L + 1 + m].all(1)))
    if k is not None:
        at = L + 1 + m
        out.top_ids = torch.from_numpy(a[:, at: at + L * k].astype(np.int64).reshape(B, L, k))
        out.top_probs = torch.from_numpy(a[:, at + L * k: at + 2 * L * k].reshape(B, L, k))
        out.token_probs = torch.from_numpy(a[:, at + 2 * L * k:])
    return out


def prefill_rows(model, rows, cache, params: SamplingParams, generator, top_k: int | None) -> HostStep:
    """Feed the prompts of ``rows`` (the loop's :class:`~stree.decoding.loop.Rows`) into the (empty)
    cache and draw each row's first token."""
    longest = int(rows.lengths.max())
    logits = model.prefill(rows.seq[:, :longest].to(model.device), cache, lengths=rows.lengths)
    finite, logits = _finite(logits, params)
    first, = agree(model, params.sample(logits, generator)[:, None])
    probs = None if top_k is None else params.observed(logits)[:, None]
    return _to_host(first, torch.ones_like(first[:, 0]), probs, top_k or 0, finite)


def autoregressive_step(model, cache, roots: torch.Tensor, params: SamplingParams, generator,
                        runner: DecodeRunner | None = None, top_k: int | None = None) -> HostStep:
    """One token for every row: the target's step on the roots (the ``runner``'s step, a CUDA graph
    or a compiled one, when given), then one sampled token each, with the law it was drawn from
    when ``top_k`` is set (a drafter learning from the target's distributions)."""
    runner = runner or EagerRunner(model, cache)
    fused = params.greedy and runner.fused_step(_greedy_step, "greedy")
    if fused:  # (CUDA graphs: the step, the token's choice and the host's packed part as one graph)
        k = None if top_k is None else min(top_k, model.vocab_size)
        return unpack(fused(roots, k).to("cpu", copy=True), 1, 1, k)  # (a copy: the graph's output is its own)
    # where the model has it, the step with each row's greedy choice, its finiteness and (greedy) the laws a
    # drafter learns from as one call (the laws' softmax, top-k and gather in torch had cost a plain step a
    # sixth more; sampled, its flags spare the logits' sum and masking in torch, about a seventh of a
    # sampled step at batch 2: docs/benchmarks.md)
    one = None
    if tensor_parallel(model) is None:
        one = runner.greedy_step(roots, top_k if params.greedy and _verify.COMPILED_ON_CPU else None)
    if one is not None and not params.greedy:
        logits, _, _, finite, _ = one
        if not finite.numpy().all():  # (NaN must not reach a draw: those rows' logits zeroed, the flag raised)
            logits = logits.where(finite[:, None], 0.0)
        nxt = params.sample(logits, generator)[:, None]
        probs = None if top_k is None else params.observed(logits)[:, None]
        return _to_host(nxt, torch.ones_like(nxt[:, 0]), probs, top_k or 0, finite)
    if one is not None:
        logits, nxt, counts, finite, laws = one
        if laws is None:
            probs = None if top_k is None else params.observed(logits)[:, None]
            return _to_host(nxt, counts, probs, top_k or 0, finite)
        host = HostStep(nxt, counts, finite)  # (its outputs are the host's own)
        host.top_ids, host.top_probs, host.token_probs = laws
        return host
    logits = runner.step()(roots, validate=False)
    if greedy_on_host(params, logits) and tensor_parallel(model) is None:
        nxt, finite = greedy_rows_host(logits)
    else:
        finite, logits = _finite(logits, params)
        nxt, = agree(model, params.sample(logits, generator))
        nxt = nxt[:, None]
    probs = None if top_k is None else params.observed(logits)[:, None]
    return _to_host(nxt, torch.ones_like(finite, dtype=torch.long), probs, top_k or 0, finite)


def speculative_step(model, cache, draft: TokenTree, params: SamplingParams, generator, scan: str = "tree",
                     top_k: int | None = None, lap=None, runner: DecodeRunner | None = None):
    """Score ``draft`` (on the model's device, checked on the host) in one tree pass, verify it,
    commit the accepted paths, and hand the host the emitted tokens (accepted drafts, then the
    bonus) with their target laws when ``top_k`` is set. Returns ``(host, result)``. With a
    ``runner`` (default: the model's own calls on ``cache``), a draft of a static shape goes
    through that shape's tree pass and commit (CUDA graphs or compiled).
    ``lap(phase)``, if given, is called after "verify" (tree pass and verification) and "commit"."""
    runner = runner or EagerRunner(model, cache)
    fused = (params.greedy and scan == "tree" and draft.static_shape is not None
             and runner.fused(_greedy_iteration, draft.static_shape, "greedy"))
    if fused:  # the pass, greedy verification and what the host reads as one graph (compiled, or CUDA graphs)
        k = None if top_k is None else min(top_k, model.vocab_size)
        valid = draft.valid if draft.valid is not None else _all_valid(draft.tokens.shape, draft.tokens.device)
        packed = not runner.fused_on_host
        tree_pass, (accepted, num, bonus, host) = fused(draft.tokens, valid, draft.static_shape.max_depth, k, packed)
        result = VerifyResult(accepted, num, bonus, None)
        if lap is not None:
            lap("verify")
        fused.commit(tree_pass, accepted, num)
        if packed:  # (the one transfer, a copy: the graph's outputs are its own, the next iteration's)
            host = unpack(host[0].to("cpu", copy=True), draft.static_shape.max_depth + 1, 1, k)
            result = VerifyResult(*(t.clone() for t in (accepted, num, bonus)))
        else:
            host = HostStep(*host)
        if lap is not None:
            lap("commit")
        return host, result
    # greedy, where the model has it: the pass, verification, commit and the laws a drafter learns from
    # as one call (their Python and the scratch's arrays had cost a small tree's iteration about half a
    # plain step, and the laws' softmax and top-k a STAND tree's a fifth more)
    one = None
    if params.greedy and scan == "tree" and _verify.COMPILED_ON_CPU and tensor_parallel(model) is None:
        one = runner.greedy_tree(draft, top_k)
    if one is not None:
        logits, accepted, num, bonus, out, finite, laws = one
        result = VerifyResult(accepted, num, bonus, None)
        if lap is not None:
            lap("verify")
        if laws is not None or top_k is None:  # (its outputs are the host's own, with the laws asked for)
            host = HostStep(out, num, finite)
            if laws is not None:
                host.top_ids, host.top_probs, host.token_probs = laws
            if lap is not None:
                lap("commit")
            return host, result
    else:
        tree_calls, commit = runner.tree_calls(draft, scan)
        logits, tree_pass = tree_calls(draft)
        if greedy_on_host(params, logits) and tensor_parallel(model) is None:
            result, out, finite = verify_greedy_host(draft, logits)
        else:
            finite, logits = _finite(logits, params)
            result = verify(draft, logits, params, generator=generator, validate=False)
            result.accepted, result.num_accepted, result.bonus = agree(model, result.accepted, result.num_accepted,
                                                                       result.bonus)  # rank 0's, under TP
            out = _emitted(draft.tokens, result.accepted, result.num_accepted, result.bonus)
        if lap is not None:
            lap("verify")
        commit(tree_pass, result.accepted, result.num_accepted)
    drawn_from = result.probs is not None and not params.some_greedy  # (else a greedy row's: the model's softmax)
    if top_k is not None and _verify.COMPILED_ON_CPU and out.device.type == "cpu" and (drawn_from or params.greedy):
        host = _to_host(out, result.num_accepted, None, 0, finite)  # (the laws at the paths' real nodes alone)
        host.top_ids, host.top_probs, host.token_probs = _path_laws(
            result.probs if drawn_from else logits, result.accepted, result.num_accepted, out, top_k,
            None if drawn_from else _GREEDY.observed)
    else:
        probs = None if top_k is None else (_along(result.probs, result.accepted) if drawn_from
                                            else params.observed(_along(logits, result.accepted)))
        host = _to_host(out, result.num_accepted, probs, top_k or 0, finite)
    if lap is not None:
        lap("commit")
    return host, result


def build_calls(model, runner: DecodeRunner, shapes, params: SamplingParams, top_k: int | None = None,
                step_top_ks=(None,)) -> None:
    """Build ``runner``'s step (greedy, where the runner fuses it, for each of ``step_top_ks``, the
    ``top_k`` its plain steps may take) and, for each static shape of ``shapes`` (verified under the
    tree scan), the pass :func:`speculative_step` takes (greedy: the fused iteration; else the tree
    pass), by running each once on the runner's cache, then empty the cache. A decoding loop calls
    it before its prefill: compiling a call costs seconds on the CPU, which would otherwise land
    inside the first decoding that uses it (every fixed size of ``tree="auto"``, whose costs
    were read from the cache file, compiled within a timed call). Nothing is drawn; what the
    runner has run once is not run again (``runner.built``)."""
    batch, device = runner.cache.batch_size, model.device
    roots = torch.zeros(batch, dtype=torch.long, device=device)
    fused = params.greedy and runner.fused_step(_greedy_step, "greedy")
    if "step" not in runner.built and not fused:
        runner.step()(roots, validate=False)
        runner.built.add("step")
    for k in set(step_top_ks) if fused else ():
        if ("step", k) not in runner.built:
            fused(roots, None if k is None else min(k, model.vocab_size))
            runner.built.add(("step", k))
    k = None if top_k is None else min(top_k, model.vocab_size)
    for shape in shapes:
        if (shape, params.greedy, k) in runner.built:
            continue
        tokens = torch.zeros(batch, shape.n, dtype=torch.long, device=device)
        fused = params.greedy and runner.fused(_greedy_iteration, shape, "greedy")
        if fused:
            fused(tokens, _all_valid(tuple(tokens.shape), device), shape.max_depth, k, not runner.fused_on_host)
        else:
            runner.tree(shape)[0](tokens, validate=False)
        runner.built.add((shape, params.greedy, k))
    runner.zero()


@functools.lru_cache(maxsize=64)
def _all_valid(shape: tuple, device: torch.device) -> torch.Tensor:
    """A draft without a validity mask as one with every node valid: a compiled graph takes the
    one kind of input (None there would be another graph, compiled again inside decoding)."""
    return torch.ones(shape, dtype=torch.bool, device=device)


def _greedy_iteration(model, tokens, index, cache, kernels: str, valid, max_depth: int, k: int | None, packed: bool):
    """A static shape's tree pass, greedy verification, and the fields of the :class:`HostStep`:
    the emitted tokens, their counts, finiteness (and the target's top-``k`` laws along the
    accepted path where a drafter learns from them): tensors only, for
    :meth:`~stree.runtime.runners.DecodeRunner.fused` to run as one graph. Compiled on the CPU its
    outputs are the host's already (packed into one tensor and unpacked on the host, they had cost
    a compiled tree iteration a twentieth of a step); for a device (``packed``) they are
    :func:`pack`'s one tensor, for one transfer. The same arithmetic as the eager step's
    (:func:`speculative_step`), tested equal."""
    logits, ssm, attn = model.tree_layers(tokens, index, cache, "tree", kernels)
    accepted, num, bonus = greedy_path(index.parents, tokens, valid, logits.argmax(-1), max_depth)
    emitted = _emitted(tokens, accepted, num, bonus)
    finite = _finite_rows(logits).all(1)
    laws = None if k is None else _laws(emitted, _GREEDY.observed(_along(logits, accepted)), k)
    if packed:
        host = (_pack(emitted, num, finite, laws),)
    else:
        host = (emitted, num, finite) + (() if laws is None else (laws[0], laws[1].float(), laws[2].float()))
    return ssm, attn, (accepted, num, bonus, host)


def _greedy_step(model, tokens, cache, k: int | None) -> torch.Tensor:
    """A plain greedy step and its :class:`HostStep` as :func:`pack` gives it (the target's
    top-``k`` law where a drafter learns from it): tensors only, for
    :meth:`~stree.runtime.runners.DecodeRunner.fused_step` to capture as one graph (run eager after a
    graphed step, the choice, the check and the packing were seven launches, as much host time as
    the step's graph on an H200). The same arithmetic as :func:`autoregressive_step`'s, tested equal."""
    logits = model.step(tokens, cache, validate=False)
    nxt = logits.argmax(-1)[:, None]
    laws = None if k is None else _laws(nxt, _GREEDY.observed(logits)[:, None], k)
    return _pack(nxt, torch.ones_like(nxt[:, 0]), _finite_rows(logits), laws)


_GREEDY = SamplingParams(0.0)


_WRONG_ROOT = -2


@njit(cache=True)
def _token_fault(tokens, roots, vocab_size):
    """What :func:`check_draft` finds of a draft's ``tokens [B, N]``, in one compiled pass (the
    numpy checks' half dozen calls cost a tree iteration more): -1 nothing, ``_WRONG_ROOT`` a
    row whose root is not its last token, else the flat index of the first id outside the
    vocabulary."""
    B, N = tokens.shape
    for b in range(B):
        if tokens[b, 0] != roots[b]:
            return _WRONG_ROOT
    for b in range(B):
        for i in range(N):
            if tokens[b, i] < 0 or tokens[b, i] >= vocab_size:
                return b * N + i
    return -1


def check_draft(draft: TokenTree, roots: torch.Tensor, vocab_size: int) -> None:
    """The drafter's tree, on the host (no device is waited on): one row per drafted row, the
    rows' roots, every id in the vocabulary."""
    if not isinstance(draft, TokenTree) or draft.batch_size != len(roots):
        raise ValueError(f"the drafter must return a TokenTree with one row per active row ({len(roots)})")
    # (numpy: a drafter's trees are on the host, and small)
    tokens = draft.arrays()[0] if draft.tokens.device.type == "cpu" else draft.tokens.cpu().numpy()
    fault = _token_fault(tokens, roots.numpy(), vocab_size)
    if fault == _WRONG_ROOT:
        raise ValueError("the drafter returned a tree whose root token is not the row's last token")
    if fault >= 0:
        pos = divmod(fault, tokens.shape[1])
        raise ValueError(f"tree.tokens{list(pos)} = {int(tokens[pos])} is outside the vocabulary [0, {vocab_size})")
    if draft.child_ids is not None:
        ids = draft.child_ids.cpu().numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"tree.child_ids holds ids outside the vocabulary [0, {vocab_size})")
