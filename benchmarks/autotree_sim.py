"""``tree="auto"`` on a virtual clock: the decoding loop, the choice and the drafters run for real
(``LM.generate``, the shipped pair, greedy: every output is autoregressive decoding's), but the
time the loop and the choice read is a clock that advances by a fixed table of costs, in plain
steps: a tree pass (verification and commit included) of n nodes, drafting, and the plain steps
right after a tree dearer by given factors (what a pass leaves in the caches, which the choice
charges the tree for one step only). The same table gives the same choices and the same gain in
any run on any machine, so that what a change to the choice is worth can be told apart from the
noise that hides it on a 2-core CPU (docs/benchmarks.md). The gains are the table's, not a
measurement of speed: the table is what the machine was measured to cost.

    python benchmarks/autotree_sim.py          # the compiled batch-2 table measured on the 2-core EPYC
    python benchmarks/autotree_sim.py --passes 2:1.5,8:1.8,16:2.2 --draft 0.2 --after 1.15,1.1 --batch 1
    python benchmarks/autotree_sim.py --mode eager --batch 1 --measured  # this machine's table, now
    python benchmarks/autotree_sim.py --smoke  # 2 prompts x 16 tokens (CI)

The choice's cost profile is the table (its prior; it learns the aftermath and whatever else the
table leaves out from the clock, as in decoding), so nothing of the machine but the table enters.
A table measured on another day ranks changes wrongly where the machine has changed since
(docs/benchmarks.md: a change that gained on an old table lost on the machine, and on the day's
table): ``--measured`` takes them from the machine as the n-gram drafter's choice prices them after
decoding the prompts for real (:func:`measured_table`), and the result records them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import types
from pathlib import Path

import torch

import stree
import stree.decoding.autotree as autotree
import stree.decoding.loop as loop
from stree.decoding.cost import CostProfile
from stree.drafters.registry import make_drafter
from stree.tools.demo import DRAFTER, TARGET, read_prompts
from stree.tools.timing import run_info, save_result

# Measured on the 2-core EPYC (2026-11-29, docs/benchmarks.md), compiled, batch 2, by the clock in the
# loop: a speculative step of n nodes in plain steps (8 nodes 2.5-3.9, most near 3.2), drafting a
# tree, and the plain steps 1, 2, ... after a tree.
PASSES = "2:2.7,4:2.9,8:3.2,16:3.8"
DRAFT = 0.25
AFTER = "1.34,1.3,1.3,1.35,1.19,1.14,1.09"


class Clock:
    """Virtual milliseconds; ``perf_counter`` in seconds, as the loop reads it."""

    def __init__(self):
        self.ms = 0.0

    def perf_counter(self) -> float:
        return self.ms / 1e3


def parse_passes(parser, text: str) -> dict[int, float]:
    """``--passes``: ``nodes:steps`` pairs, trees of at least 2 nodes at positive costs."""
    try:
        table = {int(n): float(v) for n, v in (item.split(":") for item in text.split(","))}
    except ValueError:
        parser.error(f"--passes must be nodes:steps pairs, e.g. 2:1.9,8:2.4, got {text!r}")
    if not table or min(table) < 2 or min(table.values()) <= 0:
        parser.error(f"--passes needs trees of at least 2 nodes at positive costs, got {text!r}")
    return table


def parse_after(parser, text: str) -> list[float]:
    """``--after``: positive factors, comma-separated (empty: none)."""
    try:
        factors = [float(v) for v in text.split(",")] if text else []
    except ValueError:
        parser.error(f"--after must be comma-separated factors, got {text!r}")
    if any(f <= 0 for f in factors):
        parser.error(f"--after factors must be positive, got {text!r}")
    return factors


class Virtual:
    """The loop's and the choice's clock replaced by a :class:`Clock` that the loop's own calls
    advance, in milliseconds that are plain steps: a plain step by one (times its factor after a
    tree), a speculative step by the pass of its size (the nearest larger one in the table), a
    checked draft by ``draft``. The choice's cost profile is the table itself (a plain step 1 ms,
    the passes and drafting as given): its prior is what the clock then says, the same in every
    run, where a measured one would differ from run to run."""

    def __init__(self, passes: dict[int, float], draft: float, after: list[float]):
        self.passes, self.draft, self.after = passes, draft, after
        self.profiles: dict = {}  # one per call kind, as the cache keeps one: what choosers learn goes on
        self.clock, self.since_tree = Clock(), len(after)
        self.saved = (loop.time, autotree.time, loop.autoregressive_step, loop.speculative_step, loop.check_draft,
                      autotree.cost_profile, autotree._ASKED)

    def pass_steps(self, n: int) -> float:
        sizes = sorted(self.passes)
        return self.passes[next((s for s in sizes if s >= n), sizes[-1])]

    def __enter__(self):
        clock = types.SimpleNamespace(perf_counter=self.clock.perf_counter)
        step, spec, check = self.saved[2:5]

        def plain(*args, **kw):
            factor = self.after[self.since_tree] if self.since_tree < len(self.after) else 1.0
            self.since_tree += 1
            self.clock.ms += factor
            return step(*args, **kw)

        def tree(model, cache, draft, *args, **kw):
            self.since_tree = 0
            self.clock.ms += self.pass_steps(draft.n)
            return spec(model, cache, draft, *args, **kw)

        def drafted(draft, *args, **kw):
            self.clock.ms += self.draft
            return check(draft, *args, **kw)

        def table(model, batch, drafter=None, mode="eager", sampled=False, **kw):
            key = (batch, mode, sampled, type(drafter).__name__)
            if key not in self.profiles:
                nodes = tuple(sorted(self.passes))
                profile = CostProfile(1.0, nodes, tuple(self.passes[n] for n in nodes), (self.draft,) * len(nodes))
                # (profiles are equal by value: what an earlier run's choosers learned of an equal one goes)
                autotree._LEARNED.pop(profile, None)
                self.profiles[key] = profile
            return self.profiles[key]

        loop.time = autotree.time = clock
        loop.autoregressive_step, loop.speculative_step, loop.check_draft = plain, tree, drafted
        autotree.cost_profile = table
        autotree._ASKED = type(autotree._ASKED)()  # (what auto_tree looked up before: the table answers now)
        return self

    def __exit__(self, *exc):
        (loop.time, autotree.time, loop.autoregressive_step, loop.speculative_step, loop.check_draft,
         autotree.cost_profile, autotree._ASKED) = self.saved


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("eager", "compiled"), default="compiled",
                   help="the decode path (and so the cached cost profile the choice starts from)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--drafters", default="ngram,stand-det")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--passes", help=f"nodes:steps of a speculative step (pass, verify, commit); default {PASSES}")
    p.add_argument("--draft", type=float, help=f"steps to draft a tree; default {DRAFT}")
    p.add_argument("--after", default=AFTER, help="the plain steps 1, 2, ... after a tree, in steps (with "
                                                    "--measured from the second on: the first is in the scale)")
    p.add_argument("--measured", action="store_true",
                   help="--passes and --draft as this machine's choice prices them now (the n-gram drafter's cost "
                        "profile times the tree scale its choice learns decoding the prompts)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--stem", default=None)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    if args.measured and (args.passes is not None or args.draft is not None):
        p.error("--measured takes --passes and --draft from the machine: give either, not both")
    passes, after = parse_passes(p, args.passes or PASSES), parse_after(p, args.after)
    args.draft = DRAFT if args.draft is None else args.draft
    if args.draft < 0 or args.batch < 1:
        p.error(f"--draft must be >= 0 and --batch >= 1, got {args.draft}, {args.batch}")
    if args.smoke:  # (eager: nothing to compile in CI)
        args.mode, args.batch, args.prompts, args.max_new_tokens = "eager", 1, 2, 16
    lm = stree.LM.from_pretrained(TARGET, dtype=torch.float32, drafter_model=DRAFTER)
    texts = read_prompts(TARGET / "prompts.jsonl", args.prompts)
    measured = None
    if args.measured:
        passes, args.draft, measured = measured_table(lm, texts, args.batch, args.mode, args.max_new_tokens)
        after = after[1:]  # (the scale holds what the plain step right after a tree took beyond a plain step's)
        table = ", ".join(f"{n}:{v:.2f}" for n, v in passes.items())
        print(f"measured: passes {table}, draft {args.draft:.2f} (the profile's times {measured['tree_scale']:.2f})",
              file=sys.stderr)
    starts = range(0, len(texts) - args.batch + 1, args.batch)
    compiled = args.mode == "compiled"
    names = ["autoregressive"] + args.drafters.split(",")
    for name in names:  # compiling, before the virtual clock
        spec = dict(method="autoregressive") if name == "autoregressive" else dict(drafter=name)
        for s in starts:
            lm.generate(texts[s: s + args.batch], max_new_tokens=8, torch_compile=compiled, **spec)
    results, reference = [], None
    for name in names:
        spec = dict(method="autoregressive") if name == "autoregressive" else dict(drafter=name)
        ms = tokens = steps = trees = 0.0
        outputs = []
        with Virtual(passes, args.draft, after):
            for s in starts:
                out = lm.generate(texts[s: s + args.batch], max_new_tokens=args.max_new_tokens,
                                  torch_compile=compiled, **spec)
                ms += (out.stats.time_total - out.stats.time_prefill) * 1e3  # (plain steps)
                tokens += sum(out.stats.new_tokens)
                steps += sum(out.stats.trees.values())
                trees += sum(v for n, v in out.stats.trees.items() if n > 1)
                outputs.append(out.token_ids)
        reference = reference or outputs
        per_step = tokens / ms  # tokens a plain step's time
        results.append(dict(drafter=name, virtual_steps=ms, iterations=steps, tree_share=trees / steps,
                            tau=tokens / (steps * args.batch), identical=outputs == reference,
                            gain=per_step / results[0]["tokens_per_step"] if results else 1.0,
                            tokens_per_step=per_step))
        r = results[-1]
        print(f"{args.mode} b{args.batch} {name:<15} gain {r['gain']:.3f}  tau {r['tau']:.2f}  trees "
              f"{r['tree_share']:.0%}  identical {'yes' if r['identical'] else 'NO'}", file=sys.stderr)
    result = dict(benchmark="autotree_sim", **run_info(lm.model.device, argv), mode=args.mode, batch=args.batch,
                  prompts=args.prompts, max_new_tokens=args.max_new_tokens, passes=passes, draft=args.draft,
                  after=after, measured=measured,
                  note="virtual clock: gains are the cost table's (in plain steps), not measured speed",
                  results=results)
    stem = args.stem or ("autotree_sim_smoke" if args.smoke else f"autotree_sim_{args.mode}_b{args.batch}")
    save_result(result, args.out, stem, plot)
    return result


def measured_table(lm, texts, batch: int, mode: str, tokens: int) -> tuple[dict[int, float], float, dict]:
    """The passes (nodes: steps) and drafting (steps) as the n-gram drafter's choice prices them
    after decoding ``texts`` for real (``tokens`` each, ``batch`` at a time, in ``mode``): the cost
    profile ``tree="auto"`` measures (afresh), times the tree scale the choice then learned from
    the clock. The profile times a tree's iteration in a steady state; the loop's own work around a
    tree (the draft's checks, the choice, the rows' bookkeeping) and the plain step after it add
    to that, and by the clock a compiled batch-2 tree cost some 1.4 times the profile's (2026-11-29:
    with the profile alone the simulator promised 1.42x where the machine ran 0.95x-1.0x; with the
    scale, 0.99x). Also returns the profile and the scale, for the result."""
    made = []
    real = loop.auto_tree

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    autotree.auto_tree(lm.model, make_drafter("ngram"), batch, mode=mode, refresh=True)  # (the file's, afresh)
    loop.auto_tree = spy
    try:
        for s in range(0, len(texts) - batch + 1, batch):
            lm.generate(texts[s: s + batch], max_new_tokens=tokens, torch_compile=mode == "compiled", drafter="ngram")
    finally:
        loop.auto_tree = real
    profile, scale = made[-1].profile, float(made[-1].scale["tree"])
    passes = {n: t / profile.step_ms * scale for n, t in zip(profile.nodes, profile.tree_ms)}
    draft = statistics.median(profile.draft_ms) / profile.step_ms * scale
    return passes, draft, dict(profile=profile.to_dict(), tree_scale=scale)


def plot(result):
    import matplotlib.pyplot as plt

    rows = result["results"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["drafter"] for r in rows], [r["gain"] for r in rows], color="tab:blue")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("gain over autoregressive (virtual clock)")
    ax.set_title(f"tree='auto' on a cost table: {result['mode']}, batch {result['batch']}")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
