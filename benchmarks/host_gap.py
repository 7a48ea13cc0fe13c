"""What a forward costs after the host has worked for a while: the shipped target's plain step and
tree pass (batch 1), each timed right after a busy wait of G milliseconds (no memory touched by
this process meanwhile), against the same call with no wait; ``--after N``: also the N - 1 calls
that follow it back to back (how many a wait slows); a control, ``products``: a row's product with
each of the model's weight matrices in plain PyTorch (``F.linear``, none of stree's code), which
says whether what a wait does is the library's or the machine's. Each call runs once right before
its wait, so that the wait is all that comes between it and its timed calls (another call's
weights read in between would be timed too). Writes JSON and a PNG to benchmarks/results/.

Why: a decoding loop does host work between forwards (drafting, verification, the choice's
bookkeeping: a tree's iteration about half a millisecond on the 2-core CPUs, a plain step's a
tenth), and timed back to back, as a cost profile and a microbenchmark time them, the forwards
find the weights in the caches. On the 2-core AMD EPYC VMs the last-level cache is shared with
other machines' work: after a wait of 3.2 ms a step took 1.25-2.1 times as long as without one,
the weights read again from memory, and after 0.4 ms 1.03-1.1 times (docs/benchmarks.md,
"Forwards after host work"). Gaps take turns within each round, so that drift hits them alike.

    python benchmarks/host_gap.py
    python benchmarks/host_gap.py --after 12 --gaps 0,0.4,2
    python benchmarks/host_gap.py --smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before stree.kernels is imported

from tqdm import tqdm  # noqa: E402

from stree.models import load  # noqa: E402
from stree.models.presets import TINY  # noqa: E402
from stree.tools.demo import TARGET  # noqa: E402
from stree.tools.timing import run_info, save_result  # noqa: E402
from stree.tree import TokenTree, TreeShape  # noqa: E402

GAPS_MS = (0.0, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2)


def busy(ms: float) -> None:
    """Host work that touches no memory of its own: a clock read in a loop."""
    end = time.perf_counter() + ms * 1e-3
    while time.perf_counter() < end:
        pass


def calls(model, nodes: int):
    """``{"step": fn, "tree": fn, "products": fn}``: one plain step and one tree pass of ``nodes``
    nodes (a full binary tree's first ones) on a cache of 64 prompt tokens, each leaving the cache
    as it was; and the control, a row's product with each of the model's weight matrices in plain
    PyTorch (the bytes a step's products read, none of stree's code)."""
    cache = model.allocate_cache(1, 256)
    gen = torch.Generator().manual_seed(0)
    model.prefill(torch.randint(0, model.vocab_size, (1, 64), generator=gen), cache)
    token = torch.randint(0, model.vocab_size, (1,), generator=gen)
    shape = TreeShape(tuple([-1] + [(i - 1) // 2 for i in range(1, nodes)]))
    tree = TokenTree.from_shape(shape, torch.randint(0, model.vocab_size, (1, nodes), generator=gen))

    def step():
        model.step(token, cache, validate=False)
        cache.seqlens -= 1

    weights = [w.detach().float() for w in model.parameters() if w.dim() == 2]
    rows = {w.shape[1]: torch.ones(1, w.shape[1]) for w in weights}

    def products():
        for w in weights:
            F.linear(rows[w.shape[1]], w)

    return {"step": step, "tree": lambda: model.forward_tree(tree, cache, validate=False), "products": products}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=8, help="the tree pass's nodes (default 8)")
    p.add_argument("--rounds", type=int, default=200, help="timed calls per (call, gap) (default 200)")
    p.add_argument("--gaps", default=",".join(map(str, GAPS_MS)), help="the busy waits, ms (comma-separated)")
    p.add_argument("--after", type=int, default=1, help="calls timed back to back after each wait (default 1)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--stem", default=None, help="result file name (default: host_gap_cpu, or host_gap_smoke)")
    args = p.parse_args(argv)
    if args.nodes < 2 or args.rounds < 1 or args.after < 1:
        p.error(f"--nodes must be >= 2, --rounds and --after >= 1, got {args.nodes}, {args.rounds}, {args.after}")
    try:
        args.gaps = sorted({float(g) for g in args.gaps.split(",")} | {0.0})
    except ValueError:
        p.error(f"--gaps must be comma-separated milliseconds, got {args.gaps!r}")
    if args.gaps[0] < 0:
        p.error(f"--gaps must be >= 0, got {args.gaps[0]}")
    with torch.no_grad():
        rows, rounds = measure(args)
    result = dict(benchmark="host_gap", **run_info(torch.device("cpu"), argv), model="tiny mamba2" if args.smoke
                  else "shipped target", batch=1, nodes=args.nodes, rounds=rounds, after=args.after,
                  note="median_ms: one call right after a busy wait of gap_ms (no memory touched meanwhile); "
                       "over_no_gap: over the same call without a wait; in_steps_without_gap: over a plain step "
                       "without a wait; following: the medians of the calls after it, back to back, each over "
                       "the last of them without a wait (steady_ms, the call's steady state); products: the control, a "
                       "row's product with each weight matrix in plain PyTorch; each call runs once, untimed, "
                       "right before its wait",
                  results=rows)
    save_result(result, args.out, args.stem or ("host_gap_smoke" if args.smoke else "host_gap_cpu"), plot)
    for r in rows:
        then = "  then x" + " ".join(f"{x:.2f}" for x in r["following"]) if r["following"] else ""
        print(f"{r['call']:<5} after {r['gap_ms']:4.1f} ms: {r['median_ms']:7.3f} ms  x{r['over_no_gap']:.2f} of no "
              f"wait  {r['in_steps_without_gap']:.2f} steps{then}")
    return result


def measure(args) -> tuple[list[dict], int]:
    """The rows of the result (each call after each gap), and the rounds timed."""
    if args.smoke:
        cls, make = TINY["mamba2-tiny"]
        torch.manual_seed(0)
        model, gaps, rounds = cls(make()).eval(), (0.0, 0.4), 5
    else:
        model, gaps, rounds = load(TARGET), args.gaps, args.rounds
    fns = calls(model, args.nodes)
    for fn in fns.values():  # (first calls measure the products and compile)
        for _ in range(5):
            fn()
    # times[(call, gap)][i]: the i-th call after the wait, each round's
    times = {(name, gap): [[] for _ in range(args.after)] for name in fns for gap in gaps}
    for r in tqdm(range(rounds), desc="rounds", file=sys.stderr):
        order = gaps if r % 2 == 0 else gaps[::-1]
        for gap in order:
            for name, fn in fns.items():
                fn()  # (the call's own data last in the caches: the wait is all that comes between)
                busy(gap)
                for i in range(args.after):
                    start = time.perf_counter()
                    fn()
                    times[(name, gap)][i].append((time.perf_counter() - start) * 1e3)
    rows = []
    for name in fns:
        base = statistics.median(times[(name, 0.0)][0])
        steady = statistics.median(times[(name, 0.0)][-1])
        for gap in gaps:
            ms = statistics.median(times[(name, gap)][0])
            rows.append(dict(call=name, gap_ms=gap, median_ms=ms, over_no_gap=ms / base, steady_ms=steady,
                             following=[statistics.median(t) / steady for t in times[(name, gap)][1:]]))
    step0 = next(r["median_ms"] for r in rows if r["call"] == "step" and r["gap_ms"] == 0.0)
    for r in rows:
        r["in_steps_without_gap"] = r["median_ms"] / step0
    return rows, rounds


def plot(result):
    import matplotlib.pyplot as plt

    labels = {"step": "plain step", "tree": f"tree pass, {result['nodes']} nodes",
              "products": "the weights' products in plain PyTorch (control)"}
    tail = result.get("after", 1) > 1
    fig, axes = plt.subplots(1, 2 if tail else 1, figsize=(11 if tail else 6, 4), squeeze=False)
    ax = axes[0][0]
    for call, label in labels.items():
        rows = [r for r in result["results"] if r["call"] == call]
        ax.plot([r["gap_ms"] for r in rows], [r["median_ms"] for r in rows], "o-", label=label)
    ax.set(xlabel="host work before the call (ms, busy wait)", ylabel="call (ms, median)",
           title=f"{result['model']}, batch 1: forwards after host work\n{result['device']}")
    ax.set_ylim(bottom=0)
    ax.legend()
    if tail:  # the calls after the first, back to back, after the longest wait
        ax = axes[0][1]
        gap = max(r["gap_ms"] for r in result["results"])
        for call, label in labels.items():
            row = next(r for r in result["results"] if r["call"] == call and r["gap_ms"] == gap)
            ax.plot(range(2, len(row["following"]) + 2), row["following"], "o-", label=label)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xlabel=f"call after a {gap:g} ms wait", ylabel="over the call's steady state (median)",
               title="the calls that follow it")
        ax.legend()
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
