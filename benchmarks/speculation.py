"""Speculation at default settings, as a user meets it: the README's text API (``LM.generate``,
``tree="auto"``) with each drafter against stree's own autoregressive decoding in the same mode
(eager against eager, compiled against compiled), at batch 1 and 2 (and more with
``--batches``), greedy and sampled, on the shipped pair's held-out code prompts.

Every configuration runs once on every batch of prompts first (numba compiling, torch.compile,
measuring the machine's costs, each prompt length's first prefill; short runs where nothing
compiles), then the configurations of one (mode, batch size, temperature) take turns
on every batch of prompts, the order rotating (reversed every other cycle, so that no configuration
always follows the same one), so that drift hits all alike (``--rounds`` times;
the same seed per batch of prompts in every round). Reported per
configuration: tokens/s, the gain over autoregressive decoding (and the quartiles of each turn's
gain over the autoregressive run of the same prompts in the same turn: paired, so that the
machine's drift between turns cancels), tau (tokens per decoding step),
the decoding step's cost in autoregressive steps, the share of plain steps and the tree sizes the
choice took, and for greedy runs whether every output equals the autoregressive one. A second
autoregressive configuration ("autoregressive again", identical to the first) takes its turns
too: its "gain" is the noise of this machine in this group, the margin within which any other
gain is no gain at all.

    python benchmarks/speculation.py                       # batch 1, 2; greedy, 0.6, 1.0; eager, compiled
    python benchmarks/speculation.py --modes eager --temperatures 0 --batches 8,16
    python benchmarks/speculation.py --modes eager --temperatures 0 --batches 2,8 --per-row  # rows' own sizes
    python benchmarks/speculation.py --modes eager --temperatures 0 --trees chain:3,chain:5  # beside fixed trees
    python benchmarks/speculation.py --modes eager --floor  # beside a choice that never drafts: the floor
    python benchmarks/speculation.py --smoke               # CI: 2 prompts x 8 tokens
    python benchmarks/speculation.py --device cuda --modes eager   # on a GPU (float32 unless --dtype)
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import stree
from stree.tools.demo import DRAFTER, TARGET, read_prompts
from stree.decoding.autotree import AutoTree
from stree.decoding.cost import CostProfile
from stree.decoding.loop import merged_trees, pooled_tau, trees_chosen
from stree.runtime import CompiledModel
from stree.tree import TreeShape
from stree.tools.timing import add_device_args, device_and_dtype, run_info, save_result

DRAFTERS = ("ngram", "stand", "stand-det", "ssm")
CONTROL = "autoregressive again"  # the same configuration twice: what the machine's noise alone makes of a gain
PER_ROW = " per row"  # a drafter with AutoTree.PER_ROW on: each row of a batch may take a tree size of its own
FIXED = "@"  # "<drafter>@<tree spec>": the drafter with that tree every step (--trees), beside its tree="auto"
NEVER = " never drafting"  # a drafter whose choice never drafts (--floor)


class NeverDrafts(AutoTree):
    """The speculative loop's floor: a choice that never drafts (every step plain, in one run decided
    ahead, no draft watched or probed), so that a call costs what the drafter's learning from every
    token, the choice's setup and the loop's bookkeeping add to plain decoding: the most that a
    choice which never speculates where speculation does not pay can reach with that drafter."""

    def __init__(self):  # (costs it never weighs, and nothing learned from the clock: every step is plain)
        super().__init__(CostProfile(1.0, (2,), (1.0,)))

    def plan(self, behind=None, left=None):
        return None

    def plain_ahead(self, pending: int = 0) -> int:
        return self.NEVER

    def watch_shape(self):
        return None


def _drafter_model(device, dtype):
    """The shipped drafter model as the text API loads it (float32 on the CPU, the target's dtype on a
    GPU), or, with an older revision's stree (speculation_ab.py runs this script with one), as that
    loaded it: in the target's dtype."""
    try:
        from stree.lm import load_drafter_model
    except ImportError:
        from stree.models import load

        return load(DRAFTER, dtype=dtype, device=device)
    return load_drafter_model(DRAFTER, device, dtype)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batches", default="1,2")
    p.add_argument("--temperatures", default="0,0.6,1.0")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--drafters", default=",".join(DRAFTERS))
    p.add_argument("--rounds", type=int, default=2, help="times each configuration decodes every batch of prompts")
    p.add_argument("--per-row", action="store_true",
                   help=f"also run each drafter with each row of a batch at a tree size of its own where the choice "
                        f"finds that pays (\"<drafter>{PER_ROW}\": AutoTree.PER_ROW on, packed passes)")
    p.add_argument("--trees", default="",
                   help=f"comma-separated tree specs (chain:D, paper13, full:WxD) each drafter also runs with every "
                        f"step (\"<drafter>{FIXED}<spec>\"), beside the default tree=\"auto\"")
    p.add_argument("--floor", action="store_true",
                   help=f"also run each drafter with a choice that never drafts (\"<drafter>{NEVER}\"): what its "
                        f"learning from every token and the loop's bookkeeping cost where nothing is speculated")
    p.add_argument("--no-watch", action="store_true",
                   help="greedy choices verify probes alone, watching no drafts during plain steps (AutoTree.WATCH off)")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="on CUDA, eager calls without CUDA graphs (graphs are made per tree shape, so rows' own "
                        "sizes, --per-row, run only without them)")
    p.add_argument("--target", choices=("target", "drafter"), default="target",
                   help="the model that decodes: the shipped target, or the shipped 1-layer drafter, whose step costs "
                        "a fraction of the target's, so that the loop's own host work weighs on a CPU as it does on a "
                        "GPU's graphed steps (the drafter model then has none smaller to draft: the ssm drafters are "
                        "left out)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--stem", default=None, help="result file name (default: speculation_<device>, or _smoke)")
    add_device_args(p)
    args = p.parse_args(argv)
    # float32 everywhere unless asked: the greedy identity check compares the tree pass with plain
    # steps, and in bfloat16 their different summation orders may flip a near-tie
    args.dtype = args.dtype or "float32"
    AutoTree.WATCH = not args.no_watch
    device, dtype = device_and_dtype(args)
    if args.smoke:
        args.prompts, args.max_new_tokens, args.batches, args.temperatures = 2, 8, "1", "0"
        args.modes, args.drafters, args.rounds = "eager", "ngram,ssm", 1
    # (parsed before anything loads: a bad spec is refused by TreeShape.from_spec's ValueError, which names it)
    fixed_trees = {t: TreeShape.from_spec(t) for t in args.trees.split(",") if t}
    batches = [int(b) for b in args.batches.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    modes, drafters = args.modes.split(","), args.drafters.split(",")
    torch.manual_seed(0)
    small = None if args.target == "drafter" else _drafter_model(device, dtype)
    if small is None:
        drafters = [d for d in drafters if not d.startswith("ssm")]
    lms = {mode: stree.LM.from_pretrained(DRAFTER if small is None else TARGET, dtype=dtype, device=device,
                                          drafter_model=CompiledModel(small) if mode == "compiled" and small else small)
           for mode in modes}
    texts = read_prompts(TARGET / "prompts.jsonl", max(args.prompts, max(batches)))
    rows = []
    groups = list(itertools.product(modes, batches, temperatures))
    for mode, batch, temperature in tqdm(groups, desc="mode x batch x temperature", file=sys.stderr):
        lm = lms[mode]
        names = ["autoregressive", CONTROL] + drafters + ([d + PER_ROW for d in drafters] if args.per_row else [])
        names += [d + FIXED + t for d in drafters for t in fixed_trees]
        names += [d + NEVER for d in drafters] if args.floor else []
        kw = dict(max_new_tokens=args.max_new_tokens, temperature=temperature, torch_compile=mode == "compiled")
        if args.no_cuda_graph:
            kw["cuda_graph"] = False

        def run(name, prompts, seed, **extra):
            """The output and the call's wall-clock seconds: what a user waits for, the drafter's
            making and the tree choice's setup included."""
            t0 = time.perf_counter()  # (the floor's choice is made inside the call's time, as tree="auto"'s is)
            drafter, _, tree = name.removesuffix(PER_ROW).removesuffix(NEVER).partition(FIXED)
            spec = (dict(method="autoregressive") if name in ("autoregressive", CONTROL)
                    else dict(drafter=drafter, tree=NeverDrafts()) if name.endswith(NEVER)
                    else dict(drafter=drafter, **(dict(tree=fixed_trees[tree]) if tree else {})))
            default, AutoTree.PER_ROW = AutoTree.PER_ROW, name.endswith(PER_ROW) or AutoTree.PER_ROW
            out = lm.generate(prompts, seed=seed if temperature > 0 else None, **spec, **dict(kw, **extra))
            seconds = time.perf_counter() - t0
            AutoTree.PER_ROW = default
            return out, seconds

        prompts = texts[: max(args.prompts, batch)]
        starts = range(0, len(prompts) - batch + 1, batch)
        t0 = time.perf_counter()
        for name in names:  # compiling and measuring the machine's costs: before any timing
            run(name, texts[:batch], 0, max_new_tokens=8)
            # each cache-size bucket and tree shape compiles on first use (and on CUDA Triton compiles
            # its kernels for each new prompt length's specialisation); eager on the CPU, a prefill of
            # a new length chooses its products and builds oneDNN's calls for its sizes, 10-20 ms of a
            # 0.3 s call landing on whichever configuration met that batch first: every batch of
            # prompts once
            for start in starts:
                run(name, prompts[start: start + batch], start, **({} if mode == "compiled" or device.type == "cuda"
                                                                   else dict(max_new_tokens=8)))
        warmup = time.perf_counter() - t0
        runs = {name: [] for name in names}
        for turn, (_, start) in enumerate(itertools.product(range(args.rounds), starts)):
            # every other cycle of the rotation runs the names reversed: a rotation alone keeps each
            # configuration after the same one (and whatever that one leaves in the caches)
            base = names if turn // len(names) % 2 == 0 else names[::-1]
            order = base[turn % len(base):] + base[: turn % len(base)]
            for name in order:
                runs[name].append(run(name, prompts[start: start + batch], start))
        ar = [o for o, _ in runs["autoregressive"]]
        ar_seconds = sum(t for _, t in runs["autoregressive"])
        ar_rates = [sum(o.stats.new_tokens) / t for o, t in runs["autoregressive"]]
        ar_steps = sum(len(a) for o in ar for a in o.stats.accepted)
        for name in names:
            outs = [o for o, _ in runs[name]]
            seconds = sum(t for _, t in runs[name])
            tokens = sum(sum(o.stats.new_tokens) for o in outs)
            steps = sum(len(a) for o in outs for a in o.stats.accepted)
            trees = merged_trees([o.stats for o in outs])
            # each turn's gain against autoregressive decoding's run of the same prompts in the same turn:
            # paired, so that what drifts between turns (this machine's speed) cancels; their spread is the
            # noise a gain must clear
            paired = [sum(o.stats.new_tokens) / t / a for (o, t), a in zip(runs[name], ar_rates)]
            rows.append(dict(
                mode=mode, batch=batch, temperature=temperature, drafter=name, tokens=tokens, seconds=seconds,
                tokens_per_s=tokens / seconds,
                gain=(tokens / seconds) / (sum(sum(o.stats.new_tokens) for o in ar) / ar_seconds),
                gain_turns=dict(zip(("min", "q25", "median", "q75", "max"),
                                    np.quantile(paired, (0.0, 0.25, 0.5, 0.75, 1.0)).tolist()), turns=len(paired)),
                tau=pooled_tau([o.stats for o in outs]),
                step_in_ar_steps=(seconds / steps) / (ar_seconds / ar_steps),
                trees=trees, trees_chosen=trees_chosen(trees), packed=sum(o.stats.packed for o in outs),
                watched=sum(o.stats.watched for o in outs),
                # (getattr: speculation_ab.py runs this script against revisions from before AutoTree.rests)
                rested=sum(getattr(o.stats, "rested", False) for o in outs),
                # where a call's wall clock goes (ms per call): setting up the tree choice, the prefill,
                # the decoding loop after it, and what the call does outside the loop (tokenising,
                # making the drafter, detokenising): on a GPU, where a call of 128 tokens takes tens of
                # milliseconds, a few of them outside the steps are a gain's worth
                call_ms={k: 1e3 * v / len(outs) for k, v in (
                    ("setup", sum(o.stats.time_setup for o in outs)),
                    ("prefill", sum(o.stats.time_prefill for o in outs)),
                    ("loop", sum(o.stats.time_total - o.stats.time_prefill for o in outs)),
                    ("outside", seconds - sum(o.stats.time_total + o.stats.time_setup for o in outs)))},
                identical=None if temperature > 0 else [o.token_ids for o in outs] == [o.token_ids for o in ar],
                rounds=args.rounds,
                warmup_s=warmup if name == names[0] else None))
            r = rows[-1]
            print(f"{mode:<9}b{batch:<3}T{temperature:<4}{name:<15}{r['tokens_per_s']:>8.1f} tok/s  "
                  f"x{r['gain']:.2f} (turns {r['gain_turns']['q25']:.2f}-{r['gain_turns']['q75']:.2f})  tau {r['tau']:.2f}  step {r['step_in_ar_steps']:.2f} AR  {r['trees_chosen']}"
                  f"  packed {r['packed']}  watched {r['watched']}  rested {r['rested']}/{len(outs)}"
                  + ("" if r["identical"] is None else f"  identical {'yes' if r['identical'] else 'NO'}")
                  + "  ms/call " + " ".join(f"{k} {v:.2f}" for k, v in r["call_ms"].items()),
                  file=sys.stderr)
    result = dict(benchmark="speculation", **run_info(device, argv), dtype=str(dtype).removeprefix("torch."), threads=torch.get_num_threads(),
                  prompts=args.prompts, max_new_tokens=args.max_new_tokens, watch=AutoTree.WATCH,
                  target="the shipped drafter" if small is None else "the shipped target",
                  note="LM.generate at default settings (tree='auto'); gain: tokens/s (each call's wall clock: "
                       "tokenising, the drafter's making and the tree choice's setup included) over stree's own "
                       "autoregressive decoding in the same mode, batch size and temperature, runs interleaved per "
                       "batch of prompts; gain_turns: quartiles of each turn's gain over the autoregressive run of "
                       "the same prompts in the same turn (paired: the machine's drift cancels); step_in_ar_steps: seconds per decoding step over the autoregressive one's; "
                       "trees: steps per tree size (1: a plain step); packed: tree steps whose rows each took a size "
                       "of their own; watched: drafts made during plain steps and learned from, not verified "
                       "(deterministic drafts); rested: calls decoded plainly, the drafter unused, where calls "
                       "before had explored drafts in vain (AutoTree.rests); warm-up (compiling, measuring costs) "
                       "not timed",
                  results=rows)
    stem = args.stem or ("speculation_smoke" if args.smoke else f"speculation_{device.type}")
    save_result(result, args.out, stem, plot)
    return result


def plot(result):
    import matplotlib.pyplot as plt

    rows = [r for r in result["results"] if r["drafter"] != "autoregressive"]
    labels = [f"{r['mode'][:5]} b{r['batch']} T{r['temperature']:g} {r['drafter']}" for r in rows]
    fig, ax = plt.subplots(figsize=(8, max(3, 0.22 * len(rows))))
    spread = np.array([[r["gain"] - r["gain_turns"]["q25"], r["gain_turns"]["q75"] - r["gain"]] for r in rows]).T
    ax.barh(labels, [r["gain"] for r in rows], xerr=spread.clip(0, None), error_kw=dict(lw=0.8, capsize=2),
            color=["tab:gray" if r["drafter"] == CONTROL else "tab:green" if r["gain"] >= 1 else "tab:red"
                   for r in rows])
    ax.axvline(1.0, color="black", lw=0.8)
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    ax.set(xlabel="tokens/s over stree's own autoregressive decoding (same mode, batch, temperature)",
           title=f"LM.generate defaults (tree='auto'; <drafter>{FIXED}<tree>: that tree every step)\n{result['device']}; "
                 "whiskers: the turns' quartiles")
    ax.title.set_fontsize(8)
    return fig


if __name__ == "__main__":
    main()
