"""``tree="auto"``: each step's tree chosen for expected tokens per second on the machine at hand,
or no tree at all (a plain autoregressive step) where none pays.

Acceptance: :mod:`stree.decoding.acceptance` (:class:`~stree.decoding.acceptance.PathRates`, the
chance that a drafted child of a given sibling rank and depth is accepted, learned from verified
steps only, per batch and per row). The best tree of n nodes is then the n likeliest, grown best
first (:mod:`stree.decoding.plans`); for a drafter model, which steps once per level, the best of
those grown within several depths.

Cost: :func:`stree.decoding.cost.cost_profile`, measured with the drafter: drafting a tree of n nodes
(for a drafter model, of n nodes and d levels), then the target's pass, verification and commit
of it, against a plain step.

The choice (:class:`AutoTree`), every step:

1. Before drafting, the size n maximising E(n) / (D(n) + C(n)) over the ladder of best-first
   trees, against 1 / C(1) for a plain step. Where the plain step wins it is taken without
   drafting; now and then one draft is verified anyway (a probe, paid from a ledger whose
   share of the plain steps halves while probes keep losing), so that the rates follow the text.
   Greedy, a draft is also watched now and then (:meth:`AutoTree.watch_shape`): drafted, not
   verified; the plain steps after it emit what verifying it would have, so the rates learn from
   it as from a verified step, at the price of drafting alone.
2. After drafting, the draft's own chances (its invalid nodes worth nothing) give every prefix m
   of it its E(m); the best prefix by E(m) / C(m) is verified (drafting is paid by then), or a
   plain step taken where that is better (not on a probe) or where nothing was drafted.

In a batch, E is that of the rows expected to finish last (``Rows.critical``: within a step of
the most tokens left at a row's own tokens per step so far), each under its own rates: the batch
decodes until the last of them is done, so tokens a tree brings rows that finish early anyway buy
nothing. Of two such rows E is their mean, of more the least of them
(:func:`~stree.decoding.plans.rows_worth`): two level rows take turns being behind, and weighed by
the least of them, a batch-2 choice priced every tree by the slower of two draws, calibrated its
promises down by that, and in some processes stayed plain for whole calls (n-gram at batch 2, six
processes: 0.60x-1.29x, by the mean 1.13x-1.24x); the slowest of many level rows sets the batch's
end, and weighed by their mean, batches 8 and 16 ran trees that lost (0.91x-0.94x against
0.95x-0.98x; docs/benchmarks.md). What the verified trees then brought those rows (the same: their
mean, or their least) against what was predicted calibrates every prediction
(:meth:`AutoTree.gain_scale`): the least of several rows' draws falls short of the least of their
expectations, and a row's rates lean on the batch's, so the raw predictions promise more than trees
bring.

Rows may also take sizes of their own (:func:`~stree.decoding.plans.best_rows`, ``AutoTree.per_row``): for each level
of gain an active row's prefix reaches, every row takes its smallest prefix reaching it, so a row
that accepts more gets fewer nodes for the same least gain. The nodes in all are one packed pass
(the rows' trees back to back without padding: ``TokenTree.row_sizes``), priced as the padded
pass with as many nodes a row (the products see as many rows) times what packed passes took by
the clock; it is taken where it beats the best size the rows share. By default only where the
choice follows the clock, which learns what packing costs on the machine.

Everything the choice reads is the past (verified steps, measured costs) and the draft itself,
never the target's output at this step, so every drafter stays lossless. A seed repeats its
output: for deterministic drafts whatever the trees (keyed draws, :mod:`stree.sampling.keyed`),
for random drafts as long as the cost profile is the same one (it is cached:
:mod:`stree.decoding.cost`), the choice then reading the profile alone.
"""

from __future__ import annotations

import functools
import math
import time
import weakref
from collections import Counter

import numpy as np
import torch

from .acceptance import (PathRates, RowRates, chances, pooled, shape_structure, structure, valid_mask, walk, weak_class,
                         weak_mask)
from .cost import STALE, WAKE, CostProfile, bracketed_profile, cost_profile, default_sizes, forget
from .plans import best_prefix, best_rows, best_size, cut_rows, expected_accepted, plan_shape, remade, rows_worth, weigh
from ..models.fused_step import measure_half_rows
from ..tree import TokenTree, TreeShape

__all__ = ["AutoTree", "auto_tree", "tree_room"]

# Sizes an eager loop weighs before drafting (any prefix of a draft may be verified after it).
LADDER = (2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
# Sizes a compiled or graphed loop uses: each is one compilation or capture, made while measuring.
FIXED = (2, 4, 8, 16)
FIXED_CUDA = (2, 4, 8, 16, 32, 64, 128)
# Depths a drafter model's plans are cut at, to weigh against the uncut one (its drafting costs a step a level).
DEPTH_CAPS = (1, 2, 3, 4, 6, 8, 12)


@functools.lru_cache(maxsize=64)
def _iteration_by_size(profile: CostProfile, top: int, sizes: tuple[int, ...] | None) -> np.ndarray:
    """Milliseconds of the target's part of an iteration of m nodes, m = 0..top (inf for m = 0 and
    for sizes other than ``sizes`` where given), read-only: every chooser of the profile shares it.
    Made once: interpolated at every size again, it was a third of what making a call's chooser took."""
    out = np.full(top + 1, np.inf)
    for m in range(1, top + 1):
        if sizes is None or m == 1 or m in sizes:
            out[m] = profile.iteration_ms(m)
    out.setflags(write=False)
    return out


@functools.lru_cache(maxsize=256)
def _drafting_by_depth(profile: CostProfile, order: TreeShape, top: int) -> np.ndarray:
    """Milliseconds of drafting every prefix m = 0..top of ``order`` for a drafter model, by its
    nodes and depth (:meth:`~stree.decoding.cost.CostProfile.drafting_ms`'s fit), read-only: made
    once per plan, as a drafter model's choice weighs a plan per depth cap at every re-plan."""
    depth = np.maximum.accumulate(shape_structure(order)[2][0])  # depth[m - 1]: the prefix of m nodes
    m = np.arange(top + 1)
    a, b, c = profile.draft_fit
    out = a + b * depth[np.clip(m, 1, order.n) - 1] + c * m
    out[:2] = 0.0  # (no drafting for a plain step)
    out.setflags(write=False)
    return out


@functools.lru_cache(maxsize=64)
def _drafting_by_size(profile: CostProfile, top: int) -> np.ndarray:
    """Milliseconds of drafting m nodes, m = 0..top, for a drafter without a model (read-only:
    every chooser of the profile shares it). Made once: a choice re-plans after every verified
    tree and watched draft, and interpolating each size again took about as long as the rest of
    the re-plan."""
    out = np.array([profile.drafting_ms(m) for m in range(top + 1)])
    out.setflags(write=False)
    return out


class AutoTree:
    """The per-step choice of one decoding call (see the module docstring): :meth:`plan` before
    drafting (a shape, or None for a plain step), :meth:`choose` after it (the draft cut to its
    best prefix, or None for a plain step), :meth:`record` after the step.

    ``profile``: the measured costs of the target (and drafter) at the loop's batch size;
    ``sizes``: the tree sizes allowed (None: any prefix up to the profile's largest size, shapes
    re-planned from the rates as they change; else those sizes only, prefixes of one fixed plan,
    as compiled passes and CUDA graphs need); ``chain``: chains only (``method="chain"``);
    ``fills_shapes``: whether the drafter drafts the shape it is given (else its own, and only
    the choice after drafting applies); ``depth``: the deepest tree the cache has room for;
    ``adaptive``: scale the profile's plain and speculative costs by what the loop's iterations
    take (:meth:`record`'s ``elapsed_ms``): a drafter model catching up after plain steps, caches
    the drafter evicts, the loop's own bookkeeping. The choice then follows the clock: outputs
    stay lossless but a seed no longer fixes the trees, so decoding turns it on only where the
    output does not depend on them (greedy, no seed, or deterministic drafts at keyed draws:
    :mod:`stree.sampling.keyed`); otherwise trees must beat plain steps by ``MARGIN``.
    Probes are paid from a ledger (``scale["bank"]``, milliseconds): every plain step puts
    ``PROBE_SHARE`` of its time in, every probe takes out what it lost against plain steps for the
    tokens it emitted (what one gained goes in, up to one probe's price), and a probe waits until
    the bank holds what the next one is expected to lose. So, whatever a probe costs, probes
    together lose at most ``PROBE_SHARE`` of the plain
    steps' time (and one probe's loss): the most that turning speculation on loses where it never
    pays; less once probes keep losing (``BACKOFF``), and from call to call once calls keep exploring
    in vain (``IDLE_CALLS``), where most calls then rest (:meth:`rests`). An adaptive choice charges what its probes
    took by the clock (a drafter model catching up on the tokens of the plain steps before, the
    caches it evicts: costs the profile's steady state does not see); a seeded one what the
    profile predicts, its drafter's catch-up included.
    An adaptive choice learns no cost from a call's first iteration (``SETTLE``), nor from a tree
    shape's first pass in the process (:func:`_first_pass`), and while trees keep winning it takes
    plain steps once in ``PLAIN_EVERY`` to weigh plain steps again (``AFTERMATH`` and one: the plain
    steps right after a tree teach no cost, what they take beyond a plain step's is the tree's, as
    they pay for what it evicted).
    ``rates`` and ``scale`` (``{"plain": x, "tree": y}``: a plain step's realised / predicted
    time, and a tree's relative to that, as a declined draft's is; and the ledger) may be shared with
    earlier choosers, which then hand over what they learned. ``chosen`` counts the steps per tree
    size (1: a plain step). ``probes``: whether a choice that watches drafts also funds probes from its
    plain steps (one that cannot watch always does: it has no other way to explore); unfunded, it
    still probes where the next probe is priced at no loss."""

    REPLAN = 8  # steps between re-plans (of an eager loop's shapes, and of the size to draft)
    # A tree that lost more than this many plain steps' time against plain steps for the tokens it
    # brought has the size to draft weighed again at once, not up to REPLAN steps later: a drafter
    # model's deep trees (a drafter step a level) had lost ten plain steps' time each for one token,
    # eight times running, where a new prompt broke the pattern the last one had taught. Only such
    # bets: weighed right after bad luck (after any tree short of its promise, half of them), the
    # choice went plain, and stayed plain until a probe, where cheap drafters' trees paid.
    DEAR = 3.0
    PROBE = 4  # plain steps between probes, at least
    NEVER = 1 << 30  # the plain steps ahead where no probe ever falls due
    # What probes may cost, at most, of the plain steps' time they interrupt: the most that turning
    # speculation on loses where it never pays.
    PROBE_SHARE = 0.02
    # Each probe that loses time against plain steps while probes have lately lost on average (text
    # the drafter cannot follow, or a machine where its trees cannot pay: a drafter model's on a small
    # CPU) halves that share, down to PROBE_SHARE / 2**BACKOFF; a probe that pays makes it whole
    # again, as does the next call (where the last explored drafts enough to halve it on its own:
    # AGAIN). Where speculation never pays, decoding then loses a quarter of a percent to probes, not
    # two; where the text turns predictable, the first probe that pays brings their pace back. The
    # average (``PACE``, the weight of the newest probe's loss) keeps the whole share where probes
    # pay on the whole though most of them lose a little (a batch whose least row often accepts
    # nothing). (Halved only by probes that lost more than a plain step, cheap trees that brought
    # nothing, n-gram's at temperature 1.0 on the 2-core Xeon, kept the whole share for good: 0.936 of
    # plain decoding's pace against 0.966 with this rule, benchmarks/choice_ab.py, three processes,
    # each +0.7% to +6.9%; greedy at batch 2, eager and compiled, the average stayed below zero and
    # no probe halved the share.)
    BACKOFF = 3
    PACE = 0.1
    AGAIN = 2  # the drafts a call must explore (probes, watched) for the next to start whole (see __init__)
    ADAPT = 0.15  # weight of the newest iteration in the cost scales and the share of drafts verified
    # The most one iteration's realised / predicted time may say, as a factor of its scale's present
    # value (so that no one iteration moves a scale by more than ADAPT (CLIP - 1), while many take it
    # anywhere: clipped to [1 / CLIP, CLIP] itself, a profile that priced plain steps at 4.8 times their
    # time, measured beside other work, left them priced at 1.4 times it, trees' own scale (relative)
    # went below zero through their aftermath, and probes that lost looked paying: a probe every few
    # plain steps, compiled STAND at batch 2 at 0.70-0.80 of plain decoding's pace)
    CLIP = 3.0
    # The plain steps weighed after which an adaptive choice that found them over ``FORGET`` times faster
    # than its profile says drops the profile from the cache file (cost.forget): measured while other
    # work took the cores, it is measured again by the next process. (Not at cost.STALE, which a profile
    # just measured in a compiled call's process, the machine otherwise idle, reached: 0.72 of its plain step.)
    STALE_AFTER, FORGET = 64, 2.0
    # A call's first iteration is not learned from: it pays once per call (a drafter model's prefill
    # of the prompt, first-use allocations), which the steady state the scales describe does not.
    SETTLE = 1
    # The plain steps after a tree (or probe) whose time beyond a plain step's is the tree's: what
    # its pass pushed out of the caches, a step weighed alone with the drafter reading its token.
    # Charged for the first one alone, trees at batch 2 ran where they lost (compiled, 2-core EPYC:
    # the second and third plain steps after a tree still took a quarter and a sixth of a step more
    # than a run's, priced as plain steps, and decoding went at 0.84-0.94 of plain decoding's pace).
    AFTERMATH = WAKE
    # While trees keep winning, a plain step in this many is weighed (after AFTERMATH plain steps, the
    # tree's), so that the plain scale follows the machine too: one slow plain iteration (a first
    # call) had made plain steps look dear for good, and speculation then ran where it lost.
    PLAIN_EVERY = 64
    # Where the choice cannot follow the clock (a seed must repeat the output), what the profile
    # misses (the loop's bookkeeping, caches a drafter evicts) is covered by asking a tree to beat
    # a plain step by this much.
    MARGIN = 1.2
    # Watched drafts (deterministic drafts, drafters without a model): whether ``watch`` is heeded (off:
    # benchmarks/speculation.py --no-watch, to compare); one every this many plain steps at least,
    # and watching them (drafting, then learning from them) at most this share of the plain steps' time.
    WATCH = True
    WATCH_EVERY = 4
    WATCH_SHARE = 0.01
    # A watched draft's nodes, at least, where the sizes allow (not the probe's few), and it would have paid
    # where a prefix of it of one of the sizes would have (_prefix_paid): a probe's size, early in a
    # process its rates' prior plan of two or three levels, brought three or four tokens at most against
    # its price, and whether the first such watch paid decided whether a fresh process's choice drafted
    # at all. n-gram, batch 1, greedy (2-core Xeon, benchmarks/speculation.py in fresh processes): five
    # processes in fifteen decoded their first predictable prompts plain, some then resting, tau 1.29-1.41
    # where the others' was 2.2-2.4; with this, none of five. Deep watches judged by the probe's size
    # alone, or the probe's size judged by its best prefix, left three of five so. (Paired in twelve fresh
    # processes a side, benchmarks/speculation_ab.py: n-gram +0.040, STAND deterministic -0.008, STAND
    # -0.018; docs/benchmarks.md, 2026-12-07, evening.)
    WATCH_NODES = 16
    # A call's first watched draft is due after this many plain steps at most, whatever the share: each
    # call is new text, and at the share's pace (a watch in 100-200 plain steps once backed off) a call
    # of 128 tokens explored nothing and decoded plain where its drafter's trees paid (STAND deterministic,
    # batch 1, a fresh process: its second to fifth calls, whose text later calls drafted at 2.7-5.8
    # tokens a step). At most one watch a call beyond the share: under one plain step's time in 128.
    # (Batch 1 only, as auto_tree makes choices: at batch 2, a call's first watch and those it led to took
    # some three plain steps' time each on a 2-core Zen 5 EPYC, where a plain step is a tenth of a
    # millisecond, and the batch's trees seldom paid: without it, every configuration at batch 2 gained
    # +0.014 to +0.097 over plain decoding, benchmarks/choice_ab.py, five processes each, all positive.)
    FIRST_WATCH = 16
    WAIT_AFTER, WAIT_MOST = 2, 4  # (plain_ahead, where the drafter keeps having nothing, or nothing kept)
    # Calls in a row (of one cost profile, in one process) of at least FIRST_WATCH steps that found no
    # draft that paid (no probe, no watched draft that would have paid, no tree kept on its worth),
    # whether they explored drafts in vain or explored none, after which the next calls start at the
    # least shares, and only one in IDLE_WAKE explores (with a first watch) while the others rest
    # (rests), until one finds a draft that pays. (Counting only calls that explored: at batch 2, where
    # calls watch no first draft and fund no probes, and with a drafter model, whose probes are calls
    # apart, calls that drafted nothing at all never rested.) Sampled at temperature 0.6 or 1.0, where
    # the shipped pair's drafts are next to never accepted, each call started whole again had watched a
    # draft or two and probed about once (the drafter catching up on the prompt, learning from them).
    # (Counting shorter calls, and with no first watch at all, a benchmark's warm-up calls of 8 tokens,
    # a failed probe each, had left greedy STAND at batch 1 plain for good: 0.97x, not 1.2x; after two
    # fruitless calls, with a first watch one call in four, greedy n-gram decoded three predictable
    # prompts plain after two that were not.)
    # Each call that explores while calls rest and again finds nothing doubles the calls between such calls,
    # up to one in IDLE_WAKE_MOST: an exploring call there costs what its choice's setup, first plan and first
    # watch take, a few plain steps' time (sampled at temperature 0.6, n-gram, batch 1, 2-core Intel Xeon:
    # such calls at 0.95 of plain decoding's pace, the rested ones at 1.00, the process at 0.97 with one call
    # in two exploring), where the text had paid no draft for several calls; a call that finds one ends the
    # rest at once, as before.
    IDLE_CALLS, IDLE_WAKE, IDLE_WAKE_MOST = 4, 2, 8
    # Whether rows take sizes of their own by default (see per_row): off, as on the CPU measured so far
    # packed passes lost more than they saved (docs/decoding.md); benchmarks/speculation.py --per-row
    PER_ROW = False

    def __init__(self, profile: CostProfile, *, sizes=None, chain: bool = False, fills_shapes: bool = True,
                 depth: int = PathRates.DEPTH, adaptive: bool = False, rates: PathRates | None = None,
                 scale: dict | None = None, per_row: bool | None = None, watch: bool = False,
                 first_watch: bool = True, probes: bool = True):
        self.profile, self.chain, self.fills_shapes, self.adaptive = profile, chain, fills_shapes, adaptive
        # drafts watched during plain steps (watch_shape): where the output cannot depend on the trees
        self.watching = watch and self.WATCH and adaptive and fills_shapes
        self._unwatched = 0  # plain steps since the last watched draft
        self._undrafted = 0  # steps in a row the drafter had nothing for, where the choice drafted (undrafted)
        self._just_undrafted = False  # whether the last step was one of them
        self._paid_watch = False  # whether the last watched draft would have paid, verified
        # whether this call has yet to watch a draft, due within FIRST_WATCH plain steps (first_watch False: none)
        self._first_watch = first_watch
        self.probes = probes or not self.watching
        # each row its own size (packed passes) where that pays: by default where the clock says
        # what packed passes cost (the profile measures padded ones), in any size eager loops verify
        self.per_row = self.PER_ROW and adaptive and sizes is None and not chain if per_row is None else per_row
        self.rates = rates if rates is not None else PathRates()
        self._row_rates: RowRates | None = None  # this call's rows' own (row_rates: made where first asked)
        self._focus: int | None = None  # the batch row the choice serves (the one to finish last), once known
        # The hazards last weighed and the expected accepted drafts of each prefix of the plans weighed
        # under them: most steps re-weigh the sizes with new costs under the same rates (every plain
        # step does), and remaking both was most of what the choice cost a plain step. (Shared by the
        # choices of one rates, _EXPECTED: a call's choice weighs at once under the rates the last left.)
        self._memo: tuple[np.ndarray, dict] | None = _EXPECTED.get(self.rates)
        self.scale = scale if scale is not None else {"plain": 1.0, "tree": 1.0}  # realised / predicted time
        self.scale.setdefault("probe_loss", 0.0)  # ms a probe took beyond plain steps for its tokens (adaptive)
        self.scale.setdefault("probes", 0)  # the probes that measured it
        self.scale.setdefault("bank", 0.0)  # ms the next probes may lose (the ledger)
        self.scale.setdefault("losing", 0)  # the times the ledger's share is halved (BACKOFF)
        self.scale.setdefault("pace", 0.0)  # what probes lost lately, ms a probe (PACE)
        self.scale.setdefault("plain_run", 0)
        self.scale.setdefault("plain_age", 0)  # weighed tree steps since the last weighed plain step
        self.scale.setdefault("gain_got", 0.0)  # drafts accepted by the rows a choice served (faded)...
        self.scale.setdefault("gain_said", 0.0)  # ...and what their rates had promised (gain_scale)
        self.scale.setdefault("watch_ms", 0.0)  # what a watched draft took by the clock (0: none yet)
        self.scale.setdefault("watch_idle", 0)  # watched drafts in a row after which plain steps still won
        # realised / predicted time of packed passes (row_sizes), from the padded passes' until measured
        self.scale.setdefault("packed", self.scale["tree"])
        # realised / predicted time of a declined draft's iteration (drafted, found wanting, a plain step
        # taken), relative to a plain step's as a tree's is: learned into the plain scale, what drafting
        # took beyond its prediction had made plain steps look dearer, and drafting look cheaper
        self.scale.setdefault("declined", 1.0)
        # the share of drafts (probes and watched ones as the choice would have judged them) verified
        # rather than found wanting. Carried over calls as
        # the rates are: begun whole at each call, it said 0.68 on average where drafting was chosen,
        # and 0.47 of those drafts were verified (compiled, batch 2, STAND deterministic: drafting
        # was chosen where it lost)
        self.scale.setdefault("verified", 1.0)
        self.scale.setdefault("plain_weighed", 0)  # plain steps that taught the plain scale (_check_profile)
        self.scale.setdefault("forgotten", False)  # whether the profile was dropped from the cache file
        self.depth = min(depth, PathRates.DEPTH)
        top = max(profile.nodes) if profile.nodes else 2
        self.fixed = sizes is not None
        # Fixed sizes (compiled passes, CUDA graphs) keep one plan for good: the prior's, which the
        # cost profile compiled and captured, whatever rates an earlier call of the process learned
        # (a plan from those would be new shapes, compiled again inside decoding).
        self._order = (plan_shape(self.rates, top, chain, self.depth) if sizes is None
                       else _prior(max(sizes), chain, self.depth))
        limit = min(top, self._order.n)
        self.sizes = tuple(sorted(s for s in (sizes or LADDER) if s <= limit))
        self._size_array = np.array(self.sizes, dtype=np.int64)
        if not fills_shapes:
            self._order = None
        self.max_nodes = max(self.sizes, default=1)
        # the target's part of an iteration of m nodes (inf: a size not allowed)
        self.cost = _iteration_by_size(profile, self.max_nodes, self.sizes if self.fixed else None)
        self.margin = 1.0 if adaptive else self.MARGIN
        self.draft_cost = self._drafting(self._order)
        if self._order is not None and profile.depths and not self.fixed:
            self._set_plan(self._plan_for(self.rates))
        self.chosen: Counter = Counter()
        self._since_plan, self._probing = 0, False
        self._stale = False  # whether the rates or cost scales moved since the last re-plan
        # An adaptive choice goes on where the last call of its profile left off (probes stay spaced);
        # a seeded one keeps its ledger to itself, so that its choices follow the seed alone.
        if not adaptive:
            self.scale.update(bank=0.0, plain_run=0)
        # Each call explores at the whole shares again (BACKOFF) where the last one explored drafts
        # enough to back off on its own: a new call is new text, which the probes and watched drafts that lost
        # on the last ones' say little about. Carried on, the halved shares had left n-gram decoding at
        # batch 2 plain through whole benchmark runs (eager, 2-core EPYC, fresh processes: 0.99x-1.11x,
        # mean 1.04x, in six; whole at each call 1.01x-1.22x, mean 1.11x, in eight). Where a call
        # explores one draft or none (a drafter model's probes, each paying its catch-up: one every three
        # or four calls), the share could never halve within a call and probes took the whole of it:
        # there the backoff carries over; for a choice that watches drafts, one halving short of the
        # least at most, where a call of 128 tokens still watches a draft or two: carried whole over
        # calls too short to explore (a benchmark's warm-up calls of 8 tokens), its shares had reached
        # their least, where such a call explores nothing, and stayed there (STAND at batch 2, eager:
        # 15 trees and 5 watched drafts in 12 calls, tau 1.05, 0.97x of plain decoding's pace, where
        # other processes found tau 2.1 and 1.03x-1.07x). Whole at every call, such a choice explored
        # twice as much where nothing paid (sampled, STAND deterministic: 58 trees and 48 watched
        # drafts in 48 calls against 34 and 20). Over the demo's calls (one of 8 tokens, then eight of
        # 128; six processes each), mean tau: n-gram 2.13 carried whole, 2.45 capped, 2.63 whole at
        # every call; STAND deterministic 2.04, 2.22, 1.66. The probes' share, though, starts whole only
        # where one of the last call's probes paid: where none did (sampled text the drafter cannot
        # follow), whole at each call they had cost about a probe a call of 128 tokens, each some 1.3
        # plain steps lost (n-gram at temperature 1.0, batch 1: 0.965x of plain decoding's pace against
        # 0.984x carried, benchmarks/choice_ab.py, three processes; greedy, where some probe of a call
        # pays, -1.3% to +2.7%: the noise). (Carried wherever the probes' average lost, or at the least share for
        # every choice that watches, greedy batch 2 lost 5-17%: there probes pay where the choice
        # declines trees.)
        # After IDLE_CALLS calls in a row that found nothing, a call starts at the least shares (those
        # that auto_tree lets rest, one in IDLE_WAKE, explore at all), until a call finds a draft that pays
        # (``found``, ``paid``).
        if adaptive:
            self.scale["idle_calls"] = self._idle_calls(self.scale)
        idle = adaptive and self.scale["idle_calls"] >= self.IDLE_CALLS
        if not adaptive:
            self.scale.update(losing=0, watch_idle=0)
        elif idle:
            self.scale.update(losing=self.BACKOFF, watch_idle=self.BACKOFF)
        elif self.scale.get("explored", self.AGAIN) >= self.AGAIN:
            self.scale["watch_idle"] = 0
            if self.scale.get("paid", True):
                self.scale["losing"] = 0
        elif self.watching:
            top = self.BACKOFF - 1
            self.scale.update(losing=min(self.scale["losing"], top), watch_idle=min(self.scale["watch_idle"], top))
        self.scale["explored"] = 0  # the drafts this call explored: probes and watched drafts
        self.scale["paid"] = False  # whether a probe of this call paid
        self.scale["found"] = False  # whether a watched draft of this call would have paid, or a tree was kept
        self.scale["steps"] = 0  # this call's steps, plain runs' included
        self._plain_run = self.scale["plain_run"]
        self._closed = False  # whether a seeded choice's call has too few steps left for a probe to pay (plan)
        self._probe_loss = 0.0  # what the next probe is predicted to lose, its drafter's catch-up aside
        self._catch_due = 0.0  # the catch-up the drafter last said a probe would need (ms, seeded)
        self._charge = 0.0  # what this step's probe is charged where it is not measured
        # The last tree recorded (its kind, predicted ms and, for a measured probe, the weight of its loss
        # in the probes' average, else None) while AFTERMATH plain steps after it are not yet recorded.
        self._after: tuple[str, float, float | None] | None = None
        self._after_left = 0
        self._promised: tuple[float, np.ndarray] | None = None  # this step's tree: the drafts promised, the rows
        self._predicted = ("plain", self.cost[1])  # this step's kind and predicted milliseconds
        self._iterations = 0  # recorded in this call
        self._relearning = False  # whether plain steps are being weighed one after another (record)
        self._narrowed = False  # whether rows left the batch this call, its scales since then its own (narrowed)
        self._drafted = 0  # nodes drafted this step (0: none)
        self._strong_only = False  # whether drafts weak throughout lose (_pick_sizes)
        self._pick, self._probe_size = self._pick_sizes()

    @classmethod
    def _idle_calls(cls, scale: dict) -> int:
        """The calls in a row that found no draft that paid (IDLE_CALLS) as a call of the choices sharing
        ``scale`` begins: 0 where the last one found one, one more where it did not in FIRST_WATCH steps
        or more."""
        if scale.get("paid", True) or scale.get("found", True):
            return 0
        return scale.get("idle_calls", 0) + (scale.get("steps", 0) >= cls.FIRST_WATCH)

    @classmethod
    def rests(cls, scale: dict) -> bool:
        """Whether a call of the adaptive choices sharing ``scale`` rests: decodes plainly, as
        ``method="autoregressive"`` does, its drafter neither asked nor shown a token and no choice made
        (so nothing of ``scale`` moves but the count of idle calls begun). Where IDLE_CALLS calls in a row
        found no draft that paid, all but one call in IDLE_WAKE rest, and one in twice as many after each exploring
        call that again found none (up to IDLE_WAKE_MOST); the one that does not explores (at the least
        shares, its first watch kept) and, finding a draft that pays, ends the rest. Exploring at the
        least shares, such calls had each still spent about three plain steps' time beyond plain decoding's
        (the choice's setup, its first plan, a probe now and then; n-gram at temperature 1.0, batch 1,
        2-core Zen 5 EPYC), where the text had paid no draft for several calls."""
        idle = cls._idle_calls(scale)
        if idle < cls.IDLE_CALLS:
            return False
        wake = min(cls.IDLE_WAKE << (idle - cls.IDLE_CALLS), cls.IDLE_WAKE_MOST)
        scale["quiet"] = (scale.get("quiet", 0) + 1) % wake  # (idle calls begun)
        return scale["quiet"] != 0

    @property
    def strong_only(self) -> bool:
        """Whether the loop asks the drafter for a draft with a strong node, not just any
        (:meth:`~stree.drafters.base.Drafter.can_draft_strong`): where drafts weak throughout lose, but
        not for a probe, which verifies what there is to learn from (a probe waiting for a strong draft
        kept every step asking, sampled at temperature 1.0 where none came)."""
        return self._strong_only and not self._probing

    @property
    def row_rates(self) -> RowRates:
        """This call's rows' own rates (:class:`~stree.decoding.acceptance.RowRates`), made where first
        asked: a call whose steps all stay plain never asks."""
        if self._row_rates is None:
            self._row_rates = RowRates(self.rates.decay)
        return self._row_rates

    # -- before drafting ----------------------------------------------------------------------
    def prefix(self, m: int) -> TreeShape:
        """The first ``m`` nodes of the current plan."""
        return self._order.prefix(m)

    def _best_size(self, order: TreeShape, draft_cost: np.ndarray, hazard: np.ndarray,
                   weak: bool = False) -> tuple[int, float, float]:
        """The prefix of ``order`` with the most expected tokens per millisecond: its size, that
        rate and its expected tokens; ``weak``: every node priced as a weak one."""
        made = hazard if hazard.base is None else hazard.base  # (a focus row's hazards: a view of the kept rows')
        if self._memo is None or self._memo[0] is not made:
            self._memo = _EXPECTED[self.rates] = (made, {})
        memo = self._memo[1]
        expected = memo.get((order, weak))
        if expected is None:
            expected = memo[order, weak] = expected_accepted(*shape_structure(order),
                                                             weak_class(hazard) if weak else pooled(hazard))
        best, rate, gain = best_size(expected, self.gain_scale(), self._size_array, self.cost, draft_cost,
                                     self._scaled("tree"), order.n)
        return int(best), rate, gain

    def _drafting(self, order: TreeShape | None) -> np.ndarray:
        """Milliseconds of drafting every prefix m of ``order`` (by its nodes, and for a drafter
        model by its depth too: :meth:`~stree.decoding.cost.CostProfile.drafting_ms`)."""
        if order is None or not self.profile.depths:
            return _drafting_by_size(self.profile, self.max_nodes)
        return _drafting_by_depth(self.profile, order, self.max_nodes)

    def _plan_for(self, rates: PathRates) -> TreeShape:
        """The plan under ``rates``: the likeliest nodes, best first; for a drafter model, whose
        drafting costs a step per level, the best of such plans cut at several depths (a deep
        chain of likely nodes can cost more to draft than a bushier tree of fewer levels)."""
        top = self.max_nodes
        if not self.profile.depths or self.fixed:
            return plan_shape(rates, top, self.chain, self.depth)
        # (a focus row's plan weighs that row's own rates too: made afresh)
        made = (rates.version, top, self.chain, self.depth) if self._focus is None else None
        hit = _PLANNED.get(rates)
        if made is not None and hit is not None and hit[0] == made and hit[1] is self.profile:
            return hit[2]
        hazard, best = self._hazard(rates), None
        for cap in sorted({c for c in DEPTH_CAPS if c < self.depth} | {self.depth}):
            order = plan_shape(rates, top, self.chain, cap)
            if order.n < 2:
                continue
            rate = self._best_size(order, self._drafting(order), hazard)[1]
            if best is None or rate > best[0] * (1.0 + 1e-9):
                best = (rate, order)
        order = best[1] if best is not None else plan_shape(rates, top, self.chain, self.depth)
        if made is not None:
            _PLANNED[rates] = (made, self.profile, order)
        return order

    def _hazard(self, rates: PathRates | None = None) -> np.ndarray:
        """The hazards the choice weighs a tree by: the batch's, or the focus row's own once
        :meth:`choose` has named it (the batch decodes until that row is done)."""
        h = (rates or self.rates).hazard()
        return h if self._focus is None else self.row_rates.hazard(np.array([self._focus]), h)[0]

    def _set_plan(self, order: TreeShape) -> None:
        self._order, self.draft_cost = order, self._drafting(order)

    def _scaled(self, kind: str) -> float:
        """Realised / predicted time of an iteration of ``kind``: a plain step's as learned; a
        tree's (or packed pass's) is its own scale relative to the plain step's. Whatever slows
        the whole machine (another process, a slower clock) is learned from the plain steps,
        the most frequent, and prices trees too: learned apart, a slowdown had made plain steps
        dear and trees, not drafted meanwhile, cheap, and trees then ran where they lost."""
        return self.scale["plain"] if kind == "plain" else self.scale["plain"] * self.scale[kind]

    def _pick_sizes(self) -> tuple[int, int]:
        """The size to draft before drafting (1: a plain step), and the best size of a draft
        whatever a plain step is worth (what a probe drafts): by expected tokens per millisecond
        under the current rates and costs (see :meth:`_worth_drafting`). Also what the next probe
        is expected to lose against plain steps (the ledger waits for it)."""
        order = self._order
        if order is None or not self.sizes:  # no tree fits: plain steps only
            return 1, 1
        hazard = self._hazard()
        best, _, self._gain = self._best_size(order, self.draft_cost, hazard)
        tree = self._scaled("tree")
        self._tree_ms, self._draft_ms = self.cost[best] * tree, self.draft_cost[best] * tree
        self._declined_ms = (self.draft_cost[best] + self.cost[1]) * self._scaled("declined")
        plain = self.cost[1] * self.scale["plain"]
        # Drafts weak throughout (a drafter's nodes below a weak one are weak: the n-gram drafter's) at
        # their best size, verified whatever they are worth, against a plain step: where they lose, the
        # drafter is asked for a draft with a strong node (Drafter.can_draft_strong), and one it has
        # nothing but weak drafts for is not drafted. (n-gram, batch 1, greedy, 2-core Zen 5 EPYC: trees
        # rooted in weak nodes lost five times in six where verified, and most such drafts,
        # each some 1.3 plain steps' time beyond its step, were declined after drafting; docs/benchmarks.md.)
        self._strong_only = self._best_size(order, self.draft_cost, hazard, weak=True)[1] * plain <= self.margin
        # What a probe is predicted to lose against plain steps: its time beyond theirs for the tokens
        # it is expected to emit. A seeded choice prices the worst case, one token from a probe (with
        # the margin): its rates start from the prior each call, which may promise what this text
        # never gives.
        expected = self._gain if self.adaptive else 1.0
        self._probe_loss = (self._tree_ms + self._draft_ms) * self.margin - expected * plain
        return (best if self._worth_drafting() else 1), best

    def _worth_drafting(self) -> bool:
        """Whether drafting the best size beats a plain step, counting that only a share ``s`` of
        drafts is verified (the others, found wanting after drafting, cost what such iterations
        take, Q: their drafting and a plain step, at the scale learned for them): (s E + 1 - s) /
        (s (D + C) + (1 - s) Q) against ``margin`` / P."""
        s, plain = self.scale["verified"], self.cost[1] * self.scale["plain"]
        rate = (s * self._gain + 1.0 - s) / (s * (self._draft_ms + self._tree_ms) + (1.0 - s) * self._declined_ms)
        return rate > self.margin / plain

    def plan(self, behind=None, left=None):
        """The shape to draft this step, None for a plain step without drafting, or "own" (a
        drafter that drafts its own trees: draft, then :meth:`choose`). After at least ``PROBE``
        plain steps in a row (chosen before or after drafting), once the ledger holds what a probe
        is expected to lose, the step is a probe: drafted, and verified whatever its worth.
        ``behind``: a callable saying how many tokens the drafter must read before it drafts
        (asked only when the ledger holds the rest of a probe's price): where the choice does not
        measure its probes, their price includes that catch-up, at the profile's ``catch_ms`` a
        token. ``left``: a callable saying how many steps the call may still take (its rows' most
        tokens left), asked by a seeded choice before a probe: its rates and ledger are its call's
        own, so what a probe teaches it pays only in the steps after it in that call, and it probes
        only where at least as many are left as the plain steps that bought the probe. (Probing to
        the end, seeded sampling with STAND's random drafts at temperature 0.6 probed one to three
        times in each call of 128 tokens, about a hundred plain steps in, each probe taking about
        four plain steps' time for a lesson the call had few steps left to use.)"""
        self._promised = None
        if self._plain_run >= self.PROBE and not self.adaptive and left is not None:
            # (the steps left only fall and the plain steps only grow until a tree: no probe is due
            # again in this call unless one is taken for its worth)
            self._closed = self._closed or left() < self._plain_run
        # (a plain step to weigh comes first: probes are priced against plain steps)
        refresh = self.adaptive and self.scale["plain_age"] >= self.PLAIN_EVERY and self.fills_shapes
        self._probing = (self._plain_run >= self.PROBE and not self._closed and not refresh
                         and self._probe_paid(behind))
        if self._probing:
            self._plain_run, self._catch_due = 0, 0.0
        self._predicted, self._drafted = ("plain", self.cost[1]), 0
        if not self.fills_shapes:
            return "own"
        if (refresh or self._pick == 1 or not self._worth_drafting()) and (not self._probing or not self.sizes):
            self._plain_run += 1
            return None
        self._drafted = self._pick if self._pick > 1 else self._probe_size
        return self.prefix(self._drafted)

    def undrafted(self) -> None:
        """After :meth:`plan` named a shape: the drafter knew before drafting that it had nothing
        to draft (:meth:`~stree.drafters.base.Drafter.can_draft`), and the step is a plain one. It
        counts as a draft found wanting, as an empty draft does (the share of drafts verified and
        the price of such iterations, the ``declined`` scale, are learned over both, drafted or
        not: counted apart, the choice drafted where it had not and lost a few points at batch
        1), less the drafting. A probe that was due is no probe: it waits for the next step, its
        price still in the ledger (a probe without a draft would teach the ledger that probes
        cost nothing)."""
        if self._probing:
            self._probing, self._plain_run = False, self.PROBE + 1
            self._predicted, self._drafted = ("plain", self.cost[1]), 0
            return
        self._predicted = ("declined", self.draft_cost[min(self._drafted, self.max_nodes)] + self.cost[1])
        self._learn_kept(False)
        self._undrafted += 1
        self._just_undrafted = True

    def plain_ahead(self, pending: int = 0) -> int:
        """After a plain step's :meth:`record`: how many of the next steps are plain whatever they
        take (no probe falls due before they end; what the step taught is re-planned first, and
        nothing else moves the choice meanwhile). The loop may run them without asking
        (:meth:`plain_steps` then records them). ``pending``: the plain steps until a watched draft
        the loop holds is settled (0: none), before which it drafts no other."""
        if not self.fills_shapes:
            return 0
        # Trees winning, an eager choice re-weighs its sizes every REPLAN steps (record), not after
        # each tree: its choice after drafting weighs each draft under the rates of the moment anyway,
        # and re-weighing took about a fiftieth of a tree's iteration. (Against plain decoding, the two
        # rules taking turns in each of five to eight processes on the 2-core EPYC: batch 2 n-gram
        # +2.4% and +3.0%, STAND +2.0% and +1.2%, STAND deterministic -0.5%; batch 1 -0.6% to +2.5%;
        # mean +1.1% over 13 such runs.) Fixed sizes (compiled passes) still re-weigh after each tree:
        # without it compiled STAND at batch 1 lost 3.0% and 1.7%.
        if self._stale and (self._pick == 1 or self.fixed):
            self._replan(None)
        just, self._just_undrafted = self._just_undrafted, False
        if self._pick > 1 and self._worth_drafting():
            # Where the drafter had nothing (or drafted nothing kept: _found_wanting) for WAIT_AFTER steps in a
            # row, a run of plain steps (1, 2, 4, at most WAIT_MOST) before it is asked again: each step asked
            # alone (its plan, the drafter's answer and its
            # reading of the token, the choice learning the step) took half a step's time more than a run's
            # (the drafter is asked again at the run's end: the wait follows a step it had nothing for alone)
            wait = self._undrafted - self.WAIT_AFTER
            return 0 if wait < 0 or not just else min(1 << wait, self.WAIT_MOST)
        short = self._probe_price() - self.scale["bank"]
        if self._closed or (short > 0.0 and self._deposit() <= 0.0):
            ahead = self.NEVER  # (no probe falls due: PROBE_SHARE 0, or a seeded call's last steps)
        else:
            buying = math.ceil(short / self._deposit() - 1e-9) if short > 0.0 else 0
            ahead = max(0, self.PROBE - self._plain_run, buying)
        if self.watching and self._probe_size > 1:
            # The run ends where the next watched draft is due, and not before the one pending is settled:
            # the loop drafts no other meanwhile. (Ended where one was due alone, runs of one step followed
            # each other until the pending one was settled, each run's end taking half a step's time more:
            # compiled, batch 2, STAND, where watches paid every few steps.)
            ahead = min(ahead, max(self._watch_gap() - self._unwatched, pending, 1))
        return ahead

    # -- watched drafts ----------------------------------------------------------------------------
    def _watch_gap(self) -> int:
        """Plain steps between watched drafts: at least ``WATCH_EVERY``, and so many that watching
        them costs at most ``WATCH_SHARE`` of the plain steps' time: what watches take by the clock
        (:meth:`watched`, learned from what drafting one is predicted to), or, before any, that
        prediction. (Learning from
        one, re-planning included, took longer than drafting it: priced at its drafting alone,
        watches took 4% of a compiled batch-2 loop's plain steps, not 1%.) The share halves with
        each watched draft in a row after which plain steps still won, down to ``WATCH_SHARE /
        2**BACKOFF``, as the probes' does (and is whole again at the next call): where trees never
        pay (a batch of 8 here), watching them is a loss too. After a watched draft that would have
        paid, verified (its tokens against its iteration's price), the next one is due after
        ``WATCH_EVERY`` plain steps, and the share is whole: text where drafts pay
        is found within a call (at the share's pace, a call's one or two watches moved its rates too
        little to leave plain steps: STAND deterministic, batch 1, decoded four calls of a fresh process
        plain whose text later calls drafted at 2.7-5.8 tokens a step); where none would have paid,
        watches keep the share's pace. A call's first is due after ``FIRST_WATCH`` plain steps at
        most."""
        if self._paid_watch:
            return self.WATCH_EVERY
        watching = max(self.draft_cost[self._watch_size()] * self._scaled("tree"), self.scale["watch_ms"])
        share = self.WATCH_SHARE * 0.5 ** self.scale["watch_idle"]
        gap = max(self.WATCH_EVERY, math.ceil(watching / (share * self.cost[1] * self.scale["plain"])))
        return min(gap, self.FIRST_WATCH) if self._first_watch else gap

    def watch_shape(self) -> TreeShape | None:
        """After a plain step's :meth:`record` (or a plain run's :meth:`plain_steps`): the shape to
        draft now and watch (:meth:`watched`), or None where no watched draft is due, or where the
        next step drafts anyway (:meth:`wants_trees`: the watched draft's lesson would come after
        that tree's, for its drafting's price; where a watched draft that paid ended a run, the next
        one was drafted at once, and the tree after it settled it with nothing seen)."""
        if (not self.watching or self._probe_size < 2 or self._unwatched < self._watch_gap()
                or self.wants_trees()):
            return None
        self._unwatched = 0
        return self.prefix(self._watch_size())

    def _watch_size(self) -> int:
        """A watched draft's nodes: the probe's size, or more, up to ``WATCH_NODES`` where the sizes allow."""
        deep = max((m for m in self.sizes if m <= self.WATCH_NODES), default=1)
        return max(self._probe_size, deep)

    def _prefix_paid(self, parents, tokens, valid, emitted, seen, served) -> bool:
        """Whether a prefix of a watched draft of one of the sizes would have paid, verified: what it would
        have brought the rows ``served`` against its iteration's price."""
        plain, tree = self.cost[1] * self.scale["plain"], self._scaled("tree")
        index = np.arange(valid.shape[1])
        for m in self.sizes:
            if m > valid.shape[1]:
                break
            counts = walk(parents, tokens, valid & (index < m), emitted, seen)
            if rows_worth(counts[served].tolist()) * plain > (self.cost[m] + self.draft_cost[m]) * tree:
                return True
        return False

    def watched(self, draft: TokenTree, after: list[np.ndarray], served: np.ndarray, ids: np.ndarray,
                drafting_ms: float | None = None) -> None:
        """Learn from a draft made for the rows ``ids`` (batch ids) and never verified: ``after[b]``
        the tokens row b emitted since (plain steps: greedy, or drawn at keyed draws, what verifying
        the draft would have emitted too). Each row's accepted path is read off them as verification would have found
        it, as far as they reach: nodes they do not reach below are left out (a path matching all
        of them is cut, the last one standing for the bonus). The rates learn it as a verified
        step, and what it brought the rows ``served`` (the mask of rows the choice served when it
        was drafted) calibrates the promises (:meth:`gain_scale`), and whether the choice would
        have kept it for them the share of drafts kept; the sizes are then weighed again.
        ``drafting_ms``: what drafting it took by the clock; with this call's own time, what
        the next watches are spaced by (:meth:`_watch_gap`)."""
        began = time.perf_counter()
        seen = np.array([len(a) for a in after], dtype=np.int64)
        rows = np.flatnonzero(seen > 0)
        if not len(rows):
            return
        self._first_watch = False
        parents, rank, depth = structure(draft)
        drafted, weak = valid_mask(draft), weak_mask(draft)
        if not drafted[:, 1:].any():  # (the drafter had nothing: no lesson about its drafts, as for the ledger)
            return
        # (a row that emitted nothing keeps its root)
        valid = drafted & (depth < np.maximum(seen, 1)[:, None])
        emitted = np.zeros((len(after), int(seen.max())), dtype=np.int64)
        for b in rows:
            emitted[b, : seen[b]] = after[b]
        tokens = np.ascontiguousarray(draft.arrays()[0])
        counts = walk(parents, tokens, valid, emitted, seen)
        served = served & (seen > 0)
        if served.any():
            hazard = self.row_rates.hazard(ids, self.rates.hazard())
            said = rows_worth(chances(parents, rank, depth, valid, weak, hazard)[served, 1:].sum(1).tolist())
            brought = rows_worth(counts[served].tolist())
            self._learn_gain(brought - 1.0, said)
            # whether the choice would have kept it teaches the share of drafts kept: learned from chosen
            # drafts alone, a share that had fallen kept the choice from drafting, and so from learning
            # it again (compiled, batch 1, STAND: +0.18 over plain decoding, paired, docs/benchmarks.md)
            m = weigh(parents, rank, depth, drafted, weak, hazard, served, min(draft.n, self.max_nodes),
                      *self._weighing(), True, self.gain_scale())[0]
            self._learn_kept(m > 1)
            # (whether it paid in hindsight: what a prefix of it brought the rows served, against its price)
            self._paid_watch = self._prefix_paid(parents, tokens, valid, emitted, seen, served)
        else:
            self._paid_watch = False
        cut = remade(draft, valid=torch.from_numpy(valid), weak=draft.weak)
        self.rates.record(cut, emitted, counts, rows, self.row_rates, ids)
        self._stale = True
        self._replan(cut)
        useful = self._paid_watch or self.wants_trees()
        self.scale["watch_idle"] = 0 if useful else min(self.scale["watch_idle"] + 1, self.BACKOFF)
        # (a call found drafts that pay where the choice came to want trees: watched drafts that paid in
        # hindsight while it went on declining to draft had kept every call from counting as idle, at batch 2
        # on a 2-core Zen 5 EPYC, where a watched draft took some three plain steps' time)
        self.scale["found"] = self.scale["found"] or self.wants_trees()
        self.scale["explored"] += 1
        if drafting_ms is not None:
            # (from the predicted drafting, not from the first watch's time, which then spaced the next
            # ones: a first watch dearer than later ones (first uses), the share halved by each watch after
            # which plain steps still won, and a process watched a draft once in about 200 plain steps and
            # stayed plain where trees paid. Begun at the drafting alone, below what a watch takes with its
            # learning, watches come more often in a process's first calls, while the cost converges:
            # eager, batch 1, 2-core EPYC, six processes each, STAND's gain over plain decoding 0.97-1.32
            # (mean 1.05) before, 1.29-1.43 (mean 1.35) after, n-gram's 1.01-1.35 (mean 1.14), 1.12-1.50
            # (mean 1.28))
            took = drafting_ms + (time.perf_counter() - began) * 1e3
            known = self.scale["watch_ms"] or self.draft_cost[self._probe_size] * self._scaled("tree")
            self.scale["watch_ms"] = known + self.ADAPT * (took - known)

    def wants_trees(self) -> bool:
        """Whether the size to draft is a tree that beats a plain step (a plain run may end early)."""
        return self._pick > 1 and self._worth_drafting()

    def plain_steps(self, steps: int, times_ms=None) -> None:
        """:meth:`plan` and :meth:`record` of ``steps`` plain steps that :meth:`plain_ahead`
        promised, at once; ``times_ms``: each one's milliseconds (None: not timed). Those within
        ``AFTERMATH`` steps of the last tree are the tree's (:meth:`_aftermath`); from the others an
        adaptive choice learns what a plain step costs, as if from each of them: where plain steps
        win they run in such runs, so a run's step is the price a tree must beat. (Learning from the
        few plain steps the choice weighs alone, most of them after a probe and left out, left a
        profile's plain step a quarter too dear for good: a 1-layer drafter's trees at batch 2 then
        ran where they lost.)"""
        self._probing, self._predicted, self._drafted = False, ("plain", self.cost[1]), 0
        if self.adaptive and times_ms is not None and steps > 0:
            head = min(self._after_left, len(times_ms))
            for ms in times_ms[:head]:
                self._aftermath(ms)
            rest = times_ms[head:]
            if len(rest) and sum(rest) > 0:
                ratio = self._clipped("plain", sum(rest) / len(rest) / self.cost[1])
                self.scale["plain"] += (1.0 - (1.0 - self.ADAPT) ** len(rest)) * (ratio - self.scale["plain"])
                self.scale["plain_age"] = 0
                self._stale = True
                self._check_profile(len(rest))
        self._after_left = max(self._after_left - steps, 0)
        self._plain_run += steps
        self.scale["steps"] += steps
        self._unwatched += steps
        self.chosen[1] += steps
        self._deposit_plain(steps)
        self._since_plan = (self._since_plan + steps) % self.REPLAN  # (nothing is stale: re-plans would do nothing)
        self.scale["plain_run"] = self._plain_run

    def _clipped(self, kind: str, ratio: float) -> float:
        """An iteration's realised / predicted time, within a factor ``CLIP`` of what ``kind``'s scale says."""
        return min(max(ratio, self.scale[kind] / self.CLIP), self.scale[kind] * self.CLIP)

    def narrowed(self) -> None:
        """Rows left the batch for the rest of the call (an eager loop's finished rows leave its
        device batch): its iterations no longer cost what the profile's batch size does. They are
        learned by the clock from here on all the same, into scales of this call alone, which later
        calls of the profile do not continue (they decode its whole batch), and which do not judge the
        profile (:meth:`_check_profile`). (Left untimed, they taught nothing, and a probe among them
        was charged what the profile predicts for the whole batch: where a batch of two drifted
        apart under trees, n-gram, eager, its last row decoded alone with a probe every few plain
        steps, which the ledger, then banking probes' gains whole, let through for the rest of the
        call; see :meth:`_withdraw`.)"""
        if not self._narrowed:
            self._narrowed = True
            self.scale = dict(self.scale)

    def _check_profile(self, steps: int) -> None:
        """After ``steps`` plain steps taught the plain scale: drop a profile that prices them at more
        than ``FORGET`` times their time from the cache file, once (see ``STALE_AFTER``)."""
        if self._narrowed:
            return
        self.scale["plain_weighed"] += steps
        if (self.scale["plain_weighed"] >= self.STALE_AFTER and self.scale["plain"] * self.FORGET < 1.0
                and not self.scale["forgotten"]):
            forget(self.profile)
            self.scale["forgotten"] = True

    # -- the probes' ledger ---------------------------------------------------------------------
    def _deposit(self) -> float:
        """What one plain step puts in the ledger: ``PROBE_SHARE`` of its time, halved as many
        times as probes said (``BACKOFF``); nothing where the choice takes no probes."""
        if not self.probes:
            return 0.0
        share = self.PROBE_SHARE * 0.5 ** self.scale["losing"]
        return share * self.cost[1] * self.scale["plain"]

    def _deposit_plain(self, steps: int) -> None:
        """``steps`` plain steps' deposits. The ledger holds at most the next probe's price (and one
        deposit): a long run of plain steps buys one probe at its end, not a burst of them."""
        self._withdraw(-steps * self._deposit())

    def _top(self) -> float:
        """The most the ledger holds: the next probe's price and one deposit."""
        return max(self._probe_price(), 0.0) + self._deposit()

    def _withdraw(self, lost: float) -> None:
        """Take what a probe (or a plain step in its wake) ``lost`` against plain steps out of the
        ledger; what one gained (``lost`` below zero, as plain steps' deposits come in too) goes in,
        but the ledger then holds no more than its top (:meth:`_top`). (Banked whole, the gains of
        probes where trees paid had built up tens of milliseconds over a process's calls, carried
        on; text where they lost then drew a
        probe every ``PROBE`` plain steps until that was spent: n-gram at batch 2, eager, 2-core
        Zen 5 EPYC, 0.76-0.88 of plain decoding's pace in such calls, whole processes at
        0.86-0.90.)"""
        was = self.scale["bank"]
        self.scale["bank"] = was - lost if lost > 0.0 else min(was - lost, max(self._top(), was))

    def _probe_price(self) -> float:
        """What the next probe is expected to lose: what an adaptive choice's probes lost by the
        clock, once it has measured one; else the predicted loss with the drafter's catch-up it
        was last told of."""
        if self.adaptive and self.scale["probes"]:
            return self.scale["probe_loss"]
        return self._probe_loss + self._catch_due

    def _probe_paid(self, behind) -> bool:
        """Whether the ledger holds the next probe's price. A choice that does not measure its
        probes asks the drafter how far behind it is once the rest of the price is there, and
        prices the catch-up in (asked again once the ledger holds that too: the drafter falls
        further behind meanwhile)."""
        bank = self.scale["bank"]
        if bank < self._probe_price():
            return False
        catch = self.profile.catch_ms
        if behind is None or catch == 0.0 or (self.adaptive and self.scale["probes"]):
            self._charge = self._probe_price()
            return True
        self._catch_due = catch * behind()
        self._charge = self._probe_price()
        return bank >= self._charge

    # -- after drafting -------------------------------------------------------------------------
    def choose(self, draft: TokenTree, active: np.ndarray, ids: np.ndarray | None = None) -> TokenTree | None:
        """``draft`` (CPU, one row per batch row; ``active`` marks the rows that count) cut to its
        best prefix, or None where a plain step is better or nothing was drafted. ``ids``: the
        rows' ids in the batch, whose own acceptance (:class:`RowRates`) then prices their nodes."""
        self._drafted = self._drafted or draft.n
        drafting = self.draft_cost[min(self._drafted, self.max_nodes)]
        self._predicted = ("declined", drafting + self.cost[1])  # (a tree's, below, where one is kept)
        n = min(draft.n, self.max_nodes)
        parents, rank, depth = structure(draft)
        hazard = self.rates.hazard()
        hazard = hazard[None] if ids is None else self.row_rates.hazard(ids, hazard)
        m, focus, promised, v, raw, cost = weigh(parents, rank, depth, valid_mask(draft), weak_mask(draft), hazard,
                                                 active, n, *self._weighing(), not self._probing, self.gain_scale())
        if m == 0:  # (no active row drafted anything)
            self._learn_kept(False)
            self._found_wanting()
            return None
        if ids is not None:  # the row the choice before drafting weighs from now on: the one gaining least
            self._focus = int(ids[focus])
        sizes = self._row_sizes(v, active, cost, m) if ids is not None and self.per_row else None
        # A probe is verified whatever it is worth; whether the choice would have kept it teaches the
        # share of drafts kept, as a watched draft's does. (Probes left out, a share that undrafted
        # steps at a call's start had taken to 0.08 stayed there while probes accepted 8 and 14 of 14
        # nodes: the choice stayed plain for most of the call, STAND deterministic, batch 1.)
        worth = m > 1 if not self._probing else best_prefix(v, active, cost, True) > 1
        self._learn_kept(worth or sizes is not None)
        if sizes is not None:
            self._undrafted = 0
            total = int(sizes.sum())
            kept = np.arange(1, n)[None] < sizes[:, None]
            self._promised = (rows_worth((raw[:, 1:n] * kept)[active].sum(1).tolist()), active.copy())
            self._predicted = ("packed", drafting + float(self._packed_ms(total, len(sizes))))
            return cut_rows(draft, sizes)
        if m == 1:
            self._plain_run += 1
            self._found_wanting()
            return None
        self._undrafted = 0
        self._promised = (promised, active.copy())
        self._predicted = ("tree", drafting + self.cost[m])
        return draft if m == draft.n else draft.prefix(m)

    def _found_wanting(self) -> None:
        """A draft declined after drafting counts, for the runs of plain steps before the drafter is
        asked again (:meth:`plain_ahead`, ``WAIT_AFTER``), as a step the drafter had nothing for
        (:meth:`undrafted`). (Counted apart, drafts found wanting were drafted at every step through
        text the drafter could not follow, each some half a plain step's time: n-gram at batch 1,
        eager, 2-core Zen 5 EPYC, 13-22 a call of 128 tokens on such prompts; waiting, 1.04-1.06 ->
        1.14-1.19 of plain decoding's pace, docs/benchmarks.md.) A probe that drafted nothing starts the count
        again, as a verified one does."""
        if self._probing:
            self._undrafted = 0
            return
        self._undrafted += 1
        self._just_undrafted = True

    def _weighing(self) -> tuple[np.ndarray, float, float]:
        """What a drafted tree is weighed against (its drafting already spent), as :func:`weigh`
        takes it: each prefix's iteration (``cost``) at the trees' scale, and at 1 a plain
        step's, over the margin."""
        return self.cost, self._scaled("tree"), self.cost[1] * self.scale["plain"] / self.margin

    def _packed_ms(self, total, rows: int):
        """The target's part of an iteration scoring ``total`` nodes (an int or an array) of
        ``rows`` trees packed: the padded pass's at ``total / rows`` nodes a row (the products see
        the same rows), at least a 2-node tree's (a tree pass's own work)."""
        sizes = np.arange(2, self.max_nodes + 1)
        return np.interp(np.maximum(np.asarray(total) / rows, 2.0), sizes, self.cost[2:])

    def _row_sizes(self, v: np.ndarray, active: np.ndarray, cost: np.ndarray, m: int) -> np.ndarray | None:
        """The rows' own prefix sizes (:func:`best_rows`, priced as packed passes) where they beat
        the best prefix ``m`` they all share (or the plain step it stands for), else None."""
        B, n = v.shape
        if B < 2 or not active.any():
            return None
        packed = self._packed_ms(np.arange(B * n + 1), B) * self._scaled("packed")
        sizes, rate = best_rows(v, active, packed)
        if rate <= 0.0 or sizes.min() == sizes.max():  # (the same size for all: the padded pass is that)
            return None
        least = v[active][:, 1:m].sum(1).min() if m > 1 else 0.0
        shared = (1.0 + least) / cost[m] if m > 1 or not self._probing else -1.0
        return sizes if rate > shared * (1.0 + 1e-9) else None

    # The weight of the prior (one accepted draft promised, one brought) in gain_scale, and the fade
    # of the counts per verified tree: recent trees speak, and one tree cannot swing it alone.
    GAIN_PRIOR, GAIN_DECAY = 1.0, 0.95

    def gain_scale(self) -> float:
        """Accepted drafts per accepted draft promised, over the verified trees the choice served
        (faded): what the served rows got against what their rates promised them, each as a tree
        is judged (:func:`~stree.decoding.plans.rows_worth`: of two rows the mean, of more the
        least). Every prediction of a tree's worth is scaled by it."""
        w = self.GAIN_PRIOR
        return (self.scale["gain_got"] + w) / (self.scale["gain_said"] + w)

    def _calibrate(self, counts: np.ndarray) -> float | None:
        """After a verified tree that :meth:`choose` kept: what its served rows got (their accepted
        drafts as a tree is judged, returned; None where it served none)."""
        said, served = self._promised
        self._promised = None
        # (lists: a NumPy reduction right after a model pass costs several times more)
        served, counts = served.tolist(), counts.tolist()
        if len(counts) != len(served) or not any(served):
            return None
        got = rows_worth([c for c, s in zip(counts, served) if s]) - 1.0  # (the bonus is no draft)
        self._learn_gain(got, said)
        return got

    def _learn_gain(self, got: float, said: float) -> None:
        """One tree's accepted drafts ``got`` and promised ``said`` into :meth:`gain_scale`'s counts."""
        self.scale["gain_got"] = self.GAIN_DECAY * self.scale["gain_got"] + got
        self.scale["gain_said"] = self.GAIN_DECAY * self.scale["gain_said"] + said
        self._stale = True

    def _lost_dearly(self, kind: str, predicted: float, emitted: float) -> bool:
        """Whether a tree of ``kind`` predicted (unscaled) at ``predicted`` ms lost more than ``DEAR``
        plain steps' time against plain steps for the ``emitted`` tokens it brought, by the costs
        the choice weighs."""
        plain = self.cost[1] * self.scale["plain"]
        return predicted * self._scaled(kind) - emitted * plain > self.DEAR * plain

    def _learn_kept(self, kept: bool) -> None:
        self.scale["verified"] += self.ADAPT * (kept - self.scale["verified"])

    # -- after the step -------------------------------------------------------------------------
    def record(self, tree: TokenTree | None, tokens: np.ndarray | None = None, counts: np.ndarray | None = None,
               rows: np.ndarray | None = None, elapsed_ms: float | None = None, ids: np.ndarray | None = None) -> None:
        """After a step: ``tree`` the verified draft (None: a plain step) and, for the rows
        ``rows`` of it, the emitted ``tokens``/``counts``; ``elapsed_ms``: the whole iteration;
        ``ids``: the tree rows' ids in the batch (each row's own acceptance is learned too)."""
        self.chosen[1 if tree is None else tree.n] += 1
        kind, predicted = self._predicted
        self._iterations += 1
        self.scale["steps"] += 1
        # The plain steps right after a tree (AFTERMATH) read weights and state it pushed out of the
        # caches: what they take beyond a plain step's is the tree's (a probe's, the ledger's too).
        # Priced by such steps (in a run of trees the only plain steps there are), plain steps looked
        # dearer than a run of them costs, and trees that lost to such a run went on winning; uncharged,
        # trees that alternate with plain steps (compiled, batch 2) looked cheaper than they were.
        # (nor from a shape's first pass in the process, nor the plain steps in its wake: _first_pass)
        first = tree is not None and _first_pass(tree)
        timed = self.adaptive and elapsed_ms is not None and elapsed_ms > 0 and not first
        if tree is None and self._after_left:
            self._after_left -= 1
            if timed:
                self._aftermath(elapsed_ms)
        elif timed and self._iterations > self.SETTLE:
            # clipped: one iteration that compiled or measured something must not price trees out for good
            base = 1.0 if kind == "plain" else self.scale["plain"]  # (a tree's scale is relative: _scaled)
            ratio, was = elapsed_ms / (predicted * base), self.scale[kind]
            self.scale[kind] += self.ADAPT * (self._clipped(kind, ratio) - was)
            self.scale["plain_age"] += 1
            if kind == "plain":
                # A plain step over FORGET times quicker than both its profile and its scale said has the
                # next ones weighed too, until one comes within STALE of the scale (while trees win, one in
                # PLAIN_EVERY is: from a profile measured beside other work, the scale took a thousand
                # steps to come down, and trees ran where they lost meanwhile); and such steps are the
                # profile's error, not the machine's news: the prices the trees (and declined drafts)
                # learned by the clock meanwhile stay as they are (moved with the plain scale, trees priced
                # at a fifth of their time ran on). (Entered against the scale alone, a scale that plain
                # steps weighed alone had raised, their bookkeeping and watched drafts in them, kept
                # raising the trees' prices: STAND at batch 2, eager, lost 5.5% against plain decoding;
                # entered at STALE, where an eager profile's plain step is about 1.5 times a loop's, STAND
                # at batch 1 lost 3-6%.)
                self._relearning = (ratio * STALE < was if self._relearning
                                    else ratio * self.FORGET < min(was, 1.0))
                self.scale["plain_age"] = self.PLAIN_EVERY if self._relearning else 0
                for other in ("tree", "packed", "declined") if self._relearning else ():
                    self.scale[other] *= was / self.scale["plain"]
                self._check_profile(1)
            self._stale = True
        if tree is not None:
            self._after, self._after_left = None if first else (kind, predicted, None), self.AFTERMATH
        self._since_plan += 1
        got = None
        if tree is not None:
            self._stale = True
            if ids is None:
                self.rates.record(tree, tokens, counts, rows)
            else:
                self.rates.record(tree, tokens, counts, rows, self.row_rates, ids)
            if not self._probing:  # speculation won this step: plain steps count again from here
                self._plain_run, self._closed = 0, False
                self.scale["found"] = True
            if self._promised is not None:
                got = self._calibrate(counts[rows])
        if self._probing:
            self._pay_probe(predicted, tree, counts, rows, ids, elapsed_ms, got)
        elif tree is None:
            self._deposit_plain(1)
        if tree is None:
            self._unwatched += 1
        self.scale["plain_run"] = self._plain_run
        if (tree is not None and self._probing) or self._since_plan >= self.REPLAN:
            self._replan(tree)
        elif got is not None and self._lost_dearly(kind, predicted, got + 1.0):
            self._pick, self._probe_size = self._pick_sizes()

    def _pay_probe(self, predicted: float, tree, counts, rows, ids, elapsed_ms: float | None,
                   got: float | None = None) -> None:
        """Take this step's probe out of the ledger: by the clock where the choice is adaptive
        (its time beyond plain steps for the tokens it emitted; a probe whose draft came out empty
        emitted one), else at the price it was let through at. What it lost (by the clock, else by
        the profile's prediction) sets the ledger's pace (``BACKOFF``). The tokens it emitted are
        what the rows it served got as trees are judged (``got``, the accepted drafts
        :meth:`_calibrate` found, plus the bonus): counted for the one row the choice had weighed before
        drafting, at batch 8 a probe that row took whole while another served row took nothing
        looked paying, the ledger filled, and probes ran every few plain steps where trees lost."""
        self.scale["explored"] += 1
        emitted = 1.0
        if got is not None:
            emitted = got + 1.0
        elif tree is not None:
            focus = rows if ids is None or self._focus is None else rows[np.asarray(ids)[rows] == self._focus]
            emitted = float(np.mean(counts[focus if len(focus) else rows]))
        step = self.cost[1] * self.scale["plain"]
        plain = emitted * step
        timed = self.adaptive and elapsed_ms is not None
        if not timed:
            self._withdraw(self._charge)
            self._pace(predicted - plain)
            return
        beyond = elapsed_ms - plain
        # Clipped: one probe that compiled something (two orders of magnitude over its prediction)
        # would stop probing for tens of thousands of steps, and text where trees paid would run
        # plain. The first at CLIP times its prediction, later ones at twice what is known, so that
        # truly dear probes (a drafter model catching up) are learned within a few.
        known = self.CLIP * predicted
        if self.scale["probes"]:
            known = 2.0 * max(known, self.scale["probe_loss"])
        beyond = min(beyond, known)
        self._withdraw(beyond)
        self._pace(beyond)
        weight = 0.5 if self.scale["probes"] else 1.0
        self.scale["probe_loss"] += weight * (beyond - self.scale["probe_loss"])
        self.scale["probes"] += 1
        if tree is not None and self._after is not None:  # the plain steps after it add to its loss
            self._after = (self._after[0], self._after[1], weight)

    def _pace(self, lost: float) -> None:
        """The ledger's pace after a probe that lost ``lost`` ms against plain steps for its
        tokens (``BACKOFF``, ``PACE``)."""
        self.scale["pace"] += self.PACE * (lost - self.scale["pace"])
        if lost <= 0.0:
            self.scale["losing"], self.scale["paid"] = 0, True
        elif self.scale["pace"] > 0.0:
            self.scale["losing"] = min(self.scale["losing"] + 1, self.BACKOFF)

    def _aftermath(self, elapsed_ms: float) -> None:
        """A plain step of ``elapsed_ms`` within ``AFTERMATH`` steps of a tree: its time beyond a
        plain step's (at most a plain step's either way) added to what the tree's iteration took,
        in the tree's scale; after a measured probe, also charged to the ledger and added to the
        probe's loss (at its weight in the probes' average)."""
        if self._after is None:  # (in the wake of a shape's first pass: _first_pass)
            return
        kind, predicted, weight = self._after
        plain = self.cost[1] * self.scale["plain"]
        excess = min(max(elapsed_ms - plain, -plain), plain)
        # (down by at most ADAPT of itself: plain steps quicker than the plain scale says must not price
        # trees below nothing)
        self.scale[kind] = max(self.scale[kind] + self.ADAPT * excess / (predicted * self.scale["plain"]),
                               (1.0 - self.ADAPT) * self.scale[kind])
        self._stale = True
        if weight is not None:
            self._withdraw(excess)
            self.scale["probe_loss"] += weight * excess

    def _replan(self, tree: TokenTree | None) -> None:
        """The shape (after a verified ``tree``), and the sizes to draft where anything moved."""
        self._since_plan = 0
        if tree is not None and not self.fixed and self.fills_shapes:
            self._set_plan(self._plan_for(self.rates))
        if self._stale:  # (a run of plain steps of a seeded choice changes nothing to re-plan)
            self._pick, self._probe_size = self._pick_sizes()
            self._stale = False


def _first_pass(tree: TokenTree) -> bool:
    """Whether ``tree``'s static shape is verified for the first time in the process (it is marked
    so now). Such a step is not learned from by the clock, as a call's first is not (SETTLE): what is
    made once per shape (the plan drafters fill it by, its index, its structure for the choice) took
    50-250 microseconds in its first tree there, on a 2-core Zen 5 EPYC up to twice a 5-node tree's
    price, and a fresh process, whose plans are all new, had its trees priced at 1.5-1.8 times their
    cost after its first call's two trees (1.1 with this rule), from where trees seldom came back.
    (Fresh processes there, six each, the old rule's and this one's in turns: tau rose, n-gram's at
    batch 1 from 1.80 to 2.13 eager and 1.50 to 2.46 compiled; the gain over plain decoding moved by
    -0.002 to +0.014, within the noise: on that machine the trees it adds barely pay. docs/benchmarks.md)"""
    shape = tree.static_shape
    if shape is None or shape in _PRICED:
        return False
    _PRICED.add(shape)
    return True


def tree_room(drafter) -> int:
    """How deep ``drafter``'s trees may reach, for sizing a cache: its own trees' depth, or its
    own shape's, else the deepest tree ``tree="auto"`` plans."""
    if drafter is None:
        return 0
    shape = getattr(drafter, "shape", None)
    return getattr(drafter, "draft_depth", None) or (shape.max_depth if shape is not None else PathRates.DEPTH)


def auto_tree(model, drafter, batch: int, *, mode: str, sampled: bool = False, chain: bool = False,
              depth: int = PathRates.DEPTH, adaptive: bool = False, refresh: bool = False,
              bracketed: bool = False, watch: bool = False, may_rest: bool = False) -> AutoTree | None:
    """The :class:`AutoTree` of a decoding call: the costs of ``model`` with ``drafter`` at
    ``batch`` rows in ``mode``, greedy or ``sampled`` (measured on first use, then cached:
    :func:`stree.decoding.cost.cost_profile`; ``refresh``: measured again; an adaptive one's, from the
    file, spot-checked first) over the shapes the rates' prior plans (at most ``depth`` deep).
    An ``adaptive`` one continues the cost scales and rates of the last adaptive chooser of the
    same profile in this process (where the output cannot depend on the trees, what earlier
    calls learned about this machine and drafter is worth keeping; ``watch``: it watches drafts
    during plain steps, :meth:`AutoTree.watch_shape`; a call's first within ``FIRST_WATCH`` plain steps at
    batch 1 alone, and at larger batches its plain steps fund no probes: it explores by its watched drafts,
    and probes only where the next is priced at no loss, as after probes that paid on average). At batch 2 a
    probe verifies the whole batch's tree, and one taken alone, after a plain run, took some eight plain
    steps' time with its drafting and learning, cold (2-core Zen 5 EPYC, n-gram), where a watched draft
    tells a greedy choice what verifying it would have, for its drafting alone; without probes there,
    against with them, paired in five fresh processes each (benchmarks/choice_ab.py): eager n-gram
    +0.025 and +0.016, STAND deterministic +0.031, STAND +0.037, compiled n-gram +0.018, STAND
    deterministic +0.016, n-gram at temperature 1.0 +0.007. At batch 1 probes pay: without them eager
    n-gram lost 0.046, STAND deterministic 0.021, compiled n-gram 0.009. ``bracketed``: the costs of a
    batch size between two powers of two interpolated between theirs
    (:func:`stree.decoding.cost.bracketed_profile`), for callers whose batch size keeps changing.
    ``may_rest``: None where an adaptive call rests (:meth:`AutoTree.rests`), for a caller whose drafter
    serves the call alone (what a resting call does not show it would be lost with the call anyway)."""
    _load_helpers()
    measure_half_rows(model)  # (before the costs, which the packs move; once per model's step in a process)
    fills = getattr(drafter, "fills_shapes", True)
    profile, sizes, fixed = _profile(model, drafter if fills else None, batch, mode, sampled, chain, depth, refresh,
                                     adaptive, bracketed)
    # adaptive choosers of one profile hand on what they learned: a later call starts from it
    scale = rates = None
    if adaptive:
        learned = _LEARNED.get(profile)  # (not setdefault: its default, new rates, made at every call)
        if learned is None:
            learned = _LEARNED[profile] = ({"plain": 1.0, "tree": 1.0}, PathRates())
        scale, rates = learned
        if may_rest and AutoTree.rests(scale):
            return None
    return AutoTree(profile, sizes=fixed and sizes, chain=chain, fills_shapes=fills, depth=depth, adaptive=adaptive,
                    rates=rates, scale=scale, watch=watch, per_row=None if mode == "eager" else False,
                    first_watch=batch == 1, probes=batch == 1)


def _profile(model, drafter, batch: int, mode: str, sampled: bool, chain: bool, depth: int, refresh: bool,
             check: bool, bracketed: bool) -> tuple[CostProfile, tuple[int, ...], tuple[int, ...] | None]:
    """:func:`auto_tree`'s cost profile, the sizes it allows and whether they are fixed (None: any),
    asked once per model and arguments in the process (while the model, its dtype and device and the
    drafter's model stay the same ones)."""
    inner = getattr(drafter, "level_model", None)
    asked = (batch, mode, sampled, chain, depth, bracketed, check, type(drafter), getattr(drafter, "stochastic", None),
             id(inner), torch.get_num_threads())
    now = (getattr(model, "cfg", None), model.dtype, None if inner is None else inner.dtype)
    try:
        made = _ASKED.setdefault(model, {})
    except TypeError:  # (a model that cannot be weakly referenced: asked every time)
        made = {}
    hit = None if refresh else made.get(asked)
    if (hit is not None and all(a is b for a, b in zip(hit[0], now)) and hit[1] == model.device
            and (inner is None or hit[3]() is inner)):
        return hit[2]
    device = model.device
    # (compiled, greedy, where the passes are one call each: nothing to compile per shape, so eager's sizes)
    free = mode == "eager" or (mode == "compiled" and not sampled and _passes_are_one_call(model))
    fixed = None if free else (FIXED_CUDA if device.type == "cuda" else FIXED)
    allowed = fixed or default_sizes(device)
    prior = _prior(max(allowed), chain, depth)
    sizes = tuple(n for n in allowed if n <= prior.n) or (prior.n,)
    profile = (bracketed_profile if bracketed else cost_profile)(
        model, batch, drafter=drafter, mode=mode, sampled=sampled, shapes=[prior.prefix(n) for n in sizes if n >= 2],
        refresh=refresh, check=check, scan="chain" if chain else "tree")
    try:
        made[asked] = (now, device, (profile, sizes, fixed), None if inner is None else weakref.ref(inner))
    except TypeError:  # (a drafter model that cannot be weakly referenced: asked every time)
        pass
    return profile, sizes, fixed


def _passes_are_one_call(model) -> bool:
    """Whether ``model``'s steps, tree passes and greedy iterations are one call each
    (:mod:`stree.models.fused_step`: a Mamba2 model on the CPU), which a compiled loop takes
    too: it then compiles nothing per tree shape, and plans any size and shape as an eager one. (On
    fixed sizes and the prior's plan, compiled STAND deterministic at batch 1 gained 1.23x-1.27x
    where eager gained 1.4x-1.5x on the same machine, docs/benchmarks.md.)"""
    if getattr(model, "fused_step", None) is None:  # (a stand-in model of the decoding protocol)
        return False
    # (the cache it asks with kept per model, dtype and device: allocating one at every call took half
    # of what setting up a compiled call's choice took, cold after decoding)
    made = (model.dtype, model.device)
    hit = _ASKING.get(model)
    if hit is None or hit[0] != made:
        hit = _ASKING[model] = (made, model.allocate_cache(1, 1))
    with torch.no_grad():
        return model.fused_step(hit[1], None, model.kernel_backend) is not None


@functools.lru_cache(maxsize=64)
def _prior(top: int, chain: bool, depth: int) -> TreeShape:
    """The plan before any step (the rates' prior), of at most ``top`` nodes: made once, where every
    decoding call's choice starts from it."""
    return plan_shape(PathRates(), top, chain, depth)


@functools.cache
def _load_helpers() -> None:
    """Run the choice on a made-up batch once per process, as setup: each compiled helper's first
    call loads it (a few milliseconds each, from numba's cache), which inside a timed iteration of
    a few milliseconds had made trees (or packed passes) look up to three times dearer to a choice
    that follows the clock, and it went on without them."""
    auto = AutoTree(CostProfile(1.0, (2, 4), (1.1, 1.2)), per_row=True, adaptive=True, watch=True)
    shape = TreeShape((-1, 0, 0, 1))
    tokens = torch.zeros(2, shape.n, dtype=torch.long)
    both, rows = np.ones(2, dtype=np.bool_), np.arange(2)
    flags = np.zeros((2, shape.n), dtype=np.bool_)
    marked = TokenTree.from_arrays(shape, tokens.numpy(), ~flags, flags)
    for draft in (TokenTree.from_shape(shape, tokens), TokenTree(shape.parents_tensor().expand(2, -1), tokens), marked,
                  marked.prefix(3)):  # (a drafter's weak nodes, and a cut draft's: other array types to numba)
        for probing in (False, True):  # (a probe's draft is also weighed as the choice would have kept it)
            auto._probing = probing
            auto.choose(draft, both, rows)
        auto._probing = False
        auto.record(draft, np.zeros((2, 2), dtype=np.int64), np.ones(2, dtype=np.int64), rows, ids=rows)
        auto.watched(draft, [np.zeros(2, dtype=np.int64)] * 2, both, rows)


# per model, auto_tree's profiles and sizes by what it was asked (and what the model, its dtype and device,
# and the drafter's model were then): a decoding call asks once, and looking the profile up again (its
# key a text of the config and arguments) with the sizes and shapes it is asked for was a third of what a
# call's choice took to set up, cold after decoding (docs/benchmarks.md, "A call's setup")
_ASKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

# per model, the one-row cache _passes_are_one_call asks with, and the dtype and device it was made for
_ASKING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

# the tree shapes verified so far in the process (_first_pass)
_PRICED: "weakref.WeakSet[TreeShape]" = weakref.WeakSet()

# per rates, the last plan a drafter model's choice made under them for the batch (_plan_for): the rates'
# version, its size and depth, the profile, the plan. Each call's choice plans from the rates the last call of its
# profile left, and weighing every depth cap again was most of what a call's choice took to set up where no
# draft had moved the rates since the last call's plan (docs/benchmarks.md, "A call's setup").
_PLANNED: "weakref.WeakKeyDictionary[PathRates, tuple]" = weakref.WeakKeyDictionary()

# per rates, the memo of expected accepted drafts their choices last weighed by (AutoTree._best_size): the
# hazards, and the expectation of each plan's prefixes under them
_EXPECTED: "weakref.WeakKeyDictionary[PathRates, tuple]" = weakref.WeakKeyDictionary()

# what adaptive choosers learned, per cost profile (the same model, drafter kind, batch size and mode)
_LEARNED: "weakref.WeakKeyDictionary[CostProfile, tuple[dict, PathRates]]" = weakref.WeakKeyDictionary()
