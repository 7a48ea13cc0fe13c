"""What a forward costs after the host has worked for a while: the shipped target's plain step and
tree pass (batch 1), each timed right after a busy wait of G milliseconds (no memory touched by
this process meanwhile), against the same call with no wait. Writes JSON and a PNG to
benchmarks/results/.

Why: a decoding loop does host work between forwards (drafting, verification, the choice's
bookkeeping: a tree's iteration about half a millisecond on the 2-core CPUs, a plain step's a
tenth), and timed back to back, as a cost profile and a microbenchmark time them, the forwards
find the weights in the caches. On the 2-core AMD EPYC VMs the last-level cache is shared with
other machines' work: after a wait of 3.2 ms a step took 1.25-2.1 times as long as without one,
the weights read again from memory, and after 0.4 ms 1.03-1.1 times (docs/benchmarks.md,
"Forwards after host work"). Gaps take turns within each round, so that drift hits them alike.

    python benchmarks/host_gap.py
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
    """``{"step": fn, "tree": fn}``: one plain step and one tree pass of ``nodes`` nodes (a full
    binary tree's first ones) on a cache of 64 prompt tokens, each leaving the cache as it was."""
    cache = model.allocate_cache(1, 256)
    gen = torch.Generator().manual_seed(0)
    model.prefill(torch.randint(0, model.vocab_size, (1, 64), generator=gen), cache)
    token = torch.randint(0, model.vocab_size, (1,), generator=gen)
    shape = TreeShape(tuple([-1] + [(i - 1) // 2 for i in range(1, nodes)]))
    tree = TokenTree.from_shape(shape, torch.randint(0, model.vocab_size, (1, nodes), generator=gen))

    def step():
        model.step(token, cache, validate=False)
        cache.seqlens -= 1

    return {"step": step, "tree": lambda: model.forward_tree(tree, cache, validate=False)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=8, help="the tree pass's nodes (default 8)")
    p.add_argument("--rounds", type=int, default=200, help="timed calls per (call, gap) (default 200)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--stem", default=None, help="result file name (default: host_gap_cpu, or host_gap_smoke)")
    args = p.parse_args(argv)
    if args.nodes < 2 or args.rounds < 1:
        p.error(f"--nodes must be >= 2 and --rounds >= 1, got {args.nodes} and {args.rounds}")
    with torch.no_grad():
        rows, rounds = measure(args)
    result = dict(benchmark="host_gap", **run_info(torch.device("cpu"), argv), model="tiny mamba2" if args.smoke
                  else "shipped target", batch=1, nodes=args.nodes, rounds=rounds,
                  note="median_ms: one call right after a busy wait of gap_ms (no memory touched meanwhile); "
                       "over_no_gap: over the same call without a wait; in_steps_without_gap: over a plain step "
                       "without a wait",
                  results=rows)
    save_result(result, args.out, args.stem or ("host_gap_smoke" if args.smoke else "host_gap_cpu"), plot)
    for r in rows:
        print(f"{r['call']:<5} after {r['gap_ms']:4.1f} ms: {r['median_ms']:7.3f} ms  x{r['over_no_gap']:.2f} of no wait  "
              f"{r['in_steps_without_gap']:.2f} steps")
    return result


def measure(args) -> tuple[list[dict], int]:
    """The rows of the result (each call after each gap), and the rounds timed."""
    if args.smoke:
        cls, make = TINY["mamba2-tiny"]
        torch.manual_seed(0)
        model, gaps, rounds = cls(make()).eval(), (0.0, 0.4), 5
    else:
        model, gaps, rounds = load(TARGET), GAPS_MS, args.rounds
    fns = calls(model, args.nodes)
    for fn in fns.values():  # (first calls measure the products and compile)
        for _ in range(5):
            fn()
    times = {(name, gap): [] for name in fns for gap in gaps}
    for r in tqdm(range(rounds), desc="rounds", file=sys.stderr):
        order = gaps if r % 2 == 0 else gaps[::-1]
        for gap in order:
            for name, fn in fns.items():
                busy(gap)
                start = time.perf_counter()
                fn()
                times[(name, gap)].append((time.perf_counter() - start) * 1e3)
    rows = []
    for name in fns:
        base = statistics.median(times[(name, 0.0)])
        for gap in gaps:
            ms = statistics.median(times[(name, gap)])
            rows.append(dict(call=name, gap_ms=gap, median_ms=ms, over_no_gap=ms / base))
    step0 = next(r["median_ms"] for r in rows if r["call"] == "step" and r["gap_ms"] == 0.0)
    for r in rows:
        r["in_steps_without_gap"] = r["median_ms"] / step0
    return rows, rounds


def plot(result):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for call in ("step", "tree"):
        rows = [r for r in result["results"] if r["call"] == call]
        label = "plain step" if call == "step" else f"tree pass, {result['nodes']} nodes"
        ax.plot([r["gap_ms"] for r in rows], [r["median_ms"] for r in rows], "o-", label=label)
    ax.set(xlabel="host work before the call (ms, busy wait)", ylabel="call (ms, median)",
           title=f"{result['model']}, batch 1: forwards after host work\n{result['device']}")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
